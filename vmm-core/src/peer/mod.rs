//! The cross-language descriptor protocol: CUDA VMM, fabric and host (memfd) descriptors to
//! and from processes vmm-core did not start, in any language, on a named endpoint or (for
//! messages without fds) on any byte stream.
//!
//! One message is a small self-describing header (magic `VMMI`, version, kind, handle type,
//! chunk count and sizes, size, device UUID, location), then a payload, and for `CUDA_VMM` and
//! `HOST_MEMFD` one fd per chunk in `SCM_RIGHTS`; `docs/protocol.md` in the repository is the
//! specification, and `python/vmm_ipc_peer.py` a standard-library Python peer. This module
//! turns those messages into [`IpcDescriptor`]s, [`FabricDescriptor`]s and [`HostDescriptor`]s
//! and back. [`Session`] speaks the protocol on a named endpoint's authenticated connection
//! ([`wire::endpoint::Connection`](crate::wire::endpoint::Connection)): the handshake, then
//! [`send_descriptor`](Session::send_descriptor), [`recv_descriptor`](Session::recv_descriptor)
//! and `DATA`; [`stream`] writes and reads the messages without fds (`CUDA_FABRIC`, `DATA`) on
//! any [`std::io::Write`]/[`std::io::Read`], a TCP connection say, so a fabric descriptor
//! crosses machines.
//!
//! # Layers
//!
//! The protocol sits above the transport ([`wire`](crate::wire): packets, fds, credentials,
//! which knows nothing of descriptors) and above the descriptors it carries
//! ([`cuda`](crate::cuda), [`shm`](crate::shm)), whose rules it reuses rather than restates:
//! the message codec (`frame`) checks a descriptor's chunk layout with the rule every
//! descriptor meets, and names handle types by [`HandleType`]'s driver numbers. So `wire`
//! imports nothing of `cuda` or `peer`, and nothing imports `peer` back.
//!
//! # Versions
//!
//! Each message carries the version that defines its kind: `HELLO`, `REFUSED`, `DATA`,
//! `CUDA_VMM` and `HOST_MEMFD` are version 1 and are sent exactly as version 1 sent them;
//! `CUDA_FABRIC` (one 64-byte fabric handle per chunk, no fds) is version 2. So this crate
//! speaks version 1 to a version 1 peer as long as it sends it no fabric descriptor, and a
//! version 1 peer refuses one, naming the version it speaks. A message whose version is not
//! its kind's, or an unknown version, is refused ([`Error::Protocol`], naming the versions this
//! crate speaks). Whether a peer takes fabric descriptors is for the applications to agree
//! (there is no negotiation on the wire).
//!
//! # Checks on receipt
//!
//! Receiving validates as importing does, before anything is mapped: the header's counts
//! against the documented maxima and the fds the kernel delivered, then the descriptor's
//! layout by import's own rules (non-empty chunks, no overflow, size within the chunks, a
//! handle type this crate can import, one fabric handle per chunk); the fds are owned (and
//! close-on-exec) from the moment they arrive and are closed on any refusal. The descriptor
//! that comes out is an ordinary one:
//! [`VirtualMemoryBuffer::import`](crate::cuda::VirtualMemoryBuffer::import),
//! [`VirtualMemoryBuffer::import_fabric`](crate::cuda::VirtualMemoryBuffer::import_fabric) (or
//! [`HostBuffer::import`](crate::shm::HostBuffer::import)) runs its full checks again and maps.
//!
//! # Fabric handles are bearer tokens
//!
//! Whoever holds a fabric handle's 64 bytes (and an IMEX channel of the same NVLink domain)
//! can map the memory: send a [`FabricDescriptor`] only to a peer you would give the memory
//! (on an endpoint, an admitted peer; on a stream, one the stream authenticates). No `Debug`
//! output and no error of this module shows a handle byte. A handle does not keep the memory
//! alive: keep the exported buffer until the importer says it has imported (a `DATA` reply).
//! See [`cuda::fabric`](crate::cuda::fabric).
//!
//! For a transport of your own, [`encode_descriptor`] and [`decode_message`] are the codec
//! (a message's bytes exclude the packet's leading frame byte; see the specification).

