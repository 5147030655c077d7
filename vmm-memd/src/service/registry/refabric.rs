//! Fabric handles for a generation taken back from the keeper. A restarted service holds such
//! a generation's chunks as the fds its keeper kept: imports, never its own allocations, and
//! fabric handles are exported only from an allocation's own handle (vmm-core refuses an
//! import). So the first fabric attach of such a generation copies it, on the device, into
//! fresh fabric-shareable chunks, which become the generation's chunks (the keeper is told,
//! and holds the copies from then on). The bytes are the same, and so are the digests.
//! Readers that mapped the old chunks keep them (their imports hold the memory) until they
//! let go; until then the device holds both, uncharged beyond the generation's size.

use std::sync::Arc;

use super::kept::keep;
use super::{Registry, State};
use crate::error::Refusal;
use crate::protocol::Backend;
use crate::service::generation::Chunk;
use crate::trace::event;

impl Registry {
    /// Make generation `number` of `region` fabric-shareable where it came back from the
    /// keeper: each chunk without its allocation is copied into a fresh fabric-shareable one
    /// (see the module). Nothing for a host region, a region whose chunks were never
    /// fabric-shareable, a discarded generation, or one whose chunks have their allocations;
    /// nothing either where this service's device cannot make fabric-shareable chunks (the
    /// attach then finds no fabric handles: `FabricUnavailable`).
    pub(super) fn refabric_if_kept(
        &self,
        state: &mut State,
        region: &str,
        number: u64,
    ) -> Result<(), Refusal> {
        let Some(r) = state.regions.get_mut(region) else {
            return Ok(());
        };
        let (Backend::Gpu { uuid }, true) = (r.backend, r.fabric) else {
            return Ok(());
        };
        let Some(g) = r.generations.get_mut(&number) else {
            return Ok(());
        };
        if g.discarded.is_some() || g.chunks.iter().all(|c| c.origin.is_some()) {
            return Ok(());
        }
        let mut copies = Vec::with_capacity(g.chunks.len());
        for chunk in &g.chunks {
            if chunk.origin.is_some() {
                copies.push(None);
                continue;
            }
            match self.gpus.fabric_copy(&uuid, &chunk.fd, chunk.len)? {
                Some(copy) => copies.push(Some(copy)),
                None => return Ok(()),
            }
        }
        for (chunk, copy) in g.chunks.iter_mut().zip(copies) {
            if let Some((fd, allocation)) = copy {
                *chunk = Chunk {
                    fd: Arc::new(fd),
                    len: chunk.len,
                    origin: Some(allocation),
                };
            }
        }
        event!(
            INFO,
            "memd.refabric",
            region,
            generation = number,
            bytes = g.bytes()
        );
        keep(state, region, number);
        Ok(())
    }
}
