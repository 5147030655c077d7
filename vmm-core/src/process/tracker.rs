//! Watching a scope's children from outside their [`Process`](super::Process)es: a child's
//! [`Fate`], shared with whoever tracks it, and the [`Tracker`] a [`Context`](super::Context)
//! tells of every child it starts (the `#[ipc_test]` runtime's registry, so that none outlives
//! its test unnoticed).

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use nix::unistd::Pid;

use super::supervisor::{Reaper, kill_child, pidfd_exits_within, reap_within};
use crate::error::StartMethod;

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
    /// The tracker killed and reaped it (its `Process` outlived the scope): the pid is no
    /// longer this child's, so the `Process` must never signal or wait for it again.
    Reaped = 4,
}

/// The fate of one child, shared by its `Process` and the tracker.
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

/// One child started through a tracked [`Context`](super::Context), as its tracker sees it.
#[derive(Debug)]
pub(crate) struct TrackedChild {
    pid: Pid,
    method: StartMethod,
    fate: Arc<FateCell>,
    /// The Process's pidfd, while the Process exists.
    pidfd: Option<Weak<OwnedFd>>,
}

impl TrackedChild {
    pub(crate) fn new(
        pid: Pid,
        method: StartMethod,
        fate: Arc<FateCell>,
        pidfd: Option<&Arc<OwnedFd>>,
    ) -> TrackedChild {
        TrackedChild {
            pid,
            method,
            fate,
            pidfd: pidfd.map(Arc::downgrade),
        }
    }

    pub(crate) fn pid(&self) -> Pid {
        self.pid
    }

    pub(crate) fn method(&self) -> StartMethod {
        self.method
    }

    pub(crate) fn fate(&self) -> Fate {
        self.fate.get()
    }

    /// SIGKILL it if it is still running (through the pidfd where its Process still holds
    /// one; an unreaped child of ours by pid; a forkserver child without a pidfd cannot be
    /// told from a reused pid, and is left to its Process). Best effort: a child that is gone
    /// already needs no signal.
    pub(crate) fn kill_if_running(&self) {
        if self.fate() != Fate::Running {
            return;
        }
        let reaper = Reaper::of(self.method);
        let pidfd = self.pidfd.as_ref().and_then(Weak::upgrade);
        if pidfd.is_some() || reaper == Reaper::Us {
            let _ = kill_child(self.pid, pidfd.as_deref(), reaper);
        }
    }

    /// Take it from its Process, which outlived the scope: it is seen dead (a child of ours
    /// reaped, a forkserver child's pidfd readable) within `limit` (`Some(false)`: not), or
    /// cannot be watched (`None`: no pidfd). Its Process never touches the pid again.
    pub(crate) fn take_over(&self, limit: Duration) -> Option<bool> {
        let dead = match Reaper::of(self.method) {
            Reaper::Us => Some(reap_within(self.pid, limit)),
            Reaper::Forkserver => self
                .pidfd
                .as_ref()
                .and_then(Weak::upgrade)
                .and_then(|pidfd| pidfd_exits_within(&pidfd, limit)),
        };
        self.fate.set(Fate::Reaped);
        dead
    }
}

/// Told of every child a [`Context`](super::Context) starts.
pub(crate) trait Tracker: Send + Sync + fmt::Debug {
    /// A child was started (and holds its start message).
    fn track(&self, child: TrackedChild);
}
