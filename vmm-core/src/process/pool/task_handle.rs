//! [`TaskHandle`]: a submitted task, as its submitter holds it.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;

use super::super::timeout::default_timeout;
use super::Shared;
use crate::Result;
use crate::{trace, wire};

/// A submitted task: [`join`](Self::join) it for its result. Dropping it unjoined cancels the
/// task (see [`Pool::submit`](super::Pool::submit)).
#[must_use = "dropping a TaskHandle cancels its task"]
pub struct TaskHandle<R> {
    id: u64,
    shared: Arc<Shared>,
    joined: bool,
    _result: PhantomData<fn() -> R>,
}

impl<R> fmt::Debug for TaskHandle<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TaskHandle")
            .field("id", &self.id)
            .field("method", &self.shared.method)
            .finish()
    }
}

impl<R> TaskHandle<R> {
    pub(super) fn new(id: u64, shared: Arc<Shared>) -> TaskHandle<R> {
        TaskHandle {
            id,
            shared,
            joined: false,
            _result: PhantomData,
        }
    }
}

impl<R: DeserializeOwned> TaskHandle<R> {
    /// Wait for the task's result, at most `timeout`.
    ///
    /// `Ok` carries what the function returned (its fds, for fd-backed values, arrived with
    /// it); what the task printed is replayed into this process's stdout and stderr (test
    /// capture sees it). Errors: [`Error::Child`](crate::Error::Child) when the task panicked (the message, its
    /// location, the task's output and the worker's exit status), when its worker died
    /// (the status) or was killed at the timeout ([`ChildError::timed_out`](crate::process::ChildError::timed_out)), or when its
    /// argument could not be received ([`ChildError::not_run`](crate::process::ChildError::not_run)); [`Error::Timeout`](crate::Error::Timeout) when it was
    /// still waiting for a worker at the deadline (it is then cancelled); the result's own
    /// error when it could not be sent back or received; [`Error::Disconnected`](crate::Error::Disconnected) when the pool
    /// was dropped first. It returns by `timeout` plus the time a kill takes; `Duration::MAX`
    /// waits forever.
    pub fn join(mut self, timeout: Duration) -> Result<R> {
        let _span = trace::span!(
            INFO,
            "pool.join",
            method = self.shared.method.name(),
            task = self.id
        );
        self.joined = true;
        let finished = self.shared.wait_for(self.id, timeout)?;
        let (bytes, fds) = finished.result?;
        print!("{}", finished.stdout);
        eprint!("{}", finished.stderr);
        wire::decode(&bytes, fds)
    }

    /// [`join`](Self::join) with the [default timeout](super::default_timeout).
    pub fn wait(self) -> Result<R> {
        self.join(default_timeout())
    }
}

impl<R> Drop for TaskHandle<R> {
    fn drop(&mut self) {
        if self.joined {
            return;
        }
        let mut inner = self.shared.lock();
        // A running task's worker is killed with it (and reaped in the background: the lock is
        // never held while a child dies), and replaced.
        if let Some(worker) = inner.cancel(self.id) {
            drop(worker);
            self.shared.replace_dead(&mut inner);
        }
        self.shared.wake_driver(&inner);
        drop(inner);
    }
}
