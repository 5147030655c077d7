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

use std::borrow::Borrow;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::sys::socket::MsgFlags;
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::StartMethod;
use super::context;
use super::handle::STATUS_REPORT_GRACE;
use super::launch::current_test_name;
use super::protocol::{Begin, Payload, Report, Serve, Task, TaskOutcome};
use super::status::{ChildError, ExitStatus, Observed, Outcome};
use super::timeout::default_timeout;
use super::{sys, warm, worker};
use crate::wire::{self, Channel};
use crate::{Error, Result};

/// The test name a spawned worker gets in its argv in a test binary (see the warm pool's).
const PLACEHOLDER_TEST: &str = "vmm-ipc-pool-worker";

/// How many workers in a row may die while starting before the pool stops replacing them and
/// fails the tasks that wait.
const START_FAILURES_MAX: usize = 3;

/// How many workers a task is sent to at most: one that dies before taking the task off its
/// channel (killed while idle, say) leaves it to the next, up to this many times.
const DELIVERIES_MAX: u32 = 3;

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
///   for the [warm pool's devices](super::WarmOptions), where there is a GPU). Under
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
///   ([`ChildError::timed_out`]).
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

struct Shared {
    method: StartMethod,
    workers: usize,
    devices: Vec<usize>,
    test_binary: bool,
    /// Wakes the waiter that reads the workers (a submit, a worker replaced, the pool dropped).
    wake: OwnedFd,
    inner: Mutex<Inner>,
    /// Notified when a task finishes or the reading waiter steps down.
    changed: Condvar,
}

#[derive(Default)]
struct Inner {
    /// One per worker position; `None` while a dead worker awaits its replacement.
    slots: Vec<Option<Worker>>,
    queue: VecDeque<Queued>,
    tasks: HashMap<u64, TaskState>,
    next_id: u64,
    /// A waiter is reading the workers (only one at a time sleeps in `poll` on them).
    driving: bool,
    closed: bool,
    /// Workers that died before serving, in a row.
    start_failures: usize,
    /// Why the last worker could not be started or died starting.
    start_error: Option<Error>,
    /// Tasks finished so far (a waiter that reads the workers wakes the others when it grows).
    finished: u64,
}

enum TaskState {
    Queued,
    Running {
        slot: usize,
        timed_out: Option<Duration>,
    },
    Done(Finished),
}

struct Queued {
    id: u64,
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// How many workers it was sent to that died before taking it.
    deliveries: u32,
}

/// A task's end: its result's bytes and fds, or the error; and what it printed.
struct Finished {
    result: Result<(Vec<u8>, Vec<OwnedFd>)>,
    stdout: String,
    stderr: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WorkerState {
    /// Sent its `Serve`, not yet `Serving`.
    Starting,
    Idle,
    Busy(u64),
}

struct Worker {
    pid: Pid,
    pidfd: Option<Arc<OwnedFd>>,
    channel: Arc<Channel>,
    stdout: OwnedFd,
    stderr: OwnedFd,
    state: WorkerState,
    tasks_done: u64,
    /// Our end of its task socket: tasks go here, nothing is read (shut for reading, so the
    /// worker cannot fill it).
    tasks: Channel,
    /// Its end of the task socket, which we keep so that a task it never received stays
    /// queued there, for us to see, after it is gone.
    unread: OwnedFd,
    /// The task it runs, kept (with its fds) until it reports: if it dies before taking it, the
    /// task goes to another worker.
    in_flight: Option<Queued>,
    /// Its exit status, if the forkserver already reported it.
    exited: Option<ExitStatus>,
}

impl Pool {
    /// Start `workers` workers with `method` and wait until each has warmed up (at most the
    /// [default timeout](super::default_timeout)). Zero workers is
    /// [`Error::InvalidArgument`]; a worker that cannot be started, or dies starting, is the
    /// error it gave ([`Error::Child`] with its story, for one that died).
    pub fn new(method: StartMethod, workers: usize) -> Result<Pool> {
        Self::with_devices(method, workers, warm::warm_options().devices())
    }

