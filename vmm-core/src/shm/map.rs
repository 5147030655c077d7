//! The one place in `shm` that touches raw memory: memfd creation, sealing, mmap, munmap.

use std::num::NonZeroUsize;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::OnceLock;

use nix::fcntl::{FcntlArg, OFlag, SealFlag, fcntl, open};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};
use nix::sys::stat::{Mode, fstat};
use nix::unistd::ftruncate;

use crate::{Error, Result};

/// The seals every shared buffer carries: its size can never change, so no process can make
/// another's mapping fault (SIGBUS) by shrinking the file.
pub(crate) const SIZE_SEALS: SealFlag = SealFlag::F_SEAL_SHRINK.union(SealFlag::F_SEAL_GROW);

/// A shared, read-write mapping of a whole memfd. Unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// (st_dev, st_ino) of the file, to check that a reopened fd is the same file.
    file_id: (u64, u64),
}

// SAFETY: the mapping is plain shared memory; every access goes through raw-pointer copies,
// never through references, so sharing the pointer between threads adds no aliasing.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Map the first `len` bytes of `fd` (described by `facts`, from [`inspect`]) shared and
    /// read-write.
    ///
    /// Refused unless the file holds at least `len` bytes and is sealed against shrinking and
    /// growing: otherwise its owner could shrink it and make every access here fault (SIGBUS).
    pub(crate) fn map(fd: BorrowedFd<'_>, len: NonZeroUsize, facts: &FileFacts) -> Result<Mapping> {
        if !facts.size_sealed {
            return Err(Error::InvalidArgument(
                "host descriptor's fd is not sealed against shrinking and growing \
                 (F_SEAL_SHRINK | F_SEAL_GROW); mapping it would let its owner crash this process"
                    .into(),
            ));
        }
        if facts.size < len.get() as u64 {
            return Err(Error::InvalidArgument(format!(
                "host descriptor says {len} bytes but its file holds {}",
                facts.size
            )));
        }
        // SAFETY: a fresh shared mapping at an address of the kernel's choosing; it aliases no
        // Rust object, and the file is sealed against shrinking and holds `len` bytes (checked
        // above, on the same fd) so no access can fault.
        let ptr = unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd,
                0,
            )
        }
        .map_err(|e| Error::errno(format!("mmap({} bytes, MAP_SHARED)", len), e))?;
        Ok(Mapping {
            ptr: ptr.cast(),
            len: len.get(),
            file_id: facts.id,
        })
    }

    /// A fresh fd for the mapped file, through `/proc/self/map_files` (needs privilege).
    pub(crate) fn reopen(&self) -> Result<OwnedFd> {
        let start = self.ptr.as_ptr() as usize;
        let end = start + self.len.next_multiple_of(page_size());
        let path = format!("/proc/self/map_files/{start:x}-{end:x}");
        let fd = open(
            path.as_str(),
            OFlag::O_RDWR | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| Error::errno(format!("open({path})"), e))?;
        let stat = fstat(&fd).map_err(|e| Error::errno("fstat(reopened memfd)", e))?;
        if (stat.st_dev, stat.st_ino) != self.file_id {
            return Err(Error::Protocol(format!("{path} is not the buffer's memfd")));
        }
        Ok(fd)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned, and no reference into the mapping
        // outlives the last handle (all accesses are copies).
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}

/// A sealed memfd of exactly `len` bytes.
pub(crate) fn create_sealed(len: usize) -> Result<OwnedFd> {
    let fd = memfd_create(
        c"vmm-ipc-host-buffer",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .map_err(|e| Error::errno("memfd_create(host buffer)", e))?;
    let size =
        i64::try_from(len).map_err(|_| Error::InvalidArgument(format!("size {len} too large")))?;
    ftruncate(&fd, size).map_err(|e| Error::errno(format!("ftruncate(memfd, {len})"), e))?;
    fcntl(
        &fd,
        FcntlArg::F_ADD_SEALS(SIZE_SEALS | SealFlag::F_SEAL_SEAL),
    )
    .map_err(|e| Error::errno("fcntl(F_ADD_SEALS)", e))?;
    Ok(fd)
}

/// What the kernel says about a file before it is mapped: one `fstat` and one `F_GET_SEALS`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FileFacts {
    /// Its size in bytes.
    pub(crate) size: u64,
    /// Whether it is sealed against shrinking and growing.
    pub(crate) size_sealed: bool,
    /// (st_dev, st_ino), to check that a reopened fd is the same file.
    pub(crate) id: (u64, u64),
}

/// The file's size, seals and identity.
pub(crate) fn inspect(fd: BorrowedFd<'_>) -> Result<FileFacts> {
    let stat = fstat(fd).map_err(|e| Error::errno("fstat(descriptor fd)", e))?;
    let seals = fcntl(fd, FcntlArg::F_GET_SEALS).map_err(|e| {
        if e == nix::errno::Errno::EINVAL {
            Error::InvalidArgument(
                "host descriptor's fd is not a memfd (it has no seals), so nothing stops its \
                 owner from shrinking it"
                    .into(),
            )
        } else {
            Error::errno("fcntl(F_GET_SEALS)", e)
        }
    })?;
    Ok(FileFacts {
        size: stat.st_size as u64,
        size_sealed: SealFlag::from_bits_truncate(seals).contains(SIZE_SEALS),
        id: (stat.st_dev, stat.st_ino),
    })
}

fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .map_or(4096, |p| p as usize)
    })
}

/// Whether `/proc/self/map_files` reopens work here, probed with a one-page buffer.
///
/// The answer is remembered only once it is definite: a reopen that worked, or one the kernel
/// refused for lack of privilege (`EACCES`, `EPERM`) or of the feature (`ENOENT`). A probe that
/// failed for a passing reason (out of fds or memory) answers `false` for now (the buffer being
/// made keeps its fd, which is always correct) and is tried again next time.
pub(crate) fn reopen_supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    if let Some(&known) = SUPPORTED.get() {
        return known;
    }
    let probe = || -> Result<()> {
        let fd = create_sealed(1)?;
        let facts = inspect(fd.as_fd())?;
        let mapping = Mapping::map(fd.as_fd(), NonZeroUsize::MIN, &facts)?;
        drop(fd);
        mapping.reopen().map(drop)
    };
    match probe() {
        Ok(()) => *SUPPORTED.get_or_init(|| true),
        Err(e) => match e.raw_os_error() {
            Some(libc::EACCES | libc::EPERM | libc::ENOENT) => *SUPPORTED.get_or_init(|| false),
            _ => false,
        },
    }
}
