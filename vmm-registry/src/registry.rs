//! The blocking registry: every call runs on the background thread and ends by its
//! deadline, whatever etcd does.

use std::sync::Arc;
use std::time::Duration;

use crate::background::Background;
use crate::config::RegistryConfig;
use crate::core::{Core, Listing, Published};
use crate::error::{LeaseLoss, Op, RegistryError};
use crate::lease_state::LeaseEvent;
use crate::locator::{Entry, Locator};
use crate::watch::Watch;

/// A process's connection to the registry: one lease, kept alive on a background thread
/// through any etcd outage, under which it publishes its locators (and publishes them again
/// under a new lease if etcd says the lease is gone: [`next_lease_event`](Self::next_lease_event)). Dropping it revokes the lease (as [`close`]
/// does, with the call deadline), so a clean exit unpublishes at once and a crash
/// unpublishes within the TTL.
///
/// [`close`]: Registry::close
#[derive(Debug)]
pub struct Registry {
    core: Arc<Core>,
    open_timeout: Duration,
    closed: bool,
    // Last: dropped after the revoke in `drop`.
    background: Background,
}

impl Registry {
    /// Connect to etcd over mutual TLS and grant this process's lease, within the config's
    /// open timeout. etcd down, or refusing the certificate, fails here.
    pub fn open(config: RegistryConfig) -> Result<Registry, RegistryError> {
        config.check()?;
        let background = Background::start()?;
        let open_timeout = config.open_timeout;
        let core = background.run(Op::Open, open_timeout, Core::open(config))?;
        let core = Arc::new(core);
        background
            .handle()
            .spawn(crate::lease::keep_alive(core.clone()));
        Ok(Registry {
            core,
            open_timeout,
            closed: false,
            background,
        })
    }

    fn run<T, F, Fut>(&self, op: Op, call: F) -> Result<T, RegistryError>
    where
        T: Send + 'static,
        F: FnOnce(Arc<Core>) -> Fut,
        Fut: std::future::Future<Output = Result<T, RegistryError>> + Send + 'static,
    {
        self.background
            .run(op, self.core.call_timeout, call(self.core.clone()))
    }

    /// Publish `locator` as `name` (create-only: [`RegistryError::Duplicate`] when taken),
    /// attached to this process's lease.
    pub fn publish(&self, name: &str, locator: &Locator) -> Result<Published, RegistryError> {
        let (name, locator) = (name.to_owned(), locator.clone());
        self.run(Op::Publish, move |core| async move {
            core.publish(&name, &locator).await
        })
    }

    /// Replace the value of this process's locator `name` (a new generation, say), under its
    /// lease; [`RegistryError::NotPublishedHere`] when this process did not publish `name`
    /// (absent, or another process's), which is left alone. A watcher sees a `Put` with the
    /// new value.
    pub fn update(&self, name: &str, locator: &Locator) -> Result<Published, RegistryError> {
        let (name, locator) = (name.to_owned(), locator.clone());
        self.run(Op::Update, move |core| async move {
            core.update(&name, &locator).await
        })
    }

    /// Remove this process's locator `name`; `false` when there was none.
    pub fn unpublish(&self, name: &str) -> Result<bool, RegistryError> {
        let name = name.to_owned();
        self.run(Op::Unpublish, move |core| async move {
            core.unpublish(&name).await
        })
    }

    /// The locator `owner` published as `name`, checked against its key.
    pub fn resolve(&self, owner: &str, name: &str) -> Result<Option<Entry>, RegistryError> {
        let (owner, name) = (owner.to_owned(), name.to_owned());
        self.run(Op::Resolve, move |core| async move {
            core.resolve(&owner, &name).await
        })
    }

    /// Every locator of the domain, and the values refused.
    pub fn list(&self) -> Result<Listing, RegistryError> {
        self.run(Op::List, move |core| async move { core.list().await })
    }

    /// Watch the domain: its listing now, then every change.
    pub fn watch(&self) -> Result<Watch, RegistryError> {
        self.watch_inner(None)
    }

    /// Watch the domain's changes from `revision` on (one a caller saw before, such as the
    /// last it handled + 1); if etcd has compacted it, the first event is
    /// [`WatchEvent::Relisted`](crate::WatchEvent::Relisted) with the domain as it is now.
    pub fn watch_from(&self, revision: i64) -> Result<Watch, RegistryError> {
        self.watch_inner(Some(revision))
    }

    fn watch_inner(&self, from: Option<i64>) -> Result<Watch, RegistryError> {
        let client = self.core.client.clone();
        let domain = self.core.domain.clone();
        let handle = self.background.handle().clone();
        let deadline = self.core.call_timeout;
        self.background.run(
            Op::Watch,
            deadline,
            crate::watch::start_blocking(client, domain, deadline, handle, from),
        )
    }

    /// Why no lease is held now: `Some` from the moment etcd said the lease is gone until a
    /// new one is granted (then the locators it held are being published again). An etcd
    /// that does not answer is not a loss: the lease is kept alive through any outage.
    pub fn lease_lost(&self) -> Option<LeaseLoss> {
        self.core.lease.lost()
    }

    /// The next thing that happened to the lease (a loss etcd reported, the new lease, each
    /// locator published again), waiting up to `timeout`; `None` if nothing did. Events are
    /// kept, oldest first, until taken (at most [`MAX_LEASE_EVENTS`](crate::MAX_LEASE_EVENTS)).
    pub fn next_lease_event(&self, timeout: Duration) -> Option<LeaseEvent> {
        self.core.lease.next_event(timeout)
    }

    /// Every lease event not yet taken, oldest first, without waiting.
    pub fn lease_events(&self) -> Vec<LeaseEvent> {
        self.core.lease.events()
    }

    /// The lease held now (etcd's id): the one granted at open, until etcd says it is gone;
    /// then the one granted in its place ([`LeaseEvent::Granted`]).
    pub fn lease_id(&self) -> i64 {
        self.core.lease.id()
    }

    /// The open timeout this registry was opened with.
    pub fn open_timeout(&self) -> Duration {
        self.open_timeout
    }

    /// Revoke the lease (every locator of this process disappears at once) and stop.
    pub fn close(mut self) -> Result<(), RegistryError> {
        self.closed = true;
        self.run(Op::Revoke, move |core| async move { core.revoke().await })
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if !self.closed {
            // Best effort: a revoke that fails leaves the lease to expire within its TTL.
            let _ = self.run(Op::Revoke, move |core| async move { core.revoke().await });
        }
    }
}
