//! The warm pool: children started ahead of need, each a fresh exec of this executable (as spawn
//! starts them) that initialises CUDA for the configured devices and then waits for its start
//! message. `StartMethod::Warm` takes one and starts a replacement in the background.
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
//! Pools are kept per environment (`Context::with_env`): a child's environment is fixed at its
//! exec, before CUDA reads variables such as `CUDA_VISIBLE_DEVICES`.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;

use super::StartMethod;
use super::launch::{self, Launch, Made, current_test_name, dup, output_memfds};
use super::protocol::{Begin, Report};
use super::status::{ChildError, ExitStatus, Observed};
use super::sys;
use super::timeout::default_timeout;
use crate::wire::{self, Channel};
use crate::{Error, Result};

/// The variable that sets the pool's [depth](WarmOptions::depth): how many children wait.
pub const DEPTH_VAR: &str = "VMM_WARM_DEPTH";

/// The variable that sets the [devices](WarmOptions::devices) a warm child initialises: CUDA
/// ordinals, comma-separated (`0`, `0,1`), or `none`.
pub const DEVICES_VAR: &str = "VMM_WARM_DEVICES";

/// The depth when [`DEPTH_VAR`] is not set.
pub const DEFAULT_DEPTH: usize = 2;

/// The test name a warm child gets in its argv in a test binary: no test has it, so if the
/// child did not take its role before `main` (the hook disabled), libtest runs nothing and the
/// child exits without acknowledging, which the parent reports.
const PLACEHOLDER_TEST: &str = "vmm-ipc-warm-child";

/// How long a ready waiting child has to answer a [`Begin::Ping`] before it is taken for dead.
/// A live one answers in microseconds; this covers a machine under heavy load.
const PING_LIMIT: Duration = Duration::from_secs(2);

/// How long [`quiesce`] waits for launches in flight.
const QUIESCE_LIMIT: Duration = Duration::from_secs(10);

/// How the warm pool is kept: how many children wait, and which CUDA devices each initialises.
///
/// The default (and what [`warm_options`] starts from) is [`DEFAULT_DEPTH`] (2) children that
/// each retain the primary context of device 0, or what [`DEPTH_VAR`] and [`DEVICES_VAR`] say.
/// The depth is small because every waiting child holds a CUDA context on each of its devices
/// (a few hundred MiB of device memory each, on an H200) for as long as it waits, and because
/// a pool refills in the background anyway: two cover a test or a program that starts children
/// one after another. Raise it for a suite that runs many tests in parallel
/// (`VMM_WARM_DEPTH` = the number of test threads keeps each test's child warm); 0 turns the
/// pool off (every warm child is then started on demand, as a spawned one).
///
/// ```
/// use vmm_core::process::{WarmOptions, set_warm_options};
/// set_warm_options(WarmOptions::new().with_depth(4).with_devices([0, 1]));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmOptions {
    depth: usize,
    devices: Vec<usize>,
}

impl Default for WarmOptions {
    fn default() -> Self {
        WarmOptions {
            depth: DEFAULT_DEPTH,
            devices: vec![0],
        }
    }
}

impl WarmOptions {
    /// The defaults: depth [`DEFAULT_DEPTH`], device 0; the environment is not read.
    pub fn new() -> WarmOptions {
        WarmOptions::default()
    }

    /// The defaults, overridden by [`DEPTH_VAR`] and [`DEVICES_VAR`] where they are set. A
    /// value that is not a count (depth) or a list of ordinals (devices) is
    /// [`Error::InvalidArgument`], naming the variable and the value.
    pub fn from_env() -> Result<WarmOptions> {
        let mut options = WarmOptions::default();
        if let Some(value) = std::env::var_os(DEPTH_VAR) {
            let value = value.to_string_lossy();
            options.depth = value.trim().parse().map_err(|_| {
                Error::InvalidArgument(format!(
                    "{DEPTH_VAR}={value:?}: not a number of children (such as 2, or 0 for none)"
                ))
            })?;
        }
        if let Some(value) = std::env::var_os(DEVICES_VAR) {
            options.devices = parse_devices(&value.to_string_lossy())?;
        }
        Ok(options)
    }

