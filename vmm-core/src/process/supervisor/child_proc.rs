//! What is known of a child's end ([`Proc`]: its pid, pidfd, reaper and state), and the plain
//! calls on a child: kill it, reap it, wait for its exit, by deadline.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

use super::super::status::ExitStatus;
use super::super::sys;
use crate::error::StartMethod;
use crate::{Error, Result};

/// Once a forkserver child is known to have exited (its pidfd said so) or was killed, how long
/// the parent waits for the server's report of its exit status before calling the status lost.
/// Only a dead or stuck server needs it: a live one reports within milliseconds. Also how long
/// a child asked to exit by itself ([`Child::end`](super::Child::end) with `let_exit`) is given before it is killed.
pub(crate) const STATUS_REPORT_GRACE: Duration = Duration::from_secs(5);

/// While a child of ours cannot be watched through a pidfd (none could be opened, at the fd
/// limit say), how often `waitpid` is asked whether it has exited.
pub(crate) const REAP_POLL: Duration = Duration::from_millis(10);

/// Who reaps a child, and so where its exit status comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reaper {
    /// This process (spawn, warm): `waitpid`.
    Us,
    /// The forkserver: its [`Report::Exited`](super::super::protocol::Report::Exited) on the child's channel.
    Forkserver,
}

impl Reaper {
    /// Who reaps a child started with `method`.
    pub(crate) fn of(method: StartMethod) -> Reaper {
        if method.is_direct_child() {
            Reaper::Us
        } else {
            Reaper::Forkserver
        }
    }
}

/// What is known of a child's end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum State {
    /// Alive, as far as anything has told.
    Running,
    /// Its pidfd said it has exited, at this instant; its status is not known yet (a forkserver
    /// child's is on its way in the server's report; one of ours is about to be reaped).
    Exited(Instant),
    /// Reaped (here, or by the forkserver, which reported it), with its exit status.
    Reaped(ExitStatus),
    /// Its exit status will never be known, and why.
    Lost(String),
}

/// What reading a child's channel has found, for [`Child::conclude`](super::Child::conclude).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChannelEnd {
    /// Something may still write to it.
    Open,
    /// Every other end is closed: only what is queued remains.
    HungUp,
    /// Reading it failed in a way that may repeat; it is no longer read.
    Broken,
}

/// The process side of a child: pid, pidfd, who reaps it, what is known of its end. All a
/// child's killing and reaping is done here, for a held [`Child`](super::Child) and an orphan alike.
#[derive(Debug)]
pub(super) struct Proc {
    pub(super) pid: Pid,
    pub(super) reaper: Reaper,
    /// Watched for its exit, and used to signal it (never a recycled pid), where one could be
    /// had (not at the fd limit, say).
    pub(super) pidfd: Option<Arc<OwnedFd>>,
    pub(super) state: State,
}

impl Proc {
    pub(super) fn ended(&self) -> bool {
        matches!(self.state, State::Reaped(_) | State::Lost(_))
    }

    pub(super) fn exited_at(&self) -> Option<Instant> {
        match self.state {
            State::Exited(at) => Some(at),
            _ => None,
        }
    }

    pub(super) fn kill(&self) -> Result<()> {
        if self.ended() {
            return Ok(());
        }
        kill_child(self.pid, self.pidfd.as_deref(), self.reaper)
    }

    pub(super) fn poll_exited(&mut self) -> bool {
        if self.exited_at().is_some() {
            return true;
        }
        let Some(pidfd) = &self.pidfd else {
            return false;
        };
        if pidfd_exits_within(pidfd, Duration::ZERO) == Some(true) {
            self.note_exited();
            return true;
        }
        false
    }

    pub(super) fn note_exited(&mut self) {
        if self.state == State::Running {
            self.state = State::Exited(Instant::now());
        }
    }

    pub(super) fn conclude(&mut self, channel: ChannelEnd) -> bool {
        if self.ended() {
            return true;
        }
        if self.reaper == Reaper::Us {
            return self.try_reap();
        }
        let why = if channel == ChannelEnd::HungUp {
            "the forkserver died before reporting it".to_owned()
        } else if self.report_due().is_some_and(|due| Instant::now() >= due) {
            format!(
                "the forkserver did not report it within {STATUS_REPORT_GRACE:?} of the child's \
                 death"
            )
        } else if channel == ChannelEnd::Broken && self.pidfd.is_none() {
            "its channel could not be read, and there is no pidfd to watch it by".into()
        } else {
            return false;
        };
        self.state = State::Lost(why);
        true
    }

