//! One supervised child, as its parent sees it: its pid (and pidfd), its channel, its captured
//! output ([`Output`], read under the output cap), and what is known of its end. Every holder of a child (a [`Process`](super::Process),
//! a child waiting in the warm pool, a pool worker) keeps it as a [`Child`], and the
//! registry of an `#[ipc_test]` uses the same kill and reap, so that killing, reaping, waiting
//! by a deadline and reading output are written once.
//!
//! A spawned or warm child is ours: we reap it, and until then its pid cannot be reused, so it
//! may be signalled by pid when no pidfd could be had. A forkserver child is the server's: the
//! server reaps it and reports its status on the child's channel ([`Report::Exited`]), so here
//! it is only ever signalled through its pidfd (or while that report has not come).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

use super::StartMethod;
use super::ends::{ParentEnd, Received};
use super::output::Output;
use super::protocol::Report;
use super::status::ExitStatus;
use super::sys;
use crate::wire;
use crate::{Error, Result};

/// Once a forkserver child is known to have exited (its pidfd said so), how long the parent
/// waits for the server's report of its exit status before calling the status lost. Only a
/// dead or stuck server needs it: a live one reports within milliseconds.
pub(crate) const STATUS_REPORT_GRACE: Duration = Duration::from_secs(5);

/// Who reaps a child, and so where its exit status comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reaper {
    /// This process (spawn, warm): `waitpid`.
    Us,
    /// The forkserver: its [`Report::Exited`] on the child's channel.
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
pub(crate) enum State {
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

/// What the next packet on a child's channel is.
#[derive(Debug)]
pub(crate) enum Incoming {
    /// A report, with the fds its packet carried.
    Report(Report, Vec<OwnedFd>),
    /// Nothing queued.
    Empty,
    /// Every other end is closed: nothing more will come.
    HungUp,
    /// A packet that is not a report (it was consumed: reading may go on).
    NotAReport(String),
    /// Reading failed in a way that may repeat.
    Broken(Error),
}

/// A child of this process's making: see the module docs.
#[derive(Debug)]
pub(crate) struct Child {
    pid: Pid,
    reaper: Reaper,
    /// Watched for its exit, and used to signal it (never a recycled pid), where one could be
    /// had (not at the fd limit, say).
    pidfd: Option<Arc<OwnedFd>>,
    /// The parent's end of its channel (shared with whoever polls it without the holder's lock).
    channel: Arc<ParentEnd>,
    output: Output,
    state: State,
}

impl Child {
    /// A child of ours (spawn, warm), just started: a pidfd is opened for it here (ours until
    /// reaped, so the pid is still it). Without one it is watched by polling `waitpid`.
    pub(crate) fn ours(pid: Pid, channel: ParentEnd, output: Output) -> Child {
        let pidfd = sys::pidfd_open(pid).ok().map(Arc::new);
        Child::new(pid, Reaper::Us, pidfd, channel, output)
    }

    /// A child the forkserver forked, with the pidfd it sent for it, if any.
    pub(crate) fn forked(
        pid: Pid,
        pidfd: Option<OwnedFd>,
        channel: ParentEnd,
        output: Output,
    ) -> Child {
        Child::new(
            pid,
            Reaper::Forkserver,
            pidfd.map(Arc::new),
            channel,
            output,
        )
    }

    fn new(
        pid: Pid,
        reaper: Reaper,
        pidfd: Option<Arc<OwnedFd>>,
        channel: ParentEnd,
        output: Output,
    ) -> Child {
        Child {
            pid,
            reaper,
            pidfd,
            channel: Arc::new(channel),
            output,
            state: State::Running,
        }
    }

    pub(crate) fn pid(&self) -> Pid {
        self.pid
    }

    pub(crate) fn reaper(&self) -> Reaper {
        self.reaper
    }

    pub(crate) fn pidfd(&self) -> Option<&Arc<OwnedFd>> {
        self.pidfd.as_ref()
    }

    pub(crate) fn channel(&self) -> &Arc<ParentEnd> {
        &self.channel
    }

    pub(crate) fn output(&self) -> &Output {
        &self.output
    }

    /// Its exit status, once known.
    pub(crate) fn status(&self) -> Option<ExitStatus> {
        match self.state {
            State::Reaped(status) => Some(status),
            _ => None,
        }
    }

    /// Why its exit status will never be known, once that is certain.
    pub(crate) fn lost(&self) -> Option<&str> {
        match &self.state {
            State::Lost(why) => Some(why),
            _ => None,
        }
    }

    /// Whether its end is known: its status, or that it never will be.
    pub(crate) fn ended(&self) -> bool {
        matches!(self.state, State::Reaped(_) | State::Lost(_))
    }

    /// When it was seen to exit, while its status is not known yet.
    pub(crate) fn exited_at(&self) -> Option<Instant> {
        match self.state {
            State::Exited(at) => Some(at),
            _ => None,
        }
    }

    /// The forkserver reported its status.
    pub(crate) fn set_reaped(&mut self, status: ExitStatus) {
        self.state = State::Reaped(status);
    }

    /// Its status will never be known.
    pub(crate) fn set_lost(&mut self, why: String) {
        self.state = State::Lost(why);
    }