use std::os::fd::{BorrowedFd, OwnedFd};

use serde::Serialize;

use crate::cuda::{
    DeviceIdentity, FabricDescriptor, FabricHandle, HandleType, IpcDescriptor, Location,
};
use crate::shm::HostDescriptor;
use crate::{Error, Result};

mod frame;
mod session;
pub mod stream;

use frame::{FABRIC_HANDLE_BYTES, Frame, FrameLocation, Kind};
pub use frame::{MAX_CHUNKS, MAX_DATA, PROTOCOL_VERSION};
pub use session::{Handshake, Session};

/// A descriptor received from a peer: a CUDA VMM buffer's (by fd or by fabric handle), or a
/// host (memfd) buffer's. It owns the fds that came with it.
#[derive(Debug)]
pub enum Descriptor {
    /// A CUDA VMM descriptor (kind `CUDA_VMM`): import it with
    /// [`VirtualMemoryBuffer::import`](crate::cuda::VirtualMemoryBuffer::import).
    Cuda(IpcDescriptor),
    /// A host memfd descriptor (kind `HOST_MEMFD`): import it with
    /// [`HostBuffer::import`](crate::shm::HostBuffer::import).
    Host(HostDescriptor),
    /// A CUDA VMM descriptor as fabric handles (kind `CUDA_FABRIC`, protocol version 2; no
    /// fds): import it with
    /// [`VirtualMemoryBuffer::import_fabric`](crate::cuda::VirtualMemoryBuffer::import_fabric).
    /// Its handles are bearer tokens (its `Debug` shows none).
    Fabric(FabricDescriptor),
}

impl Descriptor {
    /// The protocol's name for the descriptor's kind.
    fn kind_name(&self) -> &'static str {
        match self {
            Descriptor::Cuda(_) => Kind::Cuda.name(),
            Descriptor::Host(_) => Kind::Host.name(),
            Descriptor::Fabric(_) => Kind::Fabric.name(),
        }
    }

    /// `Error::Protocol`: expected `wanted`, the peer sent this.
    fn unexpected(&self, wanted: Kind) -> Error {
        Error::Protocol(format!(
            "expected a {} descriptor, the peer sent a {} one",
            wanted.name(),
            self.kind_name()
        ))
    }

    /// The CUDA descriptor, or an [`Error::Protocol`] saying which kind the peer sent instead.
    pub fn into_cuda(self) -> Result<IpcDescriptor> {
        match self {
            Descriptor::Cuda(d) => Ok(d),
            other => Err(other.unexpected(Kind::Cuda)),
        }
    }

    /// The host descriptor, or an [`Error::Protocol`] saying which kind the peer sent instead.
    pub fn into_host(self) -> Result<HostDescriptor> {
        match self {
            Descriptor::Host(d) => Ok(d),
            other => Err(other.unexpected(Kind::Host)),
        }
    }

    /// The fabric descriptor, or an [`Error::Protocol`] saying which kind the peer sent
    /// instead.
    pub fn into_fabric(self) -> Result<FabricDescriptor> {
        match self {
            Descriptor::Fabric(d) => Ok(d),
            other => Err(other.unexpected(Kind::Fabric)),
        }
    }

    /// The buffer's size in bytes.
    pub fn size(&self) -> usize {
        match self {
            Descriptor::Cuda(d) => d.size(),
            Descriptor::Host(d) => d.size(),
            Descriptor::Fabric(d) => d.size(),
        }
    }

    /// Its fds, one per chunk (none for an empty host buffer, none for a fabric descriptor).
    pub fn fds(&self) -> Vec<BorrowedFd<'_>> {
        match self {
            Descriptor::Cuda(d) => d.fds().collect(),
            Descriptor::Host(d) => d.fd().into_iter().collect(),
            Descriptor::Fabric(_) => Vec::new(),
        }
    }
}

