//! [`Pool`]: reusable worker processes that run tasks, for programs (like
//! `multiprocessing.Pool`).
//!
//! Every worker is a child started with the pool's method that warmed up (CUDA initialised for
//! the warm pool's devices, where there is a GPU) and then serves tasks one after another. A
//! task is a plain `fn(A) -> R` and an argument: the argument travels as a `Context::spawn`
//! argument does (fds out of band), is received in the worker for that task alone and moved into
//! the function, so the buffers and descriptors it carries are imported for the task and
//! released when the function returns; the result comes back the same way.
//!
//! No background thread: whoever waits (a [`TaskHandle::join`], [`Pool::new`]) reads the
//! workers' reports, one waiter at a time, and hands each result to its task; the others sleep
//! until their result is in or their deadline passes. A worker that dies or panics fails only
//! the task it was running, with an [`Error::Child`] that says what happened, and is replaced.
//! A worker that dies before it took its task off its task socket (killed while idle: such a
//! death can go unseen for as long as the process's teardown takes) never ran it, and the task
//! goes to the replacement instead. The pool knows which case it is from the kernel, not from
//! anything the worker wrote: it keeps a reference to the worker's end of the task socket, so a
//! task the worker never received is still queued there after the worker is gone. A worker (or
//! a task running in it) can consume messages but never put one back, so whatever a task does
//! to its own process, a task that may have run is never sent again.

// Who owns what: `PoolState` (pool_state) is the one owner of everything that changes behind
// the pool's lock, with private fields; `Worker` (worker) owns a worker's state the same way.
// The other files work through their methods: `Pool` (here) submits and closes, the waiters'
// event loop (events) reads, replaces and dispatches, report reads one worker's reports,
// `TaskHandle` (task_handle) joins or cancels; a `TaskMessage` (task_message) is a task on its
// way to a worker. Imports point down: events, report -> pool_state -> worker -> task_message.
mod events;
mod pool_state;
mod report;
mod task_handle;
mod task_message;
mod worker;

use std::borrow::Borrow;
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::ends::Sealed;
use super::hook::{self, ChildKind};
use super::protocol::Call;
use super::timeout::default_timeout;
use super::warm::{WarmOptions, WarmPool};
use super::{remote, sys};
use crate::error::OptionRule;
use crate::error::StartMethod;
use crate::{Error, Result};
use crate::{trace, wire};

use pool_state::PoolState;
pub use task_handle::TaskHandle;
use worker::Worker;

/// Reusable worker processes that run tasks: `fn(A) -> R` with a serde argument and result.
///
/// ```no_run
/// use std::time::Duration;
/// use vmm_core::process::{Pool, StartMethod};
/// use vmm_core::shm::HostBuffer;
///
/// fn checksum(buf: HostBuffer) -> u64 {
///     buf.to_vec().iter().map(|&b| u64::from(b)).sum()
/// }
///
/// fn main() -> vmm_core::Result<()> {
///     vmm_core::process::init(); // first line of main in a binary that starts children
///     let pool = Pool::new(StartMethod::Warm, 2)?; // two workers, warmed up
///     let buf = HostBuffer::new(4096)?;
///     buf.fill(1)?;
///     // By reference: the argument is serialised at once (a buffer exported on the way).
///     let tasks = [pool.submit(checksum, &buf)?, pool.submit(checksum, &buf)?];
///     for task in tasks {
///         assert_eq!(task.join(Duration::from_secs(10))?, 4096);
///     }
///     Ok(())
/// }
/// ```
///
/// - [`Pool::new`] starts the workers and returns once each has warmed up (CUDA initialised
///   for the [warm pool's devices](WarmOptions::devices), where there is a GPU). Under
///   `StartMethod::Warm` the workers come from the warm pool; under spawn and forkserver they
///   are started the way those methods start a child.
/// - [`submit`](Self::submit) queues a task; a free worker takes it at once. The argument's
///   buffers and descriptors are imported in the worker for that task and released when it
///   ends: no fd or mapping of a task outlives it there.
/// - [`TaskHandle::join`] gives the result, or the error: a task that panics, or whose worker
///   dies while running it, fails with [`Error::Child`] (the panic, the exit status, the task's
///   output); its worker is replaced and the other tasks go on. A task whose worker died before
///   taking it runs on the replacement (at most three workers are tried); a task never runs
///   twice. A task that is still waiting for a worker at
///   the deadline is [`Error::Timeout`]; a running one is killed with its worker
///   ([`ChildError::timed_out`](super::ChildError::timed_out)).
/// - Dropping the pool kills and reaps every worker (tasks that had not finished fail with
///   [`Error::Disconnected`]).
///
/// The parent holds one fd for the pool and six per worker (channel, pidfd, stdout, stderr,
/// and both ends of its task socket); they stay the same across tasks and replacements.
pub struct Pool {
    shared: Arc<Shared>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("method", &self.shared.method)
            .field("workers", &self.shared.workers)
            .field("pids", &self.pids())
            .finish()
    }
}

