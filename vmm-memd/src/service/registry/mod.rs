//! The service's state: regions, their generations, leases, the writer slots and the quotas,
//! behind one lock, with one condition variable that every change signals (waiting writers
//! wait on it). Every operation is keyed by the connection it comes from and the kernel's
//! identity of its peer; nothing here reads a socket.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_core::cuda::FabricDescriptor;

use crate::error::{Refusal, RequestRule, Right};
use crate::identity::{Admins, Identity};
use crate::keeper::KeeperLink;
use crate::memfd;
use crate::protocol::{
    Acl, Backend, GenerationStatus, MAX_CHUNKS, Principal, RegionStatus, RegionSummary, SleepState,
    Status, TensorMeta, check_region_name,
};
use crate::service::generation::{Chunk, ChunkFd, Generation, Lease, MetaReplies};
use crate::service::gpu::Gpus;

mod discard;
mod gpu_requests;
mod hashing;
mod kept;
mod leases;
mod operators;
mod refabric;
mod tokens;
mod verify;

use crate::trace::event;
use kept::keep;
use leases::generations_mut;

/// The service's limits that the registry applies.
#[derive(Debug, Clone)]
pub(crate) struct Policy {
    pub(crate) quota: u64,
    pub(crate) quota_of: HashMap<u32, u64>,
    pub(crate) lease_ttl: Duration,
    pub(crate) max_wait: Duration,
    /// Retired generations kept per region without leases (newest first).
    pub(crate) retain: usize,
    /// Who may send an operator's requests.
    pub(crate) admins: Admins,
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
    /// Where its generations live (chosen when it was created).
    backend: Backend,
    /// Whether its GPU chunks are also fabric-shareable.
    fabric: bool,
    current: Option<u64>,
    /// Committed generations still held: the current one, and retired ones with leases.
    generations: BTreeMap<u64, Generation>,
    /// The writer's generation and the writer's connection and pid.
    pending: Option<(u64, i32, Generation)>,
    /// Connections waiting for the writer slot, first come first served.
    waiting: VecDeque<u64>,
    /// The tokens of its latest tokened commits and their generations, oldest first (at most
    /// `MAX_LANDED_TOKENS`; see `tokens`).
    landed: VecDeque<([u8; 16], u64)>,
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

    /// [`may`](Self::may), or `who` is one of the service's admins, for what an operator
    /// does to a region (see it in `List` and `Status`, delete it, sleep and wake it, change
    /// its ACL): never to read or write its memory.
    fn operable(&self, who: &Identity, right: Right) -> bool {
        who.admin || self.may(who, right)
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
    /// Quotas an admin set at run time (`SetQuota`), before the policy's; kept by the keeper.
    quotas: BTreeMap<u32, u64>,
}

/// A lease, as [`Registry::attach`] grants it.
#[derive(Debug)]
pub(crate) struct Grant {
    pub(crate) lease: u64,
    pub(crate) generation: u64,
    pub(crate) chunks: Vec<(ChunkFd, u64)>,
    /// The metadata, as the `MetaPage` replies to send.
    pub(crate) meta: MetaReplies,
    pub(crate) backend: Backend,
    pub(crate) fabric: bool,
    /// The chunks as fabric handles (one single-chunk descriptor each), when asked for.
    pub(crate) fabric_handles: Option<Vec<FabricDescriptor>>,
}

/// A pending generation as [`Registry::begin`] made it: its number, its chunks (fds to send
/// and sizes), where they live.
#[derive(Debug)]
pub(crate) struct Began {
    pub(crate) generation: u64,
    pub(crate) chunks: Vec<(ChunkFd, u64)>,
    pub(crate) backend: Backend,
    pub(crate) fabric: bool,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Registry {
    state: Mutex<State>,
    changed: Condvar,
    policy: Policy,
    /// The GPU backend: devices are opened on the first request for a GPU region.
    gpus: Gpus,
    /// Committed GPU generations waiting for their digests (see `hashing`).
    hashing: hashing::HashQueue,
}

impl Registry {
    pub(crate) fn new(policy: Policy) -> Registry {
        Registry {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            policy,
            gpus: Gpus::default(),
            hashing: hashing::HashQueue::default(),
        }
    }

