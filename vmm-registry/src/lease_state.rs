//! The process's lease as the keep-alive task and every caller share it: which lease is
//! held, whether it is lost, the lease events not yet taken, and the record of what this
//! process published (which the keep-alive, `lease.rs`, publishes again after a loss, and
//! every publish, update and unpublish, `core.rs`, keeps under the same lock).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::Duration;

use crate::error::{LeaseLoss, RegistryError};
use crate::locator::Locator;

/// The most lease events kept for a caller who does not read them (the oldest go first).
pub const MAX_LEASE_EVENTS: usize = 1024;

/// What happened to the process's lease, in the order it happened
/// ([`Registry::next_lease_event`](crate::Registry::next_lease_event)).
#[derive(Debug)]
pub enum LeaseEvent {
    /// etcd answered that lease `lease` is gone: the locators published under it
    /// (`unpublished`) went with it. A new lease is being granted; until then
    /// [`publish`](crate::Registry::publish) and [`update`](crate::Registry::update) are
    /// [`RegistryError::LeaseLost`].
    Lost {
        /// The lease that is gone.
        lease: i64,
        /// How etcd said so.
        reason: LeaseLoss,
        /// The names this process had published under it.
        unpublished: Vec<String>,
    },
    /// A new lease, `lease`, replaces the lost one: every publish is on it from now on, and
    /// the lost locators are being published again under it.
    Granted {
        /// The new lease.
        lease: i64,
    },
    /// Locator `name` was published again under `lease`, with its last value.
    Republished {
        /// Its name.
        name: String,
        /// The lease it is on now.
        lease: i64,
        /// The value published (the last one this process published or updated).
        locator: Locator,
        /// The revision that wrote it.
        revision: i64,
    },
    /// Locator `name` could not be published again, and this process no longer publishes it:
    /// its name was taken meanwhile ([`RegistryError::Duplicate`]: another process of the
    /// same owner published it) or etcd's RBAC denies it now
    /// ([`RegistryError::PermissionDenied`]). Any other failure is retried instead.
    NotRepublished {
        /// Its name.
        name: String,
        /// Why.
        error: RegistryError,
    },
}

/// A locator this process published: its last value, and the lease it is on now (`None`
/// after that lease was lost, until it is published again).
#[derive(Debug)]
pub(crate) struct Record {
    pub(crate) locator: Locator,
    pub(crate) lease: Option<i64>,
}

/// What this process published, by name (under [`LeaseState::records`]' lock).
pub(crate) type Records = BTreeMap<String, Record>;

/// Whether the lease is held, which one, and what happened to it: shared by the keep-alive
/// task and every caller.
#[derive(Debug)]
pub(crate) struct LeaseState {
    /// The lease held now (or, between a loss and the next grant, the one lost).
    id: AtomicI64,
    status: Mutex<Status>,
    changed: Condvar,
    closing: AtomicBool,
    /// What this process published. Every publish, update and unpublish holds it across its
    /// transaction, as do the loss and the republish, so the record is what etcd holds.
    pub(crate) records: tokio::sync::Mutex<Records>,
}

#[derive(Debug, Default)]
struct Status {
    /// Set from a loss until the next grant.
    lost: Option<LeaseLoss>,
    events: VecDeque<LeaseEvent>,
}

impl LeaseState {
    pub(crate) fn new(id: i64) -> LeaseState {
        LeaseState {
            id: AtomicI64::new(id),
            status: Mutex::default(),
            changed: Condvar::new(),
            closing: AtomicBool::new(false),
            records: tokio::sync::Mutex::new(Records::new()),
        }
    }

    fn status(&self) -> std::sync::MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lease held now (between a loss and the next grant: the one lost).
    pub(crate) fn id(&self) -> i64 {
        self.id.load(Ordering::SeqCst)
    }

    /// Why no lease is held now: `Some` from a loss until the next grant.
    pub(crate) fn lost(&self) -> Option<LeaseLoss> {
        self.status().lost
    }

    /// `Err(LeaseLost)` while no lease is held.
    pub(crate) fn check(&self) -> Result<(), RegistryError> {
        match self.lost() {
            Some(reason) => Err(RegistryError::LeaseLost { reason }),
            None => Ok(()),
        }
    }

    pub(crate) fn push(&self, event: LeaseEvent) {
        let mut status = self.status();
        if status.events.len() == MAX_LEASE_EVENTS {
            status.events.pop_front();
        }
        status.events.push_back(event);
        self.changed.notify_all();
    }

    /// The next lease event, waiting up to `timeout` for one.
    pub(crate) fn next_event(&self, timeout: Duration) -> Option<LeaseEvent> {
        let status = self.status();
        let (mut status, _) = self
            .changed
            .wait_timeout_while(status, timeout, |status| status.events.is_empty())
            .unwrap_or_else(PoisonError::into_inner);
        status.events.pop_front()
    }

    /// Every lease event not yet taken, oldest first.
    pub(crate) fn events(&self) -> Vec<LeaseEvent> {
        self.status().events.drain(..).collect()
    }

    /// The registry is shutting down: the keep-alive stops without calling that a loss.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
    }

    pub(crate) fn closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// etcd said lease `id` is gone: publishing stops until a new one is granted, every
    /// record waits to be published again, and the loss is reported.
    pub(crate) async fn lose(&self, id: i64, reason: LeaseLoss) {
        let mut records = self.records.lock().await;
        self.status().lost = Some(reason);
        for record in records.values_mut() {
            record.lease = None;
        }
        let unpublished = records.keys().cloned().collect();
        self.push(LeaseEvent::Lost {
            lease: id,
            reason,
            unpublished,
        });
    }

    /// Lease `id` replaces the lost one.
    pub(crate) async fn granted(&self, id: i64) {
        let _records = self.records.lock().await;
        self.id.store(id, Ordering::SeqCst);
        self.status().lost = None;
        self.push(LeaseEvent::Granted { lease: id });
    }
}
