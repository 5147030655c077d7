//! The one supervisor of every child this process starts: how a child is watched, killed and
//! reaped, how its reports are read, and what becomes of one that nobody waits for.
//!
//! Every holder of a child (a [`Process`](super::Process), a child waiting in the warm pool, a
//! pool worker) keeps it as a [`Child`]: its pid (and pidfd), its channel, its captured output
//! ([`Output`], read under the output cap) and what is known of its end; the registry of an
//! `#[ipc_test]` uses the same kill and reap. What follows is written once, here.
//!
//! - **Who reaps.** A spawned or warm child is ours ([`Reaper::Us`]): we reap it with
//!   `waitpid`, and until then its pid cannot be reused, so it may be signalled by pid when no
//!   pidfd could be had. A forkserver child is the server's ([`Reaper::Forkserver`]): the
//!   server reaps it and reports its status on the child's channel ([`Report::Exited`]), so
//!   here it is only ever signalled through its pidfd (or by pid while that report has not
//!   come). [`Child::conclude`] is the one place that decides, without waiting, whether a
//!   child's end is known (reaped; reported; or its status lost), for `join` and for every
//!   [`Ending`] alike.
//! - **Reading reports.** [`Child::read_reports`] is the one loop over a child's channel, for
//!   `Process`, a pool worker, a warm child and a forkserver child's end alike: it hands each
//!   packet (a report and its fds, or a packet that is not a report) to the caller's closure,
//!   which says whether to go on; it reads at most [`READ_MAX`] packets, waits up to a deadline
//!   where asked, tells a hang-up from an empty packet, and takes the forkserver's `Exited`
//!   itself (it is the child's status, not the caller's business).
//! - **Ending.** [`Child::end`] kills the child (or, asked to, lets it exit by itself for up to
//!   [`STATUS_REPORT_GRACE`] first) and waits for its status: for the callers that want the
//!   status (`join`'s paths, the warm pool's story of a child that keeps dying). The same steps
//!   without waiting are an [`Ending`]: a pool's driver advances one for a worker whose status
//!   its task's error needs, polling what [`Child::ending_watch`] names, and never holds the
//!   pool's lock while it waits.
//! - **Dropping.** Dropping a `Child` whose end is not known never waits. The child is
//!   SIGKILLed (through its pidfd where there is one), reaped at once if it is a zombie
//!   already, and otherwise handed to the process-wide orphan queue with its pidfd (and, for a
//!   forkserver child, its channel, on which the server's report will come); its output files
//!   are closed at once, as nobody will read them. The queue is swept (without waiting) on
//!   every drop and every new child, as tokio's orphan queue is, and by one background thread,
//!   started when the queue gains an orphan and gone once it has been empty for half a second,
//!   that sleeps in `poll` on the orphans' pidfds and channels and on an eventfd that brings it
//!   new ones. No SIGCHLD handler: a pidfd says that a child has exited without taking a
//!   signal that the program may own. An orphan of ours is reaped as soon as its pidfd says it
//!   has exited, so none stays a zombie (where no thread can be started, the sweeps reap it at
//!   the next drop or child); a forkserver orphan's report is awaited at most
//!   [`STATUS_REPORT_GRACE`] after the kill. The queue's fds (its orphans' pidfds and channels, the thread's eventfd)
//!   are closed once it is empty: [`settle_orphans`] waits for that (fd accounting calls it).
//!
//! What a drop costs the code that drops (vmm-bench's `host-drop` group; medians of a few runs
//! on a loaded 2-core VM, indicative only): dropping a `Process` whose child runs took 10 to
//! 40 us (the SIGKILL through the pidfd, a `waitpid` that finds the child still alive, the
//! queue's lock; a drop that finds the reaper gone pays its thread's start, about 25 us more).
//! Killing and joining the same child, the blocking kill + reap that a drop did before the
//! orphan queue, took 100 to 200 us (for a forkserver child, until the server's report came),
//! and killing a bare `std::process::Child` of `sleep` and waiting for it 65 to 95 us. The
//! blocking drop's worst case was not its typical one: up to [`STATUS_REPORT_GRACE`] for a
//! forkserver child whose server did not report, and as long as the kernel took to end the
//! child (a CUDA context's teardown: hundreds of milliseconds), sometimes under a `Pool`'s lock.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

