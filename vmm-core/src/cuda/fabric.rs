//! Fabric handles: [`FabricDescriptor`] (one 64-byte [`FabricHandle`] per chunk, plain data
//! that crosses any transport), its layout rules and serde form. Whether this process can use
//! fabric handles at all is
//! [`Device::check_fabric`](super::Device::check_fabric)'s question.
//!
//! # A fabric handle is a bearer token
//!
//! Anyone who holds a handle's 64 bytes and an IMEX channel can import and map the memory. A
//! POSIX fd is a capability that only the processes it was sent to hold; a fabric handle is
//! bytes that can be copied, logged or forwarded. So:
//! - send a [`FabricDescriptor`] only over channels you trust (a socket between your own
//!   processes, a `Queue`, an authenticated or loopback connection), and never log it;
//! - `Debug` of [`FabricHandle`] and [`FabricDescriptor`], and every error of this crate,
//!   print no handle byte (the chunk count, sizes, owner and location only).
//!
//! # A fabric handle does not keep memory alive
//!
//! The memory lives as long as the exporter's buffer (and every import of it) does. Once the
//! exporter has dropped the last buffer that maps a chunk, importing that chunk's handle fails
//! ([`Error::Ipc`] while importing the chunk, with the driver's error as its source); buffers
//! imported before stay valid, since each import holds its own reference. So the exporter
//! must keep its buffer until every importer has imported:
//! - a buffer sent as a value (a process argument, a [`Queue`](crate::wire::Queue) item) does
//!   this by itself: it travels with an acknowledgement pipe, and the sending process keeps a
//!   handle to the buffer until the receiver has imported it (or failed to, or the message was
//!   dropped unread); [`VirtualMemoryBuffer::wait_imported`](super::VirtualMemoryBuffer::wait_imported)
//!   waits for that;
//! - a [`FabricDescriptor`] is plain data and carries nothing of the kind: keep the buffer
//!   until the importers say they have imported (a reply on your transport, an acknowledgement
//!   `Queue`).
//!
//! A process that exits frees its memory with it, kept buffers included (an fd in flight
//! would have kept it): a sender that may exit before its receivers have imported should call
//! `wait_imported` first.
//!
//! # Between machines (not tested here)
//!
//! This crate is tested on one machine. Between the nodes of an NVLink fabric, NVIDIA's IMEX
//! service (`nvidia-imex`) must run on every node and grant the processes the same IMEX channel
//! on each (a Kubernetes ComputeDomain does that). [`VirtualMemoryResource::import_fabric`]
//! maps memory whatever device owns it, one this process cannot see included (another node's
//! GPU; on one machine, a GPU hidden by `CUDA_VISIBLE_DEVICES`), for the resource's device with
//! the resource's access; the buffer keeps the owner's UUID
//! ([`VirtualMemoryBuffer::owner_uuid`](super::VirtualMemoryBuffer::owner_uuid)). Where the
//! driver refuses, the error says which of these it is: no fabric support
//! ([`Error::FabricUnsupported`]), no IMEX channel ([`Error::NoImexChannel`]), or no path to
//! the owner ([`Error::FabricUnreachable`]). Tested here between two GPUs of one machine, each
//! process seeing one of them; not between machines.
//!
//! [`VirtualMemoryResource::import_fabric`]: super::VirtualMemoryResource::import_fabric

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use super::device::format_uuid;
use super::driver::FABRIC_HANDLE_LEN;
use super::ipc_descriptor::{DeviceIdentity, validate_chunks};
use super::resource_options::{HandleType, Location};
use crate::error::DescriptorRule;
use crate::wire::deserialize_error;
use crate::{Error, Result};

/// The most chunks a [`FabricDescriptor`] may name (a peer's descriptor with more is refused
/// before anything is imported). A POSIX-fd descriptor is bounded by the fds one message can
/// carry ([`MAX_FDS`](crate::wire::MAX_FDS)); a fabric one carries no fd, so it has its own
/// bound.
pub const MAX_FABRIC_CHUNKS: usize = 65_536;

/// The directory whose device nodes are IMEX channels.
pub const IMEX_CHANNEL_DIR: &str = crate::error::IMEX_CHANNEL_DIR;

