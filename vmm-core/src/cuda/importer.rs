//! The receiving side: which [`VirtualMemoryResource`] a buffer that arrives in this process is
//! imported into.
//!
//! A buffer arrives either as a value decoded from [`wire`](crate::wire) (a process argument, a
//! [`Queue`](crate::wire::Queue) item) or through [`VirtualMemoryBuffer::import`]. Neither names
//! a resource, so each process keeps one importer per device and location:
//! [`set_importer`] registers one, and [`importer`] returns it (or, when none is registered, a
//! resource with default options, created on first use and kept).
//!
//! This module sits above both the buffer and the resource (it uses both; neither uses it),
//! which is why the buffer's `Deserialize` impl lives here and not beside its `Serialize`.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

use serde::Deserialize;
use serde::de::Deserializer;

use super::buffer::VirtualMemoryBuffer;
use super::descriptor::IpcDescriptor;
use super::device::Device;
use super::options::{Location, ResourceOptions};
use super::resource::VirtualMemoryResource;
use crate::Result;
use crate::wire::deserialize_error;

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

impl VirtualMemoryBuffer {
    /// Import `descriptor` into this process's [`importer`] for the exporter's device (found by
    /// UUID, so device renumbering between processes does not matter; device 0 for a
    /// descriptor built with [`IpcDescriptor::from_fds`], which names none) and its location.
    /// Initialises CUDA here if needed.
    ///
    /// Without a [`set_importer`] for that device and location, that is a resource with
    /// default options: no peer has access to the mapping. To import into a resource of your
    /// choosing just once, use [`VirtualMemoryResource::import`].
    pub fn import(descriptor: &IpcDescriptor) -> Result<VirtualMemoryBuffer> {
        let device = match descriptor.device() {
            Some(identity) => Device::by_uuid(&identity.uuid)?,
            None => Device::new(0)?,
        };
        importer(&device, descriptor.location())?.import(descriptor)
    }
}

/// Receiving a buffer imports it exactly as [`VirtualMemoryBuffer::import`] does: into this
/// process's [`importer`] for the exporter's device (found by UUID) and location, that is the
/// resource last given to [`set_importer`] for them, else a resource with default options (no
/// peer access). CUDA is initialised here if needed. The received fds are closed once mapped;
/// a failed import is the decode's error (the same [`Error`](crate::Error) variant).
impl<'de> Deserialize<'de> for VirtualMemoryBuffer {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let descriptor = IpcDescriptor::deserialize(deserializer)?;
        VirtualMemoryBuffer::import(&descriptor).map_err(deserialize_error::<D>)
    }
}