    pub(crate) fn policy(&self) -> &Policy {
        &self.policy
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
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
            .filter(|(_, r)| r.operable(who, Right::Read))
            .map(|(name, r)| {
                let current = r.current.and_then(|g| r.generations.get(&g));
                RegionSummary {
                    region: name.clone(),
                    generation: r.current.unwrap_or(0),
                    bytes: current.map_or(0, Generation::bytes),
                    sleep: current.map_or(SleepState::Awake, Generation::sleep_state),
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
            .filter(|(_, r)| r.operable(who, Right::Read))
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
                        sleep: g.sleep_state(),
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
            quota: quota_of(&state, &self.policy, who.uid),
            regions,
            refusals: state.refusals,
            expired_leases: state.expired_leases,
            truncated: false,
        }
    }

    /// Start the next generation of `region` for connection `conn` on `backend`: see
    /// `Request::BeginOn`. Waits (at most `wait`, capped by the policy) for the writer slot,
    /// first come first served; while it waits, `gone()` is asked every 50 ms whether the
    /// connection has ended.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn begin(
        &self,
        conn: u64,
        who: &Identity,
        region: &str,
        chunks: &[u64],
        acl: Acl,
        wait: Duration,
        backend: Backend,
        gone: &dyn Fn() -> bool,
    ) -> Result<Began, Refusal> {
        check_region_name(region)?;
        acl.check()?;
        if chunks.is_empty() || chunks.len() > MAX_CHUNKS || chunks.contains(&0) {
            return Err(Refusal::InvalidRequest {
                rule: RequestRule::Chunks,
                detail: format!("a generation has 1 to {MAX_CHUNKS} chunks, none empty"),
            });
        }
        // Another backend than the region's is refused before a device is opened.
        self.check_backend(region, backend)?;
        let (chunks, fabric) = match backend {
            Backend::Host => (chunks.to_vec(), false),
            Backend::Gpu { uuid } => (self.gpus.rounded(&uuid, chunks)?, self.gpus.fabric(&uuid)),
        };
        let chunks = &chunks[..];
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
                backend,
                fabric,
                current: None,
                generations: BTreeMap::new(),
                pending: None,
                waiting: VecDeque::new(),
                landed: VecDeque::new(),
            });
        if r.may(who, Right::Read) && r.backend != backend {
            let refusal = backend_refusal(region, r.backend);
            drop_if_unused(&mut state, region);
            return Err(refusal);
        }
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
        let quota = quota_of(&state, &self.policy, who.uid);
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
            let created = match backend {
                Backend::Host => memfd::create(len).map(|fd| (fd, None)),
                Backend::Gpu { uuid } => self.gpus.create(&uuid, len, false),
            };
            match created {
                Ok((fd, origin)) => made.push(Chunk {
                    fd: Arc::new(fd),
                    len,
                    origin,
                }),
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
            meta_replies: None,
            token: None,
            charged_to: who.uid,
            leases: HashMap::new(),
            digests: Vec::new(),
            discard_wanted: false,
            discarded: None,
        };
        let fds = generation.chunk_fds();
        let number = generation.number;
        let fabric = r.fabric;
        r.pending = Some((conn, who.pid, generation));
        *state.used.entry(who.uid).or_default() += asked;
        event!(
            INFO,
            "memd.begin",
            region,
            generation = number,
            uid = who.uid,
            pid = who.pid,
            conn,
            bytes = asked,
            backend = ?backend
        );
        Ok(Began {
            generation: number,
            chunks: fds.into_iter().zip(chunks.iter().copied()).collect(),
            backend,
            fabric,
        })
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

