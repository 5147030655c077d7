//! Attaching a committed generation: the reply, its metadata pages, then the chunks mapped
//! read-only: memfds with `mmap` (host), or GPU chunks imported read-only for their device
//! (see [`GpuChunks`]). With a placement (a wake), only a generation of the slept layout is
//! mapped, at the slept addresses.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::time::Duration;

use vmm_core::cuda::FabricDescriptor;
use vmm_core::peer::{Descriptor, PeerMessage};

use super::connection::{Client, unexpected};
use super::gpu_mapping::GpuChunks;
use super::layout::{Placement, layout_hash_on};
use super::mapping::ReadOnlyChunk;
use crate::error::{MemdError, Result};
use crate::protocol::{Backend, MAX_CHUNKS, MAX_META_ENTRIES, Request, Response, TensorMeta};

impl Client {
    /// Attach `region`'s current committed generation: a lease (held by this connection),
    /// its metadata, and its chunks mapped read-only.
    pub fn attach(&self, region: &str) -> Result<Attached> {
        self.attach_generation(region, None)
    }

    /// [`attach`](Self::attach) generation `generation` (`None`: the current one), if the
    /// service still holds it (a lease or the retention setting keeps it).
    pub fn attach_generation(&self, region: &str, generation: Option<u64>) -> Result<Attached> {
        let _turn = self.turn();
        self.attach_placed(region, generation, &mut None)
    }

    /// End the lease of `attached` (its mapping stays valid: see [`Attached`]).
    pub fn detach(&self, attached: &Attached) -> Result<()> {
        self.detach_lease(attached.lease)
    }

    /// Attach `region`'s generation `generation` (`None`: the current one) as fabric handles,
    /// to import here or to forward to a process on another node of the fabric (which needs
    /// an IMEX channel): a lease held by this connection, the metadata, and one
    /// [`FabricDescriptor`] for all chunks (back to back; import it with
    /// `VirtualMemoryResource::import_fabric`, read-only with
    /// `ResourceOptions::read_only`). A fabric handle does not keep memory alive: keep the
    /// lease (this connection) until every importer has imported.
    /// [`Refusal::FabricUnavailable`](crate::Refusal::FabricUnavailable) where the chunks
    /// cannot be shared so (a host region, no fabric support). A generation the service took
    /// back from its keeper after a restart is first copied, on the device, into chunks that
    /// can be (once: the copies are the generation's from then on).
    pub fn attach_fabric(&self, region: &str, generation: Option<u64>) -> Result<FabricAttached> {
        let _turn = self.turn();
        let reply = self.request(&Request::AttachFabric {
            region: region.to_owned(),
            generation,
        })?;
        let Response::AttachedGpu {
            lease,
            generation,
            chunks,
            meta_pages,
            ttl_ms,
            device,
            ..
        } = reply
        else {
            return Err(unexpected("AttachedGpu", &reply));
        };
        if chunks.len() > MAX_CHUNKS || meta_pages as usize > MAX_META_ENTRIES {
            return Err(MemdError::BadReply(format!(
                "{} chunks and {meta_pages} metadata pages announced",
                chunks.len()
            )));
        }
        self.leased(Duration::from_millis(ttl_ms));
        let meta = self.meta_pages(meta_pages)?;
        let mut handles = Vec::with_capacity(chunks.len());
        for &size in &chunks {
            match self.session().recv_message()? {
                PeerMessage::Descriptor(Descriptor::Fabric(d))
                    if d.size() as u64 == size && d.handles().len() == 1 =>
                {
                    handles.extend_from_slice(d.handles())
                }
                other => {
                    return Err(MemdError::BadReply(format!(
                        "expected a one-chunk fabric descriptor of {size} bytes, got {other:?}"
                    )));
                }
            }
        }
        let sizes: Vec<usize> = chunks.iter().map(|&c| c as usize).collect();
        let descriptor =
            FabricDescriptor::from_handles(&handles, &sizes, sizes.iter().sum(), device)?;
        Ok(FabricAttached {
            region: region.to_owned(),
            lease,
            generation,
            meta,
            ttl: Duration::from_millis(ttl_ms),
            descriptor,
        })
    }

