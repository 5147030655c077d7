//! The service's memfds: created sealed against resizing but open to writes (vmm-core's
//! `HostBuffer` seals `F_SEAL_SEAL` at creation, which rules out sealing writes later), and
//! sealed against writes at commit. The service never maps them: it holds fds only, so its
//! own mapping can never stand in the way of the write seal.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::error::Refusal;

/// A fresh memfd of `len` bytes, sealed against shrinking and growing (what vmm-core's import
/// requires), not yet against writes. Sparse: its pages are allocated (and charged to the
/// memory cgroup of whoever touches them) as the writer fills them.
pub(crate) fn create(len: u64) -> Result<OwnedFd, Refusal> {
    let failed = |op: &str| Refusal::ServiceFailed {
        op: op.to_owned(),
        errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
    };
    // SAFETY: a NUL-terminated name and flags; the result is checked.
    let raw = unsafe {
        libc::memfd_create(
            c"vmm-memd-chunk".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if raw < 0 {
        return Err(failed("memfd_create"));
    }
    // SAFETY: a fresh fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let len = libc::off_t::try_from(len).map_err(|_| Refusal::ServiceFailed {
        op: format!("ftruncate to {len} bytes"),
        errno: libc::EFBIG,
    })?;
    // SAFETY: a live fd and a length.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        return Err(failed("ftruncate(memfd)"));
    }
    add_seals(fd.as_raw_fd(), libc::F_SEAL_SHRINK | libc::F_SEAL_GROW)
        .map_err(|_| failed("F_ADD_SEALS(shrink, grow)"))?;
    Ok(fd)
}

/// Seal `fd` against writes for good: `F_SEAL_WRITE` (write(2), fallocate, new writable shared
/// mappings, and `mprotect` of a read-only shared mapping to writable all fail with `EPERM`
/// from then on), `F_SEAL_FUTURE_WRITE` for kernels where it covers more, and `F_SEAL_SEAL`
/// so no one adds or changes seals after. `Err(())` with `EBUSY`: some process still maps it
/// writable (nothing was sealed).
pub(crate) fn seal_writes(fd: BorrowedFd<'_>) -> std::io::Result<()> {
    // Sealed by an earlier commit that a later chunk's EBUSY refused: nothing more to do (and
    // F_SEAL_SEAL would refuse any F_ADD_SEALS).
    let done = libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
    if seals(fd)? & done == done {
        return Ok(());
    }
    add_seals(fd.as_raw_fd(), libc::F_SEAL_WRITE)?;
    add_seals(
        fd.as_raw_fd(),
        libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL,
    )
}

fn add_seals(fd: libc::c_int, seals: libc::c_int) -> std::io::Result<()> {
    // SAFETY: fcntl on a live fd with an int argument.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The seals on `fd` (`F_GET_SEALS`).
pub(crate) fn seals(fd: BorrowedFd<'_>) -> std::io::Result<libc::c_int> {
    // SAFETY: fcntl on a live fd.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(seals)
}
