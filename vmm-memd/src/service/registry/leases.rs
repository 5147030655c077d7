//! Leases ending and renewed: `Detach`, `Renew`, a connection's end, the TTL. Each end may
//! free a retired generation (or the memory of one a discard sleep marked): see `prune`.

use std::time::Instant;

use super::{Registry, State, drop_if_unused, prune, refund};
use crate::service::generation::Generation;
use crate::trace::event;

/// What events call the region of a generation whose region was deleted.
const DELETED: &str = "(deleted)";

impl Registry {
    /// End `conn`'s lease `lease` (a lease of another connection is not found).
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(crate) fn detach(&self, conn: u64, lease: u64) -> bool {
        let mut state = self.lock();
        let found = named_generations_mut(&mut state).any(|(region, g)| {
            let ended = match g.leases.get(&lease) {
                Some(l) if l.conn == conn => g.leases.remove(&lease),
                _ => None,
            };
            if let Some(ended) = &ended {
                event!(
                    DEBUG,
                    "memd.detach",
                    region,
                    generation = g.number,
                    lease,
                    conn,
                    pid = ended.pid
                );
            }
            ended.is_some()
        });
        prune(&mut state, self.policy.retain);
        self.changed.notify_all();
        found
    }

    /// Whether connection `conn` holds a lease.
    pub(crate) fn holds_leases(&self, conn: u64) -> bool {
        let mut state = self.lock();
        generations_mut(&mut state).any(|g| g.leases.values().any(|l| l.conn == conn))
    }

    /// Renew every lease of `conn` for another TTL; how many.
    pub(crate) fn renew(&self, conn: u64) -> u32 {
        let mut state = self.lock();
        let expires = Instant::now() + self.policy.lease_ttl;
        let mut n = 0;
        for g in generations_mut(&mut state) {
            for l in g.leases.values_mut().filter(|l| l.conn == conn) {
                l.expires = expires;
                n += 1;
            }
        }
        n
    }

    /// Connection `conn` ended: its leases end, its pending generation (of `writing`, if any)
    /// is freed, and it leaves every writer queue.
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(crate) fn release(&self, conn: u64, writing: Option<&str>) {
        let mut state = self.lock();
        for g in generations_mut(&mut state) {
            g.leases.retain(|_, l| l.conn != conn);
        }
        if let Some(region) = writing
            && let Some(r) = state.regions.get_mut(region)
            && r.pending.as_ref().is_some_and(|(c, _, _)| *c == conn)
        {
            let (_, pid, generation) = r.pending.take().expect("checked");
            event!(
                INFO,
                "memd.abort",
                region,
                generation = generation.number,
                conn,
                pid,
                bytes = generation.bytes(),
                outcome = "writer gone"
            );
            refund(&mut state, &generation);
            drop_if_unused(&mut state, region);
        }
        prune(&mut state, self.policy.retain);
        self.changed.notify_all();
    }

    /// End leases past their TTL; how many.
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(crate) fn expire(&self, now: Instant) -> usize {
        let mut state = self.lock();
        let mut n = 0;
        for (region, g) in named_generations_mut(&mut state) {
            let number = g.number;
            g.leases.retain(|&lease, l| {
                let live = l.expires > now;
                if !live {
                    n += 1;
                    event!(
                        INFO,
                        "memd.lease.expired",
                        region,
                        generation = number,
                        lease,
                        conn = l.conn,
                        pid = l.pid
                    );
                }
                live
            });
        }
        if n > 0 {
            state.expired_leases += n as u64;
            prune(&mut state, self.policy.retain);
            self.changed.notify_all();
        }
        n
    }
}

/// Every committed generation, of live and deleted regions.
pub(super) fn generations_mut(state: &mut State) -> impl Iterator<Item = &mut Generation> {
    state
        .regions
        .values_mut()
        .chain(state.deleted.iter_mut())
        .flat_map(|r| r.generations.values_mut())
}

/// Every committed generation with its region's name ([`DELETED`] for a deleted region's).
fn named_generations_mut(state: &mut State) -> impl Iterator<Item = (&str, &mut Generation)> {
    let live = state.regions.iter_mut().map(|(name, r)| (name.as_str(), r));
    let deleted = state.deleted.iter_mut().map(|r| (DELETED, r));
    live.chain(deleted)
        .flat_map(|(name, r)| r.generations.values_mut().map(move |g| (name, g)))
}
