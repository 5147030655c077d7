//! The cross-language descriptor protocol: CUDA VMM and host (memfd) descriptors to and from
//! processes vmm-core did not start, in any language.
//!
//! One message is a small self-describing header (magic `VMMI`, version, kind, handle type,
//! chunk count and sizes, size, device UUID, location) and one fd per chunk in `SCM_RIGHTS`;
//! `docs/protocol.md` in the repository is the specification, and `python/vmm_ipc_peer.py` a
//! standard-library Python peer. This module turns those messages into
//! [`IpcDescriptor`]s and [`HostDescriptor`]s and back, and gives
//! [`Connection`] (a named endpoint's connection, see [`wire::endpoint`](crate::wire::endpoint))
//! [`send_descriptor`](Connection::send_descriptor) and
//! [`recv_descriptor`](Connection::recv_descriptor).
//!
//! Receiving validates as importing does, before anything is mapped: the header's counts
//! against the documented maxima and the fds the kernel delivered, then the descriptor's
//! layout by import's own rules (non-empty chunks, no overflow, size within the chunks, a
//! handle type this crate can import); the fds are owned (and close-on-exec) from the moment
//! they arrive and are closed on any refusal. The descriptor that comes out is an ordinary
//! one: [`VirtualMemoryBuffer::import`](crate::cuda::VirtualMemoryBuffer::import) (or
//! [`HostBuffer::import`](crate::shm::HostBuffer::import)) runs its full checks again and maps.
//!
//! For a transport of your own, [`encode_descriptor`] and [`decode_message`] are the codec
//! (a message's bytes exclude the packet's leading frame byte; see the specification).

use std::os::fd::{BorrowedFd, OwnedFd};

use serde::Serialize;

use crate::cuda::{DeviceIdentity, HandleType, IpcDescriptor, Location};
use crate::shm::HostDescriptor;
use crate::wire::endpoint::{Connection, Frame, FrameLocation, Kind};
use crate::{Error, Result};

/// A descriptor received from a peer: a CUDA VMM buffer's, or a host (memfd) buffer's. It owns
/// the fds that came with it.
#[derive(Debug)]
pub enum Descriptor {
    /// A CUDA VMM descriptor (kind `CUDA_VMM`): import it with
    /// [`VirtualMemoryBuffer::import`](crate::cuda::VirtualMemoryBuffer::import).
    Cuda(IpcDescriptor),
    /// A host memfd descriptor (kind `HOST_MEMFD`): import it with
    /// [`HostBuffer::import`](crate::shm::HostBuffer::import).
    Host(HostDescriptor),
}

impl Descriptor {
    /// The CUDA descriptor, or an [`Error::Protocol`] saying the peer sent a host one.
    pub fn into_cuda(self) -> Result<IpcDescriptor> {
        match self {
            Descriptor::Cuda(d) => Ok(d),
            Descriptor::Host(_) => Err(Error::Protocol(
                "expected a CUDA_VMM descriptor, the peer sent a HOST_MEMFD one".into(),
            )),
        }
    }

    /// The host descriptor, or an [`Error::Protocol`] saying the peer sent a CUDA one.
    pub fn into_host(self) -> Result<HostDescriptor> {
        match self {
            Descriptor::Host(d) => Ok(d),
            Descriptor::Cuda(_) => Err(Error::Protocol(
                "expected a HOST_MEMFD descriptor, the peer sent a CUDA_VMM one".into(),
            )),
        }
    }