    /// Keep `depth` children waiting (0: none).
    pub fn with_depth(mut self, depth: usize) -> WarmOptions {
        self.depth = depth;
        self
    }

    /// Initialise these CUDA devices (ordinals, as the child numbers them) in each child; none
    /// for a pool that only hides the exec. A device the child does not see is skipped.
    pub fn with_devices(mut self, devices: impl IntoIterator<Item = usize>) -> WarmOptions {
        self.devices = devices.into_iter().collect();
        self.devices.sort_unstable();
        self.devices.dedup();
        self
    }

    /// How many children wait.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The CUDA devices each child initialises while it waits.
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }
}

fn parse_devices(value: &str) -> Result<Vec<usize>> {
    let trimmed = value.trim();
    if trimmed.is_empty() || trimmed.eq_ignore_ascii_case("none") {
        return Ok(Vec::new());
    }
    let devices = trimmed
        .split(',')
        .map(|d| d.trim().parse::<usize>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| {
            Error::InvalidArgument(format!(
                "{DEVICES_VAR}={value:?}: not a list of CUDA device ordinals (such as 0 or 0,1, \
                 or none)"
            ))
        })?;
    Ok(WarmOptions::new().with_devices(devices).devices)
}

/// A waiting child. Dropping it kills and reaps the child (it never ran anything).
#[derive(Debug)]
struct Waiting {
    made: Option<Made>,
}

impl Waiting {
    fn made(&self) -> &Made {
        self.made
            .as_ref()
            .expect("a waiting child until handed out")
    }

    fn into_made(mut self) -> Made {
        self.made.take().expect("a waiting child until handed out")
    }

    fn pid(&self) -> Pid {
        self.made().pid
    }

    /// Read what it said (its `Ready`), and whether it is still alive and well.
    fn check(&mut self) -> Health {
        let made = self
            .made
            .as_mut()
            .expect("a waiting child until handed out");
        if let Some(pidfd) = &made.pidfd {
            let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
            if poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0) {
                return Health::Dead;
            }
        }
        loop {
            match made.channel.try_recv() {
                Ok(None) => return Health::Alive,
                Ok(Some(message)) => {
                    match wire::decode::<Report>(&message.bytes, Vec::new()) {
                        Ok(Report::Ready) if !made.ready && message.fds.is_empty() => {
                            made.ready = true
                        }
                        // Anything else breaks the protocol: it is not handed out.
                        _ => return Health::Dead,
                    }
                }
                Err(_) => return Health::Dead,
            }
        }
    }

    /// Hand it out if it is alive: it is not exiting (`/proc`), and, once ready, it answers a
    /// [`Begin::Ping`] within [`PING_LIMIT`]. Otherwise it is given back, to be dropped.
    ///
    /// A child still warming up is handed out without the ping: waiting for its warm-up here
    /// would hold the caller (a `Pool` replacing a worker inside a `join`) for as long as CUDA
    /// takes to start. If it was killed meanwhile, its start fails as any child's would
    /// (`join` says it never started; a `Pool` replaces a worker that dies starting).
    fn confirm(mut self) -> std::result::Result<Made, Waiting> {
        if self.check() == Health::Dead || exiting(self.pid()) {
            return Err(self);
        }
        let made = self
            .made
            .as_mut()
            .expect("a waiting child until handed out");
        if !made.ready {
            return Ok(self.into_made());
        }
        let deadline = Instant::now() + PING_LIMIT;
        let Ok(ping) = wire::encode(&Begin::Ping) else {
            return Err(self);
        };
        if made.channel.send(ping.bytes(), &[]).is_err() {
            return Err(self);
        }
        let answer = made
            .channel
            .recv(Some(deadline.saturating_duration_since(Instant::now())));
        match answer.map(|m| (wire::decode::<Report>(&m.bytes, Vec::new()), m.fds.len())) {
            Ok((Ok(Report::Pong), 0)) => Ok(self.into_made()),
            // Hung up (dead), silent past the limit (stopped, or stuck), or off the protocol:
            // not handed out.
            _ => Err(self),
        }
    }

    /// Kill (if needed) and reap it; how it ended and what it wrote, for an error.
    fn end(mut self) -> (Pid, Option<ExitStatus>, String, String) {
        let made = self.made.take().expect("a waiting child until handed out");
        let status = end_child(&made);
        let stdout = read_all(&made.stdout);
        let stderr = read_all(&made.stderr);
        (made.pid, status, stdout, stderr)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(made) = self.made.take() {
            end_child(&made);
        }
    }
}