    /// Read `pages` metadata pages.
    fn meta_pages(&self, pages: u32) -> Result<BTreeMap<String, TensorMeta>> {
        let mut meta = BTreeMap::new();
        for _ in 0..pages {
            match self.reply()? {
                Response::MetaPage(entries) if meta.len() + entries.len() <= MAX_META_ENTRIES => {
                    meta.extend(entries)
                }
                other => return Err(unexpected("MetaPage", &other)),
            }
        }
        Ok(meta)
    }

    /// Send `Attach` and read its reply and metadata pages, checked: what the chunks'
    /// descriptors that follow are.
    fn attach_reply(&self, region: &str, generation: Option<u64>) -> Result<AttachReply> {
        let reply = self.request(&Request::Attach {
            region: region.to_owned(),
            generation,
        })?;
        let (lease, generation, chunks, meta_pages, ttl_ms, gpu) = match reply {
            Response::Attached {
                lease,
                generation,
                chunks,
                meta_pages,
                ttl_ms,
            } => (lease, generation, chunks, meta_pages, ttl_ms, None),
            Response::AttachedGpu {
                lease,
                generation,
                chunks,
                meta_pages,
                ttl_ms,
                device,
                fabric,
            } => (
                lease,
                generation,
                chunks,
                meta_pages,
                ttl_ms,
                Some((device, fabric)),
            ),
            other => return Err(unexpected("Attached", &other)),
        };
        if chunks.len() > MAX_CHUNKS || meta_pages as usize > MAX_META_ENTRIES {
            return Err(MemdError::BadReply(format!(
                "{} chunks and {meta_pages} metadata pages announced",
                chunks.len()
            )));
        }
        Ok(AttachReply {
            lease,
            generation,
            meta: self.meta_pages(meta_pages)?,
            chunks,
            ttl: Duration::from_millis(ttl_ms),
            gpu,
        })
    }

    /// A lease on `region`'s generation `generation` (`None`: the current one) without
    /// mapping it: its metadata and each chunk's fd (a memfd sealed read-only for a host
    /// region; an exported POSIX fd for a GPU region, of the device `device` names), for a
    /// process that hands the memory on rather than reading it (vmm-registry's publisher).
    /// A failure part way through the chunks leaves the connection out of step: drop it.
    pub fn attach_unmapped(&self, region: &str, generation: Option<u64>) -> Result<Unmapped> {
        let _turn = self.turn();
        let reply = self.attach_reply(region, generation)?;
        self.leased(reply.ttl);
        let chunks = match reply.gpu {
            Some((device, _)) => self.gpu_descriptors(&reply.chunks, &device)?,
            None => reply
                .chunks
                .iter()
                .map(|&size| {
                    self.descriptor(size)?
                        .fd()
                        .ok_or_else(|| MemdError::BadReply("an empty chunk".into()))?
                        .try_clone_to_owned()
                        .map_err(|source| MemdError::Os {
                            op: "dup(chunk fd)",
                            source,
                        })
                })
                .collect::<Result<_>>()?,
        };
        Ok(Unmapped {
            region: region.to_owned(),
            lease: reply.lease,
            generation: reply.generation,
            chunks: chunks.into_iter().zip(reply.chunks).collect(),
            device: reply.gpu.map(|(device, _)| device),
            meta: reply.meta,
            ttl: reply.ttl,
        })
    }

