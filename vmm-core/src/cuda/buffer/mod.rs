//! [`VirtualMemoryBuffer`]: a contiguous device address range made of chunks, and its copies.
//! How it leaves this process is [`export`]'s job (an export, or a send as a fresh export); how
//! one arrives ([`VirtualMemoryBuffer::import`], the buffer's `Deserialize`) is the `importer`
//! module's (into this process's importer for its device and location).

use std::sync::Arc;

use super::device::Device;
use super::driver::{self, CUdeviceptr};
use super::ipc_descriptor::IpcDescriptor;
use super::objects::{Allocation, Reservation, Segment};
use super::resource_options::{HandleType, Location};
use crate::Result;
use crate::share::check_range;

mod export;

/// A reserved range of device addresses with nothing mapped in it: what
/// [`VirtualMemoryBuffer::into_address_range`] keeps of a buffer, for
/// [`VirtualMemoryResource::import_at`](super::VirtualMemoryResource::import_at) to map
/// memory at again. Freed (`cuMemAddressFree`) when dropped.
#[derive(Debug)]
pub struct AddressRange {
    reservation: Reservation,
}

impl AddressRange {
    /// The first address.
    pub fn device_ptr(&self) -> u64 {
        self.reservation.ptr()
    }

    /// Its length in bytes.
    pub fn size(&self) -> usize {
        self.reservation.size()
    }

    /// The device whose address space it is in.
    pub fn device(&self) -> &Device {
        self.reservation.device()
    }

    pub(crate) fn into_reservation(self) -> Reservation {
        self.reservation
    }

    pub(crate) fn from_reservation(reservation: Reservation) -> Self {
        AddressRange { reservation }
    }
}

/// A range of device virtual memory backed by one or more chunks mapped back to back.
///
/// `Clone` gives another handle to the same mapping; the last handle unmaps, frees the address
/// range and releases the chunks (a chunk shared with a grown buffer lives on in that buffer).
/// A buffer holds no file descriptor: [`VirtualMemoryBuffer::export`] makes fresh ones.
#[derive(Debug, Clone)]
pub struct VirtualMemoryBuffer {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Contiguous, in address order. Each segment unmaps its chunks then frees its range.
    segments: Vec<Arc<Segment>>,
    size: usize,
    device: Device,
    location: Location,
    handle_type: HandleType,
    imported: bool,
    /// The UUID of the device that owns the memory, where that is not `device` (a fabric
    /// import of another GPU's memory): kept for diagnostics.
    owner: Option<[u8; 16]>,
}

impl VirtualMemoryBuffer {
    /// A buffer of `size` bytes over `segments` (contiguous, in address order; none for an
    /// empty buffer), mapped for `device`.
    pub(crate) fn from_segments(
        device: &Device,
        location: Location,
        handle_type: HandleType,
        segments: Vec<Arc<Segment>>,
        size: usize,
        imported: bool,
    ) -> Self {
        VirtualMemoryBuffer {
            inner: Arc::new(Inner {
                segments,
                size,
                device: device.clone(),
                location,
                handle_type,
                imported,
                owner: None,
            }),
        }
    }

