//! A reader's mapping of a committed chunk: read-only, and immutable by construction.
//!
//! The chunk's memfd is sealed against writes (`F_SEAL_WRITE`, checked here before mapping),
//! so no process can hold a writable mapping of it, write(2) it, punch holes in it or resize
//! it: its bytes cannot change while this mapping lives. That is what makes
//! [`ReadOnlyChunk::as_slice`] sound, where vmm-core's `HostBuffer` (whose memory another
//! process may write at any time) offers copies only.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

use crate::error::{MemdError, Result};
use crate::memfd;

/// The seals a committed chunk must carry before it is mapped.
const COMMITTED_SEALS: libc::c_int =
    libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// One committed chunk, mapped `PROT_READ`, `MAP_SHARED`. Unmapped on drop.
#[derive(Debug)]
pub struct ReadOnlyChunk {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is immutable (sealed against writes everywhere, checked at map time);
// sharing a pointer to immutable memory between threads is sound.
unsafe impl Send for ReadOnlyChunk {}
// SAFETY: as above.
unsafe impl Sync for ReadOnlyChunk {}

impl ReadOnlyChunk {
    /// Map `len` bytes of `fd`, which must be a memfd on tmpfs (checked) sealed against writes and
    /// resizing (`F_SEAL_WRITE`, `F_SEAL_SHRINK`, `F_SEAL_GROW`, `F_SEAL_SEAL`) and at least `len` bytes long; the fd stays the
    /// caller's. An empty chunk is refused (the service sends none).
    pub fn map(fd: BorrowedFd<'_>, len: usize) -> Result<ReadOnlyChunk> {
        check(fd, len)?;
        // SAFETY: a fresh read-only shared mapping at an address of the kernel's choosing of a
        // file sealed against shrinking that holds `len` bytes (checked): no access can
        // fault, and it aliases no Rust object.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(MemdError::last_os("mmap(chunk, PROT_READ)"));
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(|| MemdError::last_os("mmap"))?;
        Ok(ReadOnlyChunk { ptr, len })
    }

    /// [`map`](Self::map) at the addresses `reservation` holds (its length must be `len`);
    /// on failure the reservation comes back untouched.
    pub fn map_into(
        fd: BorrowedFd<'_>,
        len: usize,
        reservation: Reservation,
    ) -> std::result::Result<ReadOnlyChunk, (MemdError, Reservation)> {
        if reservation.len != len {
            let e = MemdError::BadDescriptor(format!(
                "a chunk of {len} bytes for a reservation of {}",
                reservation.len
            ));
            return Err((e, reservation));
        }
        if let Err(e) = check(fd, len) {
            return Err((e, reservation));
        }
        // SAFETY: MAP_FIXED over `len` bytes at an address this process reserved and
        // `reservation` owns (PROT_NONE, nothing refers to it); the file is checked as in
        // `map`.
        let ptr = unsafe {
            libc::mmap(
                reservation.ptr.as_ptr().cast(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err((MemdError::last_os("mmap(chunk, MAP_FIXED)"), reservation));
        }
        let chunk = ReadOnlyChunk {
            ptr: reservation.ptr,
            len,
        };
        std::mem::forget(reservation);
        Ok(chunk)
    }

    /// Give the memory up and keep its addresses: the mapping is replaced, at once, by a
    /// `PROT_NONE` reservation of the same addresses (which no other mapping can take).
    pub fn into_reservation(self) -> Result<Reservation> {
        // SAFETY: MAP_FIXED over exactly this mapping, which `self` owns and no borrow
        // outlives (consumed here).
        let ptr = unsafe { reserve_at(self.ptr.as_ptr(), self.len) };
        if ptr == libc::MAP_FAILED {
            return Err(MemdError::last_os("mmap(PROT_NONE, MAP_FIXED)"));
        }
        let reservation = Reservation {
            ptr: self.ptr,
            len: self.len,
        };
        std::mem::forget(self);
        Ok(reservation)
    }

    /// The chunk's bytes. They cannot change: see the module docs.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` mapped, readable bytes that no one can write (sealed), alive as long
        // as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The mapping's address.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes (never, for a chunk the service sent).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for ReadOnlyChunk {
    fn drop(&mut self) {
        // SAFETY: exactly what mmap returned; no reference outlives `self` (`as_slice`
        // borrows it).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Check `fd` is a tmpfs memfd sealed read-only of at least `len` bytes (`len` > 0).
fn check(fd: BorrowedFd<'_>, len: usize) -> Result<()> {
    let raw = fd.as_raw_fd();
    let seals = memfd::seals(fd)
        .map_err(|e| MemdError::BadDescriptor(format!("F_GET_SEALS: {e} (not a memfd)")))?;
    if seals & COMMITTED_SEALS != COMMITTED_SEALS {
        return Err(MemdError::BadDescriptor(format!(
            "the chunk's memfd is not sealed read-only (seals {seals:#x}, want {COMMITTED_SEALS:#x})"
        )));
    }
    // SAFETY: a zeroed statfs filled by fstatfs on a live fd.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstatfs(raw, &mut fs) } != 0 {
        return Err(MemdError::last_os("fstatfs(chunk)"));
    }
    // Only tmpfs memfds: a hugetlbfs one can fault (SIGBUS) on a hole.
    if fs.f_type != libc::TMPFS_MAGIC {
        return Err(MemdError::BadDescriptor(format!(
            "the chunk's fd is not a memfd on tmpfs (f_type {:#x})",
            fs.f_type
        )));
    }
    // SAFETY: a zeroed stat filled by fstat on a live fd.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(raw, &mut st) } != 0 {
        return Err(MemdError::last_os("fstat(chunk)"));
    }
    if len == 0 || (st.st_size as u64) < len as u64 {
        return Err(MemdError::BadDescriptor(format!(
            "the chunk says {len} bytes, its memfd holds {}",
            st.st_size
        )));
    }
    Ok(())
}

/// `mmap(PROT_NONE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)` at `ptr`.
///
/// # Safety
///
/// `ptr..ptr + len` must be this process's to replace: no Rust object may live there.
unsafe fn reserve_at(ptr: *mut u8, len: usize) -> *mut libc::c_void {
    // SAFETY: the caller's promise.
    unsafe {
        libc::mmap(
            ptr.cast(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    }
}

/// A range of this process's addresses held `PROT_NONE` (no memory, no access): what a
/// sleeping chunk keeps so that its wake maps at the same addresses. Unmapped on drop.
#[derive(Debug)]
pub struct Reservation {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: an address range without accessible memory; nothing is shared through it.
unsafe impl Send for Reservation {}
// SAFETY: as above.
unsafe impl Sync for Reservation {}

impl Reservation {
    /// Its first address.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: chunks are not).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: exactly the range this reservation holds, which nothing refers to.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
