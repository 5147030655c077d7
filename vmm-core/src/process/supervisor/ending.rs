//! Ending a child without waiting ([`Ending`]): the steps that need no wait, and what to poll
//! before the next ([`Watch`]).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, poll};

use super::super::ends::ParentEnd;
use super::child_proc::{
    ChannelEnd, Proc, REAP_POLL, Reaper, STATUS_REPORT_GRACE, State, poll_timeout,
};
use super::report_reader::{Flow, Read, read_channel};

/// A child being ended without waiting: see [`Child::start_ending`](super::Child::start_ending).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ending {
    /// Not killed yet: it may exit by itself until then (then it is killed). `None`: killed.
    kill_at: Option<Instant>,
    /// A forkserver child's: when its status report stops being awaited, counted from the
    /// kill (from its exit, where that is seen, [`Child::conclude`](super::Child::conclude) counts too).
    report_by: Option<Instant>,
}

impl Ending {
    pub(super) fn start(proc: &mut Proc, let_exit: bool) -> Ending {
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

    /// See [`Child::advance_ending`](super::Child::advance_ending); `channel` carries a forkserver child's report.
    pub(super) fn advance(&mut self, proc: &mut Proc, channel: Option<&ParentEnd>) -> bool {
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

    pub(super) fn watch(&self, proc: &Proc, channel: Option<&Arc<ParentEnd>>) -> Watch {
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
    pub(super) pidfd: Option<Arc<OwnedFd>>,
    pub(super) channel: Option<Arc<ParentEnd>>,
    pub(super) until: Option<Instant>,
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
    pub(super) fn wait(&self) {
        wait_any(std::slice::from_ref(self), None, None);
    }
}

/// Sleep until an fd of `watches` or `wake` is readable, or the earliest time among them and
/// `cap` is up.
pub(super) fn wait_any(watches: &[Watch], wake: Option<BorrowedFd<'_>>, cap: Option<Instant>) {
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