    /// This buffer, noted as owned by the device with UUID `owner` (a fabric import), where
    /// that is not the device it is mapped for. Only for a buffer no one else holds yet.
    pub(crate) fn owned_by(mut self, owner: [u8; 16]) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner)
            && &owner != inner.device.uuid()
        {
            inner.owner = Some(owner);
        }
        self
    }

    /// The same mapping seen with another size (at most [`Self::capacity`]).
    pub(crate) fn with_size(&self, size: usize) -> Self {
        debug_assert!(size <= self.capacity());
        VirtualMemoryBuffer {
            inner: Arc::new(Inner {
                segments: self.inner.segments.clone(),
                size,
                device: self.inner.device.clone(),
                location: self.inner.location,
                handle_type: self.inner.handle_type,
                imported: self.inner.imported,
                owner: self.inner.owner,
            }),
        }
    }

    pub(crate) fn segments(&self) -> &[Arc<Segment>] {
        &self.inner.segments
    }

    /// The chunks in address order.
    pub(crate) fn chunks(&self) -> impl Iterator<Item = &Arc<Allocation>> {
        self.mapped().map(|(_, chunk)| chunk)
    }

    /// Each chunk with the address it is mapped at.
    fn mapped(&self) -> impl Iterator<Item = (CUdeviceptr, &Arc<Allocation>)> {
        self.inner
            .segments
            .iter()
            .flat_map(|s| s.mappings().iter().map(|m| (m.ptr(), m.allocation())))
    }

    /// One past the last mapped byte (where an in-place grow continues).
    pub(crate) fn end(&self) -> CUdeviceptr {
        self.inner.segments.last().map_or(0, |s| s.end())
    }

    /// The device address of the first byte (0 for an empty buffer), for kernels and
    /// other libraries. It stays mapped while this buffer or a clone of it lives: work queued
    /// on it must have finished before the last one is dropped (vmm-core's own copies wait for
    /// theirs before returning).
    pub fn device_ptr(&self) -> u64 {
        self.inner.segments.first().map_or(0, |s| s.ptr())
    }

    /// The usable size in bytes (what was asked for; chunks may hold more).
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// The bytes the chunks hold together (the size rounded up to the granularity).
    pub fn capacity(&self) -> usize {
        self.chunks().map(|c| c.size()).sum()
    }

    /// Chunk sizes in address order: one per allocation, as an export describes them.
    pub fn chunk_sizes(&self) -> Vec<usize> {
        self.chunks().map(|c| c.size()).collect()
    }

    /// The device the memory is mapped for.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The UUID of the device that owns the memory: [`device`](Self::device)'s, except for a
    /// fabric import of memory that another GPU owns (one this process may not see at all:
    /// another node's, or one hidden by `CUDA_VISIBLE_DEVICES`), whose UUID the descriptor named.
    pub fn owner_uuid(&self) -> [u8; 16] {
        self.inner.owner.unwrap_or(*self.inner.device.uuid())
    }

    /// Where the memory lives.
    pub fn location(&self) -> Location {
        self.inner.location
    }

    /// How the chunks can be shared.
    pub fn handle_type(&self) -> HandleType {
        self.inner.handle_type
    }

    /// Whether this buffer was imported (by [`VirtualMemoryResource::import`],
    /// [`VirtualMemoryBuffer::import`] or on arrival over [`wire`](crate::wire)): such a buffer
    /// cannot be exported again (forward its descriptor instead).
    ///
    /// [`VirtualMemoryResource::import`]: super::VirtualMemoryResource::import
    pub fn is_imported(&self) -> bool {
        self.inner.imported || self.chunks().any(|c| c.is_imported())
    }

    /// Unmap this buffer and keep its addresses: the chunks are released (the memory goes
    /// unless an exported fd or another process still holds it) and the address range stays
    /// reserved in this process, for
    /// [`VirtualMemoryResource::import_at`](super::VirtualMemoryResource::import_at) to map
    /// memory at the same addresses later (a sleep and wake: pointers into the buffer mean
    /// the same after the wake). A range the driver handed back could be taken by any other
    /// allocation of this process before a wake; a kept one cannot.
    ///
    /// The buffer comes back unchanged in `Err` when it cannot be taken apart: another handle
    /// to it lives (a clone, a buffer grown from it, a pending send), or it spans several
    /// reservations (grown in place), or it is empty. Device work queued on its addresses
    /// must have finished, as before dropping it.
    pub fn into_address_range(self) -> std::result::Result<AddressRange, VirtualMemoryBuffer> {
        let inner = match Arc::try_unwrap(self.inner) {
            Ok(inner) => inner,
            Err(inner) => return Err(VirtualMemoryBuffer { inner }),
        };
        if inner.segments.len() != 1 || Arc::strong_count(&inner.segments[0]) != 1 {
            return Err(VirtualMemoryBuffer {
                inner: Arc::new(inner),
            });
        }
        let Inner { mut segments, .. } = inner;
        let segment = segments.pop().and_then(|s| Arc::try_unwrap(s).ok());
        let segment = segment.expect("one segment, held only here (checked above)");
        Ok(AddressRange {
            reservation: segment.into_reservation(),
        })
    }

    fn check_range(&self, op: &'static str, offset: usize, len: usize) -> Result<()> {
        check_range(op, offset, len, self.inner.size)
    }

    /// The pieces of `offset..offset+len` that fall in each chunk: (device address, offset
    /// into the range, length). Copies go chunk by chunk so no driver call spans two
    /// allocations.
    fn pieces(
        &self,
        offset: usize,
        len: usize,
    ) -> impl Iterator<Item = (CUdeviceptr, usize, usize)> + use<> {
        pieces(
            self.mapped().map(|(ptr, chunk)| (ptr, chunk.size())),
            offset,
            len,
        )
        .into_iter()
    }

    /// Refuse a write to a buffer its device maps read-only
    /// ([`ResourceOptions::read_only`](crate::cuda::ResourceOptions::read_only)): the write
    /// would fault on the device and poison the context.
    fn check_writable(&self, op: &str) -> Result<()> {
        if self.segments().iter().any(|s| s.read_only()) {
            return Err(crate::Error::option(
                "read_only",
                crate::error::OptionRule::Conflict,
                format!("{op}: the buffer is mapped read-only for its device"),
            ));
        }
        Ok(())
    }

    /// Set every byte to `byte`; returns once the device has done it.
    pub fn fill(&self, byte: u8) -> Result<()> {
        self.check_writable("fill")?;
        if self.inner.size == 0 {
            return Ok(());
        }
        let _current = self.inner.device.make_current()?;
        let queued = self
            .pieces(0, self.inner.size)
            .try_for_each(|(ptr, _, len)| {
                // SAFETY: `pieces` gives ranges inside this buffer's own mappings, which `self`
                // keeps alive; the buffer's device (current, above) has read-write access to every
                // mapping of its resource; and the memset finishes before this returns (the
                // synchronise below runs whether or not a later memset failed).
                unsafe { driver::memset_d8(ptr, byte, len) }
            });
        let synchronised = driver::ctx_synchronize();
        queued.and(synchronised)
    }

    /// Copy `src` to `offset`; returns once the data is on the device (visible to importers).
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range("write_at", offset, src.len())?;
        self.check_writable("write_at")?;
        if src.is_empty() {
            return Ok(());
        }
        let _current = self.inner.device.make_current()?;
        let queued = self
            .pieces(offset, src.len())
            .try_for_each(|(ptr, at, len)| {
                // SAFETY: `pieces` gives ranges inside this buffer's own mappings (bounds checked
                // above), which `self` keeps alive; the buffer's device (current, above) has
                // read-write access; and the copy finishes before this returns (the synchronise
                // below runs whether or not a later copy failed).
                unsafe { driver::memcpy_htod(ptr, &src[at..at + len]) }
            });
        let synchronised = driver::ctx_synchronize();
        queued.and(synchronised)
    }

    /// Copy every byte of `src` into this buffer on the device (`cuMemcpyDtoD`, piece by
    /// piece so that no call spans two chunks of either); returns once the copy is done. Both
    /// must be as large and on the same device ([`Error::InvalidOption`](crate::Error::InvalidOption) with
    /// rule `Conflict` otherwise, before any driver call), and this one writable. For moving
    /// memory into chunks of another kind (fabric-shareable ones, say) without a trip through
    /// the host.
    pub fn copy_from(&self, src: &VirtualMemoryBuffer) -> Result<()> {
        self.check_writable("copy_from")?;
        if src.size() != self.size() || src.device() != self.device() {
            return Err(crate::Error::option(
                "src",
                crate::error::OptionRule::Conflict,
                format!(
                    "copy_from: {} bytes on device {} into {} bytes on device {}",
                    src.size(),
                    src.device().ordinal(),
                    self.size(),
                    self.device().ordinal()
                ),
            ));
        }
        if self.inner.size == 0 {
            return Ok(());
        }
        let _current = self.inner.device.make_current()?;
        let copies = copy_pieces(
            self.mapped().map(|(ptr, chunk)| (ptr, chunk.size())),
            src.mapped().map(|(ptr, chunk)| (ptr, chunk.size())),
            self.inner.size,
        );
        let queued = copies.into_iter().try_for_each(|(to, from, len)| {
            // SAFETY: `copy_pieces` gives ranges inside one mapping of each buffer (the sizes
            // are equal, checked above), which `self` and `src` keep alive; the device
            // (current, above) may read every mapping of `src` and write every one of `self`
            // (checked above); and the copy finishes before this returns (the synchronise
            // below runs whether or not a later copy failed).
            unsafe { driver::memcpy_dtod(to, from, len) }
        });
        let synchronised = driver::ctx_synchronize();
        queued.and(synchronised)
    }

    /// Copy from `offset` into `dst`, after all earlier work on the device finished.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range("read_at", offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let _current = self.inner.device.make_current()?;
        self.pieces(offset, dst.len())
            .try_for_each(|(ptr, at, len)| {
                // SAFETY: `pieces` gives ranges inside this buffer's own mappings (bounds checked
                // above), which `self` keeps alive; the buffer's device (current, above) has
                // read-write access; the copy is synchronous.
                unsafe { driver::memcpy_dtoh(&mut dst[at..at + len], ptr) }
            })
    }
}

