//! CUDA virtual-memory (VMM) buffers that can be shared with other processes by fd or by
//! fabric handle.
//!
//! The API: [`VirtualMemoryResource`] allocates, grows and imports [`VirtualMemoryBuffer`]s on
//! one [`Device`] with fixed [`ResourceOptions`]; a buffer is a contiguous range of chunks that
//! [`export`](VirtualMemoryBuffer::export)s to an [`IpcDescriptor`] (one fd per chunk, the only
//! thing that crosses a process boundary), or, allocated with [`HandleType::Fabric`],
//! [`export_fabric`](VirtualMemoryBuffer::export_fabric)s to a [`FabricDescriptor`] (one
//! 64-byte handle per chunk, plain data for any transport; see [`fabric`]); [`set_importer`] and [`importer()`] say which resource
//! buffers that arrive in this process (over [`wire`](crate::wire), or through
//! [`VirtualMemoryBuffer::import`]) are imported into.
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
//!
//! # Layout
//!
//! Layered like cudarc (sys, then result, then safe types): the driver's FFI, then the owners of
//! driver objects, then the data a buffer is described by (options, descriptors, fabric), then
//! buffer and resource, and last the receiving side. Each module has one job, and each uses
//! only the modules listed before it (`tests/tests/architecture/` checks this table against
//! the imports):
//!
//! | module | job |
//! | --- | --- |
//! | `driver` | one checked wrapper per driver call; driver types only. Wrappers whose soundness depends on what their arguments name are `unsafe fn`s with a `# Safety` section |
//! | `device` | [`Device`]: identity, capabilities, the primary context made current per call |
//! | `objects` | RAII over one driver object each (allocation, reservation, mapping, a segment of mappings): where the driver's `unsafe` contracts are discharged, by ownership and drop order |
//! | `resource_options` | [`ResourceOptions`] and its enums: plain data, checked before any driver call, translated to driver types here |
//! | `ipc_descriptor` | [`IpcDescriptor`], [`DeviceIdentity`], the layout rules a descriptor from another process must meet, its serde form |
//! | [`fabric`] | [`FabricDescriptor`] (fabric handles: plain data, any transport), its rules and serde form |
//! | `fabric_support` | whether this process can use fabric handles ([`Device::check_fabric`], [`fabric_availability`]) and what the driver's refusals of a fabric call mean |
//! | `keeper` | keeps a fabric buffer in flight alive until its receiver has imported it (one thread per process, started on first use) |
//! | `buffer` | [`VirtualMemoryBuffer`]: copies, [`export`](VirtualMemoryBuffer::export), [`export_fabric`](VirtualMemoryBuffer::export_fabric), sending (`Serialize`) |
//! | `resource` | [`VirtualMemoryResource`]: allocate, grow, [`import`](VirtualMemoryResource::import) and [`import_fabric`](VirtualMemoryResource::import_fabric) (validate, import, reserve, map, set access, or roll back) |
//! | `importer` | the receiving side: [`set_importer`], [`importer()`], [`VirtualMemoryBuffer::import`], [`VirtualMemoryBuffer::import_fabric`], and the buffer's `Deserialize` |

mod buffer;
mod device;
mod driver;
pub mod fabric;
mod fabric_support;
mod importer;
mod ipc_descriptor;
mod keeper;
mod objects;
mod resource;
mod resource_options;

/// Why CUDA cannot be used here ([`availability`], [`fabric_availability`]).
pub use crate::error::Unavailable;
pub use buffer::{AddressRange, VirtualMemoryBuffer};
pub use device::{Device, availability, format_uuid};
pub use fabric::{FabricDescriptor, FabricHandle};
pub use fabric_support::fabric_availability;
pub use importer::{importer, set_importer};
/// The descriptors' layout rule, also the peer protocol's for its CUDA kinds (one place for it).
pub(crate) use ipc_descriptor::validate_chunks;
pub use ipc_descriptor::{DeviceIdentity, IpcDescriptor};
pub use resource::VirtualMemoryResource;
pub use resource_options::{
    Access, Granularity, HandleType, Location, PeerAccess, ResourceOptions,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_types_can_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<VirtualMemoryBuffer>();
        send_sync::<VirtualMemoryResource>();
        send_sync::<IpcDescriptor>();
        send_sync::<FabricDescriptor>();
        send_sync::<Device>();
    }
}