    pub(super) fn report_due(&self) -> Option<Instant> {
        match self.reaper {
            Reaper::Us => None,
            Reaper::Forkserver => self.exited_at().map(|at| at + STATUS_REPORT_GRACE),
        }
    }

    /// Reap a child of ours if it has exited, without waiting. `true` once its end is known
    /// (reaped, or `waitpid` failed: then its status is lost).
    fn try_reap(&mut self) -> bool {
        if self.ended() {
            return true;
        }
        match waitpid(self.pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(status) => match exit_status(status) {
                Some(status) => self.state = State::Reaped(status),
                None => return false,
            },
            Err(Errno::EINTR) => return false,
            Err(e) => self.state = State::Lost(format!("waitpid({}) failed: {e}", self.pid)),
        }
        true
    }
}

/// SIGKILL a child: through its pidfd where there is one; else by pid, which for a child of
/// ours (not yet reaped) is still it, and for a forkserver child is only signalled while its
/// status has not been reported (the caller's check).
pub(crate) fn kill_child(pid: Pid, pidfd: Option<&OwnedFd>, reaper: Reaper) -> Result<()> {
    match (pidfd, reaper) {
        (Some(pidfd), _) => sys::pidfd_kill(pidfd),
        (None, Reaper::Us) => match kill(pid, Signal::SIGKILL) {
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(e) => Err(Error::errno(format!("kill({pid}, SIGKILL)"), e)),
        },
        (None, Reaper::Forkserver) => kill(pid, Signal::SIGKILL).or(Ok(())),
    }
}

/// How a `waitpid` status ended a process, if it did.
pub(crate) fn exit_status(status: WaitStatus) -> Option<ExitStatus> {
    match status {
        WaitStatus::Exited(_, code) => Some(ExitStatus::Exited(code)),
        WaitStatus::Signaled(_, signal, _) => Some(ExitStatus::Signaled(signal as i32)),
        _ => None,
    }
}

/// Wait for a child of ours to exit and reap it.
pub(crate) fn reap_pid(pid: Pid) -> Result<ExitStatus> {
    loop {
        match waitpid(pid, None) {
            Ok(status) => {
                if let Some(status) = exit_status(status) {
                    return Ok(status);
                }
            }
            Err(Errno::EINTR) => {}
            Err(e) => return Err(Error::errno(format!("waitpid({pid})"), e)),
        }
    }
}

/// Reap `pid` (a child of ours) within `limit`, polling: `true` once reaped (or already gone).
pub(crate) fn reap_within(pid: Pid, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1))
            }
            Ok(WaitStatus::StillAlive) => return false,
            _ => return true,
        }
    }
}

/// Whether the process behind `pidfd` exits within `limit` (its pidfd becomes readable);
/// `None` when it cannot be watched.
pub(crate) fn pidfd_exits_within(pidfd: &OwnedFd, limit: Duration) -> Option<bool> {
    let deadline = Instant::now() + limit;
    let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
    loop {
        match poll(&mut fds, poll_timeout(Some(deadline))) {
            Ok(n) => return Some(n > 0),
            Err(Errno::EINTR) => continue,
            Err(_) => return None,
        }
    }
}

/// `/proc/<pid>/stat`'s state letter and flags, if it can be read.
pub(super) fn proc_stat(pid: Pid) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (which may hold spaces and parentheses): state, ppid, pgrp,
    // session, tty_nr, tpgid, flags.
    let (_, fields) = stat.rsplit_once(')')?;
    let mut fields = fields.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    let flags = fields
        .nth(5)
        .and_then(|f| f.parse::<u64>().ok())
        .unwrap_or(0);
    Some((state, flags))
}

/// The `poll` timeout that lasts until `deadline` (`None`: forever), rounded up so that a
/// wait never ends before its deadline.
pub(crate) fn poll_timeout(deadline: Option<Instant>) -> PollTimeout {
    match deadline.map(|d| d.saturating_duration_since(Instant::now())) {
        None => PollTimeout::NONE,
        Some(left) => {
            PollTimeout::try_from(left.as_nanos().div_ceil(1_000_000)).unwrap_or(PollTimeout::MAX)
        }
    }
}