use super::StartMethod;
use super::output::Output;
use super::protocol::Report;
use super::status::ExitStatus;
use super::sys;
use crate::wire::{self, Channel};
use crate::{Error, Result};

/// Once a forkserver child is known to have exited (its pidfd said so) or was killed, how long
/// the parent waits for the server's report of its exit status before calling the status lost.
/// Only a dead or stuck server needs it: a live one reports within milliseconds. Also how long
/// a child asked to exit by itself ([`Child::end`] with `let_exit`) is given before it is killed.
pub(crate) const STATUS_REPORT_GRACE: Duration = Duration::from_secs(5);

/// While a child of ours cannot be watched through a pidfd (none could be opened, at the fd
/// limit say), how often `waitpid` is asked whether it has exited.
pub(crate) const REAP_POLL: Duration = Duration::from_millis(10);

/// The most packets [`Child::read_reports`] reads in one call, so that a flood from whatever
/// holds the child's end (a process it forked) cannot keep a reader from its other work.
pub(crate) const READ_MAX: usize = 1024;

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
enum State {
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

/// One packet from a child's channel, as [`Child::read_reports`] hands it over.
#[derive(Debug)]
pub(crate) enum Packet {
    /// A report, with the fds its packet carried.
    Report(Report, Vec<OwnedFd>),
    /// A packet that is not a report (consumed), and what was wrong with it.
    NotAReport(String),
}

/// What a [`Child::read_reports`] closure says after a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flow {
    Continue,
    Stop,
}

/// Why [`Child::read_reports`] returned.
#[derive(Debug)]
pub(crate) enum Read {
    /// The closure said [`Flow::Stop`].
    Stopped,
    /// Nothing more is queued (by the deadline, where one was given), or [`READ_MAX`] packets
    /// were read: reading may go on later.
    Drained,
    /// The forkserver reported the child's exit status (now known: [`Child::status`]).
    Exited,
    /// Every other end is closed: nothing more will come.
    HungUp,
    /// Reading failed in a way that may repeat.
    Broken(Error),
}

/// What reading a child's channel has found, for [`Child::conclude`].
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
/// child's killing and reaping is done here, for a held [`Child`] and an orphan alike.
#[derive(Debug)]
struct Proc {
    pid: Pid,
    reaper: Reaper,
    /// Watched for its exit, and used to signal it (never a recycled pid), where one could be
    /// had (not at the fd limit, say).
    pidfd: Option<Arc<OwnedFd>>,
    state: State,
}

/// A child of this process's making: see the module docs.
#[derive(Debug)]
pub(crate) struct Child {
    proc: Proc,
    /// The parent's end of its channel (shared with whoever polls it without the holder's lock).
    channel: Arc<Channel>,
    output: Output,
}

impl Child {
    /// A child of ours (spawn, warm), just started: a pidfd is opened for it here (ours until
    /// reaped, so the pid is still it). Without one it is watched by polling `waitpid`.
    pub(crate) fn ours(pid: Pid, channel: Channel, output: Output) -> Child {
        let pidfd = sys::pidfd_open(pid).ok().map(Arc::new);
        Child::new(pid, Reaper::Us, pidfd, channel, output)
    }

    /// A child the forkserver forked, with the pidfd it sent for it, if any.
    pub(crate) fn forked(
        pid: Pid,
        pidfd: Option<OwnedFd>,
        channel: Channel,
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
        channel: Channel,
        output: Output,
    ) -> Child {
        // A new child is a moment to reap the orphans that have exited since the last one.
        reap_orphans();
        Child {
            proc: Proc {
                pid,
                reaper,
                pidfd,
                state: State::Running,
            },
            channel: Arc::new(channel),
            output,
        }
    }

    pub(crate) fn pid(&self) -> Pid {
        self.proc.pid
    }

    pub(crate) fn reaper(&self) -> Reaper {
        self.proc.reaper
    }

    pub(crate) fn pidfd(&self) -> Option<&Arc<OwnedFd>> {
        self.proc.pidfd.as_ref()
    }

    pub(crate) fn channel(&self) -> &Arc<Channel> {
        &self.channel
    }

    pub(crate) fn output(&self) -> &Output {
        &self.output
    }

    /// Its exit status, once known.
    pub(crate) fn status(&self) -> Option<ExitStatus> {
        match self.proc.state {
            State::Reaped(status) => Some(status),
            _ => None,
        }
    }