/// One chunk's fabric handle (`CUmemFabricHandle`): 64 opaque bytes. A bearer token (see the
/// [module docs](self)): its `Debug` prints no byte of it.
///
/// Serialised as a 128-digit hex string in human-readable formats (JSON) and as 64 bytes in
/// binary ones (postcard).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FabricHandle([u8; FABRIC_HANDLE_LEN]);

impl FabricHandle {
    /// A handle from its bytes (as another transport delivered them).
    pub fn from_bytes(bytes: [u8; 64]) -> Self {
        FabricHandle(bytes)
    }

    /// The handle's bytes, to send over a transport of your own.
    pub fn as_bytes(&self) -> &[u8; 64] {
        &self.0
    }
}

impl From<[u8; 64]> for FabricHandle {
    fn from(bytes: [u8; 64]) -> Self {
        FabricHandle(bytes)
    }
}

impl fmt::Debug for FabricHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FabricHandle(<64 bytes, redacted>)")
    }
}

impl Serialize for FabricHandle {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        if serializer.is_human_readable() {
            let hex: String = self.0.iter().map(|b| format!("{b:02x}")).collect();
            serializer.serialize_str(&hex)
        } else {
            serializer.serialize_bytes(&self.0)
        }
    }
}

impl<'de> Deserialize<'de> for FabricHandle {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        if deserializer.is_human_readable() {
            deserializer.deserialize_str(HandleVisitor)
        } else {
            deserializer.deserialize_bytes(HandleVisitor)
        }
    }
}

/// Reads a handle from 64 bytes, 64 byte values, or 128 hex digits. Errors say what was wrong
/// with the shape, never what the bytes were.
struct HandleVisitor;

impl<'de> Visitor<'de> for HandleVisitor {
    type Value = FabricHandle;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a fabric handle: {FABRIC_HANDLE_LEN} bytes, or {} hex digits",
            2 * FABRIC_HANDLE_LEN
        )
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> std::result::Result<FabricHandle, E> {
        <[u8; FABRIC_HANDLE_LEN]>::try_from(v)
            .map(FabricHandle)
            .map_err(|_| {
                E::custom(format!(
                    "a fabric handle is {FABRIC_HANDLE_LEN} bytes, not {}",
                    v.len()
                ))
            })
    }

    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<FabricHandle, E> {
        let wrong = || {
            E::custom(format!(
                "a fabric handle is {} hex digits; this string has {} characters, or a \
                 character that is not a hex digit",
                2 * FABRIC_HANDLE_LEN,
                v.chars().count()
            ))
        };
        if v.len() != 2 * FABRIC_HANDLE_LEN || !v.is_ascii() {
            return Err(wrong());
        }
        let mut bytes = [0u8; FABRIC_HANDLE_LEN];
        for (byte, pair) in bytes.iter_mut().zip(v.as_bytes().chunks_exact(2)) {
            let pair = std::str::from_utf8(pair).map_err(|_| wrong())?;
            *byte = u8::from_str_radix(pair, 16).map_err(|_| wrong())?;
        }
        Ok(FabricHandle(bytes))
    }

    fn visit_seq<A: de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<FabricHandle, A::Error> {
        let mut bytes = [0u8; FABRIC_HANDLE_LEN];
        for (index, byte) in bytes.iter_mut().enumerate() {
            *byte = seq
                .next_element()?
                .ok_or_else(|| de::Error::invalid_length(index, &self))?;
        }
        if seq.next_element::<de::IgnoredAny>()?.is_some() {
            return Err(de::Error::custom(format!(
                "a fabric handle is {FABRIC_HANDLE_LEN} bytes, not more"
            )));
        }
        Ok(FabricHandle(bytes))
    }
}

