//! Closing fds a peer sent that nobody wants, off the caller's path.
//!
//! `close` runs code the file's sender chose (see [`super::defuse`]): a lingering TCP socket,
//! a Unix socket full of those, a FUSE file whose server never answers `FLUSH`. So the fds of
//! a refused message (and the unwanted fds of a message of the wrong kind, and whatever a
//! refused client sent before it was turned away) are first defused: every socket is made to
//! close without waiting and is closed at once, by the caller. Only what cannot be defused
//! (files that are not sockets; Unix sockets whose drain stopped at a bound) is handed to the
//! closer threads, which take fds from one queue: a closer stuck in one close holds that fd
//! and its thread, nothing else, and the next fd goes to a closer that is free (or to a new
//! one, once every closer has been stuck for [`STUCK`]).
//!
//! Why bounded, and what is left: a refused peer that can mount a FUSE file system (in a user
//! namespace of its own, or with `fusermount`) and never answers `FLUSH` pins one closer per
//! such fd, forever (the kernel waits for that answer uninterruptibly). At most
//! [`MAX_CLOSERS`] threads are pinned; behind them at most [`MAX_WAITING`] fds wait (so the
//! fds that peer costs this process are bounded); past that, the caller closes the fd itself
//! and waits with it. Sockets, the only hostile files an unprivileged peer can make block
//! without such a file system, never reach the closers unless the process is short of fds.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::defuse::defuse;

/// The closer threads' name (as `/proc/<pid>/task/<tid>/comm` shows it).
pub(crate) const THREAD_NAME: &str = "vmm-ipc-closer";

/// The most closer threads: each close that never returns holds one, so this bounds the
/// threads a hostile peer can pin.
pub(crate) const MAX_CLOSERS: usize = 8;

/// The most fds waiting for a closer: past that (every closer pinned and this many behind
/// them), [`close_later`] closes on the caller's thread, so that what a hostile peer sends
/// cannot hold an unbounded number of this process's fds.
pub(crate) const MAX_WAITING: usize = 256;

/// A closer's stack: it only calls `close`.
const STACK_SIZE: usize = 64 << 10;

/// A closer that has been inside one close this long is taken to be stuck on a hostile fd: only
/// then is another started for the fds waiting (so quick closes keep to one thread).
const STUCK: Duration = Duration::from_millis(100);

/// The closers' shared state.
struct Closers {
    queue: VecDeque<OwnedFd>,
    /// One entry per closer thread: since when it has been inside its current close (`None`:
    /// waiting for an fd).
    busy: Vec<Option<Instant>>,
    /// A watcher thread runs (see [`watch`]).
    watching: bool,
}

impl Closers {
    /// Whether fds wait while every closer is inside a close (not necessarily stuck yet).
    fn waiting(&self) -> bool {
        !self.queue.is_empty()
            && self.busy.len() < MAX_CLOSERS
            && self.busy.iter().all(Option::is_some)
    }

    /// Whether the fds waiting need another closer: none runs yet, or every one is stuck.
    fn short(&self) -> bool {
        !self.queue.is_empty()
            && self.busy.len() < MAX_CLOSERS
            && self
                .busy
                .iter()
                .all(|since| since.is_some_and(|since| since.elapsed() > STUCK))
    }
}

static CLOSERS: Mutex<Closers> = Mutex::new(Closers {
    queue: VecDeque::new(),
    busy: Vec::new(),
    watching: false,
});
static WORK: Condvar = Condvar::new();

/// Fds handed to [`close_later`] and not closed yet.
static PENDING: AtomicUsize = AtomicUsize::new(0);

/// Closer and watcher threads started since the process began (each has its own stack, which
/// the C library may keep mapped for reuse after the thread ends).
static STARTED: AtomicUsize = AtomicUsize::new(0);

/// How many closer and watcher threads were started so far: what a leak test allows a stack
/// mapping for, whether the thread still runs or has ended (a watcher ends once nothing waits).
pub(crate) fn started() -> usize {
    STARTED.load(Ordering::Acquire)
}

/// Start a closer or watcher thread running `body`; whether it started.
fn spawn(body: impl FnOnce() + Send + 'static) -> bool {
    let started = std::thread::Builder::new()
        .name(THREAD_NAME.into())
        .stack_size(STACK_SIZE)
        .spawn(body)
        .is_ok();
    if started {
        STARTED.fetch_add(1, Ordering::AcqRel);
    }
    started
}

/// How many fds handed to [`close_later`] are not closed yet (a close that blocks counts until
/// it returns): what `testing::settled_open_fds` waits for.
pub(crate) fn pending() -> usize {
    PENDING.load(Ordering::Acquire)
}

fn lock() -> MutexGuard<'static, Closers> {
    CLOSERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The watcher: fds wait while every closer is inside a close that may yet return; look again
/// every [`STUCK`] and become a closer once they are all stuck (or end once nothing waits), so
/// that waiting fds do not depend on another call of [`close_later`] to get a closer.
fn watch() {
    loop {
        std::thread::sleep(STUCK);
        let mut state = lock();
        if state.short() {
            let me = state.busy.len();
            state.busy.push(None);
            state.watching = false;
            drop(state);
            closer(me);
        } else if !state.waiting() {
            state.watching = false;
            return;
        }
    }
}

/// Closer thread `me`: take the next fd, close it, forever.
fn closer(me: usize) {
    let mut state = lock();
    loop {
        match state.queue.pop_front() {
            Some(fd) => {
                state.busy[me] = Some(Instant::now());
                drop(state);
                drop(fd);
                PENDING.fetch_sub(1, Ordering::AcqRel);
                state = lock();
                state.busy[me] = None;
            }
            None => state = WORK.wait(state).unwrap_or_else(|e| e.into_inner()),
        }
    }
}

/// Close `fds` without waiting for what their senders chose: defuse and close the sockets
/// here ([`super::defuse`]), and queue the rest for the closer threads (the first is started
/// on first use; another when fds wait and every closer has been stuck in one close for more
/// than [`STUCK`], up to [`MAX_CLOSERS`]). Past [`MAX_WAITING`] waiting fds,
/// or where no thread can be started, they are closed here: an fd is never kept open.
pub(crate) fn close_later(fds: Vec<OwnedFd>) {
    if fds.is_empty() {
        return;
    }
    let rest = defuse(fds);
    if rest.is_empty() {
        return;
    }
    let mut here = Vec::new();
    {
        let mut state = lock();
        for fd in rest {
            if state.queue.len() < MAX_WAITING {
                PENDING.fetch_add(1, Ordering::AcqRel);
                state.queue.push_back(fd);
            } else {
                here.push(fd);
            }
        }
        if state.short() {
            let me = state.busy.len();
            if spawn(move || closer(me)) {
                state.busy.push(None);
            }
        } else if state.waiting() && !state.watching {
            state.watching = spawn(watch);
        }
        if state.busy.is_empty() {
            // No closer could be started: close them here.
            PENDING.fetch_sub(state.queue.len(), Ordering::AcqRel);
            here.extend(state.queue.drain(..));
        }
        WORK.notify_all();
    }
    drop(here);
}
