//! What the fuzzers (`fuzz_wire`, `fuzz_peer`) share: the fds a hostile peer attaches, sending
//! a raw packet as such a peer, and this process's holdings (fds and mappings), which every
//! input must leave as it found them.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, sendmsg};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use vmm_core::shm::HostBuffer;

/// A kind of fd a hostile peer might attach.
#[derive(Debug, Clone)]
pub enum FdKind {
    /// A memfd of this size sealed against resizing: what a host import accepts.
    SizeSealed(u64),
    /// A memfd of this size sealed against writing and resizing: what a spilled wire payload
    /// needs (and a host import refuses to map writable).
    Sealed(u64),
    /// A memfd of this size, unsealed.
    Unsealed(u64),
    Pipe,
    DevNull,
    Socket,
}

/// A fresh fd of `kind`.
pub fn make(kind: &FdKind) -> OwnedFd {
    let memfd = |size: u64, seals: SealFlag| {
        let fd = memfd_create(c"fuzz", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
            .expect("memfd");
        nix::unistd::ftruncate(&fd, size as i64).expect("ftruncate");
        if !seals.is_empty() {
            fcntl(&fd, FcntlArg::F_ADD_SEALS(seals)).expect("seal");
        }
        fd
    };
    let size_seals = SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SHRINK;
    match kind {
        FdKind::SizeSealed(size) => memfd(*size, size_seals),
        FdKind::Sealed(size) => memfd(
            *size,
            size_seals | SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_SEAL,
        ),
        FdKind::Unsealed(size) => memfd(*size, SealFlag::empty()),
        FdKind::Pipe => nix::unistd::pipe().expect("pipe").0,
        FdKind::DevNull => std::fs::File::open("/dev/null").expect("/dev/null").into(),
        FdKind::Socket => OwnedFd::from(std::os::unix::net::UnixStream::pair().expect("pair").0),
    }
}

/// Any kind, memfds small or sparse (a sealed 1 TiB memfd costs nothing until read): sizes at
/// the host import cap ([`vmm_core::shm::DEFAULT_MAX_IMPORT_SIZE`]), which imports, and above
/// it, which an import refuses with `Error::LimitExceeded`.
pub fn fd_kind() -> impl Strategy<Value = FdKind> {
    let cap = vmm_core::shm::DEFAULT_MAX_IMPORT_SIZE as u64;
    let memfd_size = prop_oneof![
        4 => 0u64..70_000,
        1 => Just(cap),
        1 => Just(cap + 1),
        1 => Just(1u64 << 40),
    ];
    prop_oneof![
        2 => memfd_size.clone().prop_map(FdKind::SizeSealed),
        1 => memfd_size.clone().prop_map(FdKind::Sealed),
        1 => memfd_size.prop_map(FdKind::Unsealed),
        1 => Just(FdKind::Pipe),
        1 => Just(FdKind::DevNull),
        1 => Just(FdKind::Socket),
    ]
}

/// One packet on `socket` with `fds` in `SCM_RIGHTS`, as a hostile peer sends it.
pub fn send_raw(socket: BorrowedFd<'_>, bytes: &[u8], fds: &[OwnedFd]) {
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let iov = [std::io::IoSlice::new(bytes)];
    let cmsgs = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsgs };
    sendmsg::<UnixAddr>(socket.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None).expect("sendmsg");
}

/// The fds and mappings this process holds now.
pub fn holdings() -> (usize, usize) {
    let fds = vmm_core::testing::open_fds().expect("count fds");
    let maps = std::fs::read_to_string("/proc/self/maps")
        .expect("read maps")
        .lines()
        .count();
    (fds, maps)
}

/// Read the pages an imported host buffer claims, the first MiB of them and its last byte: a
/// mapping past the file's end would fault here. Not every page: a peer may send a sparse,
/// sealed memfd as large as the import cap (64 GiB by default; larger ones are refused), which
/// maps fine (nothing is allocated until touched) and would fill memory if read through.
///
/// Also checks the cap: an imported buffer is never larger than
/// [`max_import_size`](vmm_core::shm::max_import_size).
pub fn touch_claimed(buf: &HostBuffer) {
    assert!(
        buf.size() <= vmm_core::shm::max_import_size(),
        "a {}-byte buffer imported over the cap",
        buf.size()
    );
    let mut byte = [0u8; 1];
    for at in (0..buf.size().min(1 << 20)).step_by(4096) {
        buf.read_at(at, &mut byte).expect("in bounds");
    }
    if let Some(last) = buf.size().checked_sub(1) {
        buf.read_at(last, &mut byte).expect("in bounds");
    }
}

/// A runner of `cases` generated inputs from `seed` (the same inputs for the same seed, so a
/// failure reproduces), which persists no failures to files.
pub fn seeded_runner(cases: u32, seed: u64) -> TestRunner {
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes),
    )
}