/// Whether `pid` (a child of ours, not yet reaped, so the pid is still it) has begun to exit:
/// its main thread is a zombie or marked exiting (`PF_EXITING` in `/proc/<pid>/stat`'s flags),
/// while its other threads (a CUDA context's) may still be tearing down.
fn exiting(pid: Pid) -> bool {
    const PF_EXITING: u64 = 0x4;
    // Without /proc nothing is known here; the ping still decides.
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // After the command name (which may hold spaces and parentheses): state, ppid, pgrp,
    // session, tty_nr, tpgid, flags.
    let Some((_, fields)) = stat.rsplit_once(')') else {
        return false;
    };
    let mut fields = fields.split_ascii_whitespace();
    let state = fields.next().unwrap_or("");
    let flags = fields
        .nth(5)
        .and_then(|f| f.parse::<u64>().ok())
        .unwrap_or(0);
    matches!(state, "Z" | "X" | "x") || flags & PF_EXITING != 0
}

/// SIGKILL a child of ours that was never handed out, and reap it.
fn end_child(made: &Made) -> Option<ExitStatus> {
    let _ = match &made.pidfd {
        Some(pidfd) => sys::pidfd_kill(pidfd),
        // Ours and not yet reaped: the pid is still this child.
        None => kill(made.pid, Signal::SIGKILL).or(Ok(())),
    };
    loop {
        match waitpid(made.pid, None) {
            Ok(WaitStatus::Exited(_, code)) => return Some(ExitStatus::Exited(code)),
            Ok(WaitStatus::Signaled(_, signal, _)) => {
                return Some(ExitStatus::Signaled(signal as i32));
            }
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(_) => return None,
        }
    }
}

