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
//!   server reaps it and reports its status on the child's channel ([`Report::Exited`](super::protocol::Report::Exited)), so
//!   here it is only ever signalled through its pidfd (or by pid while that report has not
//!   come). [`Child::conclude`] is the one place that decides, without waiting, whether a
//!   child's end is known (reaped; reported; or its status lost), for `join` and for every
//!   [`Ending`] alike.
//! - **Reading reports.** [`Child::read_reports`] is the one loop over a child's channel, for
//!   `Process`, a pool worker, a warm child and a forkserver child's end alike: it hands each
//!   packet (a report and its fds, or a packet that is not a report) to the caller's closure,
//!   which says whether to go on; it reads at most [`READ_MAX`](report_reader::READ_MAX) packets, waits up to a deadline
//!   where asked, tells a hang-up from an empty packet, and takes the forkserver's `Exited`
//!   itself (it is the child's status, not the caller's business).
//! - **Ending.** [`Child::end`] kills the child (or, asked to, lets it exit by itself for up to
//!   [`STATUS_REPORT_GRACE`](child_proc::STATUS_REPORT_GRACE) first) and waits for its status: for the callers that want the
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
//!   [`STATUS_REPORT_GRACE`](child_proc::STATUS_REPORT_GRACE) after the kill. The queue's fds (its orphans' pidfds and channels, the thread's eventfd)
//!   are closed once it is empty: [`settle_orphans`] waits for that (fd accounting calls it).
//!
//! What a drop costs the code that drops (vmm-bench's `host-drop` group; medians of a few runs
//! on a loaded 2-core VM, indicative only): dropping a `Process` whose child runs took 10 to
//! 40 us (the SIGKILL through the pidfd, a `waitpid` that finds the child still alive, the
//! queue's lock; a drop that finds the reaper gone pays its thread's start, about 25 us more).
//! Killing and joining the same child, the blocking kill + reap that a drop did before the
//! orphan queue, took 100 to 200 us (for a forkserver child, until the server's report came),
//! and killing a bare `std::process::Child` of `sleep` and waiting for it 65 to 95 us. The
//! blocking drop's worst case was not its typical one: up to [`STATUS_REPORT_GRACE`](child_proc::STATUS_REPORT_GRACE) for a
//! forkserver child whose server did not report, and as long as the kernel took to end the
//! child (a CUDA context's teardown: hundreds of milliseconds), sometimes under a `Pool`'s lock.

use super::ends::ParentEnd;
use super::output::Output;
use super::status::ExitStatus;
use super::sys;
use crate::Result;
use nix::unistd::Pid;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Instant;

mod child_proc;
mod ending;
mod orphans;
mod report_reader;

pub(crate) use child_proc::{
    ChannelEnd, REAP_POLL, Reaper, exit_status, kill_child, pidfd_exits_within, poll_timeout,
    reap_pid, reap_within,
};
use child_proc::{Proc, State, proc_stat};
pub(crate) use ending::{Ending, Watch};
use orphans::adopt;
pub(crate) use orphans::{reap_orphans, settle_orphans};
use report_reader::read_channel;
pub(crate) use report_reader::{Flow, Packet, Read};

/// A child of this process's making: see the module docs.
#[derive(Debug)]
pub(crate) struct Child {
    proc: Proc,
    /// The parent's end of its channel (shared with whoever polls it without the holder's lock).
    channel: Arc<ParentEnd>,
    output: Output,
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

    pub(crate) fn channel(&self) -> &Arc<ParentEnd> {
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
    /// (`channel` says what reading found), [`STATUS_REPORT_GRACE`](child_proc::STATUS_REPORT_GRACE) after the child was seen to
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
    /// [`Flow::Stop`]: at most [`READ_MAX`](report_reader::READ_MAX) packets, and, with `until`, waiting for packets
    /// until then (without it, only what is queued now). The forkserver's [`Report::Exited`](super::protocol::Report::Exited)
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
    /// [`STATUS_REPORT_GRACE`](child_proc::STATUS_REPORT_GRACE) to exit by itself first (so that its own exit status is what is
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
    /// not exit by itself within [`STATUS_REPORT_GRACE`](child_proc::STATUS_REPORT_GRACE), so that its own exit status is what is
    /// known), then reap it here, or take a forkserver child's status from the server's report,
    /// at most [`STATUS_REPORT_GRACE`](child_proc::STATUS_REPORT_GRACE) after the kill. Afterwards its end is known. For callers
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

#[cfg(test)]
mod supervisor_tests;