    /// Why its exit status will never be known, once that is certain.
    pub(crate) fn lost(&self) -> Option<&str> {
        match &self.proc.state {
            State::Lost(why) => Some(why),
            _ => None,
        }
    }

    /// Whether its end is known: its status, or that it never will be.
    pub(crate) fn ended(&self) -> bool {
        self.proc.ended()
    }

    /// When it was seen to exit, while its status is not known yet.
    pub(crate) fn exited_at(&self) -> Option<Instant> {
        self.proc.exited_at()
    }

    /// Its status will never be known.
    pub(crate) fn set_lost(&mut self, why: String) {
        self.proc.state = State::Lost(why);
    }

    /// SIGKILL it, unless its end is known already (then its pid may be another process's).
    pub(crate) fn kill(&self) -> Result<()> {
        self.proc.kill()
    }

    /// Whether its pidfd says it has exited (without waiting); records when.
    pub(crate) fn poll_exited(&mut self) -> bool {
        self.proc.poll_exited()
    }

    /// Its pidfd became readable: it has exited.
    pub(crate) fn note_exited(&mut self) {
        self.proc.note_exited();
    }

    /// Learn, without waiting, whether its end is known now: the one place that says how a
    /// child's end becomes known. A child of ours is reaped if it has exited. A forkserver
    /// child's status is the server's `Exited` report, which reading its channel takes
    /// ([`read_reports`](Self::read_reports)); it is lost once the server has hung up
    /// (`channel` says what reading found), [`STATUS_REPORT_GRACE`] after the child was seen to
    /// exit ([`report_due`](Self::report_due)), or when its channel cannot be read and there is
    /// no pidfd to see it exit by. `true` once its end is known.
    pub(crate) fn conclude(&mut self, channel: ChannelEnd) -> bool {
        self.proc.conclude(channel)
    }

    /// When a forkserver child's status report stops being awaited, once it was seen to exit.
    pub(crate) fn report_due(&self) -> Option<Instant> {
        self.proc.report_due()
    }

    /// Reap a child of ours, waiting for it to exit (kill it first, unless it is meant to exit
    /// by itself).
    pub(crate) fn reap(&mut self) {
        debug_assert_eq!(self.proc.reaper, Reaper::Us);
        if self.ended() {
            return;
        }
        self.proc.state = match reap_pid(self.proc.pid) {
            Ok(status) => State::Reaped(status),
            Err(e) => State::Lost(e.to_string()),
        };
    }

    /// Read what its channel holds, handing each packet to `each` until it says
    /// [`Flow::Stop`]: at most [`READ_MAX`] packets, and, with `until`, waiting for packets
    /// until then (without it, only what is queued now). The forkserver's [`Report::Exited`]
    /// for a forkserver child (without fds, before its end is known) is not handed over: it
    /// is the child's status, recorded here, and reading stops ([`Read::Exited`]). Any other
    /// report, a forged `Exited` included, is `each`'s to judge.
    ///
    /// A hang-up reads like an empty packet from a peer that closed right after: one more
    /// read tells them apart, so a hang-up is reported only after what was queued before it.
    pub(crate) fn read_reports(
        &mut self,
        until: Option<Instant>,
        each: impl FnMut(Packet) -> Flow,
    ) -> Read {
        read_channel(&self.channel, &mut self.proc, until, each)
    }

    /// Start ending it without waiting: kill it now, or with `let_exit` give it
    /// [`STATUS_REPORT_GRACE`] to exit by itself first (so that its own exit status is what is
    /// known). Then [`advance_ending`](Self::advance_ending) until it says the end is known.
    pub(crate) fn start_ending(&mut self, let_exit: bool) -> Ending {
        Ending::start(&mut self.proc, let_exit)
    }

    /// Take the next steps of `ending` that need no waiting (reap, read the forkserver's
    /// report, kill once its time to exit by itself is up, give up on a report that is
    /// overdue). `true` once its end is known ([`status`](Self::status) or
    /// [`lost`](Self::lost)).
    pub(crate) fn advance_ending(&mut self, ending: &mut Ending) -> bool {
        let channel = Arc::clone(&self.channel);
        ending.advance(&mut self.proc, Some(&channel))
    }

    /// What to poll, and until when at the latest, before advancing `ending` again.
    pub(crate) fn ending_watch(&self, ending: &Ending) -> Watch {
        ending.watch(&self.proc, Some(&self.channel))
    }

