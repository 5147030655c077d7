//! What the publisher holds of one region: the generation it attached, the lease that keeps
//! the service from freeing it, and the descriptor it offers (with, for a host region, the
//! chunk fds the stand-in names).

use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};

use vmm_core::cuda::FabricDescriptor;

use crate::fetch::gpu_uuid;
use crate::locator::{ExportedObject, HandleKind, Locator};

/// One attached generation of a region, offered to importers.
#[derive(Debug)]
pub(crate) struct Held {
    /// The generation.
    pub(crate) generation: u64,
    /// The service's lease on it (`None` once the connection that held it is gone: the
    /// memory stays, held by these fds or by the importers' mappings).
    pub(crate) lease: Option<u64>,
    /// What an importer is handed.
    pub(crate) descriptor: FabricDescriptor,
    /// How it is shared.
    pub(crate) handle: HandleKind,
    /// Its tensors, in the form offered with the descriptor
    /// ([`region_metadata`](mod@super::region_metadata)); moved into the offer (empty after).
    pub(crate) metadata: Vec<u8>,
    /// A host region's chunk fds, which the stand-in descriptor names (`/proc/<pid>/fd/<n>`):
    /// the names are good while these are open. Empty for a GPU region.
    pub(crate) _fds: Vec<OwnedFd>,
}

impl Held {
    /// A host region's generation: its chunk fds and sizes, named by the stand-in.
    pub(crate) fn host(
        generation: u64,
        lease: u64,
        chunks: Vec<(OwnedFd, usize)>,
        metadata: Vec<u8>,
    ) -> Result<Held, crate::host_stand_in::StandInError> {
        let named: Vec<_> = chunks
            .iter()
            .map(|(fd, size)| (fd.as_fd(), *size))
            .collect();
        let descriptor = crate::host_stand_in::describe(&named)?;
        Ok(Held {
            generation,
            lease: Some(lease),
            descriptor,
            handle: HandleKind::HostMemfd,
            metadata,
            _fds: chunks.into_iter().map(|(fd, _)| fd).collect(),
        })
    }

    /// A GPU region's generation, as the service's fabric handles.
    pub(crate) fn fabric(
        generation: u64,
        lease: u64,
        descriptor: FabricDescriptor,
        metadata: Vec<u8>,
    ) -> Held {
        Held {
            generation,
            lease: Some(lease),
            descriptor,
            handle: HandleKind::Fabric,
            metadata,
            _fds: Vec::new(),
        }
    }

    /// The locator of `region` at this generation, served at `addr` by the exporter whose
    /// certificate names `exporter_name`, for `owner`.
    pub(crate) fn locator(
        &self,
        owner: &str,
        region: &str,
        addr: SocketAddr,
        exporter_name: &str,
    ) -> Locator {
        Locator {
            owner: owner.to_owned(),
            exporter_addr: addr,
            exporter_name: exporter_name.to_owned(),
            object: ExportedObject::Region(region.to_owned()),
            size: self.descriptor.size() as u64,
            device_uuid: (self.handle == HandleKind::Fabric)
                .then(|| gpu_uuid(self.descriptor.owner_uuid())),
            handle: self.handle,
            generation: self.generation,
        }
    }
}
