//! RAII handles over the three VMM objects: a physical allocation, an address reservation and a
//! mapping. Each undoes exactly what it did when dropped, so a sequence of steps that fails part
//! way rolls back by dropping what it built, in reverse order of construction.
//!
//! These types are where the driver layer's `unsafe` preconditions are discharged: each owns
//! exactly one driver object, so "this handle is live", "this range is exactly the one reserved"
//! and "nothing is mapped in it any more" follow from ownership and drop order.
//!
//! Drop errors cannot be returned; they are ignored (the driver reports them only for handles
//! it no longer knows, which these types never produce).

use std::sync::Arc;

use super::device::Device;
use super::driver::{
    self, CUdeviceptr, CUmemAccessDesc, CUmemAllocationProp, CUmemGenericAllocationHandle,
};
use crate::Result;
use crate::trace;

/// A physical allocation (`cuMemCreate` or `cuMemImportFromShareableHandle`, of a POSIX fd or a
/// fabric handle), released with `cuMemRelease`. Shared (`Arc`) by every mapping of it, so
/// grown buffers can reuse chunks.
#[derive(Debug)]
pub(crate) struct Allocation {
    /// Live as long as `self`: made by a constructor, released only by `Drop`, never handed
    /// out, so a driver call made while `self` is borrowed may rely on it.
    handle: CUmemGenericAllocationHandle,
    size: usize,
    imported: bool,
    device: Device,
}

impl Allocation {
    /// `cuMemCreate` of `size` bytes (a multiple of the granularity) with `prop`.
    pub(crate) fn create(device: &Device, size: usize, prop: &CUmemAllocationProp) -> Result<Self> {
        let _current = device.make_current()?;
        let handle = driver::mem_create(size, prop)?;
        Ok(Allocation {
            handle,
            size,
            imported: false,
            device: device.clone(),
        })
    }

    /// Import an exported allocation of `size` bytes from its POSIX fd (the fd stays the
    /// caller's).
    pub(crate) fn import(
        device: &Device,
        fd: std::os::fd::BorrowedFd<'_>,
        size: usize,
    ) -> Result<Self> {
        let _current = device.make_current()?;
        let handle = driver::import_posix_fd(fd)?;
        Ok(Allocation {
            handle,
            size,
            imported: true,
            device: device.clone(),
        })
    }

    /// Import an exported allocation of `size` bytes from its fabric handle.
    pub(crate) fn import_fabric(
        device: &Device,
        fabric: &[u8; driver::FABRIC_HANDLE_LEN],
        size: usize,
    ) -> Result<Self> {
        let _current = device.make_current()?;
        let handle = driver::import_fabric(fabric)?;
        Ok(Allocation {
            handle,
            size,
            imported: true,
            device: device.clone(),
        })
    }

    /// `cuMemExportToShareableHandle` of this allocation as a fabric handle. The caller makes
    /// the device current (an export of many chunks does it once: a fabric export takes about
    /// a microsecond, so a context switch per chunk would show).
    pub(crate) fn export_fabric(&self) -> Result<[u8; driver::FABRIC_HANDLE_LEN]> {
        // SAFETY: `self.handle` is live while `self` is borrowed (see the field).
        unsafe { driver::export_fabric(self.handle) }
    }

    /// `cuMemExportToShareableHandle` of this allocation as a fresh POSIX fd.
    pub(crate) fn export_posix_fd(&self) -> Result<std::os::fd::OwnedFd> {
        let _current = self.device.make_current()?;
        // SAFETY: `self.handle` is live while `self` is borrowed (see the field).
        unsafe { driver::export_posix_fd(self.handle) }
    }

