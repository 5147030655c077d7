//! The registry's side of the keeper: taking back what a keeper held at start (checked
//! chunk by chunk, and the settings an admin changed), replacing a lost keeper, leaving it
//! everything at a stop, and telling it of each committed generation and each change of the
//! settings.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd};

use super::{Region, Registry, State, prune};
use crate::keeper::{GenerationRecord, KeeperLink, Restored, Settings};
use crate::memfd;
use crate::protocol::{Backend, check_region_name};
use crate::service::generation::{Chunk, Generation};
use crate::trace::event;

impl Registry {
    /// Take `keeper` on, with what it held when this service started: those generations are
    /// this registry's again (their regions, owners, ACLs and charges as committed; the
    /// newest of each region current), and every later commit and free is told to it. A
    /// restored chunk must still be a write-sealed memfd of its recorded size, else that
    /// generation is let go (logged). A GPU generation kept before its background hash
    /// finished comes without digests: its first `Verify` takes them. `settings` (quotas an
    /// admin set) apply again.
    pub(crate) fn adopt_keeper(
        &self,
        mut keeper: KeeperLink,
        restored: Vec<Restored>,
        settings: Option<Settings>,
    ) -> usize {
        let mut state = self.lock();
        if let Some(settings) = settings {
            state.quotas = settings.quotas.into_iter().collect();
        }
        let mut adopted = 0;
        for Restored { record, chunks } in restored {
            let sound = chunks
                .iter()
                .zip(&record.chunks)
                .all(|(fd, &len)| sound_chunk(record.backend, fd.as_fd(), len))
                && (record.backend == Backend::Host
                    || record.digests.is_empty()
                    || record.digests.len() == chunks.len());
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
                    backend: record.backend,
                    fabric: record.fabric,
                    current: None,
                    generations: BTreeMap::new(),
                    pending: None,
                    waiting: VecDeque::new(),
                    landed: VecDeque::new(),
                });
            let generation = Generation {
                number: record.generation,
                chunks: chunks
                    .into_iter()
                    .zip(&record.chunks)
                    .map(|(fd, &len)| Chunk {
                        fd: fd.into(),
                        len,
                        origin: None,
                    })
                    .collect(),
                meta: record.meta,
                meta_replies: None,
                token: record.token,
                charged_to: record.charged_to,
                leases: HashMap::new(),
                digests: record.digests,
                discard_wanted: false,
                discarded: record.discarded.then(|| record.chunks.clone()),
            };
            let bytes = generation.bytes();
            if let Some(token) = generation.token {
                super::tokens::landed(r, token, record.generation);
            }
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
        event!(WARN, "memd.keeper.lost");
        if let Err(e) = keeper.restart() {
            eprintln!("vmm-memd: cannot start a keeper: {e}");
            event!(ERROR, "memd.keeper.restart", outcome = "failed", error = %e);
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
        keep_settings(&mut state);
        eprintln!("vmm-memd: a new keeper holds {} generations", held.len());
        event!(
            INFO,
            "memd.keeper.restart",
            outcome = "restarted",
            generations = held.len()
        );
        true
    }

    /// The service stops: its keeper keeps every committed generation for the next one.
    pub(crate) fn leave_keeper(&self) {
        if let Some(keeper) = self.lock().keeper.take() {
            keeper.leave();
        }
    }
}

/// Whether a chunk fd taken back from the keeper is what its record says: a write-sealed
/// memfd of `len` bytes (host), or an fd that is no memfd at all (GPU: its size and device
/// can only be checked by the driver, which a client's import does).
fn sound_chunk(backend: Backend, fd: BorrowedFd<'_>, len: u64) -> bool {
    match backend {
        Backend::Host => {
            let sealed = memfd::seals(fd).is_ok_and(|s| s & libc::F_SEAL_WRITE != 0);
            let file = fd.try_clone_to_owned().map(std::fs::File::from);
            sealed
                && file
                    .and_then(|f| f.metadata())
                    .is_ok_and(|m| m.len() == len)
        }
        Backend::Gpu { .. } => memfd::seals(fd).is_err() && len > 0,
    }
}

/// Have the keeper hold `region`'s committed generation `number`.
pub(super) fn keep(state: &mut State, region: &str, number: u64) {
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
        backend: r.backend,
        fabric: r.fabric,
        digests: g.digests.clone(),
        discarded: g.discarded.is_some(),
        token: g.token,
    };
    let fds: Vec<_> = g.chunks.iter().map(|c| c.fd.as_fd()).collect();
    // A failure marks the keeper lost; the service's keeper thread replaces it and sends
    // it everything.
    let _ = keeper.keep(&record, &fds);
}

/// Have the keeper hold the settings an admin changed (none: nothing is sent).
pub(super) fn keep_settings(state: &mut State) {
    let settings = Settings {
        quotas: state
            .quotas
            .iter()
            .map(|(&uid, &bytes)| (uid, bytes))
            .collect(),
    };
    if let Some(keeper) = state.keeper.as_mut() {
        // As for a generation: a failure marks the keeper lost, and its replacement is sent
        // everything.
        let _ = keeper.keep_settings(&settings);
    }
}