fn read_all(fd: &OwnedFd) -> String {
    let mut out = Vec::new();
    if let Ok(file) = fd.try_clone().map(std::fs::File::from) {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 16 * 1024];
        let mut offset = 0u64;
        while let Ok(n @ 1..) = file.read_at(&mut buf, offset) {
            out.extend_from_slice(&buf[..n]);
            offset += n as u64;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Health {
    Alive,
    Dead,
}

/// The children waiting with one environment.
#[derive(Debug, Default)]
struct Bucket {
    waiting: VecDeque<Waiting>,
    /// Launches queued on the launcher thread, not yet waiting.
    launching: usize,
    /// The last background launch that failed, for `warm_pool` to report.
    failed: Option<Error>,
}

#[derive(Debug)]
struct State {
    options: WarmOptions,
    /// Bumped by `set_warm_options`: launches of an older generation are discarded.
    generation: u64,
    /// A test binary's children get a placeholder test name in their argv.
    test_binary: bool,
    buckets: HashMap<Vec<(String, String)>, Bucket>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);
/// Notified when a background launch completes (or fails).
static CHANGED: Condvar = Condvar::new();

fn lock() -> MutexGuard<'static, Option<State>> {
    STATE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn state(slot: &mut Option<State>) -> &mut State {
    slot.get_or_insert_with(|| State {
        options: WarmOptions::from_env().unwrap_or_else(|error| {
            eprintln!("vmm-ipc: ignoring {error}; using the default warm pool");
            WarmOptions::default()
        }),
        generation: 0,
        test_binary: current_test_name().is_some(),
        buckets: HashMap::new(),
    })
}

/// Use `options` for the warm pool from now on: children waiting under other options are
/// killed and reaped, and the pool refills (on next use, or [`warm_pool`]) with these.
pub fn set_warm_options(options: WarmOptions) {
    let discarded: Vec<Waiting> = {
        let mut slot = lock();
        let state = state(&mut slot);
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

/// The warm pool's options: as set by [`set_warm_options`], else from the environment
/// ([`WarmOptions::from_env`]; an invalid value is warned about once and the default used).
pub fn warm_options() -> WarmOptions {
    state(&mut lock()).options.clone()
}

/// Fill this process's warm pool (the one for contexts without extra environment) and wait
/// until every child in it is ready: started, CUDA initialised where there is a GPU. Returns
/// their pids.
///
/// Like [`ensure_running`](super::ensure_running) for the forkserver, call it before taking an
/// fd baseline: once it returns, the pool's fds (four per waiting child) stay as they are, since
/// each child taken is replaced by one with the same fds' worth. `#[ipc_test]` calls it before
/// a `thread_unsafe` body under `warm`. It waits at most the [default
/// timeout](super::default_timeout) ([`Error::Timeout`]); a child that dies while warming up is
/// replaced, and one that keeps dying is [`Error::Child`] with its story.
pub fn warm_pool() -> Result<Vec<u32>> {
    let timeout = default_timeout();
    let deadline = Instant::now().checked_add(timeout);
    let mut deaths = 0;
    let mut slot = lock();
    loop {
        let state = state(&mut slot);
        let depth = state.options.depth;
        let (dead, refill) = prune_and_refill(state, &[]);
        let bucket = state.buckets.entry(Vec::new()).or_default();
        let failed = bucket.failed.take();
        let ready = bucket.waiting.len() >= depth
            && bucket.waiting.iter().all(|w| w.made().ready)
            && refill.is_empty();
        let pids: Vec<u32> = bucket
            .waiting
            .iter()
            .map(|w| w.pid().as_raw() as u32)
            .collect();
        drop(slot);
        let refilled = start_launches(refill);
        deaths += dead.len();
        // Reap every dead one; the last says what went wrong, if they keep dying.
        let mut last_death = None;
        for waiting in dead {
            last_death = Some(waiting.end());
        }
        if let Some(error) = failed.or(refilled.err()) {
            return Err(error);
        }
        if ready {
            return Ok(pids);
        }
        if let Some((pid, status, stdout, stderr)) = last_death
            && deaths > 2 * depth + 2
        {
            return Err(Error::Child(Box::new(ChildError::new(
                (StartMethod::Warm, pid.as_raw() as u32),
                (status, false),
                None,
                None,
                Observed {
                    notes: vec![format!(
                        "{deaths} warm children died while they waited; this one was the last"
                    )],
                    ..Observed::default()
                },
                (stdout, stderr),
            ))));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Error::Timeout {
                what: format!("warming up the pool of {depth} warm children"),
                after: timeout,
            });
        }
        slot = lock();
        // Woken by a launch that completes; children's `Ready` reports are polled.
        slot = CHANGED
            .wait_timeout(slot, Duration::from_millis(2))
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .0;
    }
}

/// The pids of every child waiting in this process's warm pools (without starting any).
pub fn warm_pids() -> Vec<u32> {
    lock().as_ref().map_or_else(Vec::new, |state| {
        state
            .buckets
            .values()
            .flat_map(|bucket| bucket.waiting.iter())
            .map(|w| w.pid().as_raw() as u32)
            .collect()
    })
}

/// Start the default pool filling if it is not full; does not wait. For `#[ipc_test]` bodies
/// that run beside others: the first take finds children on their way.
pub(crate) fn prestart() {
    let mut slot = lock();
    let state = state(&mut slot);
    let (dead, refill) = prune_and_refill(state, &[]);
    drop(slot);
    let _ = start_launches(refill);
    drop(dead);
}

/// Wait (at most 10 s) until no background launch is in flight, so that the parent's fds are
/// what they will stay: for fd accounting.
pub(crate) fn quiesce() {
    let deadline = Instant::now() + QUIESCE_LIMIT;
    let mut slot = lock();
    loop {
        let busy = slot
            .as_ref()
            .is_some_and(|state| state.buckets.values().any(|b| b.launching > 0));
        let left = deadline.saturating_duration_since(Instant::now());
        if !busy || left.is_zero() {
            return;
        }
        slot = CHANGED
            .wait_timeout(slot, left)
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .0;
    }
}

/// A ready child from the pool for `env`, else the oldest waiting one, else a new one started
/// now; a replacement is launched in the background either way.
///
/// A ready child is handed out only once it has answered a [`Begin::Ping`]: a child killed
/// while it waited can keep its pidfd quiet and its channel open for as long as its teardown
/// takes, but it can never answer. One that does not is killed, reaped and replaced, and the
/// next is asked. (One still warming up is handed out as it is: see `Waiting::confirm`.)
pub(crate) fn take(env: &[(String, String)]) -> Result<Made> {
    let mut asked = 0;
    loop {
        let mut slot = lock();
        let state = state(&mut slot);
        let (test_binary, devices) = (state.test_binary, state.options.devices.clone());
        let depth = state.options.depth;
        let bucket = state.buckets.entry(env.to_vec()).or_default();
        let dead = prune(bucket);
        let index = bucket
            .waiting
            .iter()
            .position(|w| w.made().ready)
            .or((!bucket.waiting.is_empty()).then_some(0));
        // Asking more than a pool's worth in one take means they keep dying: start one now.
        let taken = index
            .filter(|_| asked <= depth + 1)
            .and_then(|i| bucket.waiting.remove(i));
        let refill = plan_refill(state, env);
        drop(slot);
        // Replacements first, so that they start while this child runs.
        let _ = start_launches(refill);
        drop(dead);
        match taken {
            Some(waiting) => match waiting.confirm() {
                Ok(made) => return Ok(made),
                // Killed and reaped on drop; ask the next.
                Err(dead) => {
                    drop(dead);
                    asked += 1;
                }
            },
            // None waiting (the pool is off, used up, or its children died): start one now.
            None => {
                let (launch, pending) = prepare(env, &devices, test_binary)?;
                let pid = launch::launch(launch)?;
                return Ok(pending.finish(pid));
            }
        }
    }
}

/// One launch to start: what to exec, and where its completion goes.
struct Refill {
    launch: Launch,
    pending: Pending,
    env: Vec<(String, String)>,
    generation: u64,
}

/// Take the dead children out of `bucket` (to be reaped outside the lock), reading the others'
/// `Ready` reports.
fn prune(bucket: &mut Bucket) -> Vec<Waiting> {
    let mut dead = Vec::new();
    let mut alive = VecDeque::with_capacity(bucket.waiting.len());
    for mut waiting in bucket.waiting.drain(..) {
        match waiting.check() {
            Health::Alive => alive.push_back(waiting),
            Health::Dead => dead.push(waiting),
        }
    }
    bucket.waiting = alive;
    dead
}

/// Plan launches that bring `env`'s bucket up to the depth (counted as launching from now on).
fn plan_refill(state: &mut State, env: &[(String, String)]) -> Vec<Refill> {
    let depth = state.options.depth;
    let generation = state.generation;
    let test_binary = state.test_binary;
    let devices = state.options.devices.clone();
    let bucket = state.buckets.entry(env.to_vec()).or_default();
    let mut refill = Vec::new();
    while bucket.waiting.len() + bucket.launching < depth {
        match prepare(env, &devices, test_binary) {
            Ok((launch, pending)) => {
                bucket.launching += 1;
                refill.push(Refill {
                    launch,
                    pending,
                    env: env.to_vec(),
                    generation,
                });
            }
            Err(error) => {
                bucket.failed = Some(error);
                break;
            }
        }
    }
    refill
}

/// [`prune`] and [`plan_refill`] for `env`.
fn prune_and_refill(state: &mut State, env: &[(String, String)]) -> (Vec<Waiting>, Vec<Refill>) {
    let dead = prune(state.buckets.entry(env.to_vec()).or_default());
    (dead, plan_refill(state, env))
}

/// Queue `refill`'s launches on the launcher thread; each adds its child to its bucket when
/// done. Call it without the state's lock held (its error path takes it). The first error (the
/// launcher thread is gone) is returned; the launch counts are reset.
fn start_launches(refill: Vec<Refill>) -> Result<()> {
    for Refill {
        launch,
        pending,
        env,
        generation,
    } in refill
    {
        let queued = launch::launch_then(launch, move |launched| {
            let finished = launched.map(|pid| pending.finish(pid));
            let discard = {
                let mut slot = lock();
                let state = state(&mut slot);
                let current = state.generation == generation;
                let bucket = state.buckets.entry(env).or_default();
                if current {
                    bucket.launching = bucket.launching.saturating_sub(1);
                }
                match finished {
                    Ok(made) if current => {
                        bucket.waiting.push_back(Waiting { made: Some(made) });
                        None
                    }
                    Ok(made) => Some(Waiting { made: Some(made) }),
                    Err(error) => {
                        if current {
                            bucket.failed = Some(error);
                        }
                        None
                    }
                }
            };
            CHANGED.notify_all();
            // A child of an older generation: killed and reaped, outside the lock.
            drop(discard);
        });
        if let Err(error) = queued {
            let mut slot = lock();
            for bucket in state(&mut slot).buckets.values_mut() {
                bucket.launching = 0;
            }
            return Err(error);
        }
    }
    Ok(())
}

/// The parent's half of a warm child being launched: its fds, until the pid is known.
struct Pending {
    channel: Channel,
    stdout: OwnedFd,
    stderr: OwnedFd,
}

impl Pending {
    fn finish(self, pid: Pid) -> Made {
        // Ours until reaped, so the pid is still this child.
        let pidfd = sys::pidfd_open(pid).ok();
        Made {
            pid,
            pidfd,
            channel: self.channel,
            stdout: self.stdout,
            stderr: self.stderr,
            ready: false,
        }
    }
}

/// What to exec for one warm child with `env`, warming `devices`, and the parent's fds for it.
fn prepare(
    env: &[(String, String)],
    devices: &[usize],
    test_binary: bool,
) -> Result<(Launch, Pending)> {
    let (ours, theirs) = Channel::pair()?;
    let (stdout, stderr) = output_memfds()?;
    let devices: Vec<String> = devices.iter().map(usize::to_string).collect();
    let launch = Launch {
        role: "warm",
        role_arg: Some(devices.join(",")),
        channel: theirs.into_fd(),
        output: Some((dup(&stdout)?, dup(&stderr)?)),
        test_name: test_binary.then(|| PLACEHOLDER_TEST.to_owned()),
        env: env.to_vec(),
    };
    Ok((
        launch,
        Pending {
            channel: ours,
            stdout,
            stderr,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_lists_parse() {
        assert_eq!(parse_devices("0").unwrap(), [0]);
        assert_eq!(parse_devices(" 1, 0 ,1").unwrap(), [0, 1]);
        assert!(parse_devices("none").unwrap().is_empty());
        assert!(parse_devices("").unwrap().is_empty());
        let Err(Error::InvalidArgument(message)) = parse_devices("gpu0") else {
            panic!("gpu0 must be refused");
        };
        assert!(message.contains(DEVICES_VAR), "{message}");
    }
}
