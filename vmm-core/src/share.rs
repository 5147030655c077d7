//! The shape both backends share: a buffer that exports to a descriptor, and imports from one.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::Result;

/// A buffer that can be shared with other processes through a descriptor.
///
/// Implemented by [`HostBuffer`](crate::shm::HostBuffer) (memfd) and by the CUDA buffer, so that
/// code and tests can be written once for both. Clones are cheap handles to the same memory.
/// The buffer and its descriptor are serialisable through [`wire`](crate::wire): a buffer exports
/// on the way out and imports on arrival.
pub trait SharedBuffer: Clone + Serialize + DeserializeOwned + Send + Sync + 'static {
    /// What [`export`](Self::export) returns: owns the fds, one per chunk.
    type Descriptor: Serialize + DeserializeOwned + Send + 'static;

    /// The usable size in bytes.
    fn size(&self) -> usize;

    /// Whether this process imported the memory (imported memory cannot be exported again).
    fn is_imported(&self) -> bool;

    /// A descriptor that alone owns fresh fds for this memory.
    fn export(&self) -> Result<Self::Descriptor>;

    /// Map the memory a descriptor names into this process.
    fn import(descriptor: &Self::Descriptor) -> Result<Self>;

    /// Set every byte to `value`.
    fn fill(&self, value: u8) -> Result<()>;

    /// Copy `data` into the buffer at `offset`.
    fn write_at(&self, offset: usize, data: &[u8]) -> Result<()>;

    /// Copy from the buffer at `offset` into `out`.
    fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()>;
}

/// `impl SharedBuffer for $buffer` by its inherent methods of the same names, which both
/// backends have (they are the API; the trait only lets code be written once for both).
macro_rules! shared_buffer_by_inherent_methods {
    ($buffer:ty, $descriptor:ty) => {
        impl $crate::share::SharedBuffer for $buffer {
            type Descriptor = $descriptor;

            fn size(&self) -> usize {
                <$buffer>::size(self)
            }

            fn is_imported(&self) -> bool {
                <$buffer>::is_imported(self)
            }

            fn export(&self) -> $crate::error::Result<$descriptor> {
                <$buffer>::export(self)
            }

            fn import(descriptor: &$descriptor) -> $crate::error::Result<Self> {
                <$buffer>::import(descriptor)
            }

            fn fill(&self, value: u8) -> $crate::error::Result<()> {
                <$buffer>::fill(self, value)
            }

            fn write_at(&self, offset: usize, data: &[u8]) -> $crate::error::Result<()> {
                <$buffer>::write_at(self, offset, data)
            }

            fn read_at(&self, offset: usize, out: &mut [u8]) -> $crate::error::Result<()> {
                <$buffer>::read_at(self, offset, out)
            }
        }
    };
}
pub(crate) use shared_buffer_by_inherent_methods;

/// Why imported memory is not exported again, in the words every refusal (both backends) uses.
pub(crate) const IMPORTED_CANNOT_EXPORT: &str = "an imported buffer cannot be exported again \
     (the CUDA driver refuses to re-export imported memory, and host buffers follow the same \
     rule): forward the descriptor you imported it from, or copy the data into a buffer \
     allocated here and export that";

/// Bounds check shared by both backends' copies: `len` bytes at `offset` within `size`.
pub(crate) fn check_range(op: &'static str, offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(crate::Error::OutOfBounds {
            op: op.into(),
            offset,
            len,
            size,
        }),
    }
}

/// An [`Error::NotExportable`](crate::Error::NotExportable) for `op` on an imported buffer.
pub(crate) fn imported_cannot_export(op: &'static str) -> crate::Error {
    crate::Error::NotExportable {
        op: op.into(),
        rule: crate::error::ExportRule::Imported,
        message: IMPORTED_CANNOT_EXPORT.to_owned(),
    }
}