    /// Attach; with `place`, only a generation of its layout, mapped at its reservations
    /// (which come back in `place` when it fails, and are used up when it succeeds).
    pub(crate) fn attach_placed(
        &self,
        region: &str,
        generation: Option<u64>,
        place: &mut Option<Placement>,
    ) -> Result<Attached> {
        let AttachReply {
            lease,
            generation,
            chunks,
            meta,
            ttl,
            gpu,
        } = self.attach_reply(region, generation)?;
        self.leased(ttl);
        let backend = gpu.map_or(Backend::Host, |(uuid, _)| Backend::Gpu { uuid });
        if let Some(p) = place.as_ref() {
            let found = layout_hash_on(&chunks, &meta, backend);
            if found != p.layout {
                // Read the descriptors (closing them) to stay in step, and give the lease up.
                match gpu {
                    Some((device, _)) => drop(self.gpu_descriptors(&chunks, &device)?),
                    None => {
                        for &size in &chunks {
                            self.descriptor(size)?;
                        }
                    }
                }
                let _ = self.request(&Request::Detach { lease });
                return Err(MemdError::StaleLayout {
                    region: region.to_owned(),
                    generation,
                    expected: p.layout,
                    found,
                });
            }
        }
        if let Some((device, fabric)) = gpu {
            let range = place.as_mut().and_then(|p| p.gpu_range.take());
            let mapped = match self.gpu_descriptors(&chunks, &device) {
                Err(e) => {
                    if let (Some(p), Some(range)) = (place.as_mut(), range) {
                        p.gpu_range = Some(range);
                    }
                    Err(e)
                }
                Ok(fds) => match range {
                    None => GpuChunks::import(device, &fds, &chunks, (true, fabric)),
                    Some(range) => {
                        GpuChunks::import_at(device, &fds, &chunks, (true, fabric), range).map_err(
                            |failed| {
                                let (e, range) = *failed;
                                // Back in the placement, to wake again.
                                if let Some(p) = place.as_mut() {
                                    p.gpu_range = Some(range);
                                }
                                e
                            },
                        )
                    }
                },
            };
            match mapped {
                Ok(m) => {
                    return Ok(Attached {
                        region: region.to_owned(),
                        lease,
                        generation,
                        chunks: Vec::new(),
                        gpu: Some(m),
                        meta,
                        ttl,
                    });
                }
                Err(error) => {
                    // Best effort: the lease is of no use. (After a bad descriptor the rest
                    // of the reply is not read: the connection is out of step, drop it.)
                    if matches!(error, MemdError::Core(_)) {
                        let _ = self.request(&Request::Detach { lease });
                    }
                    return Err(error);
                }
            }
        }
        let mut mapped = Vec::with_capacity(chunks.len());
        let mut spare = place
            .as_mut()
            .map(|p| std::mem::take(&mut p.reservations).into_iter());
        for (i, &size) in chunks.iter().enumerate() {
            let chunk = self.descriptor(size).and_then(|descriptor| {
                let fd = descriptor
                    .fd()
                    .ok_or_else(|| MemdError::BadReply("an empty chunk".into()))?;
                match spare.as_mut().map(|s| s.next()) {
                    None => ReadOnlyChunk::map(fd, size as usize),
                    Some(Some(r)) => {
                        ReadOnlyChunk::map_into(fd, size as usize, r).map_err(|(e, r)| {
                            // Back where it was, for the rest to follow it.
                            if let Some(p) = place.as_mut() {
                                p.reservations.push(r);
                            }
                            e
                        })
                    }
                    Some(None) => Err(MemdError::BadReply(format!("no reservation for chunk {i}"))),
                }
            });
            match chunk {
                Ok(chunk) => mapped.push(chunk),
                Err(e) => {
                    if let (Some(p), Some(rest)) = (place.as_mut(), spare.take()) {
                        // The reservations in order: the mapped ones given up again, the
                        // failed one (pushed above), the rest.
                        let failed = std::mem::take(&mut p.reservations);
                        p.reservations = mapped
                            .drain(..)
                            .filter_map(|c: ReadOnlyChunk| c.into_reservation().ok())
                            .chain(failed)
                            .chain(rest)
                            .collect();
                    }
                    // Best effort: the lease is of no use. (The rest of the reply, if any,
                    // is not read: the connection is out of step, drop it.)
                    if matches!(e, MemdError::BadDescriptor(_) | MemdError::Os { .. }) {
                        let _ = self.request(&Request::Detach { lease });
                    }
                    return Err(e);
                }
            }
        }
        Ok(Attached {
            region: region.to_owned(),
            lease,
            generation,
            chunks: mapped,
            gpu: None,
            meta,
            ttl,
        })
    }
}

