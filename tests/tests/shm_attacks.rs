//! Host buffers against a hostile sender and against threads of one process (issue 16, items 5
//! and 7).
//!
//! - A raw sender (a bare `SOCK_SEQPACKET` socketpair and `sendmsg` with `SCM_RIGHTS`, speaking
//!   the wire's inline framing by hand) offers sparse sealed memfds far over the importer's cap,
//!   and a hugetlbfs memfd: each is refused with a typed error before anything is mapped.
//! - Under an address-space limit (`RLIMIT_AS`, as `prlimit --as` sets it) in a child process,
//!   copying out a buffer that the limit leaves no room for is an error (and `to_vec` a panic),
//!   never an abort.
//! - Two threads read and write one buffer at once: no torn words, no lost neighbours.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::resource::{Resource, getrlimit, setrlimit};
use nix::sys::socket::{
    AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, sendmsg, socketpair,
};
use serde::Serialize;
use vmm_core::Error;
use vmm_core::error::DescriptorRule;
use vmm_core::process::{Context, StartMethod};
use vmm_core::shm::{self, HostBuffer, HostDescriptor};
use vmm_core::wire::{Channel, Queue, decode};

const WAIT: Duration = Duration::from_secs(60);

/// A sparse 60 TiB: two of these filled a 47-bit address space before imports had a cap.
const SIXTY_TIB: u64 = 60 << 40;

/// The serde form of a `HostDescriptor`, written by a peer that owes the receiver nothing.
#[derive(Serialize)]
struct HostWire {
    size: u64,
    fd: Option<u32>,
}

/// A memfd of `size` bytes (sparse: nothing is allocated) sealed against resizing, made with
/// `extra` flags (e.g. `MFD_HUGETLB`).
fn sealed_memfd(size: u64, extra: MFdFlags) -> nix::Result<OwnedFd> {
    let fd = memfd_create(
        c"hostile",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING | extra,
    )?;
    nix::unistd::ftruncate(&fd, size as i64)?;
    fcntl(
        &fd,
        FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SHRINK),
    )?;
    Ok(fd)
}

/// Send a host descriptor of `size` bytes over `fd` the way a raw peer does (the channel's
/// inline tag, then postcard, the fd in `SCM_RIGHTS`) and receive it on a [`Channel`]: the
/// receiver's bytes and fds, ready to decode.
fn raw_send(size: u64, fd: &OwnedFd) -> (Vec<u8>, Vec<OwnedFd>) {
    let (tx, rx) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .expect("socketpair");
    let mut bytes = vec![2u8]; // frame byte 0x02: an inline payload
    bytes.extend(postcard::to_stdvec(&HostWire { size, fd: Some(0) }).expect("postcard"));
    let raw = [fd.as_raw_fd()];
    sendmsg::<UnixAddr>(
        tx.as_raw_fd(),
        &[std::io::IoSlice::new(&bytes)],
        &[ControlMessage::ScmRights(&raw)],
        MsgFlags::empty(),
        None,
    )
    .expect("sendmsg");
    let message = Channel::from_fd(rx)
        .recv(Some(Duration::from_secs(5)))
        .expect("recv");
    (message.bytes, message.fds)
}

fn assert_over_cap(err: &Error, size: u64, cap: usize) {
    match err {
        Error::LimitExceeded {
            size: s,
            cap: c,
            raise,
            ..
        } => {
            assert_eq!((*s, *c), (size, cap as u64), "{err}");
            assert!(
                raise.contains("import_capped") && raise.contains("set_max_import_size"),
                "the error says how to raise the cap: {err}"
            );
        }
        other => panic!("expected LimitExceeded for {size} bytes over {cap}, got {other:?}"),
    }
}

