//! What a peer message carries, as this crate's types: [`Descriptor`] (received, owning its
//! fds), [`DescriptorRef`] (to send, borrowed) and [`PeerMessage`] (a descriptor or `DATA`).

use std::os::fd::BorrowedFd;

use super::frame::Kind;
use crate::cuda::{FabricDescriptor, IpcDescriptor};
use crate::error::ProtocolRule;
use crate::shm::HostDescriptor;
use crate::{Error, Result};

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
        Error::protocol(
            ProtocolRule::UnexpectedKind,
            format!(
                "expected a {} descriptor, the peer sent a {} one",
                wanted.name(),
                self.kind_name()
            ),
        )
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
