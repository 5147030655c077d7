//! Which children a scope (one `#[ipc_test]`) started, so that none outlives it unnoticed.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

use super::StartMethod;
use super::sys;

/// What became of a tracked child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Fate {
    Running = 0,
    /// Its exit was observed (joined, or dropped after it had exited).
    Finished = 1,
    /// `kill()` was called on it: whatever follows was intended.
    Killed = 2,
    /// Its `Process` was dropped while it ran, without `kill()`: it was killed by the drop.
    DroppedRunning = 3,
    /// The registry killed and reaped it (its `Process` outlived the scope): the pid is no
    /// longer this child's, so the `Process` must never signal or wait for it again.
    Reaped = 4,
}

/// The fate of one child, shared by its `Process` and the registry.
#[derive(Debug, Default)]
pub(crate) struct FateCell(AtomicU8);

impl FateCell {
    pub(crate) fn set(&self, fate: Fate) {
        self.0.store(fate as u8, Ordering::Release);
    }

    pub(crate) fn get(&self) -> Fate {
        match self.0.load(Ordering::Acquire) {
            0 => Fate::Running,
            1 => Fate::Finished,
            2 => Fate::Killed,
            3 => Fate::DroppedRunning,
            _ => Fate::Reaped,
        }
    }
}

#[derive(Debug)]
struct Entry {
    pid: Pid,
    method: StartMethod,
    fate: Arc<FateCell>,
    /// Forkserver children: the Process's pidfd, while the Process exists.
    pidfd: Option<Weak<OwnedFd>>,
}

/// The children started through one `Context` and its clones.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    entries: Mutex<Vec<Entry>>,
}

impl Registry {
    pub(crate) fn track(
        &self,
        pid: Pid,
        method: StartMethod,
        fate: Arc<FateCell>,
        pidfd: Option<&Arc<OwnedFd>>,
    ) {
        let entry = Entry {
            pid,
            method,
            fate,
            pidfd: pidfd.map(Arc::downgrade),
        };
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(entry);
    }

    /// Kill (through the pidfd where there is one) every child that is still running.
    pub(crate) fn kill_running(&self) {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        for entry in entries.iter().filter(|e| e.fate.get() == Fate::Running) {
            // Best effort: a child that is already gone needs no signal.
            let _ = match entry.pidfd.as_ref().and_then(Weak::upgrade) {
                Some(pidfd) => sys::pidfd_kill(&pidfd),
                // Unreaped children of ours: the pid cannot have been reused.
                None if entry.method.is_direct_child() => {
                    kill(entry.pid, Signal::SIGKILL).map_err(|e| crate::Error::errno("kill", e))
                }
                None => Ok(()),
            };
        }
    }

    /// End the scope: kill and reap children still running (their `Process` was leaked, or the
    /// scope timed out while they ran), and describe every child that was left running. A
    /// child is said to have been killed only once it is seen dead (reaped, or its pidfd
    /// readable), at most [`KILL_CONFIRM`] after the signal.
    pub(crate) fn finish(&self, timed_out: bool) -> Vec<String> {
        self.kill_running();
        let entries = std::mem::take(&mut *self.entries.lock().unwrap_or_else(|e| e.into_inner()));
        let mut problems = Vec::new();
        for entry in entries {
            let (pid, method) = (entry.pid, entry.method);
            match entry.fate.get() {
                Fate::Running => {
                    let dead = match method {
                        StartMethod::Spawn | StartMethod::Warm => reap_within(pid, KILL_CONFIRM),
                        StartMethod::Forkserver => match entry.pidfd.as_ref().and_then(Weak::upgrade) {
                            Some(pidfd) => exits_within(&pidfd, KILL_CONFIRM),
                            None => None,
                        },
                    };
                    entry.fate.set(Fate::Reaped);
                    let when = if timed_out {
                        "was still running at the timeout"
                    } else {
                        "was still running when the test ended (its Process was never dropped \
                         or joined)"
                    };
                    let end = match dead {
                        Some(true) => "it has been killed".to_owned(),
                        Some(false) => format!(
                            "it was sent SIGKILL but was still alive {KILL_CONFIRM:?} later"
                        ),
                        None => "it was sent SIGKILL (its death could not be watched: no pidfd)"
                            .to_owned(),
                    };
                    problems.push(format!("child {pid} ({method}) {when}; {end}"));
                }
                Fate::DroppedRunning => problems.push(format!(
                    "child {pid} ({method}) was still running when its Process was dropped; join it, \
                     or call kill() first if ending it early is intended"
                )),
                Fate::Finished | Fate::Killed | Fate::Reaped => {}
            }
        }
        problems
    }
}

/// How long [`Registry::finish`] waits to see a killed child dead.
const KILL_CONFIRM: Duration = Duration::from_secs(5);

/// Reap `pid` (a child of ours) within `limit`: `Some(true)` once reaped (or already gone).
fn reap_within(pid: Pid, limit: Duration) -> Option<bool> {
    let deadline = Instant::now() + limit;
    loop {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1))
            }
            Ok(WaitStatus::StillAlive) => return Some(false),
            _ => return Some(true),
        }
    }
}

/// Whether the process behind `pidfd` exits within `limit` (its pidfd becomes readable).
fn exits_within(pidfd: &OwnedFd, limit: Duration) -> Option<bool> {
    let ms = u16::try_from(limit.as_millis()).unwrap_or(u16::MAX);
    let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
    loop {
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(n) => return Some(n > 0),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return None,
        }
    }
}
