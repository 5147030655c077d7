//! Attaching a region's current generation for publishing: a lease, and the memory in a form
//! that can be handed to another node.
//!
//! A host region is attached unmapped (`Client::attach_unmapped`): the stand-in names the
//! chunks' fds, so they are kept (the publisher never maps them). A GPU region is attached as
//! the service's fabric handles (`Client::attach_fabric`); its POSIX fds, which do not cross a
//! network, are closed and their lease given back. Either way the generation's metadata is
//! kept, in the form offered with the descriptor
//! ([`region_metadata`](mod@super::region_metadata)).

use std::time::Duration;

use vmm_memd::{Client, MemdError};

use super::held::Held;
use super::publish_error::RegionError;
use super::region_metadata;

/// What an attach found: the generation held, and the lease's TTL.
#[derive(Debug)]
pub(crate) struct Attachment {
    pub(crate) held: Held,
    pub(crate) ttl: Duration,
}

/// Attach `region`'s current generation.
pub(crate) fn attach(client: &Client, region: &str) -> Result<Attachment, RegionError> {
    let unmapped = client.attach_unmapped(region, None)?;
    if unmapped.device.is_some() {
        // A GPU region: close the fds the plain attach sent, give its lease back, and ask
        // for the fabric handles instead.
        drop(unmapped.chunks);
        detach(client, unmapped.lease)?;
        let fabric = client.attach_fabric(region, None)?;
        let metadata = region_metadata::encode(&fabric.meta);
        return Ok(Attachment {
            held: Held::fabric(fabric.generation, fabric.lease, fabric.descriptor, metadata),
            ttl: fabric.ttl,
        });
    }
    let lease = unmapped.lease;
    let chunks = unmapped
        .chunks
        .into_iter()
        .map(|(fd, size)| Ok((fd, to_usize(size)?)))
        .collect::<Result<Vec<_>, MemdError>>()?;
    let metadata = region_metadata::encode(&unmapped.meta);
    match Held::host(unmapped.generation, lease, chunks, metadata) {
        Ok(held) => Ok(Attachment {
            held,
            ttl: unmapped.ttl,
        }),
        Err(e) => {
            // Of no use: give the lease back (best effort: the connection's end would).
            let _ = detach(client, lease);
            Err(RegionError::StandIn(e))
        }
    }
}

/// End lease `lease` (its memory stays where it is held: fds, importers' mappings).
pub(crate) fn detach(client: &Client, lease: u64) -> Result<(), MemdError> {
    client.detach_lease(lease)
}

fn to_usize(size: u64) -> Result<usize, MemdError> {
    usize::try_from(size).map_err(|_| MemdError::BadReply(format!("a chunk of {size} bytes")))
}
