//! The warm pool ([`WarmPool`]): children started ahead of need, each a fresh exec of this
//! executable (as spawn starts them) that initialises CUDA for the configured devices and then
//! waits for its start message. `StartMethod::Warm` takes one from the
//! [process-wide pool](WarmPool::global) and starts a replacement in the background.
//!
//! A waiting child costs the parent four fds (its channel, its pidfd, its stdout and stderr),
//! and the GPU a primary context per warmed device. Children are launched from the launcher
//! thread (so that `PR_SET_PDEATHSIG` ties them to this process, not to a short-lived thread),
//! and a replacement's launch runs there too, after the take has returned. A waiting child that
//! died is found when the pool is next used (its pidfd is readable, its channel hung up, or
//! `/proc` shows it exiting), reaped, and replaced. No ready child is handed out before it
//! answers a ping, which no dying child can: a killed child's pidfd and channel stay quiet
//! until its teardown ends, and for one holding a CUDA context that takes hundreds of
//! milliseconds.
//!
//! A pool keeps its children per environment (`Context::with_env`): a child's environment is
//! fixed at its exec, before CUDA reads variables such as `CUDA_VISIBLE_DEVICES`.

mod waiting;
mod warm_options;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::ends::ParentEnd;
use super::hook::{self, ChildKind};
use super::launch::{self, Launch};
use super::output::Output;
use super::protocol::Role;
use super::status::{ChildError, Observed};
use super::supervisor::{Child, NewChild};
use super::timeout::default_timeout;
use crate::error::StartMethod;
use crate::{Error, Result};

use waiting::{Health, WaitingChild};
pub use warm_options::{DEFAULT_DEPTH, DEPTH_VAR, DEVICES_VAR, MAX_DEPTH, WarmOptions};

/// How long [`WarmPool::quiesce`] waits for launches in flight.
const QUIESCE_LIMIT: Duration = Duration::from_secs(10);

/// Children started ahead of need, waiting with CUDA initialised (where there is a GPU) for
/// the one function each will run: what [`StartMethod::Warm`] takes its children from.
///
/// `StartMethod::Warm` uses the process-wide pool, [`WarmPool::global`], configured by the
/// environment ([`WarmOptions::from_env`]) or by [`set_options`](Self::set_options). It starts
/// on first use, or with [`fill`](Self::fill), which waits until it is full. Dropping a pool
/// kills the children waiting in it (they are reaped in the background: a drop never waits).
///
/// ```no_run
/// use vmm_core::process::{WarmOptions, WarmPool};
/// let pool = WarmPool::global();
/// pool.set_options(WarmOptions::new().with_depth(4));
/// let pids = pool.fill()?; // four children, ready
/// assert_eq!(pids.len(), 4);
/// # Ok::<(), vmm_core::Error>(())
/// ```
pub struct WarmPool {
    shared: Arc<Shared>,
}

impl fmt::Debug for WarmPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WarmPool")
            .field("options", &self.options())
            .field("pids", &self.pids())
            .finish()
    }
}

struct Shared {
    state: Mutex<State>,
    /// Notified when a background launch completes (or fails).
    changed: Condvar,
}

struct State {
    options: WarmOptions,
    /// Bumped by `set_options`: launches of an older generation are discarded.
    generation: u64,
    /// A child's argv after `argv[0]` (see `hook::child_args`).
    child_args: Vec<String>,
    buckets: HashMap<Vec<(String, String)>, Bucket>,
}

/// The children waiting with one environment.
#[derive(Default)]
struct Bucket {
    waiting: VecDeque<WaitingChild>,
    /// Launches queued on the launcher thread, not yet waiting.
    launching: usize,
    /// The last background launch that failed, for `fill` to report.
    failed: Option<Error>,
}

/// One launch to start: what to exec, and where its completion goes.
struct Refill {
    launch: Launch,
    pending: Pending,
    env: Vec<(String, String)>,
    generation: u64,
}

/// The parent's half of a warm child being launched: its fds, until the pid is known.
struct Pending {
    channel: ParentEnd,
    output: Output,
}

