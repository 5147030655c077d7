//! The service's state: regions, their generations, leases, the writer slots and the quotas,
//! behind one lock, with one condition variable that every change signals (waiting writers
//! wait on it). Every operation is keyed by the connection it comes from and the kernel's
//! identity of its peer; nothing here reads a socket.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Refusal, RequestRule, Right};
use crate::generation::{Chunk, Generation, Lease};
use crate::identity::Identity;
use crate::keeper_link::{GenerationRecord, KeeperLink, Restored};
use crate::memfd;
use crate::protocol::{
    Acl, GenerationStatus, MAX_CHUNKS, Principal, RegionStatus, RegionSummary, Status, TensorMeta,
    check_region_name,
};

/// The service's limits that the registry applies.
#[derive(Debug, Clone)]
pub(crate) struct Policy {
    pub(crate) quota: u64,
    pub(crate) quota_of: HashMap<u32, u64>,
    pub(crate) lease_ttl: Duration,
    pub(crate) max_wait: Duration,
    /// Retired generations kept per region without leases (newest first).
    pub(crate) retain: usize,
}

impl Policy {
    fn quota(&self, uid: u32) -> u64 {
        self.quota_of.get(&uid).copied().unwrap_or(self.quota)
    }
}

/// A named region.
#[derive(Debug)]
struct Region {
    owner: u32,
    acl: Acl,
    current: Option<u64>,
    /// Committed generations still held: the current one, and retired ones with leases.
    generations: BTreeMap<u64, Generation>,
    /// The writer's generation and the writer's connection and pid.
    pending: Option<(u64, i32, Generation)>,
    /// Connections waiting for the writer slot, first come first served.
    waiting: VecDeque<u64>,
}

impl Region {
    fn may(&self, who: &Identity, right: Right) -> bool {
        let listed = |p: &Principal| match *p {
            Principal::Uid(uid) => uid == who.uid,
            Principal::Gid(gid) => who.has_gid(gid),
        };
        who.uid == self.owner
            || self.acl.entries(right).iter().any(listed)
            || (right == Right::Read && self.acl.write.iter().any(listed))
    }

    fn last_number(&self) -> u64 {
        self.generations.keys().next_back().copied().unwrap_or(0)
    }
}

#[derive(Debug, Default)]
struct State {
    regions: BTreeMap<String, Region>,
    /// Deleted regions whose generations still have leases.
    deleted: Vec<Region>,
    used: HashMap<u32, u64>,
    next_lease: u64,
    refusals: u64,
    expired_leases: u64,
    /// The keeper that holds every committed generation across a restart of the service.
    keeper: Option<KeeperLink>,
}

/// A lease, as [`Registry::attach`] grants it.
#[derive(Debug)]
pub(crate) struct Grant {
    pub(crate) lease: u64,
    pub(crate) generation: u64,
    pub(crate) chunks: Vec<(OwnedFd, u64)>,
    pub(crate) meta: Vec<(String, TensorMeta)>,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Registry {
    state: Mutex<State>,
    changed: Condvar,
    policy: Policy,
}

impl Registry {
    pub(crate) fn new(policy: Policy) -> Registry {
        Registry {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            policy,
        }
    }

