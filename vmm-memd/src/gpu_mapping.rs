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
    Device, HandleType, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
};

use crate::error::Result;

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
    /// or not, at `hint` if given (the driver may place it elsewhere: the caller checks).
    pub(crate) fn import(
        device: [u8; 16],
        fds: &[OwnedFd],
        sizes: &[u64],
        (read_only, fabric): (bool, bool),
        hint: Option<u64>,
    ) -> Result<GpuChunks> {
        let gpu = Device::by_uuid(&device)?;
        let mut options = ResourceOptions::default().read_only(read_only);
        if let Some(hint) = hint {
            options = options.address_hint(hint);
        }
        let resource = VirtualMemoryResource::new(&gpu, options)?;
        let lens: Vec<usize> = sizes.iter().map(|&s| s as usize).collect();
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
        let total = lens.iter().sum();
        let descriptor = IpcDescriptor::from_fds(&borrowed, &lens, HandleType::PosixFd, total)?;
        let buffer = resource.import(&descriptor)?;
        Ok(GpuChunks {
            buffer,
            device,
            sizes: sizes.to_vec(),
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