#[test]
fn sparse_memfds_over_the_cap_are_refused_before_anything_is_mapped() {
    let cap = shm::max_import_size();
    assert_eq!(cap, shm::DEFAULT_MAX_IMPORT_SIZE);
    let hostile = sealed_memfd(SIXTY_TIB, MFdFlags::empty()).expect("sparse memfd");
    // Twice: the second used to fail only because the first had taken the address space.
    for attempt in 0..2 {
        let (bytes, fds) = raw_send(SIXTY_TIB, &hostile);
        let err = decode::<HostBuffer>(&bytes, fds).expect_err("a 60 TiB buffer imported");
        assert_over_cap(&err, SIXTY_TIB, cap);
        eprintln!("attempt {attempt}: {err}");
    }
    // Just over the cap is over it, as a descriptor imported by hand too.
    let just_over = sealed_memfd(cap as u64 + 1, MFdFlags::empty()).expect("sparse memfd");
    let (bytes, fds) = raw_send(cap as u64 + 1, &just_over);
    let descriptor: HostDescriptor = decode(&bytes, fds).expect("a descriptor is only data");
    assert_over_cap(
        &HostBuffer::import(&descriptor).unwrap_err(),
        cap as u64 + 1,
        cap,
    );

    // The cap is the importer's: lower for one import, or raised when it trusts the sender.
    assert_over_cap(
        &HostBuffer::import_capped(&descriptor, 4096).unwrap_err(),
        cap as u64 + 1,
        4096,
    );
    let raised = HostBuffer::import_capped(&descriptor, cap + 1).expect("raised for one import");
    assert_eq!(raised.size(), cap + 1);
    drop(raised);
    let at_cap = sealed_memfd(cap as u64, MFdFlags::empty()).expect("sparse memfd");
    let (bytes, fds) = raw_send(cap as u64, &at_cap);
    let at_cap: HostBuffer = decode(&bytes, fds).expect("a buffer of exactly the cap");
    let mut last = [1u8];
    at_cap.read_at(cap - 1, &mut last).expect("read");
    assert_eq!(last, [0]);
}

#[test]
fn a_hugetlbfs_memfd_is_refused() {
    let huge = 2 << 20;
    let fd = match sealed_memfd(huge, MFdFlags::MFD_HUGETLB) {
        Ok(fd) => fd,
        Err(e) => {
            eprintln!(
                "SKIP a_hugetlbfs_memfd_is_refused: no sealable MFD_HUGETLB memfd here ({e})"
            );
            return;
        }
    };
    // A tmpfs memfd first, so that the importer has seen (and remembered) tmpfs: a hugetlbfs
    // one must still be asked about, not taken for the tmpfs seen last.
    let tmpfs = sealed_memfd(4096, MFdFlags::empty()).expect("a tmpfs memfd");
    let (bytes, fds) = raw_send(4096, &tmpfs);
    decode::<HostBuffer>(&bytes, fds).expect("a tmpfs memfd imports");
    // Half a huge page: the size an unaligned munmap would fail on.
    for size in [huge / 2, huge] {
        let (bytes, fds) = raw_send(size, &fd);
        let err = decode::<HostBuffer>(&bytes, fds).expect_err("a hugetlbfs memfd imported");
        assert!(
            matches!(&err, Error::InvalidDescriptor { rule: DescriptorRule::Memfd, message: m }
                if m.contains("hugetlbfs") && m.contains("tmpfs")),
            "{size} bytes: {err:?}"
        );
    }
}

/// The child's side: import `descriptor` under an address-space limit that leaves no room for
/// a copy of it, then copy it out both ways. Answers (try_to_vec's error, whether to_vec
/// panicked).
fn copy_out_under_an_address_space_limit((descriptor, answer): (HostDescriptor, Queue<String>)) {
    let buf = HostBuffer::import(&descriptor).expect("import");
    let (soft, hard) = getrlimit(Resource::RLIMIT_AS).expect("getrlimit");
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let vm_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmSize");
    // Room for what the process has and a little more: not for another copy of the buffer.
    setrlimit(Resource::RLIMIT_AS, vm_kib * 1024 + (256 << 20), hard).expect("setrlimit");
    let tried = buf.try_to_vec();
    let panicked = std::panic::catch_unwind(|| buf.to_vec().len()).is_err();
    setrlimit(Resource::RLIMIT_AS, soft, hard).expect("restore");
    let report = match tried {
        Ok(v) => format!("try_to_vec copied {} bytes", v.len()),
        Err(e) => format!(
            "try_to_vec: {:?} {e}; to_vec panicked: {panicked}",
            e.raw_os_error()
        ),
    };
    answer.put(&report).expect("answer");
}