    pub(crate) fn policy(&self) -> &Policy {
        &self.policy
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Take `keeper` on, with what it held when this service started: those generations are
    /// this registry's again (their regions, owners, ACLs and charges as committed; the
    /// newest of each region current), and every later commit and free is told to it. A
    /// restored chunk must still be a write-sealed memfd of its recorded size, else that
    /// generation is let go (logged).
    pub(crate) fn adopt_keeper(&self, mut keeper: KeeperLink, restored: Vec<Restored>) -> usize {
        let mut state = self.lock();
        let mut adopted = 0;
        for Restored { record, chunks } in restored {
            let sound = chunks.iter().zip(&record.chunks).all(|(fd, &len)| {
                let sealed = memfd::seals(fd.as_fd()).is_ok_and(|s| s & libc::F_SEAL_WRITE != 0);
                let file = fd.try_clone().map(std::fs::File::from);
                sealed
                    && file
                        .and_then(|f| f.metadata())
                        .is_ok_and(|m| m.len() == len)
            });
            if !sound || check_region_name(&record.region).is_err() {
                eprintln!(
                    "vmm-memd: the keeper's {:?} generation {} is not sound; letting it go",
                    record.region, record.generation
                );
                keeper.forget(&record.region, record.generation);
                continue;
            }
            let r = state
                .regions
                .entry(record.region.clone())
                .or_insert_with(|| Region {
                    owner: record.owner,
                    acl: record.acl.clone(),
                    current: None,
                    generations: BTreeMap::new(),
                    pending: None,
                    waiting: VecDeque::new(),
                });
            let generation = Generation {
                number: record.generation,
                chunks: chunks
                    .into_iter()
                    .zip(&record.chunks)
                    .map(|(fd, &len)| Chunk { fd, len })
                    .collect(),
                meta: record.meta,
                charged_to: record.charged_to,
                leases: HashMap::new(),
            };
            let bytes = generation.bytes();
            r.current = r.current.max(Some(record.generation));
            r.generations.insert(record.generation, generation);
            *state.used.entry(record.charged_to).or_default() += bytes;
            adopted += 1;
        }
        state.keeper = Some(keeper);
        prune(&mut state, self.policy.retain);
        adopted
    }

    /// Replace a lost keeper (exited, or a send to it failed) and send the new one every
    /// committed generation held. `false`: no keeper could be started (tried again later).
    pub(crate) fn tend_keeper(&self) -> bool {
        let mut state = self.lock();
        let Some(keeper) = state.keeper.as_mut() else {
            return true;
        };
        if !keeper.lost() {
            return true;
        }
        if let Err(e) = keeper.restart() {
            eprintln!("vmm-memd: cannot start a keeper: {e}");
            return false;
        }
        let held: Vec<(String, u64)> = state
            .regions
            .iter()
            .flat_map(|(name, r)| r.generations.keys().map(move |&n| (name.clone(), n)))
            .collect();
        for (region, number) in &held {
            keep(&mut state, region, *number);
        }
        eprintln!("vmm-memd: a new keeper holds {} generations", held.len());
        true
    }

    /// The service stops for good: its keeper lets everything go.
    pub(crate) fn quit_keeper(&self) {
        if let Some(keeper) = self.lock().keeper.take() {
            keeper.quit();
        }
    }

    /// Count a refusal (for status).
    pub(crate) fn refused(&self) {
        self.lock().refusals += 1;
    }

    /// Regions `who` may read.
    pub(crate) fn list(&self, who: &Identity) -> Vec<RegionSummary> {
        let state = self.lock();
        state
            .regions
            .iter()
            .filter(|(_, r)| r.may(who, Right::Read))
            .map(|(name, r)| {
                let current = r.current.and_then(|g| r.generations.get(&g));
                RegionSummary {
                    region: name.clone(),
                    generation: r.current.unwrap_or(0),
                    bytes: current.map_or(0, Generation::bytes),
                }
            })
            .collect()
    }

    /// What `who` may see of the service.
    pub(crate) fn status(&self, who: &Identity) -> Status {
        let state = self.lock();
        let regions = state
            .regions
            .iter()
            .filter(|(_, r)| r.may(who, Right::Read))
            .map(|(name, r)| RegionStatus {
                region: name.clone(),
                owner: r.owner,
                generations: r
                    .generations
                    .values()
                    .map(|g| GenerationStatus {
                        generation: g.number,
                        bytes: g.bytes(),
                        current: r.current == Some(g.number),
                        readers: g.leases.values().map(|l| l.pid).collect(),
                    })
                    .collect(),
                pending: r
                    .pending
                    .as_ref()
                    .map(|(_, pid, g)| (g.number, g.bytes(), *pid)),
                waiting_writers: r.waiting.len() as u32,
            })
            .collect();
        Status {
            uid: who.uid,
            used: state.used.get(&who.uid).copied().unwrap_or(0),
            quota: self.policy.quota(who.uid),
            regions,
            refusals: state.refusals,
            expired_leases: state.expired_leases,
            truncated: false,
        }
    }

    /// Start the next generation of `region` for connection `conn`: see `Request::Begin`.
    /// Waits (at most `wait`, capped by the policy) for the writer slot, first come first
    /// served; while it waits, `gone()` is asked every 50 ms whether the connection has ended.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn begin(
        &self,
        conn: u64,
        who: &Identity,
        region: &str,
        chunks: &[u64],
        acl: Acl,
        wait: Duration,
        gone: &dyn Fn() -> bool,
    ) -> Result<(u64, Vec<(OwnedFd, u64)>), Refusal> {
        check_region_name(region)?;
        acl.check()?;
        if chunks.is_empty() || chunks.len() > MAX_CHUNKS || chunks.contains(&0) {
            return Err(Refusal::InvalidRequest {
                rule: RequestRule::Chunks,
                detail: format!("a generation has 1 to {MAX_CHUNKS} chunks, none empty"),
            });
        }
        let asked = chunks
            .iter()
            .try_fold(0u64, |sum, &c| sum.checked_add(c))
            .unwrap_or(u64::MAX);
        let started = Instant::now();
        let wait = wait.min(self.policy.max_wait);
        let mut state = self.lock();
        let r = state
            .regions
            .entry(region.to_owned())
            .or_insert_with(|| Region {
                owner: who.uid,
                acl,
                current: None,
                generations: BTreeMap::new(),
                pending: None,
                waiting: VecDeque::new(),
            });
        if !r.may(who, Right::Write) {
            let refusal = match r.may(who, Right::Read) {
                true => Refusal::AccessDenied {
                    region: region.to_owned(),
                    right: Right::Write,
                    uid: who.uid,
                },
                false => Refusal::NoSuchRegion {
                    region: region.to_owned(),
                },
            };
            return Err(refusal);
        }
        r.waiting.push_back(conn);
        // Wait for the slot: free, and this connection first in line.
        loop {
            let r = state
                .regions
                .get_mut(region)
                .expect("a region with a waiter stays");
            // A writer that hung up (or a service that stops) gets no slot.
            let gone = gone();
            if !gone && r.pending.is_none() && r.waiting.front() == Some(&conn) {
                r.waiting.pop_front();
                break;
            }
            let waited = started.elapsed();
            if waited >= wait || gone {
                r.waiting.retain(|&c| c != conn);
                drop_if_unused(&mut state, region);
                self.changed.notify_all();
                return Err(Refusal::WriterBusy {
                    region: region.to_owned(),
                    waited_ms: waited.as_millis() as u64,
                });
            }
            let slice = (wait - waited).min(Duration::from_millis(50));
            state = self
                .changed
                .wait_timeout(state, slice)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        // The quota, before anything is allocated (making room by freeing generations that
        // only the retention setting keeps, the caller's own, oldest first).
        let quota = self.policy.quota(who.uid);
        evict_retained(&mut state, who.uid, quota.saturating_sub(asked));
        let used = state.used.get(&who.uid).copied().unwrap_or(0);
        if used.checked_add(asked).is_none_or(|total| total > quota) {
            drop_if_unused(&mut state, region);
            self.changed.notify_all();
            return Err(Refusal::QuotaExceeded {
                uid: who.uid,
                used,
                asked,
                quota,
            });
        }
        let mut made = Vec::with_capacity(chunks.len());
        for &len in chunks {
            match memfd::create(len) {
                Ok(fd) => made.push(Chunk { fd, len }),
                Err(e) => {
                    drop_if_unused(&mut state, region);
                    self.changed.notify_all();
                    return Err(e);
                }
            }
        }
        let r = state.regions.get_mut(region).expect("the region is there");
        let generation = Generation {
            number: r.last_number() + 1,
            chunks: made,
            meta: Vec::new(),
            charged_to: who.uid,
            leases: HashMap::new(),
        };
        let fds = generation.dup_fds()?;
        let number = generation.number;
        r.pending = Some((conn, who.pid, generation));
        *state.used.entry(who.uid).or_default() += asked;
        Ok((
            number,
            fds.into_iter().zip(chunks.iter().copied()).collect(),
        ))
    }

    /// Add metadata to `conn`'s pending generation of `region`.
    pub(crate) fn put_meta(
        &self,
        conn: u64,
        region: &str,
        entries: Vec<(String, TensorMeta)>,
    ) -> Result<(), Refusal> {
        let mut state = self.lock();
        pending_of(&mut state, conn, region)?.put_meta(entries)
    }

    /// Seal `conn`'s pending generation of `region` read-only and make it current; the
    /// previous one is retired (freed at once if no lease holds it).
    pub(crate) fn commit(&self, conn: u64, region: &str) -> Result<u64, Refusal> {
        let mut state = self.lock();
        let generation = pending_of(&mut state, conn, region)?;
        for chunk in &generation.chunks {
            if let Err(e) = memfd::seal_writes(std::os::fd::AsFd::as_fd(&chunk.fd)) {
                return Err(match e.raw_os_error() {
                    Some(libc::EBUSY) => Refusal::StillMapped {
                        region: region.to_owned(),
                        generation: generation.number,
                    },
                    errno => Refusal::ServiceFailed {
                        op: "F_ADD_SEALS(write)".into(),
                        errno: errno.unwrap_or(0),
                    },
                });
            }
        }
        let r = state.regions.get_mut(region).expect("pending_of found it");
        let (_, _, generation) = r.pending.take().expect("pending_of found it");
        let number = generation.number;
        r.generations.insert(number, generation);
        r.current = Some(number);
        keep(&mut state, region, number);
        prune(&mut state, self.policy.retain);
        self.changed.notify_all();
        Ok(number)
    }

    /// Free `conn`'s pending generation of `region`.
    pub(crate) fn abort(&self, conn: u64, region: &str) -> Result<(), Refusal> {
        let mut state = self.lock();
        pending_of(&mut state, conn, region)?;
        let (_, _, generation) = state
            .regions
            .get_mut(region)
            .and_then(|r| r.pending.take())
            .expect("pending_of found it");
        refund(&mut state, &generation);
        drop_if_unused(&mut state, region);
        self.changed.notify_all();
        Ok(())
    }

    /// A lease on `region`'s generation `generation` (`None`: the current one) for `conn`.
    pub(crate) fn attach(
        &self,
        conn: u64,
        who: &Identity,
        region: &str,
        generation: Option<u64>,
    ) -> Result<Grant, Refusal> {
        let mut state = self.lock();
        state.next_lease += 1;
        let lease = state.next_lease;
        let expires = Instant::now() + self.policy.lease_ttl;
        let none = || Refusal::NoSuchRegion {
            region: region.to_owned(),
        };
        let r = state.regions.get_mut(region).ok_or_else(none)?;
        if !r.may(who, Right::Read) {
            return Err(none());
        }
        let g = match generation {
            None => r
                .current
                .and_then(|n| r.generations.get_mut(&n))
                .ok_or_else(none)?,
            Some(n) => r
                .generations
                .get_mut(&n)
                .ok_or_else(|| Refusal::NoSuchGeneration {
                    region: region.to_owned(),
                    generation: n,
                })?,
        };
        let chunks = g.dup_fds()?.into_iter().zip(g.sizes()).collect();
        g.leases.insert(
            lease,
            Lease {
                conn,
                pid: who.pid,
                expires,
            },
        );
        Ok(Grant {
            lease,
            generation: g.number,
            chunks,
            meta: g.meta.clone(),
        })
    }

    /// End `conn`'s lease `lease` (a lease of another connection is not found).
    pub(crate) fn detach(&self, conn: u64, lease: u64) -> bool {
        let mut state = self.lock();
        let found = generations_mut(&mut state).any(|g| {
            g.leases.get(&lease).is_some_and(|l| l.conn == conn)
                && g.leases.remove(&lease).is_some()
        });
        prune(&mut state, self.policy.retain);
        self.changed.notify_all();
        found
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

    /// Delete `region`: its name goes now; its generations go as their leases end.
    pub(crate) fn delete(&self, who: &Identity, region: &str) -> Result<(), Refusal> {
        let mut state = self.lock();
        let r = state
            .regions
            .get(region)
            .ok_or_else(|| Refusal::NoSuchRegion {
                region: region.to_owned(),
            })?;
        if !r.may(who, Right::Delete) {
            return Err(match r.may(who, Right::Read) {
                true => Refusal::AccessDenied {
                    region: region.to_owned(),
                    right: Right::Delete,
                    uid: who.uid,
                },
                false => Refusal::NoSuchRegion {
                    region: region.to_owned(),
                },
            });
        }
        if r.pending.is_some() || !r.waiting.is_empty() {
            return Err(Refusal::WriterBusy {
                region: region.to_owned(),
                waited_ms: 0,
            });
        }
        let mut r = state.regions.remove(region).expect("found above");
        r.current = None;
        if let Some(keeper) = state.keeper.as_mut() {
            for &number in r.generations.keys() {
                keeper.forget(region, number);
            }
        }
        state.deleted.push(r);
        prune(&mut state, self.policy.retain);
        self.changed.notify_all();
        Ok(())
    }

    /// Connection `conn` ended: its leases end, its pending generation (of `writing`, if any)
    /// is freed, and it leaves every writer queue.
    pub(crate) fn release(&self, conn: u64, writing: Option<&str>) {
        let mut state = self.lock();
        for g in generations_mut(&mut state) {
            g.leases.retain(|_, l| l.conn != conn);
        }
        if let Some(region) = writing
            && let Some(r) = state.regions.get_mut(region)
            && r.pending.as_ref().is_some_and(|(c, _, _)| *c == conn)
        {
            let (_, _, generation) = r.pending.take().expect("checked");
            refund(&mut state, &generation);
            drop_if_unused(&mut state, region);
        }
        prune(&mut state, self.policy.retain);
        self.changed.notify_all();
    }

    /// End leases past their TTL; how many.
    pub(crate) fn expire(&self, now: Instant) -> usize {
        let mut state = self.lock();
        let mut n = 0;
        for g in generations_mut(&mut state) {
            let before = g.leases.len();
            g.leases.retain(|_, l| l.expires > now);
            n += before - g.leases.len();
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
fn generations_mut(state: &mut State) -> impl Iterator<Item = &mut Generation> {
    state
        .regions
        .values_mut()
        .chain(state.deleted.iter_mut())
        .flat_map(|r| r.generations.values_mut())
}

/// `conn`'s pending generation of `region`.
fn pending_of<'s>(
    state: &'s mut State,
    conn: u64,
    region: &str,
) -> Result<&'s mut Generation, Refusal> {
    state
        .regions
        .get_mut(region)
        .and_then(|r| r.pending.as_mut())
        .filter(|(c, _, _)| *c == conn)
        .map(|(_, _, g)| g)
        .ok_or_else(|| Refusal::InvalidRequest {
            rule: RequestRule::NotWriting,
            detail: format!("this connection writes no generation of {region:?}"),
        })
}

/// Give a freed generation's bytes back to the quota of the uid it was charged to. Its memfds
/// close when it drops; the kernel frees the pages once no reader maps them.
fn refund(state: &mut State, generation: &Generation) {
    if let Some(used) = state.used.get_mut(&generation.charged_to) {
        *used = used.saturating_sub(generation.bytes());
        if *used == 0 {
            state.used.remove(&generation.charged_to);
        }
    }
}

/// Free every committed generation that is not current and has no lease left, and drop
/// deleted regions with none left.
fn prune(state: &mut State, retain: usize) {
    let mut freed = Vec::new();
    let live = state.regions.iter_mut().map(|(n, r)| (Some(n), r, retain));
    let deleted = state.deleted.iter_mut().map(|r| (None, r, 0));
    for (name, r, retain) in live.chain(deleted) {
        let current = r.current;
        // Retired generations, newest first: the first `retain` stay.
        let gone: Vec<u64> = r
            .generations
            .values()
            .rev()
            .filter(|g| Some(g.number) != current)
            .skip(retain)
            .filter(|g| g.leases.is_empty())
            .map(|g| g.number)
            .collect();
        for n in gone {
            if let (Some(name), Some(keeper)) = (name, state.keeper.as_mut()) {
                keeper.forget(name, n);
            }
            freed.extend(r.generations.remove(&n));
        }
    }
    for generation in &freed {
        refund(state, generation);
    }
    state.deleted.retain(|r| !r.generations.is_empty());
}

/// Have the keeper hold `region`'s committed generation `number`.
fn keep(state: &mut State, region: &str, number: u64) {
    let (Some(keeper), Some(r)) = (state.keeper.as_mut(), state.regions.get(region)) else {
        return;
    };
    let Some(g) = r.generations.get(&number) else {
        return;
    };
    let record = GenerationRecord {
        region: region.to_owned(),
        generation: number,
        owner: r.owner,
        acl: r.acl.clone(),
        charged_to: g.charged_to,
        meta: g.meta.clone(),
        chunks: g.sizes(),
    };
    let fds: Vec<_> = g.chunks.iter().map(|c| c.fd.as_fd()).collect();
    // A failure marks the keeper lost; the service's keeper thread replaces it and sends
    // it everything.
    let _ = keeper.keep(&record, &fds);
}

/// Free retired generations charged to `uid` that no lease holds (kept only by the
/// retention setting), oldest first, until `uid` uses at most `target` bytes.
fn evict_retained(state: &mut State, uid: u32, target: u64) {
    let mut candidates: Vec<(u64, String)> = state
        .regions
        .iter()
        .flat_map(|(name, r)| {
            r.generations
                .values()
                .filter(move |g| {
                    Some(g.number) != r.current && g.leases.is_empty() && g.charged_to == uid
                })
                .map(move |g| (g.number, name.clone()))
        })
        .collect();
    candidates.sort();
    for (number, name) in candidates {
        if state.used.get(&uid).copied().unwrap_or(0) <= target {
            break;
        }
        if let Some(g) = state
            .regions
            .get_mut(&name)
            .and_then(|r| r.generations.remove(&number))
        {
            if let Some(keeper) = state.keeper.as_mut() {
                keeper.forget(&name, number);
            }
            refund(state, &g);
        }
    }
}

/// Drop a region that a `begin` created but that never committed and has no writer.
fn drop_if_unused(state: &mut State, region: &str) {
    if state.regions.get(region).is_some_and(|r| {
        r.current.is_none()
            && r.generations.is_empty()
            && r.pending.is_none()
            && r.waiting.is_empty()
    }) {
        state.regions.remove(region);
    }
}