pub(super) struct Shared {
    method: StartMethod,
    workers: usize,
    devices: Vec<usize>,
    /// A worker's argv after `argv[0]` (see `hook::child_args`).
    child_args: Vec<String>,
    /// Wakes the waiter that reads the workers (a submit, a worker replaced, the pool dropped).
    wake: OwnedFd,
    inner: Mutex<PoolState>,
    /// Notified when a task finishes or the reading waiter steps down.
    changed: Condvar,
}
impl Pool {
    /// Start `workers` workers with `method` and wait until each has warmed up (at most the
    /// [default timeout](super::default_timeout)). Zero workers is
    /// [`Error::InvalidOption`] (`workers`); a worker that cannot be started, or dies starting, is the
    /// error it gave ([`Error::Child`] with its story, for one that died).
    pub fn new(method: StartMethod, workers: usize) -> Result<Pool> {
        Self::with_options(method, workers, &WarmPool::global().options())
    }

    /// [`Pool::new`] whose workers warm up as `options` say (its [devices](WarmOptions::devices)
    /// are initialised before a worker serves; its depth is the warm pool's business), rather
    /// than as the [process-wide warm pool's](WarmPool::global).
    pub fn with_options(
        method: StartMethod,
        workers: usize,
        options: &WarmOptions,
    ) -> Result<Pool> {
        if workers == 0 {
            return Err(Error::option(
                "workers",
                OptionRule::Missing,
                "a Pool needs at least one worker",
            ));
        }
        let pool = Pool {
            shared: Arc::new(Shared {
                method,
                workers,
                devices: options.devices().to_vec(),
                child_args: hook::child_args(ChildKind::PoolWorker),
                wake: sys::eventfd()?,
                inner: Mutex::new(PoolState::new(workers)),
                changed: Condvar::new(),
            }),
        };
        let timeout = default_timeout();
        let deadline = Instant::now().checked_add(timeout);
        let mut inner = pool.shared.lock();
        for slot in inner.empty_slots() {
            let worker = pool.shared.start_worker()?;
            inner.install(slot, worker);
        }
        // Wait until every worker serves: read their reports as a join does.
        loop {
            pool.shared.drive(&mut inner);
            if let Some(error) = inner.take_start_error() {
                return Err(error);
            }
            if inner.all_serving() {
                break;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::Timeout {
                    what: format!("starting a Pool of {workers} {method} workers"),
                    after: timeout,
                });
            }
            inner = pool.shared.sleep_on_workers(inner, deadline);
        }
        drop(inner);
        Ok(pool)
    }

    /// Queue `f(args)` on a worker; a free worker takes it at once.
    ///
    /// `f` is a `fn` item or a closure that captures nothing, compiled into the main
    /// executable, as for [`Context::spawn`](super::Context::spawn): a worker runs only entry
    /// points the executable registered; code elsewhere is refused with
    /// [`Error::SpawnRefused`] before anything is queued. `args` is the argument or a
    /// reference to it (`&descriptor`: one export, sent to many tasks). It is serialised now
    /// (fds out of band: buffers are exported on the way, descriptors' fds duplicated), so the
    /// caller may drop or reuse what it passed. Dropping the returned handle without joining
    /// cancels the task: one still queued never runs, a running one is killed with its worker
    /// (which is replaced).
    pub fn submit<F, A, R>(&self, f: F, args: impl Borrow<A>) -> Result<TaskHandle<R>>
    where
        F: Fn(A) -> R + Copy,
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
    {
        // Entered here, so that the export of a buffer argument nests in it; `task` once queued.
        let span = trace::span!(
            INFO,
            "pool.submit",
            method = self.shared.method.name(),
            task = trace::Empty
        );
        let entry = remote::registered::<F, A, R>(f);
        let what = "the task's entry point for this function";
        // Checked before anything is encoded or queued (see `Call::new`).
        let call = Call::to(entry, what)?;
        // The message owns the argument's fds (see `wire::encode`), so the argument can go now.
        let (encoded, fds) = wire::encode(args.borrow())?.into_owned()?;
        drop(args);
        let task = call.with_args(encoded);
        let bytes = Sealed::new(&task)?;
        let mut inner = self.shared.lock();
        let Some(id) = inner.submit(bytes, fds) else {
            return Err(Error::Disconnected("Pool::submit: the pool".into()));
        };
        trace::record!(span, "task", id);
        self.shared.drive(&mut inner);
        self.shared.wake_driver(&inner);
        drop(inner);
        Ok(TaskHandle::new(id, Arc::clone(&self.shared)))
    }

    /// The start method of the workers.
    pub fn method(&self) -> StartMethod {
        self.shared.method
    }

    /// How many workers the pool keeps.
    pub fn workers(&self) -> usize {
        self.shared.workers
    }

    /// The pids of the workers alive now (a dead one's replacement appears once started).
    pub fn pids(&self) -> Vec<u32> {
        self.shared.lock().workers().map(Worker::pid).collect()
    }
}

/// Never waits: the workers are killed under the lock and reaped in the background.
impl Drop for Pool {
    fn drop(&mut self) {
        let mut inner = self.shared.lock();
        for worker in inner.close() {
            worker.kill();
            let task = worker.busy_with();
            let output = worker.child.output().take();
            // Reaped in the background.
            drop(worker);
            if let Some(id) = task {
                inner.finish(
                    id,
                    Err(Error::Disconnected(
                        "a Pool task: its Pool was dropped while it ran (its worker was \
                         killed)"
                            .into(),
                    )),
                    output,
                );
            }
        }
        inner.fail_queued(|| {
            Error::Disconnected("a Pool task: its Pool was dropped before a worker took it".into())
        });
        self.shared.wake_driver(&inner);
        drop(inner);
        self.shared.changed.notify_all();
    }
}
