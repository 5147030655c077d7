//! CUDA virtual-memory (VMM) buffers that can be shared with other processes by fd.
//!
//! Layered like cudarc: a private `driver` module wraps each driver call (the only `unsafe`), the
//! handle layer owns one driver object each (allocation, reservation, mapping) and undoes it on
//! drop, and the API on top is [`VirtualMemoryResource`] (allocate, grow, import),
//! [`VirtualMemoryBuffer`] (a contiguous range of chunks; export) and [`IpcDescriptor`] (the
//! fds and sizes that carry a buffer to another process).
//!
//! ```no_run
//! use vmm_core::cuda::{Device, ResourceOptions, VirtualMemoryResource};
//! let resource = VirtualMemoryResource::new(&Device::new(0)?, ResourceOptions::default())?;
//! let buffer = resource.allocate(1 << 20)?;
//! buffer.fill(7)?;
//! let descriptor = buffer.export()?; // one fd per chunk, owned by the descriptor
//! let alias = resource.import(&descriptor)?; // same memory, another address
//! # Ok::<(), vmm_core::Error>(())
//! ```

mod buffer;
mod device;
mod driver;
mod handle;
mod ipc;
mod resource;

pub use buffer::VirtualMemoryBuffer;
pub use device::{Device, availability};
pub use ipc::{DeviceIdentity, IpcDescriptor};
pub use resource::{
    Access, Granularity, HandleType, Location, PeerAccess, ResourceOptions, VirtualMemoryResource,
};

impl crate::SharedBuffer for VirtualMemoryBuffer {
    type Descriptor = IpcDescriptor;

    fn size(&self) -> usize {
        VirtualMemoryBuffer::size(self)
    }

    fn is_imported(&self) -> bool {
        VirtualMemoryBuffer::is_imported(self)
    }

    fn export(&self) -> crate::Result<IpcDescriptor> {
        VirtualMemoryBuffer::export(self)
    }

    fn import(descriptor: &IpcDescriptor) -> crate::Result<Self> {
        VirtualMemoryBuffer::import(descriptor)
    }

    fn fill(&self, value: u8) -> crate::Result<()> {
        VirtualMemoryBuffer::fill(self, value)
    }

    fn write_at(&self, offset: usize, data: &[u8]) -> crate::Result<()> {
        VirtualMemoryBuffer::write_at(self, offset, data)
    }

    fn read_at(&self, offset: usize, out: &mut [u8]) -> crate::Result<()> {
        VirtualMemoryBuffer::read_at(self, offset, out)
    }
}
