//! A memfd-backed buffer shared between processes.

use std::fmt;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use serde::de::Deserializer;
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use super::host_descriptor::HostDescriptor;
use super::map::{self, Mapping};
use crate::error::DescriptorRule;
use crate::share::{check_range, imported_cannot_export};
use crate::trace;
use crate::{Error, Result};

/// Host memory that other processes can map: a sealed memfd, mapped shared.
///
/// The size is fixed at creation (the memfd is sealed against shrinking and growing). The
/// buffer holds no fd where [`buffers_hold_no_fd`](super::buffers_hold_no_fd) says so: each
/// [`export`](Self::export) reopens the mapping's file. Clones are handles to the same mapping;
/// the last one unmaps. Reads and writes are copies at an offset, never references, because
/// another process may write the same bytes at any time.
///
/// # Concurrent access
/// Every copy ([`read_at`](Self::read_at), [`write_at`](Self::write_at), [`fill`](Self::fill),
/// [`to_vec`](Self::to_vec)) is made of aligned machine-word (`usize`) `Relaxed` atomic loads
/// and stores; the partial words at either end of a range are read whole and written by
/// compare-exchange, so bytes next to a range are never clobbered. Threads of this process may
/// therefore use one buffer (or its clones) at once: that is not a data race. What they see:
/// - each aligned word is read or written whole (no tearing *within* it), and a read returns,
///   for every byte, a value some write stored there (or the initial zero), never a mix of
///   bits;
/// - nothing more: a copy longer than a word is not atomic as a whole (a read concurrent with
///   a write may see some words old and some new), and `Relaxed` orders nothing else;
///   synchronise through something else (a [`Queue`](crate::wire::Queue) message, a lock, an
///   atomic flag with `Release`/`Acquire`) before relying on a whole range;
/// - other processes that map the memory may write it at any time, with any access size, and
///   nothing here stops them: treat what you read as data from another process.
///
/// ```
/// use vmm_core::shm::HostBuffer;
/// let buf = HostBuffer::new(4096).unwrap();
/// buf.fill(7).unwrap();
/// let alias = HostBuffer::import(&buf.export().unwrap()).unwrap();
/// alias.write_at(0, b"hi").unwrap();
/// let mut out = [0u8; 3];
/// buf.read_at(0, &mut out).unwrap();
/// assert_eq!(&out, b"hi\x07");
/// ```
#[derive(Clone)]
pub struct HostBuffer {
    inner: Arc<Inner>,
}

struct Inner {
    /// `None` for an empty buffer.
    mapping: Option<Mapping>,
    size: usize,
    imported: bool,
    /// Kept only where the mapping cannot be reopened (see `buffers_hold_no_fd`).
    fd: Option<OwnedFd>,
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("ptr", &self.as_ptr())
            .field("size", &self.inner.size)
            .field("imported", &self.inner.imported)
            .finish()
    }
}

impl HostBuffer {
    /// A zero-filled buffer of exactly `size` bytes (`0` gives an empty buffer with no memfd).
    pub fn new(size: usize) -> Result<Self> {
        let Some(len) = NonZeroUsize::new(size) else {
            return Ok(Self::empty(false));
        };
        let fd = map::create_sealed(size)?;
        let mapping = Mapping::map(fd.as_fd(), len, &map::inspect(fd.as_fd())?)?;
        let fd = if map::reopen_supported() {
            None
        } else {
            Some(fd)
        };
        Ok(HostBuffer {
            inner: Arc::new(Inner {
                mapping: Some(mapping),
                size,
                imported: false,
                fd,
            }),
        })
    }

    fn empty(imported: bool) -> Self {
        HostBuffer {
            inner: Arc::new(Inner {
                mapping: None,
                size: 0,
                imported,
                fd: None,
            }),
        }
    }

    /// Map the memory a descriptor names, if it is at most [`max_import_size`] bytes (64 GiB
    /// unless this process changed it). The descriptor keeps its fd; the import holds none.
    ///
    /// Refused before mapping when the size is over the cap
    /// ([`Error::LimitExceeded`], which names the size and the cap), when the fd is not a
    /// memfd on tmpfs sealed against resizing (another process could shrink it and make this
    /// one fault; a hugetlbfs memfd faults on holes and cannot be unmapped in part), or when it
    /// is smaller than the descriptor says.
    ///
    /// The size is the sender's choice: mapping costs address space even when the memfd is
    /// sparse, and pages are allocated as they are touched and charged to the memory cgroup of
    /// the process that touches them. Read a whole buffer from a peer with
    /// [`try_to_vec`](Self::try_to_vec).
    ///
    /// [`max_import_size`]: super::max_import_size
    pub fn import(descriptor: &HostDescriptor) -> Result<Self> {
        Self::import_capped(descriptor, super::max_import_size())
    }

