//! Which [`VirtualMemoryResource`] a buffer that arrives in this process is imported into.
//!
//! A buffer arrives either as a value decoded from [`wire`](crate::wire) (a process argument, a
//! [`Queue`](crate::wire::Queue) item) or through [`VirtualMemoryBuffer::import`]. Neither names
//! a resource, so each process keeps one importer per device and location:
//! [`set_importer`] registers one, and [`importer`] returns it (or, when none is registered, a
//! resource with default options, created on first use and kept).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

#[cfg(doc)]
use super::buffer::VirtualMemoryBuffer;
use super::device::Device;
use super::options::{Location, ResourceOptions};
use super::resource::VirtualMemoryResource;
use crate::Result;

/// The importers of this process, by device ordinal and location.
type Importers = HashMap<(usize, Location), VirtualMemoryResource>;

fn importers() -> MutexGuard<'static, Importers> {
    static IMPORTERS: OnceLock<Mutex<Importers>> = OnceLock::new();
    IMPORTERS
        .get_or_init(Default::default)
        .lock()
        // The map is valid after any panic: each update is one insert.
        .unwrap_or_else(|e| e.into_inner())
}

/// Make `resource` this process's importer for its device and location: buffers that arrive
/// for that device and location (decoded from [`wire`](crate::wire), or imported with
/// [`VirtualMemoryBuffer::import`]) are imported into it from now on, with its options: its
/// peers get access to their mappings, and its `alignment` and `address_hint` shape their
/// reservations. It replaces any importer registered (or created by default) before for that
/// device and location; buffers imported already keep the mappings they have.
///
/// The key is `resource.device()` and `resource.options().location`. Register the importer
/// before the first buffer arrives, e.g. at the top of a child's function:
///
/// ```no_run
/// use vmm_core::cuda::{Access, Device, ResourceOptions, VirtualMemoryResource, set_importer};
/// // Buffers arriving for device 0 are mapped for device 1 as well.
/// let with_peer = ResourceOptions::default().peer(1, Access::ReadWrite);
/// set_importer(&VirtualMemoryResource::new(&Device::new(0)?, with_peer)?);
/// # Ok::<(), vmm_core::Error>(())
/// ```
pub fn set_importer(resource: &VirtualMemoryResource) {
    let key = (resource.device().ordinal(), resource.options().location);
    importers().insert(key, resource.clone());
}

/// This process's importer for `device` and `location`: the resource that arriving buffers for
/// them are imported into. That is the one registered last with [`set_importer`]; when none
/// was, it is a resource with default options (and `location`), created on the first call
/// and returned by every later one, until a [`set_importer`] replaces it.
pub fn importer(device: &Device, location: Location) -> Result<VirtualMemoryResource> {
    let mut importers = importers();
    let key = (device.ordinal(), location);
    if let Some(resource) = importers.get(&key) {
        return Ok(resource.clone());
    }
    let resource =
        VirtualMemoryResource::new(device, ResourceOptions::default().location(location))?;
    importers.insert(key, resource.clone());
    Ok(resource)
}