/// An exported buffer as fabric handles: one [`FabricHandle`] per chunk, the chunk sizes, the
/// buffer's size, the owner's device (by UUID) and where the memory lives.
///
/// Plain data: no fd, nothing to close, serialisable with any serde format (JSON, postcard,
/// a `Queue`, a process argument) and rebuildable from its parts with
/// [`from_handles`](Self::from_handles). Import it with
/// [`VirtualMemoryResource::import_fabric`](super::VirtualMemoryResource::import_fabric), or
/// with [`VirtualMemoryBuffer::import_fabric`](super::VirtualMemoryBuffer::import_fabric) into
/// this process's importer for the owner's device.
///
/// It is a bearer token and it does not keep the memory alive: see the
/// [module docs](self). Its `Debug` prints no handle byte. A value deserialised from any format
/// is checked as [`from_handles`](Self::from_handles) checks its parts, and a handle type other
/// than fabric is refused.
#[derive(Clone, PartialEq, Eq)]
pub struct FabricDescriptor {
    handles: Vec<FabricHandle>,
    chunk_sizes: Vec<usize>,
    size: usize,
    owner_uuid: [u8; 16],
    owner_ordinal: Option<usize>,
    location: Location,
}

impl fmt::Debug for FabricDescriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FabricDescriptor")
            .field(
                "handles",
                &format_args!("<{} fabric handle(s), redacted>", self.handles.len()),
            )
            .field("chunk_sizes", &self.chunk_sizes)
            .field("size", &self.size)
            .field("owner", &format_uuid(&self.owner_uuid))
            .field("owner_ordinal", &self.owner_ordinal)
            .field("location", &self.location)
            .finish()
    }
}

impl FabricDescriptor {
    /// A descriptor received as a peer-protocol message (`CUDA_FABRIC`, see [`crate::peer`]):
    /// checked by the same layout rules as [`FabricDescriptor::from_handles`], with the owner's
    /// ordinal and the location the message named.
    pub(crate) fn received(
        handles: Vec<FabricHandle>,
        chunk_sizes: Vec<usize>,
        size: usize,
        owner: DeviceIdentity,
        location: Location,
    ) -> Result<FabricDescriptor> {
        validate_fabric_layout(handles.len(), &chunk_sizes, size)?;
        Ok(FabricDescriptor::exported(
            handles,
            chunk_sizes,
            size,
            owner,
            location,
        ))
    }

    /// A descriptor from parts received by other means (the counterpart of cuda.core's
    /// `VirtualMemoryFabricBufferDescriptor.from_handles`): one handle per chunk, in chunk
    /// order, the chunk sizes, the buffer's size and the UUID of the device that owns the
    /// memory ([`Device::uuid`](super::Device::uuid)). The memory is taken to live in device memory
    /// ([`Location::Device`]).
    ///
    /// The layout is checked as far as it can be without a device (as
    /// [`IpcDescriptor::from_fds`](super::IpcDescriptor::from_fds) does); no driver call is
    /// made. `import_fabric` checks the rest (the granularity, the device).
    pub fn from_handles(
        handles: &[FabricHandle],
        chunk_sizes: &[usize],
        size: usize,
        owner_uuid: [u8; 16],
    ) -> Result<FabricDescriptor> {
        validate_fabric_layout(handles.len(), chunk_sizes, size)?;
        Ok(FabricDescriptor {
            handles: handles.to_vec(),
            chunk_sizes: chunk_sizes.to_vec(),
            size,
            owner_uuid,
            owner_ordinal: None,
            location: Location::Device,
        })
    }

    /// The descriptor of a fresh export.
    pub(crate) fn exported(
        handles: Vec<FabricHandle>,
        chunk_sizes: Vec<usize>,
        size: usize,
        owner: DeviceIdentity,
        location: Location,
    ) -> FabricDescriptor {
        debug_assert_eq!(handles.len(), chunk_sizes.len());
        FabricDescriptor {
            handles,
            chunk_sizes,
            size,
            owner_uuid: owner.uuid,
            owner_ordinal: Some(owner.ordinal),
            location,
        }
    }

    /// The handles, one per chunk, in chunk order. Bearer tokens: see the [module docs](self).
    pub fn handles(&self) -> &[FabricHandle] {
        &self.handles
    }

    /// The chunk sizes, in address order.
    pub fn chunk_sizes(&self) -> &[usize] {
        &self.chunk_sizes
    }