/// A committed generation attached: a lease, the metadata, the chunks mapped read-only.
///
/// The lease is the service's count of this reader: it ends with [`Client::detach`], with the
/// connection (this process's exit included), or when its TTL runs out without
/// [`Client::renew`]. Expiry only stops the service counting this reader (a retired
/// generation may then be freed by the service and its quota given back); the mapping here
/// stays valid and unchanged, because the kernel keeps the pages while any mapping holds them.
#[derive(Debug)]
pub struct Attached {
    /// The region.
    pub region: String,
    /// The lease number.
    pub lease: u64,
    /// The generation.
    pub generation: u64,
    /// The chunks, mapped read-only (a host region's; empty for a GPU region).
    pub chunks: Vec<ReadOnlyChunk>,
    /// A GPU region's chunks, mapped read-only for the device, back to back (`None` for a
    /// host region). Read-only is this client's choice: see [`GpuChunks`].
    pub gpu: Option<GpuChunks>,
    /// The metadata.
    pub meta: BTreeMap<String, TensorMeta>,
    /// The lease's TTL.
    pub ttl: Duration,
}

impl Attached {
    /// The device address of tensor `key` of a GPU region (`None` for a host region: see
    /// [`tensor`](Self::tensor)).
    pub fn tensor_device_ptr(&self, key: &str) -> Option<u64> {
        let meta = self.meta.get(key)?;
        let gpu = self.gpu.as_ref()?;
        Some(gpu.device_ptr() + gpu.chunk_offset(meta.chunk as usize)? + meta.offset)
    }

    /// The bytes of tensor `key` of a host region (`None` for a GPU region: its bytes are on
    /// the device, see [`tensor_device_ptr`](Self::tensor_device_ptr)).
    pub fn tensor(&self, key: &str) -> Option<&[u8]> {
        let meta = self.meta.get(key)?;
        let chunk = self.chunks.get(meta.chunk as usize)?.as_slice();
        let start = usize::try_from(meta.offset).ok()?;
        let end = start.checked_add(usize::try_from(meta.len).ok()?)?;
        chunk.get(start..end)
    }
}

/// An attach's reply and metadata, checked (the chunks' descriptors follow it).
struct AttachReply {
    lease: u64,
    generation: u64,
    chunks: Vec<u64>,
    meta: BTreeMap<String, TensorMeta>,
    ttl: Duration,
    /// A GPU region's device UUID and whether it is fabric-shareable.
    gpu: Option<([u8; 16], bool)>,
}

/// A committed generation attached without mapping it ([`Client::attach_unmapped`]).
#[derive(Debug)]
pub struct Unmapped {
    /// The region.
    pub region: String,
    /// The lease number.
    pub lease: u64,
    /// The generation.
    pub generation: u64,
    /// Each chunk's fd and size, in order.
    pub chunks: Vec<(OwnedFd, u64)>,
    /// A GPU region's device UUID (`None`: host memfds).
    pub device: Option<[u8; 16]>,
    /// The metadata.
    pub meta: BTreeMap<String, TensorMeta>,
    /// The lease's TTL.
    pub ttl: Duration,
}

/// A GPU generation attached as fabric handles ([`Client::attach_fabric`]): the lease (held
/// by the connection), the metadata, and the descriptor to import or forward.
#[derive(Debug)]
pub struct FabricAttached {
    /// The region.
    pub region: String,
    /// The lease number.
    pub lease: u64,
    /// The generation.
    pub generation: u64,
    /// The metadata.
    pub meta: BTreeMap<String, TensorMeta>,
    /// The lease's TTL.
    pub ttl: Duration,
    /// Every chunk, back to back, as fabric handles (bearer tokens: whoever has them and an
    /// IMEX channel can map the memory, read-write if it likes).
    pub descriptor: FabricDescriptor,
}