    /// [`import`](Self::import) with a cap of `max_size` bytes for this import, whatever the
    /// process-wide [`max_import_size`](super::max_import_size).
    pub fn import_capped(descriptor: &HostDescriptor, max_size: usize) -> Result<Self> {
        let _span = trace::span!(DEBUG, "shm.import", bytes = descriptor.size);
        if descriptor.size > max_size {
            return Err(Error::LimitExceeded {
                what: "importing a host buffer".into(),
                size: descriptor.size as u64,
                cap: max_size as u64,
                raise: format!(
                    "the importer chooses the cap: raise it for one import with \
                     HostBuffer::import_capped(descriptor, max_size), or for this process with \
                     vmm_core::shm::set_max_import_size (default {} bytes)",
                    super::DEFAULT_MAX_IMPORT_SIZE
                )
                .into(),
            });
        }
        let (Some(fd), Some(len)) = (descriptor.fd(), NonZeroUsize::new(descriptor.size)) else {
            return match (descriptor.fd.is_some(), descriptor.size) {
                (false, 0) => Ok(Self::empty(true)),
                (false, size) => Err(Error::descriptor(
                    DescriptorRule::Fds,
                    format!("host descriptor of {size} bytes carries no fd"),
                )),
                (true, _) => Err(Error::descriptor(
                    DescriptorRule::Fds,
                    "host descriptor of 0 bytes carries an fd; an empty buffer has none",
                )),
            };
        };
        let mapping = Mapping::map(fd, len, &map::inspect(fd)?)?;
        Ok(HostBuffer {
            inner: Arc::new(Inner {
                mapping: Some(mapping),
                size: descriptor.size,
                imported: true,
                fd: None,
            }),
        })
    }

    /// A descriptor that alone owns a fresh fd for this memory.
    ///
    /// Refused for imported memory, like the CUDA path: forward the descriptor instead.
    pub fn export(&self) -> Result<HostDescriptor> {
        let _span = trace::span!(DEBUG, "shm.export", bytes = self.inner.size);
        if self.inner.imported {
            return Err(imported_cannot_export("export"));
        }
        let fd = match (&self.inner.mapping, &self.inner.fd) {
            (None, _) => None,
            (Some(_), Some(fd)) => Some(
                fd.try_clone()
                    .map_err(|e| Error::io("dup(host buffer memfd)", e))?,
            ),
            (Some(mapping), None) => Some(mapping.reopen()?),
        };
        Ok(HostDescriptor {
            size: self.inner.size,
            fd,
        })
    }

    /// The size in bytes.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.size == 0
    }

    /// Whether this process imported the memory.
    pub fn is_imported(&self) -> bool {
        self.inner.imported
    }

    /// The mapping's address in this process (null for an empty buffer).
    pub fn as_ptr(&self) -> *const u8 {
        self.inner
            .mapping
            .as_ref()
            .map_or(std::ptr::null(), |m| m.ptr().cast_const())
    }

    /// Copy `data` into the buffer at `offset`.
    ///
    /// Safe to call from several threads at once, and while other processes use the memory:
    /// see "Concurrent access" on the type.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        check_range("HostBuffer::write_at", offset, data.len(), self.inner.size)?;
        if let Some(mapping) = &self.inner.mapping {
            mapping.write(offset, data);
        }
        Ok(())
    }

    /// Copy from the buffer at `offset` into `out`.
    ///
    /// What a read concurrent with writes sees: see "Concurrent access" on the type.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range("HostBuffer::read_at", offset, out.len(), self.inner.size)?;
        if let Some(mapping) = &self.inner.mapping {
            mapping.read(offset, out);
        }
        Ok(())
    }

    /// Set every byte to `value`.
    pub fn fill(&self, value: u8) -> Result<()> {
        if let Some(mapping) = &self.inner.mapping {
            mapping.fill(self.inner.size, value);
        }
        Ok(())
    }

    /// A copy of the whole buffer.
    ///
    /// # Panics
    /// If the memory for the copy cannot be had (a panic, not an abort, so a child's failure
    /// is reported). The size may be a peer's choice, up to the import cap
    /// ([`max_import_size`](super::max_import_size)): for a buffer that came from another
    /// process, prefer [`try_to_vec`](Self::try_to_vec).
    pub fn to_vec(&self) -> Vec<u8> {
        self.try_to_vec()
            .unwrap_or_else(|e| panic!("HostBuffer::to_vec: {e}"))
    }

    /// A copy of the whole buffer, or an [`Error::Os`] (`ENOMEM`) when the memory for it cannot
    /// be had: the allocation is fallible, so a large buffer from a peer cannot abort the
    /// process.
    pub fn try_to_vec(&self) -> Result<Vec<u8>> {
        let size = self.inner.size;
        let mut out = Vec::new();
        out.try_reserve_exact(size).map_err(|_| {
            Error::io(
                format!("HostBuffer::try_to_vec: allocating {size} bytes for a copy"),
                std::io::Error::from_raw_os_error(libc::ENOMEM),
            )
        })?;
        out.resize(size, 0);
        self.read_at(0, &mut out)?;
        Ok(out)
    }
}

crate::share::shared_buffer_by_inherent_methods!(HostBuffer, HostDescriptor);

/// Serialises by exporting: the message owns the fresh fd; the receiver gets a mapped buffer.
impl Serialize for HostBuffer {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let descriptor = self.export().map_err(crate::wire::serialize_error::<S>)?;
        descriptor.serialize_owned(serializer)
    }
}

impl<'de> Deserialize<'de> for HostBuffer {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let descriptor = HostDescriptor::deserialize(deserializer)?;
        HostBuffer::import(&descriptor).map_err(crate::wire::deserialize_error::<D>)
    }
}
