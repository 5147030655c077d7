//! The discard sleep: a reader that sleeps with discard gives its lease up and asks the
//! service to free the generation's memory once no lease holds it (every mapper asleep or
//! gone). It needs the region's write right: it replaces the contents. The generation stays
//! (its number, metadata, chunk sizes and quota charge); the keeper keeps its record without
//! chunks; the next attach (a wake) makes the chunks again,
//! zeroed, so a sleeper's layout hash still matches and it maps them at its old addresses.
//!
//! An operator's `Sleep` and `Wake` of a region (`vmm-memctl sleep`, `wake`) are the same
//! machinery without a lease: `Sleep` marks the current generation as a discard does, `Wake`
//! makes its chunks again now as the next attach would (or calls off a sleep that waits for
//! leases). Both need the region's write right, as a discard does.

use std::sync::Arc;

use super::{Registry, State, generations_mut, keep, prune};
use crate::error::{Refusal, RequestRule, Right};

use crate::identity::Identity;
use crate::memfd;
use crate::protocol::Backend;
use crate::service::generation::{Chunk, Generation};
use crate::trace::event;

impl Registry {
    /// End `conn`'s lease `lease` as a discard sleep: its generation's memory goes once no
    /// lease holds it. Discarding replaces the contents (with zeros, at the next attach), so
    /// it needs the region's write right: a reader that may only read is refused
    /// (`AccessDenied`, its lease kept). `NoSuchLease`: no such lease of this connection.
    pub(crate) fn discard(&self, conn: u64, who: &Identity, lease: u64) -> Result<(), Refusal> {
        let mut state = self.lock();
        let mine = |g: &Generation| g.leases.get(&lease).is_some_and(|l| l.conn == conn);
        // The live region holding the lease, and whether the caller may write it.
        let found = state.regions.iter().find_map(|(name, r)| {
            r.generations
                .values()
                .any(&mine)
                .then(|| (name.clone(), r.may(who, Right::Write)))
        });
        match found {
            Some((region, false)) => {
                return Err(Refusal::AccessDenied {
                    region,
                    right: Right::Write,
                    uid: who.uid,
                });
            }
            Some((region, true)) => {
                let r = state.regions.get_mut(&region).expect("found above");
                if let Some(g) = r.generations.values_mut().find(|g| mine(g)) {
                    g.leases.remove(&lease);
                    g.discard_wanted = true;
                    event!(
                        INFO,
                        "memd.discard",
                        region,
                        generation = g.number,
                        lease,
                        conn,
                        uid = who.uid,
                        pid = who.pid,
                        leases = g.leases.len()
                    );
                }
            }
            // A deleted region's generation: the lease just ends.
            None => {
                let ended = generations_mut(&mut state)
                    .any(|g| mine(g) && g.leases.remove(&lease).is_some());
                if !ended {
                    return Err(Refusal::InvalidRequest {
                        rule: RequestRule::NoSuchLease,
                        detail: format!("this connection holds no lease {lease}"),
                    });
                }
            }
        }
        prune(&mut state, self.policy.retain);
        self.changed.notify_all();
        Ok(())
    }

    /// An operator's sleep of `region`'s current generation (see `Request::Sleep`): marked
    /// as a discard marks it, so its memory goes once no lease holds it (now, if none does).
    /// Its number and how many leases still hold it.
    pub(crate) fn sleep_region(&self, who: &Identity, region: &str) -> Result<(u64, u32), Refusal> {
        let mut state = self.lock();
        let number = admin_target(&state, who, region)?;
        let g = generation_mut(&mut state, region, number);
        if g.discarded.is_none() {
            g.discard_wanted = true;
        }
        let leases = g.leases.len() as u32;
        event!(
            INFO,
            "memd.sleep",
            region,
            generation = number,
            uid = who.uid,
            pid = who.pid,
            admin = who.admin,
            leases,
            outcome = if leases == 0 { "asleep" } else { "falling" }
        );
        prune(&mut state, self.policy.retain);
        self.changed.notify_all();
        Ok((number, leases))
    }

