//! The parent's handle on a single-use child ([`Process`]): its reports, join with a timeout,
//! kill. Watching, killing and reaping the child itself is the [`Child`] it holds.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, poll};

use super::ends::Sealed;
use super::protocol::{Order, Report};
use super::status::{ChildError, ExitStatus, Observed, Outcome};
use super::supervisor::{ChannelEnd, Child, Flow, Packet, REAP_POLL, Read, Reaper, poll_timeout};
use super::tracker::{Fate, FateCell};
use crate::error::ProtocolRule;
use crate::error::StartMethod;
use crate::trace;
use crate::{Error, Result};

/// Why a child's status is unknown when the test's registry took it over.
const REGISTRY_REAPED: &str =
    "the test's registry killed and reaped it, its Process having outlived the test";

/// A running child process.
///
/// Dropping a `Process` that was not joined kills the child, so a child never outlives the
/// code that started it; the drop never waits for it (the child is reaped in the background,
/// as soon as the kernel has ended it, so it leaves no zombie). Its stdout and stderr are
/// captured; on a clean exit [`join`](Self::join) replays them into this process's
/// (test-captured) stdout and stderr, on failure they are part of the [`ChildError`].
///
/// The parent watches the child process itself (through a pidfd, or `waitpid`), not only its
/// channel: whatever the child does to its channel (writes packets that are not reports, closes
/// it by `exec`, hands it to a process it forks), `join` returns by its deadline and the child
/// is reaped.
#[derive(Debug)]
pub struct Process {
    child: Child,
    method: StartMethod,
    /// Shared with the registry of the `#[ipc_test]` that started it, if any.
    fate: Arc<FateCell>,
    default_timeout: Duration,
    /// What its reports said.
    heard: Heard,
    channel_state: ChannelEnd,
    /// The child closed its channel while still running, before reporting how its function
    /// ended.
    channel_closed_early: bool,
    exec_program: Option<String>,
}

impl Process {
    /// Hold `child`, started with `method`; `ready` when a warm child's `Ready` report was
    /// read already.
    pub(crate) fn new(
        child: Child,
        method: StartMethod,
        ready: bool,
        fate: Arc<FateCell>,
        default_timeout: Duration,
    ) -> Process {
        Process {
            child,
            method,
            fate,
            default_timeout,
            heard: Heard {
                started: false,
                ready_seen: ready || method != StartMethod::Warm,
                outcome: None,
                violation: None,
            },
            channel_state: ChannelEnd::Open,
            channel_closed_early: false,
            exec_program: None,
        }
    }

