//! The one thread that owns the registry's tokio runtime. Blocking callers hand it a future
//! and wait for the answer with their own deadline (a second guard beyond the future's own
//! timeout), so no call can hang on a runtime that stopped answering.

use std::future::Future;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::error::{Op, RegistryError};

/// How much longer than a future's own deadline a blocking caller waits for the thread.
const GRACE: Duration = Duration::from_secs(1);

/// The runtime thread; dropping it stops the runtime (every task on it ends) and joins it.
#[derive(Debug)]
pub(crate) struct Background {
    handle: Handle,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Background {
    /// Start the thread and its current-thread runtime.
    pub(crate) fn start() -> Result<Background, RegistryError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(RegistryError::Runtime)?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("vmm-registry".into())
            .spawn(move || {
                // Runs every task spawned on the handle until the registry is dropped.
                let _ = runtime.block_on(stopped);
                runtime.shutdown_timeout(Duration::from_millis(100));
            })
            .map_err(RegistryError::Runtime)?;
        Ok(Background {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The runtime's handle, to spawn long-lived tasks (keep-alive, watches) on it.
    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Run `future` (which bounds itself by `deadline`) on the runtime and wait for its
    /// answer, at most `deadline` plus a grace.
    pub(crate) fn run<F, T>(
        &self,
        op: Op,
        deadline: Duration,
        future: F,
    ) -> Result<T, RegistryError>
    where
        F: Future<Output = Result<T, RegistryError>> + Send + 'static,
        T: Send + 'static,
    {
        let (tx, rx) = mpsc::sync_channel(1);
        self.handle.spawn(async move {
            let _ = tx.send(future.await);
        });
        match rx.recv_timeout(deadline + GRACE) {
            Ok(answer) => answer,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(RegistryError::Deadline {
                op,
                after: deadline,
            }),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(RegistryError::Closed),
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