// Into this process's importer, as `VirtualMemoryBuffer::import` does.
crate::share::shared_buffer_by_inherent_methods!(VirtualMemoryBuffer, IpcDescriptor);

/// Split `offset..offset+len` over chunks given as (address, size), in order.
fn pieces(
    chunks: impl Iterator<Item = (CUdeviceptr, usize)>,
    offset: usize,
    len: usize,
) -> Vec<(CUdeviceptr, usize, usize)> {
    let end = offset + len;
    let mut out = Vec::new();
    let mut chunk_start = 0usize;
    for (ptr, size) in chunks {
        let chunk_end = chunk_start + size;
        let from = offset.max(chunk_start);
        let to = end.min(chunk_end);
        if from < to {
            out.push((ptr + (from - chunk_start) as u64, from - offset, to - from));
        }
        chunk_start = chunk_end;
        if chunk_start >= end {
            break;
        }
    }
    out
}

/// The copies of the first `len` bytes of chunks `src` into chunks `dst` (each given as
/// (address, size), in order) such that no copy spans two chunks of either side:
/// (destination address, source address, length).
fn copy_pieces(
    dst: impl Iterator<Item = (CUdeviceptr, usize)>,
    src: impl Iterator<Item = (CUdeviceptr, usize)>,
    len: usize,
) -> Vec<(CUdeviceptr, CUdeviceptr, usize)> {
    let src: Vec<_> = src.collect();
    let mut out = Vec::new();
    for (to, at, piece) in pieces(dst, 0, len) {
        // `at` is where this destination piece starts in the range; each source piece of the
        // same bytes starts `from_at` bytes into the piece (`pieces` counts from its offset).
        for (from, from_at, part) in pieces(src.iter().copied(), at, piece) {
            out.push((to + from_at as u64, from, part));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{check_range, copy_pieces, pieces};
    use crate::Error;

    #[test]
    fn ranges_are_bounds_checked() {
        check_range("read_at", 0, 10, 10).unwrap();
        check_range("read_at", 10, 0, 10).unwrap();
        let err = check_range("read_at", 5, 6, 10).unwrap_err();
        assert!(
            matches!(&err, Error::OutOfBounds { op, offset: 5, len: 6, size: 10 } if op == "read_at"),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "read_at: 6 bytes at offset 5 are out of bounds of the 10-byte buffer"
        );
        let err = check_range("write_at", usize::MAX, 1, 10).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::OutOfBounds {
                    offset: usize::MAX,
                    len: 1,
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn pieces_split_at_chunk_boundaries() {
        let chunks = [(1000u64, 10usize), (1010, 20)];
        assert_eq!(
            pieces(chunks.into_iter(), 0, 30),
            [(1000, 0, 10), (1010, 10, 20)]
        );
        assert_eq!(
            pieces(chunks.into_iter(), 5, 10),
            [(1005, 0, 5), (1010, 5, 5)]
        );
        assert_eq!(pieces(chunks.into_iter(), 12, 3), [(1012, 0, 3)]);
        assert_eq!(pieces(chunks.into_iter(), 10, 0), []);
    }

    #[test]
    fn pieces_follow_relocated_chunks() {
        // Chunks need not be at increasing addresses for the arithmetic to hold.
        let chunks = [(5000u64, 4usize), (100, 4)];
        assert_eq!(
            pieces(chunks.into_iter(), 2, 4),
            [(5002, 0, 2), (100, 2, 2)]
        );
    }

    #[test]
    fn copies_never_span_a_chunk_of_either_side() {
        // Destination: two chunks of 20 at 1000 and 5000; source: one of 40 at 100.
        let dst = [(1000, 20), (5000, 20)];
        let src = [(100, 40)];
        assert_eq!(
            copy_pieces(dst.into_iter(), src.into_iter(), 40),
            [(1000, 100, 20), (5000, 120, 20)]
        );
        // And back: the source split where the destination is not.
        assert_eq!(
            copy_pieces(src.into_iter(), dst.into_iter(), 40),
            [(100, 1000, 20), (120, 5000, 20)]
        );
        // Boundaries that do not line up: 10 + 30 into 25 + 15.
        let a = [(0, 10), (100, 30)];
        let b = [(1000, 25), (2000, 15)];
        assert_eq!(
            copy_pieces(b.into_iter(), a.into_iter(), 40),
            [(1000, 0, 10), (1010, 100, 15), (2000, 115, 15)]
        );
    }
}
