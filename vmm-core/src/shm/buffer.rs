//! A memfd-backed buffer shared between processes.

use std::fmt;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use serde::de::Deserializer;
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use super::descriptor::HostDescriptor;
use super::map::{self, Mapping};
use crate::share::{IMPORTED_CANNOT_EXPORT, SharedBuffer, check_range};
use crate::{Error, Result};

/// Host memory that other processes can map: a sealed memfd, mapped shared.
///
/// The size is fixed at creation (the memfd is sealed against shrinking and growing). The
/// buffer holds no fd where [`buffers_hold_no_fd`](super::buffers_hold_no_fd) says so: each
/// [`export`](Self::export) reopens the mapping's file. Clones are handles to the same mapping;
/// the last one unmaps. Reads and writes are copies at an offset, never references, because
/// another process may write the same bytes at any time.
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

    /// Map the memory a descriptor names. The descriptor keeps its fd; the import holds none.
    ///
    /// Refused before mapping when the fd is not a memfd sealed against resizing (another
    /// process could shrink it and make this one fault) or is smaller than the descriptor says.
    ///
    /// The size is the sender's choice, and no cap is applied: mapping costs address space only,
    /// but pages of a sparse memfd are allocated as they are touched, and charged to the memory
    /// cgroup of the process that touches them. A receiver that does not trust its sender checks
    /// [`size`](Self::size) before reading a whole buffer.
    pub fn import(descriptor: &HostDescriptor) -> Result<Self> {
        let (Some(fd), Some(len)) = (descriptor.fd(), NonZeroUsize::new(descriptor.size)) else {
            return match (descriptor.fd.is_some(), descriptor.size) {
                (false, 0) => Ok(Self::empty(true)),
                (false, size) => Err(Error::InvalidArgument(format!(
                    "host descriptor of {size} bytes carries no fd"
                ))),
                (true, _) => Err(Error::InvalidArgument(
                    "host descriptor of 0 bytes carries an fd; an empty buffer has none".into(),
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
        if self.inner.imported {
            return Err(Error::InvalidArgument(format!(
                "export: {IMPORTED_CANNOT_EXPORT}"
            )));
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
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        check_range("HostBuffer::write_at", offset, data.len(), self.inner.size)?;
        if let Some(mapping) = &self.inner.mapping {
            debug_assert!(offset + data.len() <= mapping.len());
            // SAFETY: the range is inside the live mapping (checked above); `data` is ordinary
            // memory that cannot overlap a MAP_SHARED mapping we never hand out references to.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), mapping.ptr().add(offset), data.len())
            };
        }
        Ok(())
    }

    /// Copy from the buffer at `offset` into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range("HostBuffer::read_at", offset, out.len(), self.inner.size)?;
        if let Some(mapping) = &self.inner.mapping {
            // SAFETY: as in `write_at`, with source and destination swapped.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    mapping.ptr().add(offset),
                    out.as_mut_ptr(),
                    out.len(),
                )
            };
        }
        Ok(())
    }

    /// Set every byte to `value`.
    pub fn fill(&self, value: u8) -> Result<()> {
        if let Some(mapping) = &self.inner.mapping {
            // SAFETY: exactly the mapping's `size` bytes, which it owns.
            unsafe { std::ptr::write_bytes(mapping.ptr(), value, self.inner.size) };
        }
        Ok(())
    }

    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.inner.size];
        self.read_at(0, &mut out).expect("whole range is in bounds");
        out
    }
}

impl SharedBuffer for HostBuffer {
    type Descriptor = HostDescriptor;

    fn size(&self) -> usize {
        HostBuffer::size(self)
    }

    fn is_imported(&self) -> bool {
        HostBuffer::is_imported(self)
    }

    fn export(&self) -> Result<HostDescriptor> {
        HostBuffer::export(self)
    }

    fn import(descriptor: &HostDescriptor) -> Result<Self> {
        HostBuffer::import(descriptor)
    }

    fn fill(&self, value: u8) -> Result<()> {
        HostBuffer::fill(self, value)
    }

    fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        HostBuffer::write_at(self, offset, data)
    }

    fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        HostBuffer::read_at(self, offset, out)
    }
}

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
