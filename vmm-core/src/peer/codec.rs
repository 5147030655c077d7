//! The codec between protocol messages and descriptors: [`encode_descriptor`] makes a
//! message of a descriptor, [`decode_message`] a descriptor (or `DATA`) of a message. The
//! message's own rules are [`Frame`]'s; the descriptors are built through their own
//! constructors and serde forms, so their rules run again as they would for any descriptor.

use std::os::fd::{BorrowedFd, OwnedFd};

use serde::Serialize;

use super::frame::{FABRIC_HANDLE_BYTES, Frame, FrameLocation, Kind, MAX_CHUNKS, carries_at_most};
use super::{Descriptor, DescriptorRef, PeerMessage};
use crate::cuda::{
    DeviceIdentity, FabricDescriptor, FabricHandle, HandleType, IpcDescriptor, Location,
};
use crate::error::{OptionRule, ProtocolRule, SerdeStep};
use crate::shm::HostDescriptor;
use crate::{Error, Result};

/// The header's device fields for `device`: its ordinal must fit 32 bits.
fn frame_device(ordinal: usize, uuid: [u8; 16]) -> Result<(u32, [u8; 16])> {
    let ordinal = u32::try_from(ordinal).map_err(|_| Error::TooLarge {
        size: ordinal as u64,
        max: u32::MAX.into(),
        message: format!("device ordinal {ordinal} does not fit the header's 32 bits"),
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
/// Refused, before anything is sent, for what the protocol cannot carry: with
/// [`Error::InvalidOption`] an [`IpcDescriptor`] of a handle type other than
/// [`HandleType::PosixFd`] (a fabric export is a [`FabricDescriptor`]) or a fabric descriptor
/// of no chunks; with [`Error::TooLarge`] more than [`MAX_CHUNKS`] chunks or a device ordinal
/// over `u32::MAX`.
pub fn encode_descriptor<'a>(
    descriptor: impl Into<DescriptorRef<'a>>,
) -> Result<(Vec<u8>, Vec<BorrowedFd<'a>>)> {
    let (frame, fds) = match descriptor.into() {
        DescriptorRef::Cuda(d) => {
            if d.handle_type() != HandleType::PosixFd {
                return Err(Error::option(
                    "handle_type",
                    OptionRule::Conflict,
                    format!(
                        "a descriptor of handle type {:?} cannot travel as a CUDA_VMM peer \
                         message: it carries PosixFd descriptors only (fabric handles travel as \
                         a FabricDescriptor)",
                        d.handle_type()
                    ),
                ));
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
pub(super) fn fabric_frame(d: &FabricDescriptor) -> Result<Frame> {
    let count = d.handles().len();
    if count == 0 {
        return Err(Error::option(
            "chunk_sizes",
            OptionRule::Missing,
            "a FabricDescriptor of no chunks cannot travel as a peer message: CUDA_FABRIC \
             carries at least one chunk",
        ));
    }
    carries_at_most(
        "a FabricDescriptor sent as one CUDA_FABRIC peer message",
        count,
        MAX_CHUNKS,
        "chunks",
    )?;
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

pub(super) fn from_frame(frame: Frame, mut fds: Vec<OwnedFd>) -> Result<PeerMessage> {
    match frame.kind {
        Kind::Data => Ok(PeerMessage::Data(frame.payload)),
        Kind::Cuda => cuda_descriptor(&frame, fds).map(|d| PeerMessage::Descriptor(d.into())),
        Kind::Fabric => fabric_descriptor(frame).map(|d| PeerMessage::Descriptor(d.into())),
        Kind::Host => {
            // The frame checked: no fd with size 0, one fd of `size` bytes otherwise.
            let size = usize::try_from(frame.size).map_err(|_| {
                Error::protocol(
                    ProtocolRule::Descriptor,
                    format!("peer message: HOST_MEMFD size {}", frame.size),
                )
            })?;
            Ok(PeerMessage::Descriptor(Descriptor::Host(HostDescriptor {
                size,
                fd: fds.pop(),
            })))
        }
        Kind::Hello | Kind::Refused => Err(Error::protocol(
            ProtocolRule::UnexpectedKind,
            format!(
                "peer message: {} belongs to the handshake, and the handshake is over",
                frame.kind.name()
            ),
        )),
    }
}

/// The [`FabricDescriptor`] of a decoded `CUDA_FABRIC` message. `Frame::decode` has checked
/// the kind's rules (one 64-byte handle per chunk, the owner named, the chunks' layout);
/// the descriptor's own rules run again as it is built, as they do for any fabric
/// descriptor.
fn fabric_descriptor(frame: Frame) -> Result<FabricDescriptor> {
    let Some((ordinal, uuid)) = frame.device else {
        return Err(Error::protocol(
            ProtocolRule::Descriptor,
            "peer message: CUDA_FABRIC: no owner device",
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
            Error::protocol(
                ProtocolRule::Descriptor,
                format!("peer message: CUDA_FABRIC: {v} does not fit this platform's usize"),
            )
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
    let bytes = postcard::to_stdvec(&form).map_err(|e| Error::serde(SerdeStep::Encode, e))?;
    crate::wire::decode::<IpcDescriptor>(&bytes, fds)
}

#[cfg(test)]
mod codec_tests;