    /// The buffer's size (at most the sum of the chunk sizes).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Always [`HandleType::Fabric`]: how the chunks were exported (also for a buffer allocated
    /// with [`HandleType::PosixFdAndFabric`]).
    pub fn handle_type(&self) -> HandleType {
        HandleType::Fabric
    }

    /// The UUID of the device that owns the memory.
    pub fn owner_uuid(&self) -> &[u8; 16] {
        &self.owner_uuid
    }

    /// The owner's ordinal in the exporting process, when the descriptor came from
    /// [`VirtualMemoryBuffer::export_fabric`](super::VirtualMemoryBuffer::export_fabric)
    /// (`None` from [`from_handles`](Self::from_handles)). For messages only: processes may
    /// number devices differently.
    pub fn owner_ordinal(&self) -> Option<usize> {
        self.owner_ordinal
    }

    /// The exporting device, when the exporter's ordinal is known (see
    /// [`owner_ordinal`](Self::owner_ordinal)).
    pub fn device(&self) -> Option<DeviceIdentity> {
        self.owner_ordinal.map(|ordinal| DeviceIdentity {
            ordinal,
            uuid: self.owner_uuid,
        })
    }

    /// Where the exporter's memory lives.
    pub fn location(&self) -> Location {
        self.location
    }
}

/// The layout rules a fabric descriptor meets before any device is involved: one handle per
/// chunk, at most [`MAX_FABRIC_CHUNKS`], and [`validate_chunks`] at granularity 1.
fn validate_fabric_layout(handle_count: usize, chunk_sizes: &[usize], size: usize) -> Result<()> {
    let count = chunk_sizes.len();
    if handle_count != count {
        return Err(Error::descriptor(
            DescriptorRule::ChunkCount,
            format!(
                "invalid FabricDescriptor: {handle_count} handle(s) for {count} chunk(s): a \
                 descriptor carries exactly one fabric handle per chunk"
            ),
        ));
    }
    if count > MAX_FABRIC_CHUNKS {
        return Err(Error::descriptor(
            DescriptorRule::ChunkCount,
            format!(
                "invalid FabricDescriptor: {count} chunks, more than the {MAX_FABRIC_CHUNKS} a \
                 FabricDescriptor may name"
            ),
        ));
    }
    validate_chunks("FabricDescriptor", chunk_sizes, size, 1).map(drop)
}

/// The descriptor's serde form. It begins with the handle type, as a POSIX-fd descriptor's
/// does (a buffer's form relies on that), and names the owner by UUID.
#[derive(Serialize, Deserialize)]
#[serde(rename = "FabricDescriptor")]
struct Wire {
    handle_type: u32,
    size: u64,
    chunk_sizes: Vec<u64>,
    handles: Vec<FabricHandle>,
    owner_uuid: [u8; 16],
    owner_ordinal: Option<u64>,
    location: Location,
}

impl Wire {
    fn into_descriptor(self) -> Result<FabricDescriptor> {
        if self.handle_type != HandleType::Fabric.to_raw() {
            let named = HandleType::from_raw(self.handle_type)
                .map_or_else(|_| "unknown".to_owned(), |h| format!("{h:?}"));
            return Err(Error::descriptor(
                DescriptorRule::HandleType,
                format!(
                    "invalid FabricDescriptor: handle type {} ({named}): a FabricDescriptor \
                     carries fabric handles ({}); a POSIX-fd descriptor is an IpcDescriptor",
                    self.handle_type,
                    HandleType::Fabric.to_raw()
                ),
            ));
        }
        let fit = |v: u64| {
            usize::try_from(v).map_err(|_| {
                Error::descriptor(
                    DescriptorRule::Size,
                    format!("invalid FabricDescriptor: {v} does not fit this platform's usize"),
                )
            })
        };
        let chunk_sizes = self
            .chunk_sizes
            .into_iter()
            .map(fit)
            .collect::<Result<Vec<_>>>()?;
        let size = fit(self.size)?;
        validate_fabric_layout(self.handles.len(), &chunk_sizes, size)?;
        Ok(FabricDescriptor {
            handles: self.handles,
            chunk_sizes,
            size,
            owner_uuid: self.owner_uuid,
            owner_ordinal: self.owner_ordinal.map(fit).transpose()?,
            location: self.location,
        })
    }
}