    /// The buffer's size in bytes.
    pub fn size(&self) -> usize {
        match self {
            Descriptor::Cuda(d) => d.size(),
            Descriptor::Host(d) => d.size(),
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

/// A descriptor to send, borrowed: it keeps its fds (the message carries duplicates made by
/// the kernel).
#[derive(Debug, Clone, Copy)]
pub enum DescriptorRef<'a> {
    /// A CUDA VMM descriptor.
    Cuda(&'a IpcDescriptor),
    /// A host memfd descriptor.
    Host(&'a HostDescriptor),
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

impl<'a> From<&'a Descriptor> for DescriptorRef<'a> {
    fn from(d: &'a Descriptor) -> Self {
        match d {
            Descriptor::Cuda(d) => DescriptorRef::Cuda(d),
            Descriptor::Host(d) => DescriptorRef::Host(d),
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

/// The protocol message for `descriptor` (its bytes, without the packet's frame byte) and the
/// fds to send with it, borrowed from the descriptor, one per chunk.
///
/// Refused with [`Error::InvalidArgument`] for what the protocol cannot carry: a handle type
/// other than [`HandleType::PosixFd`], more than [`MAX_CHUNKS`](crate::wire::endpoint::MAX_CHUNKS)
/// chunks, a device ordinal over `u32::MAX`.
pub fn encode_descriptor<'a>(
    descriptor: impl Into<DescriptorRef<'a>>,
) -> Result<(Vec<u8>, Vec<BorrowedFd<'a>>)> {
    let (frame, fds) = match descriptor.into() {
        DescriptorRef::Cuda(d) => {
            if d.handle_type() != HandleType::PosixFd {
                return Err(Error::InvalidArgument(format!(
                    "a descriptor of handle type {:?} cannot travel as a peer message: the \
                     protocol carries PosixFd descriptors only",
                    d.handle_type()
                )));
            }
            let device = match d.device() {
                None => None,
                Some(identity) => Some((
                    u32::try_from(identity.ordinal).map_err(|_| {
                        Error::InvalidArgument(format!(
                            "device ordinal {} does not fit the header's 32 bits",
                            identity.ordinal
                        ))
                    })?,
                    identity.uuid,
                )),
            };
            let location = match d.location() {
                Location::Device => FrameLocation::Device,
                Location::HostNuma(node) => FrameLocation::HostNuma(node),
            };
            let frame = Frame {
                handle_type: 1,
                size: d.size() as u64,
                device,
                location,
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
    };
    Ok((frame.encode()?, fds))
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
        Kind::Host => {
            // The frame checked: no fd with size 0, one fd of `size` bytes otherwise.
            let size = usize::try_from(frame.size).expect("checked by Frame::decode");
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
        location: match frame.location {
            FrameLocation::Device => Location::Device,
            FrameLocation::HostNuma(node) => Location::HostNuma(node),
        },
        fds: (0..fds.len() as u32).collect(),
    };
    let bytes = postcard::to_stdvec(&form).map_err(|e| Error::Serde(e.to_string()))?;
    crate::wire::decode::<IpcDescriptor>(&bytes, fds)
}

impl Connection {
    /// Send a CUDA or host descriptor as a protocol message (a peer in any language reads it);
    /// the descriptor keeps its fds. See [`encode_descriptor`] for what is refused.
    pub fn send_descriptor<'a>(&self, descriptor: impl Into<DescriptorRef<'a>>) -> Result<()> {
        let (bytes, fds) = encode_descriptor(descriptor)?;
        self.send_raw(&bytes, &fds)
    }

    /// Receive a descriptor (CUDA or host), validated as described in [the module
    /// docs](crate::peer). A `DATA` message instead is an [`Error::Protocol`].
    pub fn recv_descriptor(&self) -> Result<Descriptor> {
        match self.recv_message()? {
            PeerMessage::Descriptor(d) => Ok(d),
            PeerMessage::Data(bytes) => Err(Error::Protocol(format!(
                "endpoint {}: expected a descriptor, got a DATA message of {} bytes",
                self.endpoint(),
                bytes.len()
            ))),
        }
    }

    /// Receive the next protocol message: a descriptor or application bytes.
    pub fn recv_message(&self) -> Result<PeerMessage> {
        let (frame, fds) = self.recv_frame()?;
        from_frame(frame, fds)
    }
}

/// The fds a [`Descriptor`] holds, borrowed.
impl Descriptor {
    /// Its fds, one per chunk (none for an empty host buffer).
    pub fn fds(&self) -> Vec<BorrowedFd<'_>> {
        match self {
            Descriptor::Cuda(d) => d.fds().collect(),
            Descriptor::Host(d) => d.fd().into_iter().collect(),
        }
    }
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