    /// The driver's location of the memory (`cuMemGetAllocationPropertiesFromHandle`): where an
    /// imported chunk really lives.
    pub(crate) fn location(&self) -> Result<driver::CUmemLocation> {
        let _current = self.device.make_current()?;
        // SAFETY: `self.handle` is live while `self` is borrowed (see the field).
        unsafe { driver::allocation_properties(self.handle) }.map(|prop| prop.location)
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// Whether this chunk came from another exporter (and so cannot be exported again).
    pub(crate) fn is_imported(&self) -> bool {
        self.imported
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let _current = self.device.make_current();
        // SAFETY: `handle` came from `cuMemCreate` or `cuMemImportFromShareableHandle` in a
        // constructor of this value, which alone owns it; this drop is its only release and
        // nothing uses it afterwards. (Mappings hold an `Arc<Allocation>`, so none of this
        // value's mappings is left either, though the driver would allow that.)
        let _ = unsafe { driver::mem_release(self.handle) };
    }
}

/// A virtual address range (`cuMemAddressReserve`), freed with exactly the same pointer and size.
#[derive(Debug)]
pub(crate) struct Reservation {
    ptr: CUdeviceptr,
    size: usize,
    device: Device,
}

impl Reservation {
    /// Reserve `size` bytes, at `hint` if the driver can (0: anywhere).
    pub(crate) fn new(device: &Device, size: usize, alignment: usize, hint: u64) -> Result<Self> {
        let _current = device.make_current()?;
        let ptr = driver::address_reserve(size, alignment, hint)?;
        Ok(Reservation {
            ptr,
            size,
            device: device.clone(),
        })
    }

    pub(crate) fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let _current = self.device.make_current();
        // SAFETY: `ptr` and `size` are exactly what `cuMemAddressReserve` returned and was asked
        // for in `new`, freed only here. Nothing is mapped in the range any more: the only
        // mappings made in a reservation are a `Segment`'s, made by `Segment::map` at offsets
        // inside it, and a segment drops its mappings before its reservation (field order);
        // a reservation without a segment never had a mapping. The buffers that use the
        // addresses hold the segment, so none is left either.
        let _ = unsafe { driver::address_free(self.ptr, self.size) };
    }
}

/// One allocation mapped at one address (`cuMemMap` + `cuMemSetAccess`), unmapped on drop.
///
/// It keeps its allocation alive; the reservation it lies in must outlive it, which
/// [`Segment`]'s field order guarantees.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: CUdeviceptr,
    allocation: Arc<Allocation>,
}

impl Mapping {
    /// Map all of `allocation` at `ptr` and grant `access`. If granting fails the map is undone.
    ///
    /// Private to this module: [`Segment::map`] is the only way to make a mapping, so every
    /// mapping lies in a reservation that outlives it.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + allocation.size()` must lie inside a reservation that outlives the returned
    /// mapping, with nothing else mapped in that part of it for as long as the mapping lives.
    unsafe fn new(
        ptr: CUdeviceptr,
        allocation: Arc<Allocation>,
        access: &[CUmemAccessDesc],
    ) -> Result<Self> {
        let _current = allocation.device.make_current()?;
        // SAFETY: the caller guarantees the range lies in a reservation that outlives this
        // mapping, free of other mappings; `allocation.handle` is live (we hold the `Arc`).
        unsafe { driver::mem_map(ptr, allocation.size, allocation.handle) }?;
        // From here on, dropping `mapping` (on the error below) unmaps the range.
        let mapping = Mapping { ptr, allocation };
        // SAFETY: the range was just mapped by this mapping, which lives for the call.
        unsafe { driver::mem_set_access(mapping.ptr, mapping.allocation.size, access) }?;
        Ok(mapping)
    }

    pub(crate) fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    pub(crate) fn allocation(&self) -> &Arc<Allocation> {
        &self.allocation
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let _current = self.allocation.device.make_current();
        // SAFETY: exactly the range `new` mapped, unmapped only here. Nothing uses it any more:
        // mappings live in a `Segment`, which buffers share through an `Arc`, so this runs
        // when the last buffer that could copy to or from these addresses is gone; every
        // buffer operation waits for its device work before it returns, and work a user queued
        // on `VirtualMemoryBuffer::device_ptr` must have finished by then (documented there).
        let _ = unsafe { driver::mem_unmap(self.ptr, self.allocation.size) };
    }
}