#[test]
fn copying_out_under_an_address_space_limit_is_an_error_not_an_abort() {
    let size = 1u64 << 30;
    let fd = sealed_memfd(size, MFdFlags::empty()).expect("sparse memfd");
    let descriptor = HostDescriptor::from_fd(fd.as_fd(), size as usize).expect("descriptor");
    let answer = Queue::new().expect("queue");
    let child = Context::new(StartMethod::Spawn)
        .spawn(
            copy_out_under_an_address_space_limit,
            (descriptor, answer.clone()),
        )
        .expect("spawn");
    child
        .join(WAIT)
        .expect("the child ran to its end (an abort fails here)");
    let report = answer.get(WAIT).expect("report");
    assert!(
        report.starts_with(&format!("try_to_vec: Some({}) ", libc::ENOMEM))
            && report.contains(&format!("allocating {size} bytes"))
            && report.ends_with("to_vec panicked: true"),
        "{report}"
    );
}

#[test]
fn threads_sharing_a_buffer_see_whole_words_and_keep_their_neighbours() {
    const LEN: usize = 4096 + 16;
    const ROUNDS: u8 = 200;
    let buf = HostBuffer::new(LEN).expect("buffer");
    let done = Arc::new(AtomicBool::new(false));
    let writer = {
        let buf = buf.clone();
        std::thread::spawn(move || {
            for k in 1..=ROUNDS {
                // The whole buffer, then ranges that begin and end inside words.
                buf.fill(k).expect("fill");
                buf.write_at(0, &[k; 4100]).expect("write");
                buf.write_at(3, &[k; 4097]).expect("write");
                buf.write_at(1, &[k; 13]).expect("write");
            }
        })
    };
    // Writes the rest of the word that the writer's ranges end in (bytes 4100..4104) and the
    // start of the next: compare-exchange keeps both writers' bytes.
    let neighbour = {
        let buf = buf.clone();
        std::thread::spawn(move || {
            for k in 1..=ROUNDS {
                buf.write_at(4100, &[k; 7]).expect("write");
            }
        })
    };
    let reader = {
        let (buf, done) = (buf.clone(), done.clone());
        std::thread::spawn(move || {
            let mut out = vec![0u8; LEN];
            let mut reads = 0u64;
            while !done.load(Ordering::Acquire) || reads == 0 {
                buf.read_at(0, &mut out).expect("read");
                reads += 1;
                for (index, word) in out[..4096].chunks_exact(8).enumerate() {
                    // Bytes 1..16 may mix two rounds (three writes cover them differently);
                    // every other aligned word here is only ever written whole, one value.
                    if index >= 2 {
                        assert!(
                            word.iter().all(|&b| b == word[0]),
                            "word {index} torn: {word:?}"
                        );
                    }
                }
                assert!(out.iter().all(|&b| b <= ROUNDS), "a value never written");
                // An unaligned read sees the same.
                let mut odd = [0u8; 21];
                buf.read_at(4091, &mut odd).expect("read");
                assert!(odd.iter().all(|&b| b <= ROUNDS), "a value never written");
            }
            reads
        })
    };
    writer.join().expect("writer");
    neighbour.join().expect("neighbour");
    done.store(true, Ordering::Release);
    assert!(reader.join().expect("reader") > 0);
    let end = buf.to_vec();
    assert!(
        end[..4107].iter().all(|&b| b == ROUNDS),
        "a last write was lost: {:?}",
        &end[4090..4110]
    );
}
