//! The registry's requests that only the GPU backend needs: the backend check, and a
//! committed generation's chunks and digests to verify. Hashing runs outside the registry's
//! lock (it copies every byte to the host); these only hand out duplicates of the fds.

use super::{Registry, backend_refusal};
use crate::error::Refusal;
use crate::identity::Identity;
use crate::protocol::{Backend, ChunkDigest};
use crate::service::generation::ChunkFd;
use crate::service::gpu::Gpus;

/// What [`Registry::verify_target`] hands out: the generation's number, backend, chunks and
/// its digests (none while it waits for its background pass).
pub(crate) type VerifyTarget = (u64, Backend, Vec<(ChunkFd, u64)>, Vec<ChunkDigest>);

impl Registry {
    /// The GPU backend.
    pub(crate) fn gpus(&self) -> &Gpus {
        &self.gpus
    }

    /// Refuse `backend` for an existing `region` that lives elsewhere.
    pub(super) fn check_backend(&self, region: &str, backend: Backend) -> Result<(), Refusal> {
        match self.lock().regions.get(region) {
            Some(r) if r.backend != backend => Err(backend_refusal(region, r.backend)),
            _ => Ok(()),
        }
    }

    /// A committed generation of `region` (`None`: the current one) that `who` may read, to
    /// verify against its digests.
    pub(crate) fn verify_target(
        &self,
        who: &Identity,
        region: &str,
        generation: Option<u64>,
    ) -> Result<VerifyTarget, Refusal> {
        let state = self.lock();
        let none = || Refusal::NoSuchRegion {
            region: region.to_owned(),
        };
        let r = state.regions.get(region).ok_or_else(none)?;
        if !r.may(who, crate::error::Right::Read) {
            return Err(none());
        }
        let g = match generation {
            None => r
                .current
                .and_then(|n| r.generations.get(&n))
                .ok_or_else(none)?,
            Some(n) => r
                .generations
                .get(&n)
                .ok_or_else(|| Refusal::NoSuchGeneration {
                    region: region.to_owned(),
                    generation: n,
                })?,
        };
        let chunks = g.chunk_fds().into_iter().zip(g.sizes()).collect();
        Ok((g.number, r.backend, chunks, g.digests.clone()))
    }
}
