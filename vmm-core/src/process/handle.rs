//! The parent's handle on a child ([`Process`]): join with a timeout, kill, reap.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

use super::StartMethod;
use super::protocol::Report;
use super::status::{ChildError, ExitStatus, Observed, Outcome};
use super::sys;
use super::tracker::{Fate, FateCell};
use crate::wire::{self, Channel, Message};
use crate::{Error, Result};

/// Once a forkserver child is known to have exited (its pidfd said so), how long the parent
/// waits for the server's report of its exit status before calling the status lost. Only a
/// dead or stuck server needs it: a live one reports within milliseconds.
pub(crate) const STATUS_REPORT_GRACE: Duration = Duration::from_secs(5);

/// While a spawned child cannot be watched through a pidfd (none could be opened, at the fd
/// limit say), how often `waitpid` is asked whether it has exited.
const REAP_POLL: Duration = Duration::from_millis(10);

/// The most packets read from a channel in one go, so that a flood from whatever holds the
/// child's end (a process it forked) cannot keep a wait from ending.
const DRAIN_MAX: usize = 1024;

/// What is known of the parent's end of the child's channel.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ChannelState {
    /// Something may still write to it.
    Open,
    /// Every other end is closed: only what is queued remains.
    HungUp,
    /// Reading it failed in a way that may repeat; it is no longer read.
    Broken,
}

/// A running child process.
///
/// Dropping a `Process` that was not joined kills and reaps the child, so a child never
/// outlives the code that started it. Its stdout and stderr are captured; on a clean exit
/// [`join`](Self::join) replays them into this process's (test-captured) stdout and stderr,
/// on failure they are part of the [`ChildError`].
///
/// The parent watches the child process itself (through a pidfd, or `waitpid`), not only its
/// channel: whatever the child does to its channel (writes packets that are not reports, closes
/// it by `exec`, hands it to a process it forks), `join` returns by its deadline and the child
/// is reaped.
#[derive(Debug)]
pub struct Process {
    pid: Pid,
    method: StartMethod,
    channel: Channel,
    stdout: OwnedFd,
    stderr: OwnedFd,
    /// A pidfd for the child where one could be had: watched for its exit, and used to signal
    /// it (never a recycled pid). Forkserver children: the server reaps them; spawned children
    /// are ours until we reap them.
    pidfd: Option<Arc<OwnedFd>>,
    /// Shared with the registry of the `#[ipc_test]` that started it, if any.
    fate: Arc<FateCell>,
    default_timeout: Duration,
    started: bool,
    /// A warm child's `Ready` report was seen (it may come before `Started`, once).
    ready_seen: bool,
    outcome: Option<Outcome>,
    status: Option<ExitStatus>,
    /// Why the exit status will never be known, once that is certain.
    status_unknown: Option<String>,
    channel_state: ChannelState,
    /// The first way the child broke the protocol on its channel, and how many more followed.
    violation: Option<(String, usize)>,
    /// The child closed its channel while still running, before reporting how its function
    /// ended.
    channel_closed_early: bool,
    exec_program: Option<String>,
    /// When the child was seen to have exited (its pidfd became readable).
    exited_at: Option<Instant>,
}

impl Process {
    pub(crate) fn new(
        pid: Pid,
        method: StartMethod,
        channel: Channel,
        (stdout, stderr): (OwnedFd, OwnedFd),
        pidfd: Option<Arc<OwnedFd>>,
        fate: Arc<FateCell>,
        default_timeout: Duration,
    ) -> Process {
        Process {
            pid,
            method,
            channel,
            stdout,
            stderr,
            pidfd,
            fate,
            default_timeout,
            started: false,
            ready_seen: method != StartMethod::Warm,
            outcome: None,
            status: None,
            status_unknown: None,
            channel_state: ChannelState::Open,
            violation: None,
            channel_closed_early: false,
            exec_program: None,
            exited_at: None,
        }
    }