    /// End it for good and learn its status, waiting: kill it (with `let_exit`, only if it does
    /// not exit by itself within [`STATUS_REPORT_GRACE`], so that its own exit status is what is
    /// known), then reap it here, or take a forkserver child's status from the server's report,
    /// at most [`STATUS_REPORT_GRACE`] after the kill. Afterwards its end is known. For callers
    /// that want the status; a drop never waits (module docs).
    pub(crate) fn end(&mut self, let_exit: bool) {
        let mut ending = self.start_ending(let_exit);
        while !self.advance_ending(&mut ending) {
            self.ending_watch(&ending).wait();
        }
    }

    /// Whether it has begun to exit, by `/proc` (for a child of ours, not yet reaped, so the
    /// pid is still it): its main thread is a zombie or marked exiting (`PF_EXITING` in
    /// `/proc/<pid>/stat`'s flags), while its other threads (a CUDA context's) may still be
    /// tearing down.
    pub(crate) fn exiting(&self) -> bool {
        const PF_EXITING: u64 = 0x4;
        // Without /proc nothing is known here.
        let Some((state, flags)) = proc_stat(self.proc.pid) else {
            return false;
        };
        matches!(state, 'Z' | 'X' | 'x') || flags & PF_EXITING != 0
    }

    /// The program it runs, if it is not this executable (it exec'd). Only meaningful while
    /// it is known not to have been reaped, so that its pid is still it.
    pub(crate) fn foreign_program(&self) -> Option<String> {
        let ours = std::fs::read_link("/proc/self/exe").ok()?;
        let theirs = std::fs::read_link(format!("/proc/{}/exe", self.proc.pid)).ok()?;
        (ours != theirs).then(|| theirs.display().to_string())
    }
}

/// A child whose end nobody learned never outlives its holder, and its drop never waits: it is
/// killed and, unless it can be reaped at once, handed to the orphan queue (module docs).
impl Drop for Child {
    fn drop(&mut self) {
        if self.ended() {
            return;
        }
        let (pid, reaper) = (self.proc.pid, self.proc.reaper);
        let handed_over = Proc {
            pid,
            reaper,
            pidfd: None,
            state: State::Lost("handed to the orphan queue".into()),
        };
        let proc = std::mem::replace(&mut self.proc, handed_over);
        // The server's report comes on the channel: it goes along. Ours needs none.
        let channel = (proc.reaper == Reaper::Forkserver).then(|| Arc::clone(&self.channel));
        adopt(proc, channel);
    }
}

/// A child just made, waiting for its first message.
#[derive(Debug)]
pub(crate) struct NewChild {
    pub child: Child,
    /// Its `Ready` report (a warm child's) has been read already.
    pub ready: bool,
}

impl Proc {
    fn ended(&self) -> bool {
        matches!(self.state, State::Reaped(_) | State::Lost(_))
    }

    fn exited_at(&self) -> Option<Instant> {
        match self.state {
            State::Exited(at) => Some(at),
            _ => None,
        }
    }

    fn kill(&self) -> Result<()> {
        if self.ended() {
            return Ok(());
        }
        kill_child(self.pid, self.pidfd.as_deref(), self.reaper)
    }

