//! `Verify`: a committed generation's bytes read again and compared with its digests. The
//! pass runs outside the registry's lock, so the generation may change under it: its
//! chunks let go by a discard sleep and remade zeroed by a wake, or the region deleted and
//! made again under the same generation number. A pass is only ever compared with the
//! digests of the chunks it read: one whose chunks stopped being the generation's is given
//! up (asked between 16 MiB pieces, so it holds no let-go memory longer than that) and taken
//! again over the chunks the generation has now. A stop of the service, or the client
//! leaving, gives it up too.

use std::sync::Arc;

use super::Registry;
use crate::error::Refusal;
use crate::identity::Identity;
use crate::protocol::{Backend, ChunkDigest};
use crate::service::generation::{ChunkFd, Generation};

/// How many passes a `Verify` takes at most while the generation's chunks keep changing
/// under it.
const PASSES: usize = 4;

impl Registry {
    /// Verify `region`'s generation `generation` (`None`: the current one) for `who`: its
    /// number and digests (none for a host region: sealed, it cannot change), or
    /// `DigestMismatch` naming the first chunk whose bytes are not those digested. A
    /// generation without digests yet (its background pass queued, or taken back from the
    /// keeper) gets this pass's. `stopped()` (asked between pieces) gives the pass up:
    /// `ServiceFailed` with `ECANCELED`, as does a generation whose chunks changed under
    /// every one of [`PASSES`] passes (`EAGAIN`).
    pub(crate) fn verify(
        &self,
        who: &Identity,
        region: &str,
        generation: Option<u64>,
        stopped: &dyn Fn() -> bool,
    ) -> Result<(u64, Vec<ChunkDigest>), Refusal> {
        let mut asked = generation;
        for _ in 0..PASSES {
            let (number, backend, chunks, digests) = self.verify_target(who, region, asked)?;
            let Backend::Gpu { uuid } = backend else {
                return Ok((number, digests));
            };
            // A retry verifies the same generation number (what the request named).
            asked = Some(number);
            let moot = || stopped() || self.digests_if_holds(region, number, &chunks).is_none();
            let Some(now) = self.gpus.digests_until(&uuid, &chunks, &moot)? else {
                if stopped() {
                    return Err(given_up("stopped", libc::ECANCELED));
                }
                continue;
            };
            let digests = match digests.is_empty() {
                false => digests,
                // This pass becomes the generation's, unless another (the background one,
                // or another Verify) recorded its own first: then those, if still of these
                // chunks.
                true if self.record_digests(region, number, &chunks, now.clone()) => now.clone(),
                true => match self.digests_if_holds(region, number, &chunks) {
                    Some(recorded) if !recorded.is_empty() => recorded,
                    _ => continue,
                },
            };
            if let Some(chunk) = digests.iter().zip(&now).position(|(a, b)| a != b) {
                return Err(Refusal::DigestMismatch {
                    region: region.to_owned(),
                    generation: number,
                    chunk: chunk as u32,
                    expected: digests[chunk],
                    found: now[chunk],
                });
            }
            return Ok((number, digests));
        }
        Err(given_up(
            "its chunks changed under every pass",
            libc::EAGAIN,
        ))
    }

    /// Generation `number` of `region`'s digests (empty: none yet), if its chunks are still
    /// `chunks`; `None` if it is gone or has other chunks now.
    pub(super) fn digests_if_holds(
        &self,
        region: &str,
        number: u64,
        chunks: &[(ChunkFd, u64)],
    ) -> Option<Vec<ChunkDigest>> {
        let state = self.lock();
        let g = state.regions.get(region)?.generations.get(&number)?;
        holds(g, chunks).then(|| g.digests.clone())
    }
}

/// Whether `g`'s chunks are exactly `chunks` (the same fds, not copies of the bytes).
pub(super) fn holds(g: &Generation, chunks: &[(ChunkFd, u64)]) -> bool {
    g.chunks.len() == chunks.len()
        && g.chunks
            .iter()
            .zip(chunks)
            .all(|(c, (fd, _))| Arc::ptr_eq(&c.fd, fd))
}

/// A `Verify` given up: `why`, with `errno`.
fn given_up(why: &str, errno: i32) -> Refusal {
    Refusal::ServiceFailed {
        op: format!("Verify: given up ({why})"),
        errno,
    }
}