    /// Send the child its start message (see `Context::spawn`: the child waits for it).
    pub(crate) fn send_start(
        &self,
        bytes: &[u8],
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<()> {
        self.channel.send(bytes, fds)
    }

    /// A warm child whose `Ready` report the pool already took: another one is out of turn.
    pub(crate) fn set_ready_seen(&mut self) {
        self.ready_seen = true;
    }

    /// The child will never get its start message: kill and reap it, as intended (no fate to
    /// report).
    pub(crate) fn abandon(self) {
        self.fate.set(Fate::Killed);
        drop(self);
    }

    /// The pidfd, for the registry.
    pub(crate) fn pidfd(&self) -> Option<&Arc<OwnedFd>> {
        self.pidfd.as_ref()
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.pid.as_raw() as u32
    }

    /// The start method it was started with.
    pub fn method(&self) -> StartMethod {
        self.method
    }

    /// Kill the child (SIGKILL). It is reaped by [`join`](Self::join) or on drop.
    pub fn kill(&self) -> Result<()> {
        if self.finished() {
            return Ok(());
        }
        self.fate.set(Fate::Killed);
        self.signal_kill()
    }

    fn signal_kill(&self) -> Result<()> {
        if self.fate.get() == Fate::Reaped || self.finished() {
            return Ok(());
        }
        match &self.pidfd {
            Some(pidfd) => sys::pidfd_kill(pidfd),
            None if self.method.is_direct_child() => match kill(self.pid, Signal::SIGKILL) {
                Ok(()) | Err(Errno::ESRCH) => Ok(()),
                Err(e) => Err(Error::errno(format!("kill({}, SIGKILL)", self.pid), e)),
            },
            // No pidfd (old kernel): the server may have reaped it and the pid been reused;
            // only signal while the server has not reported its exit, which we just checked.
            None => kill(self.pid, Signal::SIGKILL).or(Ok(())),
        }
    }

    /// Wait up to the default timeout (`VMM_CHILD_TIMEOUT`, else 60 s); see [`join`](Self::join).
    pub fn wait(self) -> Result<ExitStatus> {
        let timeout = self.default_timeout;
        self.join(timeout)
    }

    /// Wait for the child to exit, at most `timeout`; past it, kill and reap it.
    ///
    /// `Ok` only for a child that acknowledged its start, returned from its function, exited
    /// with code 0 and kept to the protocol on its channel; anything else is [`Error::Child`]
    /// with the whole story ([`ChildError::timed_out`], [`ChildError::protocol_violation`],
    /// [`ChildError::exec_program`]...).
    ///
    /// `join` ends when the child process has exited and its reports are read, whatever else
    /// holds its channel (a process the child forked may keep a copy open; that neither delays
    /// `join` nor fails it). It returns by `timeout` plus the time the kill takes: for a spawned
    /// or warm child, until the kernel has ended it; for a forkserver child, until the server reports
    /// its exit, at most 5 s after its death (a dead server's children die with it, and their
    /// status is then unknown). A `timeout` too large to represent (`Duration::MAX`) waits
    /// forever.
    pub fn join(mut self, timeout: Duration) -> Result<ExitStatus> {
        let timed_out = self.wait_until(Instant::now().checked_add(timeout));
        if self.fate.get() == Fate::Running {
            self.fate.set(Fate::Finished);
        }
        let clean = self.started
            && matches!(self.outcome, Some(Outcome::Returned))
            && self.status.is_some_and(ExitStatus::success)
            && self.violation.is_none()
            && !timed_out;
        let (stdout, stderr) = (read_all(&self.stdout), read_all(&self.stderr));
        if clean {
            print!("{stdout}");
            eprint!("{stderr}");
            return Ok(ExitStatus::Exited(0));
        }
        let observed = Observed {
            protocol_violation: self.violation.take().map(|(first, more)| match more {
                0 => first,
                n => format!("{first} (and {n} more such packets)"),
            }),
            exec_program: self.exec_program.take(),
            status_unknown: self.status_unknown.take(),
            channel_closed_early: self.channel_closed_early,
            notes: Vec::new(),
        };
        Err(Error::Child(Box::new(ChildError::new(
            (self.method, self.pid()),
            (self.status, self.started),
            self.outcome.take(),
            timed_out.then_some(timeout),
            observed,
            (stdout, stderr),
        ))))
    }

    /// Whether the child's end is known (its status, or that it never will be).
    fn finished(&self) -> bool {
        self.status.is_some() || self.status_unknown.is_some()
    }

    /// Read reports and watch the child until its end is known. Past `deadline` (`None`:
    /// never), kill it and keep going until it has been reaped. Returns whether the deadline
    /// passed. Never fails: what goes wrong is recorded (`status_unknown`, `violation`).
    fn wait_until(&mut self, deadline: Option<Instant>) -> bool {
        let mut timed_out = false;
        loop {
            self.drain();
            if self.finished() || self.end_known() {
                return timed_out;
            }
            match self.wait_event(deadline.filter(|_| !timed_out)) {
                Ok(true) => {}
                Ok(false) => {
                    timed_out = true;
                    if self.channel_state != ChannelState::Open && self.outcome.is_none() {
                        self.channel_closed_early = true;
                    }
                    self.note_exec();
                    if let Err(e) = self.signal_kill() {
                        self.give_up(format!("killing it at the timeout failed: {e}"));
                        return timed_out;
                    }
                }
                Err(e) => {
                    self.give_up(format!("watching it failed: {e}"));
                    return timed_out;
                }
            }
        }
    }

    /// Whether the child's end is known from the outside: a spawned child has been reaped; a
    /// forkserver child's status will never come. Records what it learns.
    fn end_known(&mut self) -> bool {
        match self.method {
            StartMethod::Spawn | StartMethod::Warm => {
                if self.fate.get() == Fate::Reaped {
                    self.status_unknown = Some(
                        "the test's registry killed and reaped it, its Process having outlived \
                         the test"
                            .into(),
                    );
                    return true;
                }
                match waitpid(self.pid, Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::Exited(_, code)) => self.status = Some(ExitStatus::Exited(code)),
                    Ok(WaitStatus::Signaled(_, signal, _)) => {
                        self.status = Some(ExitStatus::Signaled(signal as i32))
                    }
                    Ok(_) | Err(Errno::EINTR) => {
                        if self.channel_state == ChannelState::HungUp && self.outcome.is_none() {
                            // Its channel closed while it runs: it may have exec'd.
                            self.note_exec();
                        }
                        return false;
                    }
                    Err(e) => {
                        self.status_unknown = Some(format!("waitpid({}) failed: {e}", self.pid));
                        return true;
                    }
                }
                // Everything it wrote before it exited is queued by now.
                self.drain();
                true
            }
            StartMethod::Forkserver => {
                let why = if self.channel_state == ChannelState::HungUp {
                    "the forkserver died before reporting it".to_owned()
                } else if self
                    .exited_at
                    .is_some_and(|at| at.elapsed() >= STATUS_REPORT_GRACE)
                {
                    format!(
                        "the forkserver did not report it within {STATUS_REPORT_GRACE:?} of the \
                         child's death"
                    )
                } else if self.channel_state == ChannelState::Broken && self.pidfd.is_none() {
                    "its channel could not be read, and there is no pidfd to watch it by".into()
                } else {
                    return false;
                };
                self.status_unknown = Some(why);
                true
            }
        }
    }