    /// Send the child its start message (see `Context::spawn`: the child waits for it).
    pub(crate) fn send_start(&self, start: &Sealed<Order>, fds: &[BorrowedFd<'_>]) -> Result<()> {
        self.child.channel().send_sealed(start, fds, None)
    }

    /// The child will never get its start message: kill it (reaped in the background), as
    /// intended (no fate to report).
    pub(crate) fn abandon(self) {
        self.fate.set(Fate::Killed);
        drop(self);
    }

    /// The pidfd, for the registry.
    pub(crate) fn pidfd(&self) -> Option<&Arc<OwnedFd>> {
        self.child.pidfd()
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.child.pid().as_raw() as u32
    }

    /// The start method it was started with.
    pub fn method(&self) -> StartMethod {
        self.method
    }

    /// Kill the child (SIGKILL). It is reaped by [`join`](Self::join), or in the background
    /// once dropped.
    pub fn kill(&self) -> Result<()> {
        if self.child.ended() {
            return Ok(());
        }
        self.fate.set(Fate::Killed);
        self.signal_kill()
    }

    fn signal_kill(&self) -> Result<()> {
        if self.fate.get() == Fate::Reaped {
            return Ok(());
        }
        self.child.kill()
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
        let _span = trace::span!(
            INFO,
            "process.join",
            method = self.method.name(),
            pid = self.pid()
        );
        let timed_out = self.wait_until(Instant::now().checked_add(timeout));
        if self.fate.get() == Fate::Running {
            self.fate.set(Fate::Finished);
        }
        let status = self.child.status();
        let clean = self.heard.started
            && matches!(self.heard.outcome, Some(Outcome::Returned(_)))
            && status.is_some_and(ExitStatus::success)
            && self.heard.violation.is_none()
            && !timed_out;
        let (stdout, stderr) = self.child.output().read();
        if clean {
            print!("{stdout}");
            eprint!("{stderr}");
            return Ok(ExitStatus::Exited(0));
        }
        let observed = Observed {
            protocol_violation: self.heard.violation.take().map(|(first, more)| match more {
                0 => first,
                n => format!("{first} (and {n} more such packets)"),
            }),
            exec_program: self.exec_program.take(),
            status_unknown: self.child.lost().map(str::to_owned),
            channel_closed_early: self.channel_closed_early,
            notes: Vec::new(),
        };
        Err(Error::Child(Box::new(ChildError::new(
            (self.method, self.pid()),
            (status, self.heard.started),
            self.heard.outcome.take(),
            timed_out.then_some(timeout),
            observed,
            (stdout, stderr),
        ))))
    }

    /// Read reports and watch the child until its end is known. Past `deadline` (`None`:
    /// never), kill it and keep going until it has been reaped. Returns whether the deadline
    /// passed. Never fails: what goes wrong is recorded (a lost status, `violation`).
    fn wait_until(&mut self, deadline: Option<Instant>) -> bool {
        let mut timed_out = false;
        loop {
            self.drain();
            if self.child.ended() || self.end_known() {
                return timed_out;
            }
            match self.wait_event(deadline.filter(|_| !timed_out)) {
                Ok(true) => {}
                Ok(false) => {
                    timed_out = true;
                    if self.channel_state != ChannelEnd::Open && self.heard.outcome.is_none() {
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

    /// Whether the child's end is known from the outside (the supervisor's
    /// [`Child::conclude`]: a spawned child has been reaped; a forkserver child's status will
    /// never come). Records what it learns.
    fn end_known(&mut self) -> bool {
        let ours = self.child.reaper() == Reaper::Us;
        if ours && self.fate.get() == Fate::Reaped {
            self.child.set_lost(REGISTRY_REAPED.into());
            return true;
        }
        if !self.child.conclude(self.channel_state) {
            if ours && self.channel_state == ChannelEnd::HungUp && self.heard.outcome.is_none() {
                // Its channel closed while it runs: it may have exec'd.
                self.note_exec();
            }
            return false;
        }
        if ours {
            // Reaped: everything it wrote before it exited is queued by now.
            self.drain();
        }
        true
    }

    /// Sleep until the channel has something (or hangs up), the child exits, or `deadline`
    /// passes. `Ok(false)` only when `deadline` passed.
    fn wait_event(&mut self, deadline: Option<Instant>) -> Result<bool> {
        let exited_at = self.child.exited_at();
        let watch_channel = self.channel_state == ChannelEnd::Open;
        let pidfd = self.child.pidfd().filter(|_| exited_at.is_none());
        let mut until = deadline;
        if let Some(due) = self.child.report_due() {
            until = Some(until.map_or(due, |d| d.min(due)));
        }
        let tick = (self.child.reaper() == Reaper::Us && pidfd.is_none()).then_some(REAP_POLL);
        let mut fds = Vec::with_capacity(2);
        if watch_channel {
            fds.push(PollFd::new(self.child.channel().as_fd(), PollFlags::POLLIN));
        }
        if let Some(pidfd) = pidfd {
            fds.push(PollFd::new(pidfd.as_fd(), PollFlags::POLLIN));
        }
        if fds.is_empty() && until.is_none() && tick.is_none() {
            return Err(Error::protocol(
                ProtocolRule::Internal,
                "nothing left to watch the child by (its channel is closed and there is no \
                 pidfd)",
            ));
        }
        if let Some(tick) = tick {
            let next = Instant::now() + tick;
            until = Some(until.map_or(next, |u| u.min(next)));
        }
        let woke = match poll(&mut fds, poll_timeout(until)) {
            Ok(n) => n > 0,
            Err(Errno::EINTR) => return Ok(true),
            Err(e) => return Err(Error::errno("poll(child channel, pidfd)", e)),
        };
        let pidfd_ready = woke
            && pidfd.is_some()
            && fds
                .last()
                .and_then(PollFd::revents)
                .is_some_and(|r| !r.is_empty());
        drop(fds);
        if pidfd_ready {
            self.child.note_exited();
        }
        Ok(woke || deadline.is_none_or(|d| Instant::now() < d))
    }

    /// Read every queued packet (at most `READ_MAX`), taking reports and recording
    /// violations; notes a hang-up.
    fn drain(&mut self) {
        if self.channel_state == ChannelEnd::Broken {
            return;
        }
        let heard = &mut self.heard;
        let read = self.child.read_reports(None, |packet| {
            heard.take(packet);
            Flow::Continue
        });
        match read {
            Read::HungUp => self.channel_state = ChannelEnd::HungUp,
            Read::Broken(e) => {
                self.heard
                    .violate(format!("reading its channel failed: {e}"));
                self.channel_state = ChannelEnd::Broken;
            }
            Read::Drained | Read::Stopped | Read::Exited => {}
        }
    }

    /// Record the program the child runs, if it is not this executable (it exec'd). Only
    /// called while the child is known not to have been reaped, so that its pid is still it.
    fn note_exec(&mut self) {
        if self.exec_program.is_none() && self.child.exited_at().is_none() {
            self.exec_program = self.child.foreign_program();
        }
    }

    /// Watching failed: end the child as surely as possible and record why.
    fn give_up(&mut self, why: String) {
        let _ = self.signal_kill();
        if self.child.reaper() == Reaper::Us && self.fate.get() != Fate::Reaped {
            // SIGKILLed: this blocks only until the kernel has ended it.
            self.child.reap();
            if self.child.status().is_some() {
                return;
            }
        }
        self.child.set_lost(why);
    }
}

/// Never waits: the child is killed and reaped in the background (see the supervisor).
impl Drop for Process {
    fn drop(&mut self) {
        if self.child.ended() {
            if self.fate.get() == Fate::Running {
                self.fate.set(Fate::Finished);
            }
            return;
        }
        if self.fate.get() == Fate::Reaped {
            // Its pid is no longer this child's: the child must not go to the orphan queue.
            self.child.set_lost(REGISTRY_REAPED.into());
            return;
        }
        if self.fate.get() == Fate::Running {
            self.fate.set(Fate::DroppedRunning);
        }
        // Dropping the child kills it (and hands it to the orphan queue).
    }
}

/// What reports a child sent (see [`Child::read_reports`]).
#[derive(Debug)]
struct Heard {
    started: bool,
    /// A warm child's `Ready` report was seen (it may come before `Started`, once).
    ready_seen: bool,
    outcome: Option<Outcome>,
    /// The first way the child broke the protocol on its channel, and how many more followed.
    violation: Option<(String, usize)>,
}

impl Heard {
    fn take(&mut self, packet: Packet) {
        match packet {
            Packet::Report(report, fds) if fds.is_empty() => self.report(report),
            // Closes the fds it carried.
            Packet::Report(report, fds) => {
                self.violate(format!("a report carrying {} fds ({report:?})", fds.len()))
            }
            Packet::NotAReport(why) => self.violate(why),
        }
    }

    fn report(&mut self, report: Report) {
        match report {
            Report::Ready if !self.ready_seen && !self.started => self.ready_seen = true,
            Report::Started if !self.started => self.started = true,
            Report::Finished(outcome) if self.outcome.is_none() => self.outcome = Some(outcome),
            // The forkserver's own `Exited` is the supervisor's (it never comes here).
            other => self.violate(format!("a report out of turn ({other:?})")),
        }
    }

    fn violate(&mut self, why: String) {
        match &mut self.violation {
            Some((_, more)) => *more += 1,
            None => self.violation = Some((why, 0)),
        }
    }
}