    /// An operator's wake of `region`'s current generation (see `Request::Wake`): its
    /// chunks made again, zeroed, now (the attach path's [`Registry::remake_if_discarded`]),
    /// or a sleep still waiting for leases called off. Its number and whether it was zeroed.
    pub(crate) fn wake_region(&self, who: &Identity, region: &str) -> Result<(u64, bool), Refusal> {
        let mut state = self.lock();
        let number = admin_target(&state, who, region)?;
        let g = generation_mut(&mut state, region, number);
        let zeroed = match (g.discarded.is_some(), g.discard_wanted) {
            (true, _) => true,
            (false, true) => {
                g.discard_wanted = false;
                false
            }
            (false, false) => {
                return Err(Refusal::InvalidRequest {
                    rule: RequestRule::NotAsleep,
                    detail: format!("region {region:?} generation {number} is awake"),
                });
            }
        };
        if zeroed {
            self.remake_if_discarded(&mut state, region, number)?;
        }
        event!(
            INFO,
            "memd.wake",
            region,
            generation = number,
            uid = who.uid,
            pid = who.pid,
            admin = who.admin,
            outcome = if zeroed { "zeroed" } else { "called off" }
        );
        self.changed.notify_all();
        Ok((number, zeroed))
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
            chunks.push(Chunk {
                fd: Arc::new(fd),
                len,
                origin,
            });
        }
        g.digests = match backend {
            Backend::Host => Vec::new(),
            Backend::Gpu { .. } => sizes
                .iter()
                .map(|&len| crate::service::gpu::zero_digest(len))
                .collect(),
        };
        g.chunks = chunks;
        g.discarded = None;
        event!(
            INFO,
            "memd.remade",
            region,
            generation = number,
            bytes = g.bytes(),
            backend = ?backend
        );
        keep(state, region, number);
        Ok(())
    }
}

/// The current generation of `region` for an operator's sleep or wake by `who` (the service's
/// admins may sleep and wake any region): a region it may not read does not exist for it
/// (`NoSuchRegion`, as everywhere); one it may read but not write is `AccessDenied` for
/// `write`; one without a committed generation, `NoSuchRegion`.
fn admin_target(state: &State, who: &Identity, region: &str) -> Result<u64, Refusal> {
    let none = || Refusal::NoSuchRegion {
        region: region.to_owned(),
    };
    let r = state.regions.get(region).ok_or_else(none)?;
    if !r.operable(who, Right::Read) {
        return Err(none());
    }
    if !r.operable(who, Right::Write) {
        return Err(Refusal::AccessDenied {
            region: region.to_owned(),
            right: Right::Write,
            uid: who.uid,
        });
    }
    r.current
        .filter(|n| r.generations.contains_key(n))
        .ok_or_else(none)
}

/// `region`'s committed generation `number`, which the caller found.
fn generation_mut<'s>(state: &'s mut State, region: &str, number: u64) -> &'s mut Generation {
    state
        .regions
        .get_mut(region)
        .and_then(|r| r.generations.get_mut(&number))
        .expect("found by the caller")
}

/// Free the memory of every generation of a live region that a discard sleep asked for and
/// no lease holds (its fds close: the kernel or the driver frees the memory once no client
/// maps it), and tell the keeper (its record alone).
pub(super) fn free_discarded(state: &mut State) {
    let mut freed = Vec::new();
    for (name, r) in state.regions.iter_mut() {
        for g in r.generations.values_mut() {
            if g.discard_wanted && g.leases.is_empty() && g.discarded.is_none() {
                event!(
                    INFO,
                    "memd.discard.freed",
                    region = name.as_str(),
                    generation = g.number,
                    bytes = g.bytes(),
                    uid = g.charged_to
                );
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