    /// Sleep until the channel has something (or hangs up), the child exits, or `deadline`
    /// passes. `Ok(false)` only when `deadline` passed.
    fn wait_event(&mut self, deadline: Option<Instant>) -> Result<bool> {
        let watch_channel = self.channel_state == ChannelState::Open;
        let watch_pidfd = self.exited_at.is_none();
        let pidfd = self.pidfd.as_deref().filter(|_| watch_pidfd);
        let mut until = deadline;
        let mut tick = None;
        if self.method == StartMethod::Forkserver
            && let Some(at) = self.exited_at
        {
            let grace_end = at + STATUS_REPORT_GRACE;
            until = Some(until.map_or(grace_end, |d| d.min(grace_end)));
        }
        if self.method.is_direct_child() && pidfd.is_none() {
            tick = Some(REAP_POLL);
        }
        let mut fds = Vec::with_capacity(2);
        if watch_channel {
            fds.push(PollFd::new(self.channel.as_fd(), PollFlags::POLLIN));
        }
        if let Some(pidfd) = pidfd {
            fds.push(PollFd::new(pidfd.as_fd(), PollFlags::POLLIN));
        }
        if fds.is_empty() && until.is_none() && tick.is_none() {
            return Err(Error::Protocol(
                "nothing left to watch the child by (its channel is closed and there is no \
                 pidfd)"
                    .into(),
            ));
        }
        let mut left = until.map(|u| u.saturating_duration_since(Instant::now()));
        if let Some(tick) = tick {
            left = Some(left.map_or(tick, |l| l.min(tick)));
        }
        // Round up so that a wait never ends before its deadline.
        let timeout = match left {
            None => PollTimeout::NONE,
            Some(left) => PollTimeout::try_from(left.as_nanos().div_ceil(1_000_000))
                .unwrap_or(PollTimeout::MAX),
        };
        let woke = match poll(&mut fds, timeout) {
            Ok(n) => n > 0,
            Err(Errno::EINTR) => return Ok(true),
            Err(e) => return Err(Error::errno("poll(child channel, pidfd)", e)),
        };
        if woke && pidfd.is_some() {
            let pidfd_ready = fds
                .last()
                .and_then(PollFd::revents)
                .is_some_and(|r| !r.is_empty());
            if pidfd_ready {
                self.exited_at = Some(Instant::now());
            }
        }
        drop(fds);
        Ok(woke || deadline.is_none_or(|d| Instant::now() < d))
    }

