//! Which [`VirtualMemoryResource`] a buffer that arrives in this process is imported into.
//!
//! A buffer arrives either as a value decoded from [`wire`](crate::wire) (a process argument, a
//! [`Queue`](crate::wire::Queue) item) or through [`VirtualMemoryBuffer::import`]. Neither names
//! a resource, so each process keeps one importer per device and location:
//! [`set_importer`] registers one, and [`importer`] returns it (or, when none is registered, a
//! resource with default options, created on first use and kept).
//!
//! How a buffer arrives in this process: [`VirtualMemoryBuffer::import`] and
//! [`VirtualMemoryBuffer::import_fabric`] (into this process's [`importer`] for the exporter's
//! device and location), and its `Deserialize`, which imports the same way.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard, OnceLock};

use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};

use super::buffer::VirtualMemoryBuffer;
use super::device::Device;
use super::fabric::FabricDescriptor;
use super::ipc_descriptor::{IpcDescriptor, PosixRest};
use super::resource::VirtualMemoryResource;
use super::resource_options::{HandleType, Location, ResourceOptions};
use crate::Result;
use crate::wire::{FdIn, deserialize_error};

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

impl VirtualMemoryBuffer {
    /// Import fabric handles into this process's [`importer`] for the owner's device (found by
    /// UUID, so device renumbering between processes does not matter) and the descriptor's
    /// location, as [`VirtualMemoryBuffer::import`] does for fds. Where this process cannot see
    /// the owner (another node's GPU, or one hidden by `CUDA_VISIBLE_DEVICES`), the memory is
    /// mapped for device 0 instead, over the fabric; [`VirtualMemoryBuffer::owner_uuid`] still
    /// names the owner. Initialises CUDA here if needed; needs an IMEX channel (see
    /// [`Device::check_fabric`]).
    ///
    /// To import for a device of your choosing (or with other access), use
    /// [`VirtualMemoryResource::import_fabric`].
    pub fn import_fabric(descriptor: &FabricDescriptor) -> Result<VirtualMemoryBuffer> {
        let device = match Device::by_uuid(descriptor.owner_uuid()) {
            Ok(owner) => owner,
            Err(_) => Device::new(0)?,
        };
        importer(&device, descriptor.location())?.import_fabric(descriptor)
    }
}

/// What a buffer's serde form holds, before it is imported.
enum Arriving {
    /// The POSIX-fd descriptor's form (its handle type, then the rest).
    Posix(u32, PosixRest),
    /// A fabric buffer: the acknowledgement pipe's write end, then the descriptor.
    Fabric(FdIn<VirtualMemoryBuffer>, FabricDescriptor),
}

/// Reads a buffer's form: the handle type first, then what that type's form holds.
struct ArrivingVisitor;

impl<'de> Visitor<'de> for ArrivingVisitor {
    type Value = Arriving;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a vmm_core::cuda::VirtualMemoryBuffer in flight")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Arriving, A::Error> {
        let handle_type: u32 = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?;
        if handle_type == HandleType::Fabric.to_raw() {
            let ack = seq
                .next_element()?
                .ok_or_else(|| de::Error::invalid_length(1, &self))?;
            let descriptor = seq
                .next_element()?
                .ok_or_else(|| de::Error::invalid_length(2, &self))?;
            Ok(Arriving::Fabric(ack, descriptor))
        } else {
            let rest = seq
                .next_element()?
                .ok_or_else(|| de::Error::invalid_length(1, &self))?;
            Ok(Arriving::Posix(handle_type, rest))
        }
    }
}

