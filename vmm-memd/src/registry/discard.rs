//! The discard sleep: a reader that sleeps with discard gives its lease up and asks the
//! service to free the generation's memory once no lease holds it (every mapper asleep or
//! gone). The generation stays (its number, metadata, chunk sizes and quota charge); the
//! keeper keeps its record without chunks; the next attach (a wake) makes the chunks again,
//! zeroed, so a sleeper's layout hash still matches and it maps them at its old addresses.

use super::{Registry, State, generations_mut, keep, prune};
use crate::error::Refusal;
use crate::generation::Chunk;
use crate::memfd;
use crate::protocol::Backend;

impl Registry {
    /// End `conn`'s lease `lease` as a discard sleep (`false`: no such lease of this
    /// connection). Its generation's memory goes once no lease holds it.
    pub(crate) fn discard(&self, conn: u64, lease: u64) -> bool {
        let mut state = self.lock();
        let found = generations_mut(&mut state).any(|g| {
            let mine = g.leases.get(&lease).is_some_and(|l| l.conn == conn);
            if mine {
                g.leases.remove(&lease);
                g.discard_wanted = true;
            }
            mine
        });
        prune(&mut state, self.policy.retain);
        self.changed.notify_all();
        found
    }

    /// Make a discarded generation's chunks again, zeroed (host: fresh memfds sealed at once;
    /// GPU: fresh chunks filled with zeros, with the digests of zeros), and tell the keeper.
    pub(super) fn remake_if_discarded(
        &self,
        state: &mut State,
        region: &str,
        number: u64,
    ) -> Result<(), Refusal> {
        let Some(r) = state.regions.get_mut(region) else {
            return Ok(());
        };
        let backend = r.backend;
        let Some(g) = r.generations.get_mut(&number) else {
            return Ok(());
        };
        let Some(sizes) = g.discarded.clone() else {
            return Ok(());
        };
        let mut chunks = Vec::with_capacity(sizes.len());
        for &len in &sizes {
            let (fd, origin) = match backend {
                Backend::Host => {
                    let fd = memfd::create(len)?;
                    memfd::seal_writes(std::os::fd::AsFd::as_fd(&fd)).map_err(|e| {
                        Refusal::ServiceFailed {
                            op: "F_ADD_SEALS(write) of a remade chunk".into(),
                            errno: e.raw_os_error().unwrap_or(0),
                        }
                    })?;
                    (fd, None)
                }
                Backend::Gpu { uuid } => self.gpus.create(&uuid, len, true)?,
            };
            chunks.push(Chunk { fd, len, origin });
        }
        g.digests = match backend {
            Backend::Host => Vec::new(),
            Backend::Gpu { .. } => sizes
                .iter()
                .map(|&len| crate::gpu::zero_digest(len))
                .collect(),
        };
        g.chunks = chunks;
        g.discarded = None;
        keep(state, region, number);
        Ok(())
    }
}

/// Free the memory of every generation of a live region that a discard sleep asked for and
/// no lease holds (its fds close: the kernel or the driver frees the memory once no client
/// maps it), and tell the keeper (its record alone).
pub(super) fn free_discarded(state: &mut State) {
    let mut freed = Vec::new();
    for (name, r) in state.regions.iter_mut() {
        for g in r.generations.values_mut() {
            if g.discard_wanted && g.leases.is_empty() && g.discarded.is_none() {
                g.discarded = Some(g.sizes());
                g.chunks.clear();
                g.digests.clear();
                g.discard_wanted = false;
                freed.push((name.clone(), g.number));
            }
        }
    }
    for (region, number) in freed {
        keep(state, &region, number);
    }
}