impl From<IpcDescriptor> for Descriptor {
    fn from(d: IpcDescriptor) -> Self {
        Descriptor::Cuda(d)
    }
}

impl From<HostDescriptor> for Descriptor {
    fn from(d: HostDescriptor) -> Self {
        Descriptor::Host(d)
    }
}

impl From<FabricDescriptor> for Descriptor {
    fn from(d: FabricDescriptor) -> Self {
        Descriptor::Fabric(d)
    }
}

/// A descriptor to send, borrowed: it keeps its fds (the message carries duplicates made by
/// the kernel).
#[derive(Debug, Clone, Copy)]
pub enum DescriptorRef<'a> {
    /// A CUDA VMM descriptor.
    Cuda(&'a IpcDescriptor),
    /// A host memfd descriptor.
    Host(&'a HostDescriptor),
    /// A fabric descriptor (no fds; its handles are bearer tokens).
    Fabric(&'a FabricDescriptor),
}

impl<'a> From<&'a IpcDescriptor> for DescriptorRef<'a> {
    fn from(d: &'a IpcDescriptor) -> Self {
        DescriptorRef::Cuda(d)
    }
}

impl<'a> From<&'a HostDescriptor> for DescriptorRef<'a> {
    fn from(d: &'a HostDescriptor) -> Self {
        DescriptorRef::Host(d)
    }
}

impl<'a> From<&'a FabricDescriptor> for DescriptorRef<'a> {
    fn from(d: &'a FabricDescriptor) -> Self {
        DescriptorRef::Fabric(d)
    }
}

impl<'a> From<&'a Descriptor> for DescriptorRef<'a> {
    fn from(d: &'a Descriptor) -> Self {
        match d {
            Descriptor::Cuda(d) => DescriptorRef::Cuda(d),
            Descriptor::Host(d) => DescriptorRef::Host(d),
            Descriptor::Fabric(d) => DescriptorRef::Fabric(d),
        }
    }
}

/// One message from a peer, after the handshake.
#[derive(Debug)]
pub enum PeerMessage {
    /// A descriptor, with its fds.
    Descriptor(Descriptor),
    /// Application bytes (`DATA`).
    Data(Vec<u8>),
}

/// The header's device fields for `device`: its ordinal must fit 32 bits.
fn frame_device(ordinal: usize, uuid: [u8; 16]) -> Result<(u32, [u8; 16])> {
    let ordinal = u32::try_from(ordinal).map_err(|_| {
        Error::InvalidArgument(format!(
            "device ordinal {ordinal} does not fit the header's 32 bits"
        ))
    })?;
    Ok((ordinal, uuid))
}

fn frame_location(location: Location) -> FrameLocation {
    match location {
        Location::Device => FrameLocation::Device,
        Location::HostNuma(node) => FrameLocation::HostNuma(node),
    }
}

fn location(location: FrameLocation) -> Location {
    match location {
        FrameLocation::Device => Location::Device,
        FrameLocation::HostNuma(node) => Location::HostNuma(node),
    }
}

