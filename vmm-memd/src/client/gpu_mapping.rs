//! A GPU region's generation as a client maps it: every chunk imported (through vmm-core)
//! back to back in one reservation on the region's device, found by its UUID. Readers map
//! read-only (`cuMemSetAccess` with `PROT_READ` for the device: a write through this mapping
//! faults, and vmm-core refuses `fill` and `write_at` on it); writers map read-write.
//!
//! Read-only is this client's choice, not the service's guarantee: whoever holds a chunk's fd
//! (every reader is sent one) can import it with read-write access of its own. The digests
//! taken at commit (`Client::verify`) detect such writes; nothing prevents them.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use vmm_core::cuda::{
    AddressRange, Device, HandleType, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer,
    VirtualMemoryResource,
};

use crate::error::{MemdError, Result};

/// A GPU generation mapped in this process. Unmapped on drop (the memory stays while the
/// service, or any other importer, holds it).
#[derive(Debug)]
pub struct GpuChunks {
    buffer: VirtualMemoryBuffer,
    device: [u8; 16],
    sizes: Vec<u64>,
    read_only: bool,
    fabric: bool,
}

impl GpuChunks {
    /// Import `fds` (one per chunk, of `sizes`) on the device with UUID `device`, read-only
    /// or not, at fresh addresses.
    pub(crate) fn import(
        device: [u8; 16],
        fds: &[OwnedFd],
        sizes: &[u64],
        (read_only, fabric): (bool, bool),
    ) -> Result<GpuChunks> {
        let (resource, descriptor) = Self::prepare(device, fds, sizes, read_only)?;
        let buffer = resource.import(&descriptor)?;
        Ok(GpuChunks {
            buffer,
            device,
            sizes: sizes.to_vec(),
            read_only,
            fabric,
        })
    }

    /// [`import`](Self::import) at the addresses of `range` (kept by a sleep): the mapping
    /// starts at `range.device_ptr()`. On failure the range comes back with the error.
    pub(crate) fn import_at(
        device: [u8; 16],
        fds: &[OwnedFd],
        sizes: &[u64],
        (read_only, fabric): (bool, bool),
        range: AddressRange,
    ) -> std::result::Result<GpuChunks, Box<(MemdError, AddressRange)>> {
        let (resource, descriptor) = match Self::prepare(device, fds, sizes, read_only) {
            Ok(prepared) => prepared,
            Err(e) => return Err(Box::new((e, range))),
        };
        match resource.import_at(&descriptor, range) {
            Ok(buffer) => Ok(GpuChunks {
                buffer,
                device,
                sizes: sizes.to_vec(),
                read_only,
                fabric,
            }),
            Err(failed) => {
                let (e, range) = *failed;
                Err(Box::new((e.into(), range)))
            }
        }
    }

    /// The resource of device `device` and the descriptor of `fds` an import maps.
    fn prepare(
        device: [u8; 16],
        fds: &[OwnedFd],
        sizes: &[u64],
        read_only: bool,
    ) -> Result<(VirtualMemoryResource, IpcDescriptor)> {
        let gpu = Device::by_uuid(&device)?;
        let options = ResourceOptions::default().read_only(read_only);
        let resource = VirtualMemoryResource::new(&gpu, options)?;
        let lens: Vec<usize> = sizes.iter().map(|&s| s as usize).collect();
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
        let total = lens.iter().sum();
        let descriptor = IpcDescriptor::from_fds(&borrowed, &lens, HandleType::PosixFd, total)?;
        Ok((resource, descriptor))
    }

    /// Unmap, keeping the address range reserved in this process (a sleep): the chunks are
    /// released here, the memory stays while the service holds it. `Err(self)` unchanged when
    /// another handle to the mapping lives (a clone of [`buffer`](Self::buffer)).
    pub(crate) fn into_address_range(self) -> std::result::Result<AddressRange, GpuChunks> {
        let GpuChunks {
            buffer,
            device,
            sizes,
            read_only,
            fabric,
        } = self;
        buffer.into_address_range().map_err(|buffer| GpuChunks {
            buffer,
            device,
            sizes,
            read_only,
            fabric,
        })
    }

    /// The mapping: all chunks back to back (read it with `read_at`; a reader's refuses
    /// `fill` and `write_at`).
    pub fn buffer(&self) -> &VirtualMemoryBuffer {
        &self.buffer
    }

    /// The device address of chunk 0 (the others follow at [`chunk_offset`](Self::chunk_offset)).
    pub fn device_ptr(&self) -> u64 {
        self.buffer.device_ptr()
    }

    /// The UUID of the device the chunks live on.
    pub fn device_uuid(&self) -> [u8; 16] {
        self.device
    }

    /// The chunk sizes.
    pub fn chunk_sizes(&self) -> &[u64] {
        &self.sizes
    }

    /// Where chunk `index` starts in [`buffer`](Self::buffer).
    pub fn chunk_offset(&self, index: usize) -> Option<u64> {
        (index < self.sizes.len()).then(|| self.sizes[..index].iter().sum())
    }

    /// Whether this process maps it read-only for the device.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Whether the chunks are also fabric-shareable (the service's device and process
    /// support fabric handles).
    pub fn fabric(&self) -> bool {
        self.fabric
    }
}