    /// [`Pool::new`] whose workers initialise these CUDA devices (ordinals) before serving,
    /// rather than the [warm pool's](super::WarmOptions::devices).
    pub fn with_devices(method: StartMethod, workers: usize, devices: &[usize]) -> Result<Pool> {
        if workers == 0 {
            return Err(Error::InvalidArgument(
                "a Pool needs at least one worker".to_owned(),
            ));
        }
        let pool = Pool {
            shared: Arc::new(Shared {
                method,
                workers,
                devices: devices.to_vec(),
                test_binary: current_test_name().is_some(),
                wake: sys::eventfd()?,
                inner: Mutex::new(Inner::default()),
                changed: Condvar::new(),
            }),
        };
        let timeout = default_timeout();
        let deadline = Instant::now().checked_add(timeout);
        let mut inner = pool.shared.lock();
        inner.slots = (0..workers).map(|_| None).collect();
        for slot in 0..workers {
            let worker = pool.shared.start_worker()?;
            inner.slots[slot] = Some(worker);
        }
        // Wait until every worker serves: read their reports as a join does.
        loop {
            pool.shared.drive(&mut inner);
            if let Some(error) = inner.start_error.take() {
                return Err(error);
            }
            let serving = inner
                .slots
                .iter()
                .all(|w| w.as_ref().is_some_and(|w| w.state != WorkerState::Starting));
            if serving {
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
    /// [`Error::InvalidArgument`] before anything is queued. `args` is the argument or a
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
        let entry = worker::registered::<F, A, R>(f);
        sys::check_main_text(
            sys::code_base as fn() -> usize as usize,
            "vmm-core's code (is vmm-core linked as a shared library?)",
        )?;
        sys::check_main_text(entry as usize, "the task's entry point for this function")?;
        // The message owns the argument's fds (see `wire::encode`), so the argument can go now.
        let (encoded, fds) = worker::encode_owned(args.borrow())?;
        drop(args);
        let task = Task {
            layout: sys::code_offset(sys::layout_probe as fn() -> usize as usize),
            entry: sys::code_offset(entry as usize),
            args: Payload(encoded),
        };
        let bytes = wire::encode(&task)?.bytes().to_vec();
        let mut inner = self.shared.lock();
        if inner.closed {
            return Err(Error::Disconnected("Pool::submit: the pool".into()));
        }
        let id = inner.next_id;
        inner.next_id += 1;
        inner.tasks.insert(id, TaskState::Queued);
        inner.queue.push_back(Queued {
            id,
            bytes,
            fds,
            deliveries: 0,
        });
        self.shared.drive(&mut inner);
        self.shared.wake_driver(&inner);
        drop(inner);
        Ok(TaskHandle {
            id,
            shared: Arc::clone(&self.shared),
            joined: false,
            _result: PhantomData,
        })
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
        self.shared
            .lock()
            .slots
            .iter()
            .flatten()
            .map(|w| w.pid.as_raw() as u32)
            .collect()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let mut inner = self.shared.lock();
        inner.closed = true;
        // Kill them all first, then reap: they die in parallel.
        for worker in inner.slots.iter().flatten() {
            let _ = signal_kill(worker, self.shared.method);
        }
        for slot in 0..inner.slots.len() {
            if let Some(worker) = inner.slots[slot].take() {
                let task = match worker.state {
                    WorkerState::Busy(id) => Some(id),
                    _ => None,
                };
                let ended = self.shared.end_worker(worker, false);
                if let Some(id) = task {
                    let (stdout, stderr) = ended.output;
                    inner.finish(
                        id,
                        Err(Error::Disconnected(
                            "a Pool task: its Pool was dropped while it ran (its worker was \
                             killed)"
                                .into(),
                        )),
                        (stdout, stderr),
                    );
                }
            }
        }
        let queued: Vec<u64> = inner.queue.drain(..).map(|q| q.id).collect();
        for id in queued {
            inner.finish(
                id,
                Err(Error::Disconnected(
                    "a Pool task: its Pool was dropped before a worker took it".into(),
                )),
                Default::default(),
            );
        }
        self.shared.wake_driver(&inner);
        drop(inner);
        self.shared.changed.notify_all();
    }
}

/// A submitted task: [`join`](Self::join) it for its result. Dropping it unjoined cancels the
/// task (see [`Pool::submit`]).
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

impl<R: DeserializeOwned> TaskHandle<R> {
    /// Wait for the task's result, at most `timeout`.
    ///
    /// `Ok` carries what the function returned (its fds, for fd-backed values, arrived with
    /// it); what the task printed is replayed into this process's stdout and stderr (test
    /// capture sees it). Errors: [`Error::Child`] when the task panicked (the message, its
    /// location, the task's output and the worker's exit status), when its worker died
    /// (the status) or was killed at the timeout ([`ChildError::timed_out`]), or when its
    /// argument could not be received ([`ChildError::not_run`]); [`Error::Timeout`] when it was
    /// still waiting for a worker at the deadline (it is then cancelled); the result's own
    /// error when it could not be sent back or received; [`Error::Disconnected`] when the pool
    /// was dropped first. It returns by `timeout` plus the time a kill takes; `Duration::MAX`
    /// waits forever.
    pub fn join(mut self, timeout: Duration) -> Result<R> {
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
        match inner.tasks.remove(&self.id) {
            Some(TaskState::Queued) => inner.queue.retain(|q| q.id != self.id),
            Some(TaskState::Running { slot, .. }) => {
                if let Some(worker) = inner.slots[slot].take() {
                    let _ = signal_kill(&worker, self.shared.method);
                    self.shared.end_worker(worker, false);
                }
                self.shared.replace_dead(&mut inner);
            }
            Some(TaskState::Done(_)) | None => {}
        }
        self.shared.wake_driver(&inner);
        drop(inner);
    }
}

/// What ending a worker found out.
struct Ended {
    status: Option<ExitStatus>,
    status_unknown: Option<String>,
    output: (String, String),
}

impl Inner {
    /// Record task `id`'s end (unless it was cancelled meanwhile).
    fn finish(
        &mut self,
        id: u64,
        result: Result<(Vec<u8>, Vec<OwnedFd>)>,
        (stdout, stderr): (String, String),
    ) {
        if let Some(state) = self.tasks.get_mut(&id) {
            *state = TaskState::Done(Finished {
                result,
                stdout,
                stderr,
            });
            self.finished += 1;
        }
    }

    fn timed_out(&self, id: u64) -> Option<Duration> {
        match self.tasks.get(&id) {
            Some(TaskState::Running { timed_out, .. }) => *timed_out,
            _ => None,
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wake the waiter that sleeps on the workers, if there is one.
    fn wake_driver(&self, inner: &Inner) {
        if inner.driving {
            let _ = nix::unistd::write(&self.wake, &1u64.to_ne_bytes());
        }
    }

    /// Start one worker and send it its `Serve`; it is `Starting` until it says `Serving`.
    fn start_worker(&self) -> Result<Worker> {
        let test_name = self.test_binary.then(|| PLACEHOLDER_TEST.to_owned());
        let (tasks, unread) = Channel::pair()?;
        nix::sys::socket::shutdown(tasks.as_raw_fd(), nix::sys::socket::Shutdown::Read)
            .map_err(|e| Error::errno("shutdown(SHUT_RD) of a worker's task socket", e))?;
        let unread = unread.into_fd();
        let made = context::make(self.method, &[], test_name)?;
        let worker = Worker {
            pid: made.pid,
            pidfd: made.pidfd.map(Arc::new),
            channel: Arc::new(made.channel),
            stdout: made.stdout,
            stderr: made.stderr,
            state: WorkerState::Starting,
            tasks_done: 0,
            tasks,
            unread,
            in_flight: None,
            exited: None,
        };
        let serve = Begin::Serve(Serve {
            devices: self.devices.clone(),
        });
        let serve = wire::encode(&serve)?;
        match worker.channel.send(serve.bytes(), &[worker.unread.as_fd()]) {
            // Disconnected: it died already; reading its channel says how.
            Ok(()) | Err(Error::Disconnected(_)) => Ok(worker),
            Err(error) => {
                self.end_worker(worker, false);
                Err(error)
            }
        }
    }

    /// Wait for task `id` to end, at most `timeout` (then cancel it: see `TaskHandle::join`).
    fn wait_for(&self, id: u64, timeout: Duration) -> Result<Finished> {
        let deadline = Instant::now().checked_add(timeout);
        let mut inner = self.lock();
        let mut driving = false;
        let mut gave_up = false;
        let mut spun = false;
        let result = loop {
            match inner.tasks.get(&id) {
                Some(TaskState::Done(_)) => match inner.tasks.remove(&id) {
                    Some(TaskState::Done(finished)) => break Ok(finished),
                    _ => unreachable!("just seen done"),
                },
                None => {
                    break Err(Error::Protocol(
                        "a Pool task that this pool does not know".into(),
                    ));
                }
                Some(_) => {}
            }
            if !gave_up && deadline.is_some_and(|d| Instant::now() >= d) {
                gave_up = true;
                match inner.tasks.get_mut(&id) {
                    Some(TaskState::Queued) => {
                        inner.tasks.remove(&id);
                        inner.queue.retain(|q| q.id != id);
                        break Err(Error::Timeout {
                            what: "a Pool task waiting for a free worker".into(),
                            after: timeout,
                        });
                    }
                    Some(TaskState::Running { slot, timed_out }) => {
                        *timed_out = Some(timeout);
                        let slot = *slot;
                        if let Some(worker) = inner.slots[slot].as_ref() {
                            let _ = signal_kill(worker, self.method);
                        }
                        if !driving {
                            self.wake_driver(&inner);
                        }
                    }
                    _ => {}
                }
            }
            if !inner.driving {
                inner.driving = true;
                driving = true;
            }
            let until = deadline.filter(|_| !gave_up);
            if driving {
                self.drive(&mut inner);
                if task_over(&inner, id) {
                    continue;
                }
                // Keep trying for a moment before sleeping: a report that comes within the
                // window costs no wake-up (as a wire receive does; see `VMM_IPC_SPIN_US`).
                if !spun {
                    spun = true;
                    let spin_end = Instant::now() + spin_window();
                    while Instant::now() < spin_end && !task_over(&inner, id) {
                        drop(inner);
                        std::hint::spin_loop();
                        inner = self.lock();
                        self.drive(&mut inner);
                    }
                    if task_over(&inner, id) {
                        continue;
                    }
                }
                inner = self.sleep_on_workers(inner, until);
            } else {
                let left = until.map(|d| d.saturating_duration_since(Instant::now()));
                inner = match left {
                    Some(left) => {
                        self.changed
                            .wait_timeout(inner, left)
                            .unwrap_or_else(|e| e.into_inner())
                            .0
                    }
                    None => self.changed.wait(inner).unwrap_or_else(|e| e.into_inner()),
                };
            }
        };
        if driving {
            inner.driving = false;
        }
        drop(inner);
        if driving {
            // Another waiter takes over reading the workers.
            self.changed.notify_all();
        }
        result
    }

    /// Release the lock and sleep until a worker says something, dies, the wake fd is written,
    /// or `until` passes; then lock again.
    fn sleep_on_workers<'a>(
        &'a self,
        inner: MutexGuard<'a, Inner>,
        until: Option<Instant>,
    ) -> MutexGuard<'a, Inner> {
        let watched: Vec<(Arc<Channel>, Option<Arc<OwnedFd>>)> = inner
            .slots
            .iter()
            .flatten()
            .map(|w| (Arc::clone(&w.channel), w.pidfd.clone()))
            .collect();
        drop(inner);
        let mut fds: Vec<PollFd<'_>> = vec![PollFd::new(self.wake.as_fd(), PollFlags::POLLIN)];
        for (channel, pidfd) in &watched {
            fds.push(PollFd::new(channel.as_fd(), PollFlags::POLLIN));
            if let Some(pidfd) = pidfd {
                fds.push(PollFd::new(pidfd.as_fd(), PollFlags::POLLIN));
            }
        }
        let timeout = match until.map(|u| u.saturating_duration_since(Instant::now())) {
            None => PollTimeout::NONE,
            // Round up so that a wait never ends before its deadline.
            Some(left) => PollTimeout::try_from(left.as_nanos().div_ceil(1_000_000))
                .unwrap_or(PollTimeout::MAX),
        };
        match poll(&mut fds, timeout) {
            Ok(_) | Err(Errno::EINTR) => {}
            // Cannot watch: do not spin.
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
        drop(fds);
        let mut drained = [0u8; 8];
        let _ = nix::unistd::read(&self.wake, &mut drained);
        self.lock()
    }

    /// Read every report the workers have sent, note deaths, replace dead workers and hand
    /// queued tasks to idle ones. Never blocks for long (reaping a dead forkserver worker waits
    /// for the server's report).
    fn drive(&self, inner: &mut Inner) {
        let finished = inner.finished;
        for slot in 0..inner.slots.len() {
            self.read_worker(inner, slot);
        }
        self.replace_dead(inner);
        self.dispatch(inner);
        if inner.finished != finished {
            // Waiters whose task just finished look again.
            self.changed.notify_all();
        }
    }

    /// Take what worker `slot` sent; end it if it died or broke the protocol.
    fn read_worker(&self, inner: &mut Inner, slot: usize) {
        let mut gone = false;
        let mut violation = None;
        loop {
            let Some(worker) = inner.slots[slot].as_mut() else {
                return;
            };
            let message = match worker.channel.try_recv() {
                Ok(Some(message)) => message,
                Ok(None) => break,
                Err(Error::Disconnected(_)) => {
                    gone = true;
                    break;
                }
                Err(error) => {
                    violation = Some(format!("reading its channel failed: {error}"));
                    break;
                }
            };
            let report = match wire::decode::<Report>(&message.bytes, Vec::new()) {
                Ok(report) => report,
                Err(error) => {
                    violation = Some(format!("a packet that is not a report: {error}"));
                    break;
                }
            };
            match (report, worker.state) {
                // A warm child's own `Ready`, from before it became a worker.
                (Report::Ready, WorkerState::Starting) => {}
                (Report::Serving, WorkerState::Starting) => {
                    worker.state = WorkerState::Idle;
                    inner.start_failures = 0;
                }
                (Report::TaskDone(outcome), WorkerState::Busy(id)) => {
                    worker.in_flight = None;
                    let output = take_output(worker);
                    match outcome {
                        TaskOutcome::Returned(bytes) => {
                            worker.state = WorkerState::Idle;
                            worker.tasks_done += 1;
                            inner.finish(id, Ok((bytes.0, message.fds)), output);
                        }
                        TaskOutcome::Unsendable(error) => {
                            worker.state = WorkerState::Idle;
                            worker.tasks_done += 1;
                            inner.finish(id, Err(error), output);
                        }
                        TaskOutcome::NotRun { stage, error } => {
                            worker.state = WorkerState::Idle;
                            worker.tasks_done += 1;
                            let pid = worker.pid.as_raw() as u32;
                            let outcome = Outcome::NotRun { stage, error };
                            let error =
                                self.not_run_error(pid, inner.timed_out(id), outcome, output);
                            inner.finish(id, Err(error), Default::default());
                        }
                        TaskOutcome::Panicked { message, location } => {
                            // It exits next, on its own: fail the task with the panic and how
                            // the worker exited.
                            let outcome = Outcome::Panicked { message, location };
                            let worker = inner.slots[slot].take().expect("read above");
                            let error = self.failed_task(inner, worker, id, Some(outcome), output);
                            inner.finish(id, Err(error), Default::default());
                            return;
                        }
                    }
                }
                (Report::Exited(status), _) if self.method == StartMethod::Forkserver => {
                    worker.exited = Some(status);
                    gone = true;
                    break;
                }
                (report, state) => {
                    violation = Some(format!("a report out of turn ({report:?} while {state:?})"));
                    break;
                }
            }
        }
        let Some(worker) = inner.slots[slot].as_ref() else {
            return;
        };
        if !gone && violation.is_none() {
            let Some(pidfd) = &worker.pidfd else {
                return;
            };
            let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
            if !poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0) {
                return;
            }
        }
        // Dead, or no longer to be trusted: end it and fail what it was doing.
        let worker = inner.slots[slot].take().expect("checked above");
        let _ = signal_kill(&worker, self.method);
        match worker.state {
            WorkerState::Busy(id) if self.never_taken(inner, &worker, id, violation.is_some()) => {
                // It died before taking the task off its channel (killed while idle, say): the
                // task never ran; the next worker gets it.
                let mut worker = worker;
                let task = worker.in_flight.take().expect("checked by never_taken");
                self.end_worker(worker, false);
                inner.tasks.insert(id, TaskState::Queued);
                inner.queue.push_front(task);
            }
            WorkerState::Busy(id) => {
                let mut error = self.failed_task(inner, worker, id, None, Default::default());
                if let (Some(violation), Error::Child(child)) = (&violation, &mut error) {
                    child.protocol_violation = Some(violation.clone());
                }
                inner.finish(id, Err(error), Default::default());
            }
            WorkerState::Starting => {
                let pid = worker.pid.as_raw() as u32;
                let ended = self.end_worker(worker, false);
                inner.start_failures += 1;
                inner.start_error = Some(Error::Child(Box::new(ChildError::new(
                    (self.method, pid),
                    (ended.status, false),
                    None,
                    None,
                    Observed {
                        protocol_violation: violation,
                        status_unknown: ended.status_unknown,
                        notes: vec!["a Pool worker, which died while it started".to_owned()],
                        ..Observed::default()
                    },
                    ended.output,
                ))));
            }
            WorkerState::Idle => {
                self.end_worker(worker, false);
            }
        }
    }

    /// Whether dead `worker`, busy with task `id`, never took it off its channel, and the task
    /// should go to another worker: it still waits for its result (not cancelled, not past its
    /// deadline), the worker kept to the protocol, and fewer than [`DELIVERIES_MAX`] workers
    /// died before taking it.
    fn never_taken(&self, inner: &Inner, worker: &Worker, id: u64, violated: bool) -> bool {
        !violated
            && task_unread(&worker.unread)
            && matches!(
                inner.tasks.get(&id),
                Some(TaskState::Running {
                    timed_out: None,
                    ..
                })
            )
            && worker
                .in_flight
                .as_ref()
                .is_some_and(|task| task.id == id && task.deliveries < DELIVERIES_MAX)
    }

    /// End `worker`, which was running task `id`, and make the task's error from what is known
    /// (`outcome`: what it reported; `output`: what it printed before that). A worker that
    /// reported (a panic) is let exit by itself, for its true exit status.
    fn failed_task(
        &self,
        inner: &Inner,
        worker: Worker,
        id: u64,
        outcome: Option<Outcome>,
        (stdout, stderr): (String, String),
    ) -> Error {
        let pid = worker.pid.as_raw() as u32;
        let done = worker.tasks_done;
        let ended = self.end_worker(worker, outcome.is_some());
        let timed_out = inner.timed_out(id);
        Error::Child(Box::new(ChildError::new(
            (self.method, pid),
            (ended.status, true),
            outcome,
            timed_out,
            Observed {
                status_unknown: ended.status_unknown,
                notes: vec![format!(
                    "a Pool worker, running its task {} (it has been replaced)",
                    done + 1
                )],
                ..Observed::default()
            },
            (stdout + &ended.output.0, stderr + &ended.output.1),
        )))
    }

    /// The error of a task that could not run on a worker that lives on (its argument could
    /// not be received, say).
    fn not_run_error(
        &self,
        pid: u32,
        timed_out: Option<Duration>,
        outcome: Outcome,
        output: (String, String),
    ) -> Error {
        Error::Child(Box::new(ChildError::new(
            (self.method, pid),
            (None, true),
            Some(outcome),
            timed_out,
            Observed {
                notes: vec!["a Pool worker (it serves on)".to_owned()],
                ..Observed::default()
            },
            output,
        )))
    }

    /// Kill (if still needed) and reap `worker`: a child of ours is reaped here; a forkserver
    /// child's status comes from the server, at most [`STATUS_REPORT_GRACE`] after its death.
    /// With `let_exit` (it said it is exiting), it gets up to [`STATUS_REPORT_GRACE`] to exit by
    /// itself before it is killed, so that its own exit status is what is reported.
    fn end_worker(&self, worker: Worker, let_exit: bool) -> Ended {
        if !let_exit || !exits_within(&worker, STATUS_REPORT_GRACE) {
            let _ = signal_kill(&worker, self.method);
        }
        let mut status = worker.exited;
        let mut status_unknown = None;
        if status.is_none() {
            if self.method.is_direct_child() {
                status = reap(worker.pid);
                if status.is_none() {
                    status_unknown = Some(format!("waitpid({}) failed", worker.pid));
                }
            } else {
                let deadline = Instant::now() + STATUS_REPORT_GRACE;
                loop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match worker.channel.recv(Some(left)) {
                        Ok(message) => {
                            if let Ok(Report::Exited(exited)) =
                                wire::decode::<Report>(&message.bytes, Vec::new())
                            {
                                status = Some(exited);
                                break;
                            }
                        }
                        Err(Error::Timeout { .. }) => {
                            status_unknown = Some(format!(
                                "the forkserver did not report it within {STATUS_REPORT_GRACE:?}"
                            ));
                            break;
                        }
                        Err(_) => {
                            status_unknown =
                                Some("the forkserver died before reporting it".to_owned());
                            break;
                        }
                    }
                }
            }
        }
        let output = take_output(&worker);
        Ended {
            status,
            status_unknown,
            output,
        }
    }

    /// Start workers in empty slots (unless the pool is closed, or workers keep dying as they
    /// start: then fail the tasks that wait, with why).
    fn replace_dead(&self, inner: &mut Inner) {
        if inner.closed {
            return;
        }
        for slot in 0..inner.slots.len() {
            if inner.slots[slot].is_some() {
                continue;
            }
            if inner.start_failures >= START_FAILURES_MAX {
                break;
            }
            match self.start_worker() {
                Ok(worker) => inner.slots[slot] = Some(worker),
                Err(error) => {
                    inner.start_failures += 1;
                    inner.start_error = Some(error);
                }
            }
        }
        let none_alive = inner.slots.iter().all(Option::is_none);
        if none_alive && inner.start_failures > 0 {
            // Nothing can run the queued tasks: fail them with why.
            let why = inner.start_error.as_ref().map(clone_error);
            let queued: Vec<u64> = inner.queue.drain(..).map(|q| q.id).collect();
            for id in queued {
                let error = why.as_ref().map(clone_error).unwrap_or_else(|| {
                    Error::Disconnected("a Pool task: no worker could be started".into())
                });
                inner.finish(id, Err(error), Default::default());
            }
        }
    }

    /// Hand queued tasks to idle workers.
    fn dispatch(&self, inner: &mut Inner) {
        while !inner.queue.is_empty() {
            let Some(slot) = inner
                .slots
                .iter()
                .position(|w| w.as_ref().is_some_and(|w| w.state == WorkerState::Idle))
            else {
                return;
            };
            let mut task = inner.queue.pop_front().expect("not empty");
            let fds: Vec<BorrowedFd<'_>> = task.fds.iter().map(AsFd::as_fd).collect();
            let worker = inner.slots[slot].as_mut().expect("found above");
            match worker.tasks.send(&task.bytes, &fds) {
                Ok(()) => {
                    drop(fds);
                    let id = task.id;
                    task.deliveries += 1;
                    worker.state = WorkerState::Busy(id);
                    worker.in_flight = Some(task);
                    inner.tasks.insert(
                        id,
                        TaskState::Running {
                            slot,
                            timed_out: None,
                        },
                    );
                }
                // The worker is gone: the task never reached it. Put it back; reading the
                // worker ends it.
                Err(Error::Disconnected(_)) => {
                    drop(fds);
                    inner.queue.push_front(task);
                    self.read_worker(inner, slot);
                    if inner.slots[slot].is_some() {
                        // Not seen dead yet: end it now rather than offer it again.
                        let worker = inner.slots[slot].take().expect("checked");
                        self.end_worker(worker, false);
                    }
                    self.replace_dead(inner);
                }
                // The task cannot be sent (too many fds for one message, say): it fails alone.
                Err(error) => {
                    drop(fds);
                    inner.finish(task.id, Err(error), Default::default());
                }
            }
        }
    }
}

/// Whether a task still waits in `unread`, a (dead) worker's end of its task socket: the worker
/// never received it. Only a message queued there counts (peeked, not taken), not an
/// end-of-file or a shutdown the worker made; anything but a message says "received", so that a
/// task that may have run is never sent again.
fn task_unread(unread: &OwnedFd) -> bool {
    let mut byte = [0u8; 1];
    let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC;
    matches!(
        nix::sys::socket::recv(unread.as_raw_fd(), &mut byte, flags),
        Ok(len) if len > 0
    )
}

/// Whether task `id` has ended (or is unknown: cancelled).
fn task_over(inner: &Inner, id: u64) -> bool {
    matches!(inner.tasks.get(&id), Some(TaskState::Done(_)) | None)
}

/// How long a waiter keeps reading the workers before it sleeps: [`crate::wire::SPIN_VAR`]
/// microseconds (the window a wire receive uses), else 20 us on a machine with more than one
/// CPU, else none.
fn spin_window() -> Duration {
    static WINDOW: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *WINDOW.get_or_init(|| {
        let micros = std::env::var(crate::wire::SPIN_VAR)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or_else(|| {
                let cpus = std::thread::available_parallelism().map_or(1, usize::from);
                if cpus > 1 { 20 } else { 0 }
            });
        Duration::from_micros(micros.min(10_000))
    })
}

/// Whether `worker` exits within `limit` (its pidfd becomes readable; without one, its channel
/// hangs up, which for a forkserver worker never happens while the server holds its copy).
fn exits_within(worker: &Worker, limit: Duration) -> bool {
    let fd = match &worker.pidfd {
        Some(pidfd) => pidfd.as_fd(),
        None if worker.exited.is_some() => return true,
        None => worker.channel.as_fd(),
    };
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let timeout = PollTimeout::try_from(left.as_millis()).unwrap_or(PollTimeout::MAX);
        let flags = if worker.pidfd.is_some() {
            PollFlags::POLLIN
        } else {
            PollFlags::empty()
        };
        let mut fds = [PollFd::new(fd, flags)];
        match poll(&mut fds, timeout) {
            Ok(n) => return n > 0,
            Err(Errno::EINTR) => continue,
            Err(_) => return false,
        }
    }
}

/// SIGKILL a worker (through its pidfd where there is one).
fn signal_kill(worker: &Worker, method: StartMethod) -> Result<()> {
    if worker.exited.is_some() {
        return Ok(());
    }
    match &worker.pidfd {
        Some(pidfd) => sys::pidfd_kill(pidfd),
        // Ours and not yet reaped: the pid is still this worker.
        None if method.is_direct_child() => match kill(worker.pid, Signal::SIGKILL) {
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(e) => Err(Error::errno(format!("kill({}, SIGKILL)", worker.pid), e)),
        },
        // A forkserver worker without a pidfd: its status was not reported, so the server has
        // not reaped it and the pid is still it.
        None => kill(worker.pid, Signal::SIGKILL).or(Ok(())),
    }
}

fn reap(pid: Pid) -> Option<ExitStatus> {
    loop {
        match waitpid(pid, None) {
            Ok(WaitStatus::Exited(_, code)) => return Some(ExitStatus::Exited(code)),
            Ok(WaitStatus::Signaled(_, signal, _)) => {
                return Some(ExitStatus::Signaled(signal as i32));
            }
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(_) => return None,
        }
    }
}

/// What the worker printed since the last call, and empty its output files for the next task
/// (they are `O_APPEND`: the worker goes on writing at their new end).
fn take_output(worker: &Worker) -> (String, String) {
    (drain(&worker.stdout), drain(&worker.stderr))
}

fn drain(fd: &OwnedFd) -> String {
    // Most tasks print nothing: one fstat, no read.
    if nix::sys::stat::fstat(fd).is_ok_and(|st| st.st_size == 0) {
        return String::new();
    }
    let Ok(file) = fd.try_clone().map(std::fs::File::from) else {
        return "(captured output unreadable: dup failed)".to_owned();
    };
    use std::os::unix::fs::FileExt;
    let mut out = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let mut offset = 0u64;
    while let Ok(n @ 1..) = file.read_at(&mut buf, offset) {
        out.extend_from_slice(&buf[..n]);
        offset += n as u64;
    }
    let _ = file.set_len(0);
    String::from_utf8_lossy(&out).into_owned()
}

/// A copy of an error (through its serde form, which keeps the variant).
fn clone_error(error: &Error) -> Error {
    postcard::to_stdvec(error)
        .ok()
        .and_then(|bytes| postcard::from_bytes(&bytes).ok())
        .unwrap_or_else(|| Error::Protocol(error.to_string()))
}