    fn poll_exited(&mut self) -> bool {
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

    fn note_exited(&mut self) {
        if self.state == State::Running {
            self.state = State::Exited(Instant::now());
        }
    }

    fn conclude(&mut self, channel: ChannelEnd) -> bool {
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

    fn report_due(&self) -> Option<Instant> {
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

/// The one loop that reads a child's channel: see [`Child::read_reports`].
fn read_channel(
    channel: &Channel,
    proc: &mut Proc,
    until: Option<Instant>,
    mut each: impl FnMut(Packet) -> Flow,
) -> Read {
    let mut hung_up = false;
    for _ in 0..READ_MAX {
        // Past a first hang-up, only what is queued counts.
        let packet = match next_packet(channel, until.filter(|_| !hung_up)) {
            Next::Packet(packet) => packet,
            Next::Empty if hung_up => return Read::HungUp,
            Next::Empty => return Read::Drained,
            Next::HungUp if hung_up => return Read::HungUp,
            Next::HungUp => {
                hung_up = true;
                continue;
            }
            Next::Broken(error) => return Read::Broken(error),
        };
        if let Packet::Report(Report::Exited(status), fds) = &packet
            && fds.is_empty()
            && proc.reaper == Reaper::Forkserver
            && !proc.ended()
        {
            proc.state = State::Reaped(*status);
            return Read::Exited;
        }
        if each(packet) == Flow::Stop {
            return Read::Stopped;
        }
    }
    if hung_up { Read::HungUp } else { Read::Drained }
}

/// What one read of a channel gave.
enum Next {
    Packet(Packet),
    /// Nothing queued (by the deadline, where there was one).
    Empty,
    HungUp,
    Broken(Error),
}

/// Read one packet: what is queued (`until` = `None`), or the first to come by `until`.
fn next_packet(channel: &Channel, until: Option<Instant>) -> Next {
    let received = match until {
        None => channel.try_recv(),
        Some(deadline) => {
            match channel.recv(Some(deadline.saturating_duration_since(Instant::now()))) {
                Ok(message) => Ok(Some(message)),
                Err(Error::Timeout { .. }) => Ok(None),
                Err(error) => Err(error),
            }
        }
    };
    let message = match received {
        Ok(Some(message)) => message,
        Ok(None) => return Next::Empty,
        Err(Error::Disconnected(_)) => return Next::HungUp,
        // The offending packet was consumed.
        Err(Error::Protocol { message, .. }) => return Next::Packet(Packet::NotAReport(message)),
        Err(error) => return Next::Broken(error),
    };
    let fds = message.fds.len();
    match wire::decode::<Report>(&message.bytes, Vec::new()) {
        Ok(report) => Next::Packet(Packet::Report(report, message.fds)),
        Err(e) => Next::Packet(Packet::NotAReport(format!(
            "a packet that is not a report ({fds} fds): {e}"
        ))),
    }
}

/// A child being ended without waiting: see [`Child::start_ending`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ending {
    /// Not killed yet: it may exit by itself until then (then it is killed). `None`: killed.
    kill_at: Option<Instant>,
    /// A forkserver child's: when its status report stops being awaited, counted from the
    /// kill (from its exit, where that is seen, [`Child::conclude`] counts too).
    report_by: Option<Instant>,
}

impl Ending {
    fn start(proc: &mut Proc, let_exit: bool) -> Ending {
        let mut ending = Ending {
            kill_at: Some(Instant::now() + STATUS_REPORT_GRACE),
            report_by: None,
        };
        if !let_exit {
            ending.kill_now(proc);
        }
        ending
    }

    fn kill_now(&mut self, proc: &mut Proc) {
        let now = Instant::now();
        // One seen to exit needs no signal (and a forkserver child's pid may be reused by now).
        if proc.exited_at().is_none() {
            let _ = proc.kill();
        }
        self.kill_at = None;
        if proc.reaper == Reaper::Forkserver && self.report_by.is_none() {
            self.report_by = Some(now + STATUS_REPORT_GRACE);
        }
    }

    /// See [`Child::advance_ending`]; `channel` carries a forkserver child's report.
    fn advance(&mut self, proc: &mut Proc, channel: Option<&Channel>) -> bool {
        if proc.ended() {
            return true;
        }
        let mut found = ChannelEnd::Open;
        if proc.reaper == Reaper::Forkserver {
            proc.poll_exited();
            if let Some(channel) = channel {
                // Anything else on the channel is dropped: only the status is awaited.
                match read_channel(channel, proc, None, |_| Flow::Continue) {
                    Read::Exited => return true,
                    // A channel that cannot be read will not carry the report either.
                    Read::HungUp | Read::Broken(_) => found = ChannelEnd::HungUp,
                    Read::Drained | Read::Stopped => {}
                }
            }
        }
        if proc.conclude(found) {
            return true;
        }
        let now = Instant::now();
        if self.kill_at.is_some_and(|at| now >= at) {
            self.kill_now(proc);
        }
        if self.report_by.is_some_and(|by| now >= by) {
            proc.state = State::Lost(format!(
                "the forkserver did not report it within {STATUS_REPORT_GRACE:?}"
            ));
            return true;
        }
        false
    }

    fn watch(&self, proc: &Proc, channel: Option<&Arc<Channel>>) -> Watch {
        let mut until = [self.kill_at, self.report_by, proc.report_due()]
            .into_iter()
            .flatten()
            .min();
        let (pidfd, channel) = match proc.reaper {
            Reaper::Us => {
                if proc.pidfd.is_none() {
                    let tick = Instant::now() + REAP_POLL;
                    until = Some(until.map_or(tick, |u| u.min(tick)));
                }
                (proc.pidfd.clone(), None)
            }
            // Its pidfd only until it is seen to exit (it stays readable); its report comes on
            // the channel.
            Reaper::Forkserver => (
                proc.pidfd.clone().filter(|_| proc.state == State::Running),
                channel.cloned(),
            ),
        };
        Watch {
            pidfd,
            channel,
            until,
        }
    }
}

/// What to poll before an [`Ending`] can advance: a pidfd (the child's exit), a channel (a
/// forkserver child's report), and when to look again at the latest (`None`: only when one
/// of them is ready).
#[derive(Debug, Clone)]
pub(crate) struct Watch {
    pidfd: Option<Arc<OwnedFd>>,
    channel: Option<Arc<Channel>>,
    until: Option<Instant>,
}

impl Watch {
    /// The fds to poll for readability.
    pub(crate) fn fds(&self) -> impl Iterator<Item = BorrowedFd<'_>> {
        self.pidfd
            .as_deref()
            .map(AsFd::as_fd)
            .into_iter()
            .chain(self.channel.as_deref().map(AsFd::as_fd))
    }

    /// When to look again at the latest.
    pub(crate) fn until(&self) -> Option<Instant> {
        self.until
    }

    /// Sleep until one of its fds is readable or its time is up.
    fn wait(&self) {
        wait_any(std::slice::from_ref(self), None, None);
    }
}

/// Sleep until an fd of `watches` or `wake` is readable, or the earliest time among them and
/// `cap` is up.
fn wait_any(watches: &[Watch], wake: Option<BorrowedFd<'_>>, cap: Option<Instant>) {
    let mut fds: Vec<PollFd<'_>> = wake
        .into_iter()
        .chain(watches.iter().flat_map(Watch::fds))
        .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
        .collect();
    let until = watches.iter().filter_map(Watch::until).chain(cap).min();
    if fds.is_empty() && until.is_none() {
        // Nothing to wait on (it cannot happen: a child is watched by pidfd, channel or time);
        // never sleep forever.
        std::thread::sleep(REAP_POLL);
        return;
    }
    match poll(&mut fds, poll_timeout(until)) {
        Ok(_) | Err(Errno::EINTR) => {}
        // Cannot watch: do not spin.
        Err(_) => std::thread::sleep(Duration::from_millis(1)),
    }
}

// ------------------------------------------------------------------------- the orphan queue

/// A dropped child whose end was not known yet: killed, to be reaped (or its report awaited).
#[derive(Debug)]
struct Orphan {
    proc: Proc,
    /// A forkserver child's channel, for the server's report.
    channel: Option<Arc<Channel>>,
    ending: Ending,
}

impl Orphan {
    fn advance(&mut self) -> bool {
        self.ending.advance(&mut self.proc, self.channel.as_deref())
    }

    fn watch(&self) -> Watch {
        self.ending.watch(&self.proc, self.channel.as_ref())
    }
}

/// How long the background reaper waits for a new orphan once the queue is empty, before it
/// ends: a program that drops children one after another starts it once, not once a drop.
const REAPER_LINGER: Duration = Duration::from_millis(500);

/// The process-wide orphan queue, and its background reaper.
#[derive(Debug)]
struct Orphans {
    list: Vec<Orphan>,
    /// A reaper thread is running (it clears this, under the lock, as it ends).
    reaping: bool,
    /// The running reaper's wake-up (an eventfd), if one could be made; closed when it ends.
    wake: Option<Arc<OwnedFd>>,
    /// The reaper is to end as soon as the queue is empty, without lingering
    /// ([`settle_orphans`]).
    end_when_empty: bool,
}

static ORPHANS: Mutex<Orphans> = Mutex::new(Orphans {
    list: Vec::new(),
    reaping: false,
    wake: None,
    end_when_empty: false,
});

/// How many orphans are queued (so that a new child looks at the queue only when it holds
/// some).
static QUEUED: AtomicUsize = AtomicUsize::new(0);

fn orphans() -> MutexGuard<'static, Orphans> {
    ORPHANS.lock().unwrap_or_else(|e| e.into_inner())
}

impl Orphans {
    /// Advance every orphan without waiting; forget those whose end is known.
    fn sweep(&mut self) {
        self.list.retain_mut(|orphan| !orphan.advance());
        QUEUED.store(self.list.len(), Ordering::Relaxed);
    }

