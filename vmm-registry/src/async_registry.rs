//! The registry's operations as `async fn`s (feature `async`), for callers that already run
//! tokio: the same checks and deadlines as [`Registry`](crate::Registry), on the caller's
//! runtime instead of a thread of the registry's own.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::config::RegistryConfig;
use crate::core::{Core, Listing, Published};
use crate::error::{LeaseLoss, RegistryError};
use crate::lease_state::LeaseEvent;
use crate::locator::{Entry, Locator};
use crate::watch::{Sink, WatchEvent};

/// [`Registry`](crate::Registry) for async callers. Its keep-alive runs as a task on the
/// runtime that opened it. Close it with [`close`](Self::close): dropping it stops the
/// keep-alive without revoking (a drop cannot wait), so its locators last until the TTL ends.
#[derive(Debug)]
pub struct AsyncRegistry {
    core: Arc<Core>,
    keep_alive: JoinHandle<()>,
}

impl AsyncRegistry {
    /// As [`Registry::open`](crate::Registry::open), on the current tokio runtime.
    pub async fn open(config: RegistryConfig) -> Result<AsyncRegistry, RegistryError> {
        let core = Arc::new(Core::open(config).await?);
        let keep_alive = tokio::spawn(crate::lease::keep_alive(core.clone()));
        Ok(AsyncRegistry { core, keep_alive })
    }

    /// As [`Registry::publish`](crate::Registry::publish).
    pub async fn publish(&self, name: &str, locator: &Locator) -> Result<Published, RegistryError> {
        self.core.publish(name, locator).await
    }

    /// As [`Registry::update`](crate::Registry::update).
    pub async fn update(&self, name: &str, locator: &Locator) -> Result<Published, RegistryError> {
        self.core.update(name, locator).await
    }

    /// As [`Registry::unpublish`](crate::Registry::unpublish).
    pub async fn unpublish(&self, name: &str) -> Result<bool, RegistryError> {
        self.core.unpublish(name).await
    }

    /// As [`Registry::resolve`](crate::Registry::resolve).
    pub async fn resolve(&self, owner: &str, name: &str) -> Result<Option<Entry>, RegistryError> {
        self.core.resolve(owner, name).await
    }

    /// As [`Registry::list`](crate::Registry::list).
    pub async fn list(&self) -> Result<Listing, RegistryError> {
        self.core.list().await
    }

    /// As [`Registry::watch`](crate::Registry::watch).
    pub async fn watch(&self) -> Result<AsyncWatch, RegistryError> {
        self.watch_inner(None).await
    }

    /// As [`Registry::watch_from`](crate::Registry::watch_from).
    pub async fn watch_from(&self, revision: i64) -> Result<AsyncWatch, RegistryError> {
        self.watch_inner(Some(revision)).await
    }

    async fn watch_inner(&self, from: Option<i64>) -> Result<AsyncWatch, RegistryError> {
        let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
        let (initial, stop) = crate::watch::start(
            self.core.client.clone(),
            self.core.domain.clone(),
            self.core.call_timeout,
            tokio::runtime::Handle::current(),
            from,
            Sink::Async(events),
        )
        .await?;
        Ok(AsyncWatch {
            initial,
            events: receiver,
            _stop: stop,
        })
    }

    /// As [`Registry::lease_lost`](crate::Registry::lease_lost).
    pub fn lease_lost(&self) -> Option<LeaseLoss> {
        self.core.lease.lost()
    }

    /// As [`Registry::lease_events`](crate::Registry::lease_events): every lease event not
    /// yet taken, oldest first, without waiting.
    pub fn lease_events(&self) -> Vec<LeaseEvent> {
        self.core.lease.events()
    }

    /// As [`Registry::lease_id`](crate::Registry::lease_id).
    pub fn lease_id(&self) -> i64 {
        self.core.lease.id()
    }

    /// Revoke the lease (every locator of this process disappears at once) and stop.
    pub async fn close(self) -> Result<(), RegistryError> {
        let revoked = self.core.revoke().await;
        self.keep_alive.abort();
        revoked
    }
}

impl Drop for AsyncRegistry {
    fn drop(&mut self) {
        self.keep_alive.abort();
    }
}

/// [`Watch`](crate::Watch) for async callers. Dropping it stops the watch.
#[derive(Debug)]
pub struct AsyncWatch {
    initial: Listing,
    events: tokio::sync::mpsc::UnboundedReceiver<WatchEvent>,
    _stop: oneshot::Sender<()>,
}

impl AsyncWatch {
    /// The listing the watch started from.
    pub fn initial(&self) -> &Listing {
        &self.initial
    }

    /// The next change, waiting up to `timeout`; `Ok(None)` if none came by then,
    /// [`RegistryError::Closed`] once the watch task is gone.
    pub async fn next_timeout(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<WatchEvent>, RegistryError> {
        match tokio::time::timeout(timeout, self.events.recv()).await {
            Ok(Some(event)) => Ok(Some(event)),
            Ok(None) => Err(RegistryError::Closed),
            Err(_) => Ok(None),
        }
    }
}