/// A reservation and the chunks mapped back to back in it (possibly fewer than fill it while
/// being built). Fields drop in order: mappings are unmapped before the range is freed.
#[derive(Debug)]
pub(crate) struct Segment {
    mappings: Vec<Mapping>,
    reservation: Reservation,
    /// Mapped read-only for its own device (the first access entry).
    read_only: bool,
}

impl Segment {
    /// Map `chunks` back to back from the start of `reservation`. On failure, returns the index
    /// of the chunk that failed with the error; everything mapped so far is unmapped and the
    /// reservation freed.
    pub(crate) fn map(
        reservation: Reservation,
        chunks: impl IntoIterator<Item = Arc<Allocation>>,
        access: &[CUmemAccessDesc],
    ) -> std::result::Result<Self, (usize, crate::Error)> {
        Segment::map_keeping(reservation, chunks, access).map_err(|failed| (failed.0, failed.1))
    }

    /// [`map`](Self::map), giving the reservation back on failure (unmapped again) with the
    /// failed chunk's index and the error: for a caller that must keep its addresses (a wake
    /// at the addresses it slept at).
    pub(crate) fn map_keeping(
        reservation: Reservation,
        chunks: impl IntoIterator<Item = Arc<Allocation>>,
        access: &[CUmemAccessDesc],
    ) -> std::result::Result<Self, Box<(usize, crate::Error, Reservation)>> {
        let span = trace::span!(
            DEBUG,
            "cuda.map",
            bytes = reservation.size,
            chunks = trace::Empty
        );
        let read_only = access
            .first()
            .is_some_and(super::driver::access_is_read_only);
        let mut segment = Segment {
            mappings: Vec::new(),
            reservation,
            read_only,
        };
        let mut offset = 0usize;
        for (index, chunk) in chunks.into_iter().enumerate() {
            let size = chunk.size;
            if offset
                .checked_add(size)
                .is_none_or(|end| end > segment.reservation.size)
            {
                let error = crate::Error::descriptor(
                    crate::error::DescriptorRule::Size,
                    format!(
                        "chunk {} does not fit the {}-byte reservation",
                        index + 1,
                        segment.reservation.size
                    ),
                );
                return Err(Box::new((index, error, segment.into_reservation())));
            }
            // SAFETY: `offset + size` fits the reservation (checked above), and the chunks are
            // mapped at increasing, non-overlapping offsets, so this range is free; the
            // reservation outlives the mapping, since the segment owns both and drops its
            // mappings first (field order), also when this loop returns early.
            let mapping =
                unsafe { Mapping::new(segment.reservation.ptr + offset as u64, chunk, access) };
            match mapping {
                Ok(mapping) => segment.mappings.push(mapping),
                Err(e) => return Err(Box::new((index, e, segment.into_reservation()))),
            }
            offset += size;
        }
        trace::record!(span, "chunks", segment.mappings.len());
        Ok(segment)
    }

    pub(crate) fn ptr(&self) -> CUdeviceptr {
        self.reservation.ptr()
    }

    /// Unmap every chunk (last mapped first) and keep the range: nothing is mapped in the
    /// returned reservation.
    pub(crate) fn into_reservation(self) -> Reservation {
        let Segment {
            mut mappings,
            reservation,
            ..
        } = self;
        while let Some(mapping) = mappings.pop() {
            drop(mapping);
        }
        reservation
    }

    /// The end of the reserved range: where an in-place grow asks for the next reservation.
    pub(crate) fn end(&self) -> CUdeviceptr {
        self.reservation.ptr() + self.reservation.size() as u64
    }

    /// Whether its own device maps it read-only.
    pub(crate) fn read_only(&self) -> bool {
        self.read_only
    }

    pub(crate) fn mappings(&self) -> &[Mapping] {
        &self.mappings
    }
}