    /// Have a reaper running, and tell it of what was queued.
    fn ensure_reaper(&mut self) {
        if self.reaping {
            self.wake_reaper();
            return;
        }
        // Without an eventfd (at the fd limit) the reaper looks for new orphans every
        // REAP_POLL instead.
        self.wake = sys::eventfd().ok().map(Arc::new);
        let started = std::thread::Builder::new()
            .name("vmm-ipc-reaper".into())
            .spawn(reap_in_background);
        match started {
            Ok(_) => self.reaping = true,
            // Swept on the next drop, the next child, or by `settle_orphans`.
            Err(_) => self.wake = None,
        }
    }

    fn wake_reaper(&self) {
        if let Some(wake) = &self.wake {
            let _ = nix::unistd::write(wake, &1u64.to_ne_bytes());
        }
    }
}

/// Take `proc` (killed now) into the orphan queue, unless it can be reaped at once.
fn adopt(proc: Proc, channel: Option<Arc<Channel>>) {
    let mut proc = proc;
    let ending = Ending::start(&mut proc, false);
    let mut orphan = Orphan {
        proc,
        channel,
        ending,
    };
    if orphan.advance() {
        return;
    }
    let mut orphans = orphans();
    orphans.sweep();
    orphans.list.push(orphan);
    QUEUED.store(orphans.list.len(), Ordering::Relaxed);
    orphans.ensure_reaper();
}

/// Reap the orphans that have exited, without waiting (and without waiting for the queue's
/// lock either: whoever holds it is sweeping).
pub(crate) fn reap_orphans() {
    if QUEUED.load(Ordering::Relaxed) == 0 {
        return;
    }
    if let Ok(mut orphans) = ORPHANS.try_lock() {
        orphans.sweep();
    }
}

/// The background reaper: sweep, then sleep on the orphans until one may have ended (or a new
/// one comes); gone once the queue has been empty for [`REAPER_LINGER`] (at once when
/// [`settle_orphans`] asks).
fn reap_in_background() {
    let mut empty_since: Option<Instant> = None;
    loop {
        let (watches, wake, mut cap) = {
            let mut orphans = orphans();
            orphans.sweep();
            let mut cap = None;
            if orphans.list.is_empty() {
                let since = *empty_since.get_or_insert_with(Instant::now);
                if orphans.end_when_empty || since.elapsed() >= REAPER_LINGER {
                    orphans.reaping = false;
                    orphans.end_when_empty = false;
                    // Closes the eventfd: its last reference (ours went with the last round).
                    orphans.wake = None;
                    return;
                }
                cap = Some(since + REAPER_LINGER);
            } else {
                empty_since = None;
            }
            let watches: Vec<Watch> = orphans.list.iter().map(Orphan::watch).collect();
            (watches, orphans.wake.clone(), cap)
        };
        if wake.is_none() {
            // Nothing tells it of new orphans: it looks for them.
            let tick = Instant::now() + REAP_POLL;
            cap = Some(cap.map_or(tick, |c| c.min(tick)));
        }
        wait_any(&watches, wake.as_deref().map(AsFd::as_fd), cap);
        if let Some(wake) = &wake {
            let mut drained = [0u8; 8];
            let _ = nix::unistd::read(wake, &mut drained);
        }
    }
}

/// Wait, at most `limit`, until the orphan queue is empty and its reaper gone (so that the fds
/// they held are closed): for fd accounting. Whether it is.
pub(crate) fn settle_orphans(limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        {
            let mut orphans = orphans();
            orphans.sweep();
            if orphans.list.is_empty() && !orphans.reaping {
                return true;
            }
            if orphans.list.is_empty() && !orphans.end_when_empty {
                // It lingers, or sleeps on fds of orphans swept meanwhile: it is to end now.
                orphans.end_when_empty = true;
                orphans.wake_reaper();
            }
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

// ------------------------------------------------------------------------- plain functions

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
fn proc_stat(pid: Pid) -> Option<(char, u64)> {
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

#[cfg(test)]
mod supervisor_tests;