    /// Read every queued packet (at most [`DRAIN_MAX`]), taking reports and recording
    /// violations; notes a hang-up.
    fn drain(&mut self) {
        let mut hang_ups = 0;
        for _ in 0..DRAIN_MAX {
            if self.channel_state == ChannelState::Broken {
                return;
            }
            match self.channel.try_recv() {
                Ok(Some(message)) => self.take(message),
                Ok(None) => return,
                Err(Error::Disconnected(_)) => {
                    self.channel_state = ChannelState::HungUp;
                    // An empty packet from a peer that closed right after reads like the
                    // hang-up itself: one more read tells them apart.
                    hang_ups += 1;
                    if hang_ups > 1 {
                        return;
                    }
                }
                // The offending packet was consumed: keep reading.
                Err(Error::Protocol(why)) => self.violate(why),
                Err(e) => {
                    self.violate(format!("reading its channel failed: {e}"));
                    self.channel_state = ChannelState::Broken;
                }
            }
        }
    }

    fn take(&mut self, message: Message) {
        let fds = message.fds.len();
        let report = wire::decode::<Report>(&message.bytes, Vec::new());
        drop(message); // closes any fds it carried
        let report = match report {
            Ok(report) if fds == 0 => report,
            Ok(report) => {
                return self.violate(format!("a report carrying {fds} fds ({report:?})"));
            }
            Err(e) => {
                return self.violate(format!("a packet that is not a report ({fds} fds): {e}"));
            }
        };
        match report {
            Report::Ready if !self.ready_seen && !self.started => self.ready_seen = true,
            Report::Started if !self.started => self.started = true,
            Report::Finished(outcome) if self.outcome.is_none() => self.outcome = Some(outcome),
            Report::Exited(status)
                if self.method == StartMethod::Forkserver && self.status.is_none() =>
            {
                self.status = Some(status)
            }
            other => self.violate(format!("a report out of turn ({other:?})")),
        }
    }

    fn violate(&mut self, why: String) {
        match &mut self.violation {
            Some((_, more)) => *more += 1,
            None => self.violation = Some((why, 0)),
        }
    }

    /// Record the program the child runs, if it is not this executable (it exec'd). Only
    /// called while the child is known not to have been reaped, so that its pid is still it.
    fn note_exec(&mut self) {
        if self.exec_program.is_some() || self.exited_at.is_some() {
            return;
        }
        let ours = std::fs::read_link("/proc/self/exe");
        let theirs = std::fs::read_link(format!("/proc/{}/exe", self.pid));
        if let (Ok(ours), Ok(theirs)) = (ours, theirs)
            && ours != theirs
        {
            self.exec_program = Some(theirs.display().to_string());
        }
    }

    /// Watching failed: end the child as surely as possible and record why.
    fn give_up(&mut self, why: String) {
        let _ = self.signal_kill();
        if self.method.is_direct_child() && self.fate.get() != Fate::Reaped {
            // SIGKILLed: this blocks only until the kernel has ended it.
            if let Ok(status) = reap(self.pid) {
                self.status = Some(status);
                return;
            }
        }
        self.status_unknown = Some(why);
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if !self.finished() {
            if self.fate.get() == Fate::Running {
                self.fate.set(Fate::DroppedRunning);
            }
            let _ = self.signal_kill();
            self.wait_until(None);
        } else if self.fate.get() == Fate::Running {
            self.fate.set(Fate::Finished);
        }
    }
}

fn reap(pid: Pid) -> Result<ExitStatus> {
    loop {
        match waitpid(pid, None) {
            Ok(WaitStatus::Exited(_, code)) => return Ok(ExitStatus::Exited(code)),
            Ok(WaitStatus::Signaled(_, signal, _)) => {
                return Ok(ExitStatus::Signaled(signal as i32));
            }
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(e) => return Err(Error::errno(format!("waitpid({pid})"), e)),
        }
    }
}

fn read_all(fd: &OwnedFd) -> String {
    let Ok(file) = fd.try_clone().map(File::from) else {
        return "(captured output unreadable: dup failed)".to_owned();
    };
    let mut out = Vec::new();
    let mut buf = [0u8; 64 * 1024];
    let mut offset = 0u64;
    while let Ok(n @ 1..) = file.read_at(&mut buf, offset) {
        out.extend_from_slice(&buf[..n]);
        offset += n as u64;
    }
    String::from_utf8_lossy(&out).into_owned()
}
