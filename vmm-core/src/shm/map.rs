//! The one place in `shm` that touches raw memory: memfd creation, sealing, mmap, munmap.

use std::num::NonZeroUsize;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use nix::fcntl::{FcntlArg, OFlag, SealFlag, fcntl, open};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};
use nix::sys::stat::{Mode, fstat};
use nix::sys::statfs::{FsType, HUGETLBFS_MAGIC, TMPFS_MAGIC, fstatfs};
use nix::unistd::ftruncate;

use crate::error::ProtocolRule;
use crate::error::{DescriptorRule, OptionRule};
use crate::trace;
use crate::{Error, Result};

/// The seals every shared buffer carries: its size can never change, so no process can make
/// another's mapping fault (SIGBUS) by shrinking the file.
pub(crate) const SIZE_SEALS: SealFlag = SealFlag::F_SEAL_SHRINK.union(SealFlag::F_SEAL_GROW);

/// The unit of every access to a mapping: an aligned machine word.
const WORD: usize = size_of::<usize>();

/// A shared, read-write mapping of a whole memfd. Unmapped on drop.
///
/// Its bytes are only ever accessed as aligned, word-sized `Relaxed` atomics ([`read`],
/// [`write`], [`fill`]): threads of this process may use one mapping at once without a data
/// race, and no access is of mixed size (the partial words at a range's ends are read whole,
/// and written by compare-exchange on the whole word).
///
/// [`read`]: Mapping::read
/// [`write`]: Mapping::write
/// [`fill`]: Mapping::fill
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// (st_dev, st_ino) of the file, to check that a reopened fd is the same file.
    file_id: (u64, u64),
}

