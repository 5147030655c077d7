//! Digests of committed GPU generations, taken off the commit's path: a commit makes its
//! generation current at once and queues it here, and one background thread of the service
//! copies each queued generation to the host and hashes it (SHA-256, about 1.2 GB/s), then
//! records the digests with the generation and in the keeper's record. A commit of 16 GiB
//! so answers in milliseconds instead of the 15 s a hash of every byte takes.
//!
//! What `Verify` then promises: the bytes are those the service read in its pass over the
//! generation, which starts when the commit lands; a write between the commit and that pass
//! is not caught. A `Verify` of a generation not hashed yet (still queued, or taken back from
//! the keeper by a restarted service) takes the pass itself, and its digests become the
//! generation's.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use super::Registry;
use super::kept::keep;
use super::verify::holds;
use crate::protocol::{Backend, ChunkDigest};
use crate::service::generation::ChunkFd;
use crate::trace::event;

/// A generation to hash: its device and its chunks (duplicated handles, sizes).
type HashTarget = ([u8; 16], Vec<(ChunkFd, u64)>);

/// How long the hashing thread sleeps between looks at its stop flag while idle.
const IDLE: Duration = Duration::from_millis(100);

/// Committed GPU generations waiting for their digests: (region, generation), oldest first.
#[derive(Debug, Default)]
pub(crate) struct HashQueue {
    queue: Mutex<VecDeque<(String, u64)>>,
    ready: Condvar,
}

impl Registry {
    /// Queue generation `number` of `region` for its digests (nothing for a host region).
    pub(crate) fn hash_later(&self, region: &str, number: u64) {
        let gpu = self
            .lock()
            .regions
            .get(region)
            .is_some_and(|r| r.backend != Backend::Host);
        if gpu {
            let q = &self.hashing;
            q.queue
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_back((region.to_owned(), number));
            q.ready.notify_one();
        }
    }

    /// The hashing thread's body: hash queued generations until `stopped()` (checked between
    /// generations and between the 16 MiB pieces of a hash, so a stop does not wait for one).
    pub(crate) fn hash_queued(&self, stopped: &dyn Fn() -> bool) {
        while !stopped() {
            let next = {
                let q = &self.hashing;
                let mut queue = q.queue.lock().unwrap_or_else(|e| e.into_inner());
                if queue.is_empty() {
                    queue = q
                        .ready
                        .wait_timeout(queue, IDLE)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                queue.pop_front()
            };
            if let Some((region, number)) = next {
                self.hash_one(&region, number, stopped);
            }
        }
    }

    /// Take and record one generation's digests, unless it is gone, hashed already, or its
    /// chunks were let go (a discard sleep) meanwhile.
    fn hash_one(&self, region: &str, number: u64, stopped: &dyn Fn() -> bool) {
        let Some((uuid, chunks)) = self.unhashed(region, number) else {
            return;
        };
        // Given up as soon as no one needs it: the service stops, or the generation was
        // freed, let go by a discard, or hashed by a Verify meanwhile (asked per 16 MiB, so
        // its chunks are not held past that).
        let moot = || stopped() || self.unhashed(region, number).is_none();
        match self.gpus.digests_until(&uuid, &chunks, &moot) {
            Ok(Some(digests)) => {
                self.record_digests(region, number, &chunks, digests);
            }
            Ok(None) => {}
            Err(refusal) => {
                // The generation stays without digests: a Verify of it takes them itself.
                eprintln!("vmm-memd: hashing {region:?} generation {number} failed: {refusal}");
                event!(WARN, "memd.hash.failed", region, generation = number, refusal = ?refusal);
            }
        }
    }

    /// A GPU generation without digests: its device and chunks (duplicated handles).
    fn unhashed(&self, region: &str, number: u64) -> Option<HashTarget> {
        let state = self.lock();
        let r = state.regions.get(region)?;
        let Backend::Gpu { uuid } = r.backend else {
            return None;
        };
        let g = r.generations.get(&number)?;
        if !g.digests.is_empty() || g.discarded.is_some() || g.chunks.is_empty() {
            return None;
        }
        Some((uuid, g.chunk_fds().into_iter().zip(g.sizes()).collect()))
    }

    /// Record `digests` of `chunks` as generation `number`'s, if it still has no digests
    /// and still those chunks (a discard and wake makes new ones, with their own digests),
    /// and tell the keeper. Whether they were recorded.
    pub(crate) fn record_digests(
        &self,
        region: &str,
        number: u64,
        chunks: &[(ChunkFd, u64)],
        digests: Vec<ChunkDigest>,
    ) -> bool {
        let mut state = self.lock();
        let Some(g) = state
            .regions
            .get_mut(region)
            .and_then(|r| r.generations.get_mut(&number))
        else {
            return false;
        };
        if !g.digests.is_empty() || !holds(g, chunks) {
            return false;
        }
        g.digests = digests;
        event!(DEBUG, "memd.hashed", region, generation = number);
        keep(&mut state, region, number);
        true
    }
}