    /// SIGKILL it, unless its end is known already (then its pid may be another process's).
    pub(crate) fn kill(&self) -> Result<()> {
        if self.ended() {
            return Ok(());
        }
        kill_child(self.pid, self.pidfd.as_deref(), self.reaper)
    }

    /// Whether its pidfd says it has exited (without waiting); records when.
    pub(crate) fn poll_exited(&mut self) -> bool {
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

    /// Its pidfd became readable: it has exited.
    pub(crate) fn note_exited(&mut self) {
        if self.state == State::Running {
            self.state = State::Exited(Instant::now());
        }
    }

    /// Reap a child of ours if it has exited, without waiting. `true` once its end is known
    /// (reaped, or `waitpid` failed: then its status is lost).
    pub(crate) fn try_reap(&mut self) -> bool {
        debug_assert_eq!(self.reaper, Reaper::Us);
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

    /// Reap a child of ours, waiting for it to exit (kill it first, unless it is meant to exit
    /// by itself).
    pub(crate) fn reap(&mut self) {
        debug_assert_eq!(self.reaper, Reaper::Us);
        if self.ended() {
            return;
        }
        self.state = match reap_pid(self.pid) {
            Ok(status) => State::Reaped(status),
            Err(e) => State::Lost(e.to_string()),
        };
    }

    /// Whether it exits within `limit`: its pidfd becomes readable; without one, its channel
    /// hangs up (which for a forkserver child never happens while the server holds its copy).
    pub(crate) fn exits_within(&self, limit: Duration) -> bool {
        if self.ended() || self.exited_at().is_some() {
            return true;
        }
        match &self.pidfd {
            Some(pidfd) => pidfd_exits_within(pidfd, limit) == Some(true),
            None => wire::wait_hangup(self.channel.as_fd(), Some(Instant::now() + limit))
                .unwrap_or(false),
        }
    }

    /// End it for good: kill it (with `let_exit`, only if it does not exit by itself within
    /// [`STATUS_REPORT_GRACE`], so that its own exit status is what is known) and learn its
    /// status: reaped here, or a forkserver child's from the server's report, at most
    /// [`STATUS_REPORT_GRACE`] after the kill. Afterwards its end is known.
    pub(crate) fn end(&mut self, let_exit: bool) {
        if self.ended() {
            return;
        }
        if !let_exit || !self.exits_within(STATUS_REPORT_GRACE) {
            let _ = self.kill();
        }
        match self.reaper {
            Reaper::Us => self.reap(),
            Reaper::Forkserver => self.await_report(),
        }
    }

    /// Read the channel until the forkserver's [`Report::Exited`], for at most
    /// [`STATUS_REPORT_GRACE`]; anything else on it is dropped.
    fn await_report(&mut self) {
        let deadline = Instant::now() + STATUS_REPORT_GRACE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.channel.recv(Some(left)) {
                Ok(Received {
                    message: Report::Exited(status),
                    ..
                }) => {
                    self.state = State::Reaped(status);
                    return;
                }
                Ok(_) | Err(Error::Protocol { .. }) => {}
                Err(Error::Timeout { .. }) => {
                    self.state = State::Lost(format!(
                        "the forkserver did not report it within {STATUS_REPORT_GRACE:?}"
                    ));
                    return;
                }
                Err(_) => {
                    self.state = State::Lost("the forkserver died before reporting it".to_owned());
                    return;
                }
            }
        }
    }

    /// The next packet on its channel, decoded as a report.
    pub(crate) fn next_report(&self) -> Incoming {
        match self.channel.try_recv() {
            Ok(Some(received)) => Incoming::Report(received.message, received.fds),
            Ok(None) => Incoming::Empty,
            Err(Error::Disconnected(_)) => Incoming::HungUp,
            // The offending packet (not a report, say) was consumed.
            Err(Error::Protocol { message, .. }) => Incoming::NotAReport(message),
            Err(error) => Incoming::Broken(error),
        }
    }

    /// Whether it has begun to exit, by `/proc` (for a child of ours, not yet reaped, so the
    /// pid is still it): its main thread is a zombie or marked exiting (`PF_EXITING` in
    /// `/proc/<pid>/stat`'s flags), while its other threads (a CUDA context's) may still be
    /// tearing down.
    pub(crate) fn exiting(&self) -> bool {
        const PF_EXITING: u64 = 0x4;
        // Without /proc nothing is known here.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) else {
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

    /// The program it runs, if it is not this executable (it exec'd). Only meaningful while
    /// it is known not to have been reaped, so that its pid is still it.
    pub(crate) fn foreign_program(&self) -> Option<String> {
        let ours = std::fs::read_link("/proc/self/exe").ok()?;
        let theirs = std::fs::read_link(format!("/proc/{}/exe", self.pid)).ok()?;
        (ours != theirs).then(|| theirs.display().to_string())
    }
}

/// A child nobody ended is killed and reaped (a forkserver child: its status awaited), so that
/// none outlives its holder.
impl Drop for Child {
    fn drop(&mut self) {
        self.end(false);
    }
}

/// A child just made, waiting for its first message.
#[derive(Debug)]
pub(crate) struct NewChild {
    pub child: Child,
    /// Its `Ready` report (a warm child's) has been read already.
    pub ready: bool,
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