// SAFETY: the mapping is plain shared memory; every access in this crate is an aligned,
// word-sized atomic access (`read`, `write`, `fill`), never a reference to plain bytes, so
// sharing the pointer between threads adds no data race.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The aligned word `index` of the mapping, as an atomic.
    ///
    /// Every word that holds a byte below `len` is mapped: the mapping starts on a page
    /// boundary and covers whole pages, and a word never straddles a page.
    fn word(&self, index: usize) -> &AtomicUsize {
        debug_assert!(index * WORD < self.len.next_multiple_of(WORD));
        // SAFETY: the word is inside the mapping's pages (see above, and every caller passes a
        // word holding a byte below `len`), aligned (the base is page-aligned), and lives as
        // long as `self`. Within this process every access to the mapping is through such
        // word-sized atomics (no mixed sizes, no plain accesses); other processes are outside
        // Rust's memory model and can only change what value a load sees.
        unsafe { AtomicUsize::from_ptr(self.ptr.as_ptr().add(index * WORD).cast()) }
    }

    /// Write `bytes` into word `index` starting at byte `lo` of it, keeping the word's other
    /// bytes: a compare-exchange loop, so a concurrent write to those bytes is not lost.
    fn merge(&self, index: usize, lo: usize, bytes: &[u8]) {
        let _ = self
            .word(index)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                let mut word = old.to_ne_bytes();
                word[lo..lo + bytes.len()].copy_from_slice(bytes);
                Some(usize::from_ne_bytes(word))
            });
    }

    /// Copy `data` into the mapping at `offset`, as Relaxed atomic word stores (the partial
    /// words at either end merged by compare-exchange).
    ///
    /// The caller checks `offset + data.len() <= len`.
    pub(crate) fn write(&self, offset: usize, data: &[u8]) {
        debug_assert!(
            offset
                .checked_add(data.len())
                .is_some_and(|end| end <= self.len)
        );
        let (mut at, mut rest) = (offset, data);
        if at % WORD != 0 && !rest.is_empty() {
            let n = (WORD - at % WORD).min(rest.len());
            self.merge(at / WORD, at % WORD, &rest[..n]);
            (at, rest) = (at + n, &rest[n..]);
        }
        let (first, full) = (at / WORD, rest.len() / WORD);
        let (middle, tail) = rest.split_at(full * WORD);
        for (i, chunk) in middle.chunks_exact(WORD).enumerate() {
            let mut word = [0u8; WORD];
            word.copy_from_slice(chunk);
            self.word(first + i)
                .store(usize::from_ne_bytes(word), Ordering::Relaxed);
        }
        if !tail.is_empty() {
            self.merge(first + full, 0, tail);
        }
    }

    /// Copy from the mapping at `offset` into `out`, as Relaxed atomic word loads.
    ///
    /// The caller checks `offset + out.len() <= len`.
    pub(crate) fn read(&self, offset: usize, out: &mut [u8]) {
        debug_assert!(
            offset
                .checked_add(out.len())
                .is_some_and(|end| end <= self.len)
        );
        let (mut at, mut rest) = (offset, out);
        if at % WORD != 0 && !rest.is_empty() {
            let (lo, n) = (at % WORD, (WORD - at % WORD).min(rest.len()));
            let word = self.word(at / WORD).load(Ordering::Relaxed).to_ne_bytes();
            let (head, others) = rest.split_at_mut(n);
            head.copy_from_slice(&word[lo..lo + n]);
            (at, rest) = (at + n, others);
        }
        let (first, full) = (at / WORD, rest.len() / WORD);
        let (middle, tail) = rest.split_at_mut(full * WORD);
        for (i, chunk) in middle.chunks_exact_mut(WORD).enumerate() {
            chunk.copy_from_slice(&self.word(first + i).load(Ordering::Relaxed).to_ne_bytes());
        }
        if !tail.is_empty() {
            let word = self
                .word(first + full)
                .load(Ordering::Relaxed)
                .to_ne_bytes();
            let n = tail.len();
            tail.copy_from_slice(&word[..n]);
        }
    }

    /// Set the first `size` bytes to `value`, as Relaxed atomic word stores (the partial last
    /// word merged by compare-exchange).
    pub(crate) fn fill(&self, size: usize, value: u8) {
        debug_assert!(size <= self.len);
        let splat = usize::from_ne_bytes([value; WORD]);
        for index in 0..size / WORD {
            self.word(index).store(splat, Ordering::Relaxed);
        }
        let tail = size % WORD;
        if tail != 0 {
            self.merge(size / WORD, 0, &[value; WORD][..tail]);
        }
    }

    /// Map the first `len` bytes of `fd` (described by `facts`, from [`inspect`]) shared and
    /// read-write.
    ///
    /// Refused unless the file holds at least `len` bytes and is sealed against shrinking and
    /// growing: otherwise its owner could shrink it and make every access here fault (SIGBUS).
    pub(crate) fn map(fd: BorrowedFd<'_>, len: NonZeroUsize, facts: &FileFacts) -> Result<Mapping> {
        let _span = trace::span!(DEBUG, "shm.map", bytes = len.get());
        if facts.fs_type != TMPFS_MAGIC {
            let fs = match facts.fs_type {
                HUGETLBFS_MAGIC => "hugetlbfs".to_owned(),
                other => format!("a filesystem of type {:#x}", other.0),
            };
            return Err(Error::descriptor(
                DescriptorRule::Memfd,
                format!(
                    "host descriptor's fd is a file on {fs}, not a memfd on tmpfs (f_type \
                     {:#x}); only those are mapped: a hugetlbfs memfd faults (SIGBUS) on a hole \
                     and cannot be unmapped at a size that is not a multiple of its page",
                    TMPFS_MAGIC.0
                ),
            ));
        }
        if !facts.size_sealed {
            return Err(Error::descriptor(
                DescriptorRule::Memfd,
                "host descriptor's fd is not sealed against shrinking and growing \
                 (F_SEAL_SHRINK | F_SEAL_GROW); mapping it would let its owner crash this process",
            ));
        }
        if facts.size < len.get() as u64 {
            return Err(Error::descriptor(
                DescriptorRule::Size,
                format!(
                    "host descriptor says {len} bytes but its file holds {}",
                    facts.size
                ),
            ));
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
            return Err(Error::protocol(
                ProtocolRule::Fds,
                format!("{path} is not the buffer's memfd"),
            ));
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
    let size = i64::try_from(len)
        .map_err(|_| Error::option("size", OptionRule::Range, format!("size {len} too large")))?;
    ftruncate(&fd, size).map_err(|e| Error::errno(format!("ftruncate(memfd, {len})"), e))?;
    fcntl(
        &fd,
        FcntlArg::F_ADD_SEALS(SIZE_SEALS | SealFlag::F_SEAL_SEAL),
    )
    .map_err(|e| Error::errno("fcntl(F_ADD_SEALS)", e))?;
    Ok(fd)
}

/// What the kernel says about a file before it is mapped: one `fstat`, one `fstatfs` and one
/// `F_GET_SEALS`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FileFacts {
    /// The filesystem's `f_type`: only tmpfs, where every memfd lives unless made with
    /// `MFD_HUGETLB` (then hugetlbfs), is mapped.
    pub(crate) fs_type: FsType,
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
    let fs_type = filesystem_type(fd, stat.st_dev)?;
    let seals = fcntl(fd, FcntlArg::F_GET_SEALS).map_err(|e| {
        if e == nix::errno::Errno::EINVAL {
            Error::descriptor(
                DescriptorRule::Memfd,
                "host descriptor's fd is not a memfd (it has no seals), so nothing stops its \
                 owner from shrinking it",
            )
        } else {
            Error::errno("fcntl(F_GET_SEALS)", e)
        }
    })?;
    Ok(FileFacts {
        fs_type,
        size: stat.st_size as u64,
        size_sealed: SealFlag::from_bits_truncate(seals).contains(SIZE_SEALS),
        id: (stat.st_dev, stat.st_ino),
    })
}

/// The `f_type` of the filesystem that holds `fd`, whose `st_dev` is `dev`.
///
/// One `fstatfs` per import would be a tenth of a host import's cost, so the device of the
/// tmpfs mount found last is remembered and a file on it is not asked again. That is sound for
/// the files `inspect`'s callers go on to map: they must carry size seals, which only memfds
/// can have (a file opened on a mounted tmpfs starts sealed against further sealing), and
/// memfds live on the kernel's internal tmpfs and hugetlbfs mounts, which are never unmounted,
/// so their device numbers are never reused for another filesystem.
fn filesystem_type(fd: BorrowedFd<'_>, dev: u64) -> Result<FsType> {
    static TMPFS_DEV: AtomicU64 = AtomicU64::new(u64::MAX);
    if dev != u64::MAX && TMPFS_DEV.load(Ordering::Relaxed) == dev {
        return Ok(TMPFS_MAGIC);
    }
    let fs_type = fstatfs(fd)
        .map_err(|e| Error::errno("fstatfs(descriptor fd)", e))?
        .filesystem_type();
    if fs_type == TMPFS_MAGIC {
        TMPFS_DEV.store(dev, Ordering::Relaxed);
    }
    Ok(fs_type)
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