    /// Seal `conn`'s pending generation of `region` read-only (host) and make it current;
    /// the previous one is retired (freed at once if no lease holds it). A GPU generation's
    /// digests are taken afterwards, off the commit's path ([`Registry::hash_later`]).
    pub(crate) fn commit(&self, conn: u64, region: &str) -> Result<u64, Refusal> {
        let mut state = self.lock();
        let gpu = state
            .regions
            .get(region)
            .is_some_and(|r| r.backend != Backend::Host);
        let generation = pending_of(&mut state, conn, region)?;
        for chunk in generation.chunks.iter().filter(|_| !gpu) {
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
        event!(
            INFO,
            "memd.commit",
            region,
            generation = number,
            conn,
            uid = generation.charged_to,
            bytes = generation.bytes()
        );
        if let Some(token) = generation.token {
            tokens::landed(r, token, number);
        }
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
        event!(
            INFO,
            "memd.abort",
            region,
            generation = generation.number,
            conn,
            bytes = generation.bytes(),
            outcome = "aborted"
        );
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
        as_fabric: bool,
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
        let (backend, fabric) = (r.backend, r.fabric);
        let number = match generation {
            None => r
                .current
                .filter(|n| r.generations.contains_key(n))
                .ok_or_else(none)?,
            Some(n) if r.generations.contains_key(&n) => n,
            Some(n) => {
                return Err(Refusal::NoSuchGeneration {
                    region: region.to_owned(),
                    generation: n,
                });
            }
        };
        // A wake after a discard sleep: the memory is made again, zeroed.
        self.remake_if_discarded(&mut state, region, number)?;
        // Fabric handles of a generation taken back from the keeper: copied into chunks
        // they can be exported from.
        if as_fabric {
            self.refabric_if_kept(&mut state, region, number)?;
        }
        let g = state
            .regions
            .get_mut(region)
            .and_then(|r| r.generations.get_mut(&number))
            .expect("found above");
        let fabric_handles = match as_fabric {
            false => None,
            true => Some(fabric_handles(g).ok_or_else(|| Refusal::FabricUnavailable {
                region: region.to_owned(),
                generation: number,
            })?),
        };
        let chunks = g.chunk_fds().into_iter().zip(g.sizes()).collect();
        g.leases.insert(
            lease,
            Lease {
                conn,
                pid: who.pid,
                expires,
            },
        );
        event!(
            DEBUG,
            "memd.attach",
            region,
            generation = g.number,
            lease,
            uid = who.uid,
            pid = who.pid,
            conn,
            bytes = g.bytes(),
            fabric = as_fabric
        );
        Ok(Grant {
            lease,
            generation: g.number,
            chunks,
            meta: g.meta_replies(),
            backend,
            fabric,
            fabric_handles,
        })
    }

    /// Delete `region`: its name goes now; its generations go as their leases end.
    #[cfg_attr(not(feature = "tracing"), allow(unused_variables))]
    pub(crate) fn delete(&self, who: &Identity, region: &str) -> Result<(), Refusal> {
        let mut state = self.lock();
        let r = state
            .regions
            .get(region)
            .ok_or_else(|| Refusal::NoSuchRegion {
                region: region.to_owned(),
            })?;
        if !r.operable(who, Right::Delete) {
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
        let generations = remove_region(&mut state, region);
        event!(
            INFO,
            "memd.delete",
            region,
            uid = who.uid,
            pid = who.pid,
            admin = who.admin,
            generations
        );
        prune(&mut state, self.policy.retain);
        self.changed.notify_all();
        Ok(())
    }
}

/// `uid`'s quota: an admin's, else the policy's.
fn quota_of(state: &State, policy: &Policy, uid: u32) -> u64 {
    state
        .quotas
        .get(&uid)
        .copied()
        .unwrap_or_else(|| policy.quota(uid))
}

/// Remove `region` (which is there) from the names: its generations go as their leases end,
/// and the keeper lets them go now. How many generations it held.
fn remove_region(state: &mut State, region: &str) -> usize {
    let mut r = state
        .regions
        .remove(region)
        .expect("a region that is there");
    r.current = None;
    if let Some(keeper) = state.keeper.as_mut() {
        for &number in r.generations.keys() {
            keeper.forget(region, number);
        }
    }
    let generations = r.generations.len();
    state.deleted.push(r);
    generations
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
            if let Some(g) = r.generations.remove(&n) {
                event!(
                    DEBUG,
                    "memd.freed",
                    region = name.map_or("(deleted)", String::as_str),
                    generation = n,
                    bytes = g.bytes(),
                    uid = g.charged_to
                );
                freed.push(g);
            }
        }
    }
    for generation in &freed {
        refund(state, generation);
    }
    state.deleted.retain(|r| !r.generations.is_empty());
    discard::free_discarded(state);
}

/// Every chunk of `g` exported as fabric handles, if every chunk has the service's own
/// fabric-shareable allocation.
fn fabric_handles(g: &Generation) -> Option<Vec<FabricDescriptor>> {
    g.chunks
        .iter()
        .map(|c| c.origin.as_ref().and_then(|b| b.export_fabric().ok()))
        .collect()
}

/// The refusal of a request for another backend than `region`'s, `found`.
fn backend_refusal(region: &str, found: Backend) -> Refusal {
    Refusal::InvalidRequest {
        rule: RequestRule::Backend,
        detail: format!("region {region:?} lives on {found:?}"),
    }
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
            event!(
                INFO,
                "memd.freed",
                region = name.as_str(),
                generation = number,
                bytes = g.bytes(),
                uid,
                outcome = "evicted for the quota"
            );
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