/// The protocol message for `descriptor` (its bytes, without the packet's frame byte) and the
/// fds to send with it, borrowed from the descriptor, one per chunk (none for a fabric
/// descriptor).
///
/// Refused with [`Error::InvalidArgument`] for what the protocol cannot carry: an
/// [`IpcDescriptor`] of a handle type other than [`HandleType::PosixFd`] (a fabric export is a
/// [`FabricDescriptor`]), more than [`MAX_CHUNKS`] chunks, a fabric descriptor of no chunks,
/// a device ordinal over `u32::MAX`.
pub fn encode_descriptor<'a>(
    descriptor: impl Into<DescriptorRef<'a>>,
) -> Result<(Vec<u8>, Vec<BorrowedFd<'a>>)> {
    let (frame, fds) = match descriptor.into() {
        DescriptorRef::Cuda(d) => {
            if d.handle_type() != HandleType::PosixFd {
                return Err(Error::InvalidArgument(format!(
                    "a descriptor of handle type {:?} cannot travel as a CUDA_VMM peer \
                     message: it carries PosixFd descriptors only (fabric handles travel as a \
                     FabricDescriptor)",
                    d.handle_type()
                )));
            }
            let device = d
                .device()
                .map(|identity| frame_device(identity.ordinal, identity.uuid))
                .transpose()?;
            let frame = Frame {
                handle_type: 1,
                size: d.size() as u64,
                device,
                location: frame_location(d.location()),
                chunk_sizes: d.chunk_sizes().iter().map(|&s| s as u64).collect(),
                ..Frame::empty(Kind::Cuda)
            };
            (frame, d.fds().collect())
        }
        DescriptorRef::Host(d) => {
            let fds: Vec<BorrowedFd<'a>> = d.fd().into_iter().collect();
            let frame = Frame {
                size: d.size() as u64,
                chunk_sizes: if fds.is_empty() {
                    Vec::new()
                } else {
                    vec![d.size() as u64]
                },
                ..Frame::empty(Kind::Host)
            };
            (frame, fds)
        }
        DescriptorRef::Fabric(d) => (fabric_frame(d)?, Vec::new()),
    };
    Ok((frame.encode()?, fds))
}

/// The `CUDA_FABRIC` message of `d`: its handles in the payload, in chunk order.
fn fabric_frame(d: &FabricDescriptor) -> Result<Frame> {
    let count = d.handles().len();
    if count == 0 {
        return Err(Error::InvalidArgument(
            "a FabricDescriptor of no chunks cannot travel as a peer message: CUDA_FABRIC \
             carries at least one chunk"
                .into(),
        ));
    }
    if count > MAX_CHUNKS {
        return Err(Error::InvalidArgument(format!(
            "a FabricDescriptor of {count} chunks cannot travel as one peer message: \
             CUDA_FABRIC carries at most {MAX_CHUNKS}"
        )));
    }
    // The ordinal is informative only; a descriptor made with from_handles has none (0).
    let device = frame_device(d.owner_ordinal().unwrap_or(0), *d.owner_uuid())?;
    let mut payload = Vec::with_capacity(FABRIC_HANDLE_BYTES * count);
    for handle in d.handles() {
        payload.extend_from_slice(handle.as_bytes());
    }
    Ok(Frame {
        handle_type: HandleType::Fabric.to_raw(),
        size: d.size() as u64,
        device: Some(device),
        location: frame_location(d.location()),
        chunk_sizes: d.chunk_sizes().iter().map(|&s| s as u64).collect(),
        payload,
        ..Frame::empty(Kind::Fabric)
    })
}

/// Decode one protocol message (its bytes, without the packet's frame byte) and the fds the
/// kernel delivered with it. Every fd is closed on a refusal, and every fd not taken by the
/// result is closed. `HELLO` and `REFUSED` belong to the handshake and are refused here.
pub fn decode_message(bytes: &[u8], fds: Vec<OwnedFd>) -> Result<PeerMessage> {
    let frame = Frame::decode(bytes, fds.len())?;
    from_frame(frame, fds)
}

fn from_frame(frame: Frame, mut fds: Vec<OwnedFd>) -> Result<PeerMessage> {
    match frame.kind {
        Kind::Data => Ok(PeerMessage::Data(frame.payload)),
        Kind::Cuda => cuda_descriptor(&frame, fds).map(|d| PeerMessage::Descriptor(d.into())),
        Kind::Fabric => fabric_descriptor(frame).map(|d| PeerMessage::Descriptor(d.into())),
        Kind::Host => {
            // The frame checked: no fd with size 0, one fd of `size` bytes otherwise.
            let size = usize::try_from(frame.size).map_err(|_| {
                Error::Protocol(format!("peer message: HOST_MEMFD size {}", frame.size))
            })?;
            Ok(PeerMessage::Descriptor(Descriptor::Host(HostDescriptor {
                size,
                fd: fds.pop(),
            })))
        }
        Kind::Hello | Kind::Refused => Err(Error::Protocol(format!(
            "peer message: {} belongs to the handshake, and the handshake is over",
            frame.kind.name()
        ))),
    }
}