impl WarmPool {
    /// A pool kept by `options`; it starts children on first use (or [`fill`](Self::fill)).
    pub fn new(options: WarmOptions) -> WarmPool {
        WarmPool {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    options,
                    generation: 0,
                    child_args: hook::child_args(ChildKind::Warm),
                    buckets: HashMap::new(),
                }),
                changed: Condvar::new(),
            }),
        }
    }

    /// A pool kept by [`WarmOptions::from_env`].
    pub fn from_env() -> Result<WarmPool> {
        WarmOptions::from_env().map(WarmPool::new)
    }

    /// The process-wide pool, which [`StartMethod::Warm`] takes its children from: made on
    /// first use from the environment ([`WarmOptions::from_env`]; an invalid value, one past
    /// [`MAX_DEPTH`] or the devices' maxima included, is warned about once and the default
    /// used: `VMM_WARM_DEPTH=300` keeps 2 children, not 300).
    pub fn global() -> &'static WarmPool {
        static GLOBAL: OnceLock<WarmPool> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            WarmPool::new(WarmOptions::from_env().unwrap_or_else(|error| {
                eprintln!("vmm-ipc: ignoring {error}; using the default warm pool");
                WarmOptions::default()
            }))
        })
    }

    /// The options the pool is kept by.
    pub fn options(&self) -> WarmOptions {
        self.shared.lock().options.clone()
    }

    /// Keep the pool by `options` from now on: children waiting under other options are
    /// killed (and reaped in the background), and the pool refills (on next use, or
    /// [`fill`](Self::fill)) with these.
    pub fn set_options(&self, options: WarmOptions) {
        let discarded: Vec<WaitingChild> = {
            let mut state = self.shared.lock();
            state.options = options;
            state.generation += 1;
            state
                .buckets
                .drain()
                .flat_map(|(_, bucket)| bucket.waiting)
                .collect()
        };
        // Killed and reaped outside the lock.
        drop(discarded);
    }

    /// Fill the pool (the children for contexts without extra environment) and wait until
    /// every child in it is ready: started, CUDA initialised where there is a GPU. Returns their
    /// pids.
    ///
    /// Like [`ensure_running`](super::ensure_running) for the forkserver, call it before taking
    /// an fd baseline: once it returns, the pool's fds (four per waiting child) stay as they
    /// are, since each child taken is replaced by one with the same fds' worth. `#[ipc_test]`
    /// calls it before a `thread_unsafe` body under `warm`. It waits at most the [default
    /// timeout](super::default_timeout) ([`Error::Timeout`]); a child that dies while warming up
    /// is replaced, and one that keeps dying is [`Error::Child`] with its story.
    pub fn fill(&self) -> Result<Vec<u32>> {
        let timeout = default_timeout();
        let deadline = Instant::now().checked_add(timeout);
        let mut deaths = 0;
        let mut state = self.shared.lock();
        loop {
            let depth = state.options.depth();
            let (dead, refill) = state.prune_and_refill(&[]);
            let bucket = state.buckets.entry(Vec::new()).or_default();
            let failed = bucket.failed.take();
            let ready = bucket.waiting.len() >= depth
                && bucket.waiting.iter().all(|w| w.ready)
                && refill.is_empty();
            let pids: Vec<u32> = bucket.waiting.iter().map(WaitingChild::pid).collect();
            drop(state);
            let refilled = self.start_launches(refill);
            deaths += dead.len();
            // Reap every dead one; the last says what went wrong, if they keep dying.
            let last_death = dead.into_iter().map(|waiting| waiting.child).last();
            if let Some(error) = failed.or(refilled.err()) {
                return Err(error);
            }
            if ready {
                return Ok(pids);
            }
            if let Some(mut child) = last_death
                && deaths > 2 * depth + 2
            {
                child.end(false);
                return Err(Error::Child(Box::new(ChildError::new(
                    (StartMethod::Warm, child.pid().as_raw() as u32),
                    (child.status(), false),
                    None,
                    None,
                    Observed {
                        notes: vec![format!(
                            "{deaths} warm children died while they waited; this one was the last"
                        )],
                        ..Observed::default()
                    },
                    child.output().read(),
                ))));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::Timeout {
                    what: format!("warming up the pool of {depth} warm children"),
                    after: timeout,
                });
            }
            // Woken by a launch that completes; children's `Ready` reports are polled.
            state = self
                .shared
                .changed
                .wait_timeout(self.shared.lock(), Duration::from_millis(2))
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    /// The pids of every child waiting in the pool (without starting any).
    pub fn pids(&self) -> Vec<u32> {
        let state = self.shared.lock();
        state
            .buckets
            .values()
            .flat_map(|bucket| bucket.waiting.iter())
            .map(WaitingChild::pid)
            .collect()
    }

    /// Start the pool filling if it is not full; does not wait. For `#[ipc_test]` bodies that
    /// run beside others: the first take finds children on their way.
    pub(crate) fn prestart(&self) {
        let mut state = self.shared.lock();
        let (dead, refill) = state.prune_and_refill(&[]);
        drop(state);
        let _ = self.start_launches(refill);
        drop(dead);
    }

    /// Wait (at most 10 s) until no background launch is in flight, so that the parent's fds
    /// are what they will stay: for fd accounting.
    pub(crate) fn quiesce(&self) {
        let deadline = Instant::now() + QUIESCE_LIMIT;
        let mut state = self.shared.lock();
        loop {
            let busy = state.buckets.values().any(|b| b.launching > 0);
            let left = deadline.saturating_duration_since(Instant::now());
            if !busy || left.is_zero() {
                return;
            }
            state = self
                .shared
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    /// A ready child from the pool for `env`, else the oldest waiting one, else a new one
    /// started now; a replacement is launched in the background either way.
    ///
    /// A ready child is handed out only once it has answered a ping: a child killed while it
    /// waited can keep its pidfd quiet and its channel open for as long as its teardown takes,
    /// but it can never answer. One that does not is killed, reaped and replaced, and the next
    /// is asked. (One still warming up is handed out as it is: see `WaitingChild::confirm`.)
    pub(crate) fn take(&self, env: &[(String, String)]) -> Result<NewChild> {
        let mut asked = 0;
        loop {
            let mut state = self.shared.lock();
            let depth = state.options.depth();
            let bucket = state.buckets.entry(env.to_vec()).or_default();
            let dead = bucket.prune();
            let index = bucket
                .waiting
                .iter()
                .position(|w| w.ready)
                .or((!bucket.waiting.is_empty()).then_some(0));
            // Asking more than a pool's worth in one take means they keep dying: start one now.
            let taken = index
                .filter(|_| asked <= depth + 1)
                .and_then(|i| bucket.waiting.remove(i));
            let refill = state.plan_refill(env);
            let launch_now = taken.is_none().then(|| state.prepare(env));
            drop(state);
            // Replacements first, so that they start while this child runs.
            let _ = self.start_launches(refill);
            drop(dead);
            match taken {
                Some(waiting) => match waiting.confirm() {
                    Ok(new_child) => return Ok(new_child),
                    // Killed and reaped on drop; ask the next.
                    Err(dead) => {
                        drop(dead);
                        asked += 1;
                    }
                },
                // None waiting (the pool is off, used up, or its children died): start one now.
                None => {
                    let (launch, pending) = launch_now.expect("prepared when none was taken")?;
                    let pid = launch::launch(launch)?;
                    return Ok(pending.finish(pid).into_new_child());
                }
            }
        }
    }

    /// Queue `refill`'s launches on the launcher thread; each adds its child to its bucket
    /// when done (or, if the pool is gone or reconfigured meanwhile, kills and reaps it). Call
    /// it without the state's lock held (its error path takes it). The first error (the
    /// launcher thread is gone) is returned; the launch counts are reset.
    fn start_launches(&self, refill: Vec<Refill>) -> Result<()> {
        for Refill {
            launch,
            pending,
            env,
            generation,
        } in refill
        {
            let shared = Arc::downgrade(&self.shared);
            let queued = launch::launch_then(launch, move |launched| {
                let finished = launched.map(|pid| pending.finish(pid));
                Shared::landed(&shared, env, generation, finished);
            });
            if let Err(error) = queued {
                let mut state = self.shared.lock();
                for bucket in state.buckets.values_mut() {
                    bucket.launching = 0;
                }
                return Err(error);
            }
        }
        Ok(())
    }
}

impl Drop for WarmPool {
    fn drop(&mut self) {
        let waiting: Vec<WaitingChild> = self
            .shared
            .lock()
            .buckets
            .drain()
            .flat_map(|(_, bucket)| bucket.waiting)
            .collect();
        // Killed and reaped outside the lock.
        drop(waiting);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A background launch for `env` of `generation` ended (on the launcher thread): the child
    /// waits in its bucket, unless the pool is gone or reconfigured meanwhile (then it is
    /// killed and reaped, outside the lock).
    fn landed(
        shared: &Weak<Shared>,
        env: Vec<(String, String)>,
        generation: u64,
        finished: Result<WaitingChild>,
    ) {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let discard = {
            let mut state = shared.lock();
            let current = state.generation == generation;
            let bucket = state.buckets.entry(env).or_default();
            if current {
                bucket.launching = bucket.launching.saturating_sub(1);
            }
            match finished {
                Ok(waiting) if current => {
                    bucket.waiting.push_back(waiting);
                    None
                }
                Ok(waiting) => Some(waiting),
                Err(error) => {
                    if current {
                        bucket.failed = Some(error);
                    }
                    None
                }
            }
        };
        shared.changed.notify_all();
        drop(discard);
    }
}

impl State {
    /// Plan launches that bring `env`'s bucket up to the depth (counted as launching from now
    /// on).
    fn plan_refill(&mut self, env: &[(String, String)]) -> Vec<Refill> {
        let depth = self.options.depth();
        let generation = self.generation;
        let mut refill = Vec::new();
        loop {
            let bucket = self.buckets.entry(env.to_vec()).or_default();
            if bucket.waiting.len() + bucket.launching >= depth {
                break;
            }
            match self.prepare(env) {
                Ok((launch, pending)) => {
                    let bucket = self.buckets.entry(env.to_vec()).or_default();
                    bucket.launching += 1;
                    refill.push(Refill {
                        launch,
                        pending,
                        env: env.to_vec(),
                        generation,
                    });
                }
                Err(error) => {
                    self.buckets.entry(env.to_vec()).or_default().failed = Some(error);
                    break;
                }
            }
        }
        refill
    }

    /// [`Bucket::prune`] and [`plan_refill`](Self::plan_refill) for `env`.
    fn prune_and_refill(&mut self, env: &[(String, String)]) -> (Vec<WaitingChild>, Vec<Refill>) {
        let dead = self.buckets.entry(env.to_vec()).or_default().prune();
        (dead, self.plan_refill(env))
    }

    /// What to exec for one warm child with `env`, and the parent's fds for it.
    fn prepare(&self, env: &[(String, String)]) -> Result<(Launch, Pending)> {
        let (ours, theirs) = ParentEnd::pair()?;
        let output = Output::new()?;
        let launch = Launch {
            role: Role::Warm {
                devices: self.options.devices().to_vec(),
            },
            channel: theirs.into_fd(),
            output: Some(output.child_ends()?),
            args: self.child_args.clone(),
            env: env.to_vec(),
        };
        let pending = Pending {
            channel: ours,
            output,
        };
        Ok((launch, pending))
    }
}

impl Bucket {
    /// Take the dead children out (to be reaped outside the lock), reading the others' `Ready`
    /// reports.
    fn prune(&mut self) -> Vec<WaitingChild> {
        let mut dead = Vec::new();
        let mut alive = VecDeque::with_capacity(self.waiting.len());
        for mut waiting in self.waiting.drain(..) {
            match waiting.check() {
                Health::Alive => alive.push_back(waiting),
                Health::Dead => dead.push(waiting),
            }
        }
        self.waiting = alive;
        dead
    }
}

impl Pending {
    fn finish(self, pid: nix::unistd::Pid) -> WaitingChild {
        WaitingChild::new(Child::ours(pid, self.channel, self.output))
    }
}