/// Receiving a buffer imports it exactly as [`VirtualMemoryBuffer::import`] (a POSIX-fd
/// buffer) or [`VirtualMemoryBuffer::import_fabric`] (a fabric buffer) does: into this
/// process's [`importer`] for the exporter's device (found by UUID) and location, that is the
/// resource last given to [`set_importer`] for them, else a resource with default options (no
/// peer access). CUDA is initialised here if needed. The received fds (a POSIX-fd buffer's, or
/// a fabric buffer's acknowledgement fd, whose closing tells the sender it may let go) are
/// closed once mapped, or once the import failed; a failed import is the decode's error (the
/// same [`Error`](crate::Error) variant).
///
/// The form begins with the handle type, as both descriptors' forms do; that is how a POSIX-fd
/// buffer (the [`IpcDescriptor`]'s form) and a fabric buffer are told apart.
impl<'de> Deserialize<'de> for VirtualMemoryBuffer {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Postcard (the only format a buffer travels in) writes a struct as its fields back to
        // back, so a tuple of (handle type, rest) reads either form.
        match deserializer.deserialize_tuple(3, ArrivingVisitor)? {
            Arriving::Posix(handle_type, rest) => {
                let descriptor = rest
                    .into_descriptor(handle_type)
                    .map_err(deserialize_error::<D>)?;
                VirtualMemoryBuffer::import(&descriptor).map_err(deserialize_error::<D>)
            }
            Arriving::Fabric(ack, descriptor) => {
                let imported = VirtualMemoryBuffer::import_fabric(&descriptor);
                // Imported (or not): the sender may let go of its copy now.
                drop(ack);
                imported.map_err(deserialize_error::<D>)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, AsRawFd};

    use serde::Serialize;
    use serde::ser::{SerializeTuple, Serializer};

    use super::*;
    use crate::cuda::FabricHandle;
    use crate::wire::{FdOut, decode, encode};

    /// The buffer's form, read up to (not including) the import.
    struct ReadForm(Arriving);

    impl<'de> Deserialize<'de> for ReadForm {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            deserializer
                .deserialize_tuple(3, ArrivingVisitor)
                .map(ReadForm)
        }
    }

    #[test]
    fn a_posix_descriptors_form_reads_as_a_posix_buffer() {
        const G: usize = 2 << 20;
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let sent = IpcDescriptor::from_fds(
            &[file.as_fd(), file.as_fd()],
            &[G, G],
            HandleType::PosixFd,
            G + 5,
        )
        .unwrap();
        let encoded = encode(&sent).unwrap();
        let fds = encoded
            .fds()
            .map(|fd| fd.try_clone_to_owned().unwrap())
            .collect();
        let ReadForm(Arriving::Posix(handle_type, rest)) = decode(encoded.bytes(), fds).unwrap()
        else {
            panic!("a POSIX-fd form read as a fabric one")
        };
        let back = rest.into_descriptor(handle_type).unwrap();
        assert_eq!(
            (back.handle_type(), back.chunk_sizes(), back.size()),
            (HandleType::PosixFd, &[G, G][..], G + 5)
        );
        assert_eq!(back.fds().count(), 2);
    }

    /// A fabric buffer's form, as its `Serialize` writes it (without a GPU to export).
    struct FabricForm(
        FabricDescriptor,
        std::cell::Cell<Option<std::os::fd::OwnedFd>>,
    );

    impl Serialize for FabricForm {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let mut form = serializer.serialize_tuple(3)?;
            form.serialize_element(&HandleType::Fabric.to_raw())?;
            let ack = self.1.take().expect("serialised once");
            form.serialize_element(&FdOut::<VirtualMemoryBuffer>::given(ack))?;
            form.serialize_element(&self.0)?;
            form.end()
        }
    }

    #[test]
    fn a_fabric_buffers_form_carries_its_handles_in_band_and_one_ack_fd() {
        const G: usize = 2 << 20;
        let handles = [
            FabricHandle::from_bytes([1; 64]),
            FabricHandle::from_bytes([2; 64]),
        ];
        let descriptor = FabricDescriptor::from_handles(&handles, &[G, G], 2 * G, [9; 16]).unwrap();
        let (reader, writer) = std::io::pipe().unwrap();
        let form = FabricForm(
            descriptor.clone(),
            std::cell::Cell::new(Some(writer.into())),
        );
        let encoded = encode(&form).unwrap();
        assert_eq!(
            encoded.fd_count(),
            1,
            "one ack fd, whatever the chunk count"
        );
        let fds = encoded
            .fds()
            .map(|fd| fd.try_clone_to_owned().unwrap())
            .collect();
        let bytes = encoded.bytes().to_vec();
        drop(encoded);
        let ReadForm(Arriving::Fabric(ack, back)) = decode(&bytes, fds).unwrap() else {
            panic!("a fabric form read as a POSIX-fd one")
        };
        assert_eq!(back, descriptor);
        // The ack fd is the pipe's write end: closing it is what the sender waits for.
        let ack = ack.into_inner();
        assert!(ack.as_raw_fd() >= 0);
        drop(ack);
        let mut rest = Vec::new();
        let mut reader = reader;
        std::io::Read::read_to_end(&mut reader, &mut rest).unwrap();
        assert!(rest.is_empty());
    }
}