/// The [`FabricDescriptor`] of a decoded `CUDA_FABRIC` message. `Frame::decode` has checked
/// the kind's rules (one 64-byte handle per chunk, the owner named, the chunks' layout);
/// the descriptor's own rules run again as it is built, as they do for any fabric
/// descriptor.
fn fabric_descriptor(frame: Frame) -> Result<FabricDescriptor> {
    let Some((ordinal, uuid)) = frame.device else {
        return Err(Error::Protocol(
            "peer message: CUDA_FABRIC: no owner device".into(),
        ));
    };
    let handles = frame
        .payload
        .chunks_exact(FABRIC_HANDLE_BYTES)
        .map(|bytes| {
            let mut handle = [0u8; FABRIC_HANDLE_BYTES];
            handle.copy_from_slice(bytes);
            FabricHandle::from_bytes(handle)
        })
        .collect();
    let fit = |v: u64| {
        usize::try_from(v).map_err(|_| {
            Error::Protocol(format!(
                "peer message: CUDA_FABRIC: {v} does not fit this platform's usize"
            ))
        })
    };
    let chunk_sizes = frame
        .chunk_sizes
        .iter()
        .map(|&c| fit(c))
        .collect::<Result<Vec<_>>>()?;
    FabricDescriptor::received(
        handles,
        chunk_sizes,
        fit(frame.size)?,
        DeviceIdentity {
            ordinal: ordinal as usize,
            uuid,
        },
        location(frame.location),
    )
}

/// The serde form of [`IpcDescriptor`] (see `cuda::descriptor`): its fields, then fd indices.
/// Building the descriptor through it hands the received fds over without a duplicate, with the
/// device and location the header named. `the_descriptor_form_is_ipc_descriptors` checks that
/// the two forms stay one.
#[derive(Serialize)]
struct IpcDescriptorForm<'a> {
    handle_type: u32,
    size: u64,
    chunk_sizes: &'a [u64],
    device: Option<DeviceIdentity>,
    location: Location,
    fds: Vec<u32>,
}