impl Serialize for FabricDescriptor {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        Wire {
            handle_type: HandleType::Fabric.to_raw(),
            size: self.size as u64,
            chunk_sizes: self.chunk_sizes.iter().map(|&c| c as u64).collect(),
            handles: self.handles.clone(),
            owner_uuid: self.owner_uuid,
            owner_ordinal: self.owner_ordinal.map(|o| o as u64),
            location: self.location,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for FabricDescriptor {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        Wire::deserialize(deserializer)?
            .into_descriptor()
            .map_err(deserialize_error::<D>)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(seed: u8) -> FabricHandle {
        FabricHandle::from_bytes(std::array::from_fn(|i| seed.wrapping_add(i as u8)))
    }

    #[test]
    fn layout_is_checked_like_from_fds() {
        const G: usize = 2 << 20;
        let d = FabricDescriptor::from_handles(&[handle(1), handle(2)], &[G, G], G + 1, [7; 16])
            .unwrap();
        assert_eq!(
            (d.chunk_sizes(), d.size(), d.owner_uuid(), d.device()),
            (&[G, G][..], G + 1, &[7; 16], None)
        );
        assert_eq!(d.handle_type(), HandleType::Fabric);
        let refused = |handles: &[FabricHandle], sizes: &[usize], size: usize| {
            match FabricDescriptor::from_handles(handles, sizes, size, [0; 16]) {
                Err(Error::InvalidDescriptor { message, .. }) => message,
                other => panic!("expected InvalidDescriptor, got {other:?}"),
            }
        };
        assert_eq!(
            refused(&[handle(1)], &[G, G], G),
            "invalid FabricDescriptor: 1 handle(s) for 2 chunk(s): a descriptor carries \
             exactly one fabric handle per chunk"
        );
        assert_eq!(
            refused(&[handle(1), handle(2)], &[G, 0], G),
            "invalid FabricDescriptor: chunk 2 of 2 has size 0: chunks are never empty"
        );
        assert_eq!(
            refused(&[handle(1)], &[G], G + 1),
            format!(
                "invalid FabricDescriptor: size {} exceeds the {G} bytes that its 1 chunk(s) hold",
                G + 1
            )
        );
        let m = refused(&[handle(1), handle(2)], &[usize::MAX, 1], 0);
        assert!(
            m.contains("chunk 2 of 2: the sum of chunk sizes overflows"),
            "{m}"
        );
        let many = vec![handle(0); MAX_FABRIC_CHUNKS + 1];
        let m = refused(&many, &vec![1; MAX_FABRIC_CHUNKS + 1], 0);
        assert!(m.contains("more than the 65536"), "{m}");
        // Empty is a valid (empty) buffer.
        FabricDescriptor::from_handles(&[], &[], 0, [0; 16]).unwrap();
    }

    #[test]
    fn a_posix_handle_type_is_refused_on_arrival() {
        let wire = |handle_type| Wire {
            handle_type,
            size: 0,
            chunk_sizes: vec![],
            handles: vec![],
            owner_uuid: [0; 16],
            owner_ordinal: None,
            location: Location::Device,
        };
        for (raw, named) in [(1, "PosixFd"), (9, "PosixFdAndFabric"), (3, "unknown")] {
            let bytes = postcard::to_stdvec(&wire(raw)).unwrap();
            let err = crate::wire::decode::<FabricDescriptor>(&bytes, Vec::new()).unwrap_err();
            assert!(
                matches!(&err, Error::InvalidDescriptor { rule: DescriptorRule::HandleType, message: m }
                    if m == &format!("invalid FabricDescriptor: handle type {raw} ({named}): a \
                                      FabricDescriptor carries fabric handles (8); a POSIX-fd \
                                      descriptor is an IpcDescriptor")),
                "{err:?}"
            );
        }
        let bytes = postcard::to_stdvec(&wire(8)).unwrap();
        crate::wire::decode::<FabricDescriptor>(&bytes, Vec::new()).unwrap();
    }
}
