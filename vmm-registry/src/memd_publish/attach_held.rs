//! Attaching a region's current generation for publishing: a lease, and the memory in a form
//! that can be handed to another node.
//!
//! A host region is attached through vmm-memd's public protocol (`Client::request_raw`, then
//! the session's messages) rather than `Client::attach`, which maps the chunks and closes
//! their fds: the stand-in names the fds, so they are kept (the publisher never maps them).
//! A GPU region is attached as the service's fabric handles (`Client::attach_fabric`); its
//! POSIX fds, which do not cross a network, are read and closed. Either way the generation's
//! metadata (the reply's `MetaPage`s) is kept, in the form offered with the descriptor
//! ([`region_metadata`](mod@super::region_metadata)).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::time::Duration;

use vmm_core::peer::{Descriptor, PeerMessage};
use vmm_memd::protocol::{MAX_CHUNKS, MAX_META_ENTRIES, Request, Response, TensorMeta};
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
    let reply = request(
        client,
        &Request::Attach {
            region: region.to_owned(),
            generation: None,
        },
    )?;
    match reply {
        Response::Attached {
            lease,
            generation,
            chunks,
            meta_pages,
            ttl_ms,
        } => {
            check_counts(chunks.len(), meta_pages)?;
            let meta = read_meta(client, meta_pages)?;
            let mut fds = Vec::with_capacity(chunks.len());
            for &size in &chunks {
                fds.push((host_fd(client, size)?, to_usize(size)?));
            }
            let metadata = region_metadata::encode(&meta);
            let held = match Held::host(generation, lease, fds, metadata) {
                Ok(held) => held,
                Err(e) => {
                    // Of no use: give the lease back (best effort: the connection's end would).
                    let _ = detach(client, lease);
                    return Err(RegionError::StandIn(e));
                }
            };
            Ok(Attachment {
                held,
                ttl: Duration::from_millis(ttl_ms),
            })
        }
        Response::AttachedGpu {
            lease,
            chunks,
            meta_pages,
            ..
        } => {
            // A GPU region: read (and close) what the plain attach sent, give its lease back,
            // and ask for the fabric handles instead.
            check_counts(chunks.len(), meta_pages)?;
            read_meta(client, meta_pages)?;
            for _ in &chunks {
                drop(client.session().recv_message().map_err(MemdError::from)?);
            }
            detach(client, lease)?;
            let fabric = client.attach_fabric(region, None)?;
            let metadata = region_metadata::encode(&fabric.meta);
            Ok(Attachment {
                held: Held::fabric(fabric.generation, fabric.lease, fabric.descriptor, metadata),
                ttl: fabric.ttl,
            })
        }
        other => Err(RegionError::Memd(MemdError::BadReply(format!(
            "expected Attached, got {other:?}"
        )))),
    }
}

/// End lease `lease` (its memory stays where it is held: fds, importers' mappings).
pub(crate) fn detach(client: &Client, lease: u64) -> Result<(), MemdError> {
    request(client, &Request::Detach { lease }).map(drop)
}

/// Send `request`; its reply, a refusal as `MemdError::Refused`.
fn request(client: &Client, request: &Request) -> Result<Response, MemdError> {
    let bytes = postcard::to_allocvec(request)
        .map_err(|e| MemdError::BadReply(format!("encoding a request: {e}")))?;
    match client.request_raw(&bytes)? {
        Response::Refused(refusal) => Err(MemdError::Refused(refusal)),
        other => Ok(other),
    }
}

fn check_counts(chunks: usize, meta_pages: u32) -> Result<(), MemdError> {
    if chunks > MAX_CHUNKS || meta_pages as usize > MAX_META_ENTRIES {
        return Err(MemdError::BadReply(format!(
            "{chunks} chunks and {meta_pages} metadata pages announced"
        )));
    }
    Ok(())
}

/// Read the metadata pages: the generation's tensors (a key twice: the later entry, as
/// vmm-memd's own client keeps it).
fn read_meta(client: &Client, pages: u32) -> Result<BTreeMap<String, TensorMeta>, MemdError> {
    let mut meta = BTreeMap::new();
    for _ in 0..pages {
        let bytes = client.session().recv_data()?;
        match postcard::from_bytes(&bytes) {
            Ok(Response::MetaPage(entries)) => meta.extend(entries),
            _ => return Err(MemdError::BadReply("expected a MetaPage".into())),
        }
    }
    Ok(meta)
}

/// The next message: a host chunk's descriptor of `size` bytes; its fd.
fn host_fd(client: &Client, size: u64) -> Result<OwnedFd, MemdError> {
    match client.session().recv_message()? {
        PeerMessage::Descriptor(Descriptor::Host(d)) if d.size() as u64 == size => d
            .fd()
            .ok_or_else(|| MemdError::BadReply("an empty chunk".into()))?
            .try_clone_to_owned()
            .map_err(|source| MemdError::Os {
                op: "dup(chunk fd)",
                source,
            }),
        other => Err(MemdError::BadReply(format!(
            "expected a host chunk of {size} bytes, got {other:?}"
        ))),
    }
}

fn to_usize(size: u64) -> Result<usize, MemdError> {
    usize::try_from(size).map_err(|_| MemdError::BadReply(format!("a chunk of {size} bytes")))
}