fn cuda_descriptor(frame: &Frame, fds: Vec<OwnedFd>) -> Result<IpcDescriptor> {
    // Frame::decode has checked what import's layout rules check (counts, empty chunks,
    // overflow, size within the chunks, handle type 1); import checks it all again.
    let form = IpcDescriptorForm {
        handle_type: frame.handle_type,
        size: frame.size,
        chunk_sizes: &frame.chunk_sizes,
        device: frame.device.map(|(ordinal, uuid)| DeviceIdentity {
            ordinal: ordinal as usize,
            uuid,
        }),
        location: location(frame.location),
        fds: (0..fds.len() as u32).collect(),
    };
    let bytes = postcard::to_stdvec(&form).map_err(|e| Error::Serde(e.to_string()))?;
    crate::wire::decode::<IpcDescriptor>(&bytes, fds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    use crate::shm::HostBuffer;

    fn received(fds: &[BorrowedFd<'_>]) -> Vec<OwnedFd> {
        fds.iter()
            .map(|fd| fd.try_clone_to_owned().unwrap())
            .collect()
    }

    /// The private serde form above must be `IpcDescriptor`'s own: a descriptor encoded by
    /// vmm_core::wire decodes through the same bytes the form makes, with every field.
    #[test]
    fn the_descriptor_form_is_ipc_descriptors() {
        let g = 2u64 << 20;
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let frame = Frame {
            handle_type: 1,
            size: 3 * g - 1,
            device: Some((2, [0x5a; 16])),
            location: FrameLocation::HostNuma(1),
            chunk_sizes: vec![g, 2 * g],
            ..Frame::empty(Kind::Cuda)
        };
        let fds = received(&[file.as_fd(), file.as_fd()]);
        let d = cuda_descriptor(&frame, fds).unwrap();
        assert_eq!(d.chunk_sizes(), &[g as usize, 2 * g as usize]);
        assert_eq!(d.size(), 3 * g as usize - 1);
        assert_eq!(d.handle_type(), HandleType::PosixFd);
        assert_eq!(
            d.device(),
            Some(DeviceIdentity {
                ordinal: 2,
                uuid: [0x5a; 16]
            })
        );
        assert_eq!(d.location(), Location::HostNuma(1));
        assert_eq!(d.fds().count(), 2);
        // And the wire form vmm-core itself writes is byte for byte the form's.
        let encoded = crate::wire::encode(&d).unwrap();
        let form = IpcDescriptorForm {
            handle_type: 1,
            size: 3 * g - 1,
            chunk_sizes: &[g, 2 * g],
            device: d.device(),
            location: Location::HostNuma(1),
            fds: vec![0, 1],
        };
        assert_eq!(encoded.bytes(), postcard::to_stdvec(&form).unwrap());
        // Back through the protocol: the same fields.
        let (bytes, out_fds) = encode_descriptor(&d).unwrap();
        let back = decode_message(&bytes, received(&out_fds)).unwrap();
        let PeerMessage::Descriptor(Descriptor::Cuda(back)) = back else {
            panic!("not a CUDA descriptor");
        };
        assert_eq!(
            (
                back.chunk_sizes(),
                back.size(),
                back.device(),
                back.location()
            ),
            (d.chunk_sizes(), d.size(), d.device(), d.location())
        );
    }

    #[test]
    fn host_descriptors_round_trip_and_import() {
        let buf = HostBuffer::new(5000).unwrap();
        buf.fill(3).unwrap();
        let d = buf.export().unwrap();
        let (bytes, fds) = encode_descriptor(&d).unwrap();
        assert_eq!(fds.len(), 1);
        let PeerMessage::Descriptor(back) = decode_message(&bytes, received(&fds)).unwrap() else {
            panic!("not a descriptor")
        };
        let alias = HostBuffer::import(&back.into_host().unwrap()).unwrap();
        assert_eq!(alias.to_vec(), vec![3; 5000]);
        let empty = HostBuffer::new(0).unwrap().export().unwrap();
        let (bytes, fds) = encode_descriptor(&empty).unwrap();
        assert!(fds.is_empty());
        let PeerMessage::Descriptor(Descriptor::Host(back)) =
            decode_message(&bytes, Vec::new()).unwrap()
        else {
            panic!("not a host descriptor")
        };
        assert_eq!((back.size(), back.fd().is_none()), (0, true));
    }

    #[test]
    fn the_wrong_kind_is_refused_by_name() {
        let buf = HostBuffer::new(64).unwrap();
        let d = Descriptor::from(buf.export().unwrap());
        let m = d.into_cuda().unwrap_err().to_string();
        assert!(m.contains("expected a CUDA_VMM descriptor"), "{m}");
        let hello = Frame::empty(Kind::Hello).encode().unwrap();
        let m = decode_message(&hello, Vec::new()).unwrap_err().to_string();
        assert!(m.contains("HELLO belongs to the handshake"), "{m}");
    }

    #[test]
    fn a_handle_type_none_descriptor_is_not_sent() {
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        // Only through the serde form can a None descriptor exist without a GPU.
        let form = IpcDescriptorForm {
            handle_type: 0,
            size: 4096,
            chunk_sizes: &[4096],
            device: None,
            location: Location::Device,
            fds: vec![0],
        };
        let bytes = postcard::to_stdvec(&form).unwrap();
        let none: IpcDescriptor = crate::wire::decode(&bytes, received(&[file.as_fd()])).unwrap();
        let err = encode_descriptor(&none).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("handle type None")),
            "{err:?}"
        );
    }
}
