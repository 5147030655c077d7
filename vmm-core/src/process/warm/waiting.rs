//! One child waiting in a warm pool: what it said (its `Ready`), whether it is still alive and
//! well, and handing it out.

use std::time::{Duration, Instant};

use super::super::protocol::{Order, Report};
use super::super::supervisor::{Child, Flow, NewChild, Packet, Read};

/// How long a ready waiting child has to answer an [`Order::Ping`] before it is taken for dead.
/// A live one answers in microseconds; this covers a machine under heavy load.
const PING_LIMIT: Duration = Duration::from_secs(2);

/// A waiting child. Dropping it kills the child (it never ran anything), without waiting: it
/// is reaped in the background.
#[derive(Debug)]
pub(super) struct WaitingChild {
    pub(super) child: Child,
    /// Its `Ready` report has been read.
    pub(super) ready: bool,
}

/// Whether a waiting child may still be handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Health {
    Alive,
    Dead,
}

impl WaitingChild {
    pub(super) fn new(child: Child) -> WaitingChild {
        WaitingChild {
            child,
            ready: false,
        }
    }

    /// The child's pid, as the public API shows pids.
    pub(super) fn pid(&self) -> u32 {
        self.child.pid().as_raw() as u32
    }

    /// Read what it said (its `Ready`), and whether it is still alive and well.
    pub(super) fn check(&mut self) -> Health {
        if self.child.poll_exited() {
            return Health::Dead;
        }
        let ready = &mut self.ready;
        let read = self.child.read_reports(None, |packet| match packet {
            Packet::Report(Report::Ready, fds) if !*ready && fds.is_empty() => {
                *ready = true;
                Flow::Continue
            }
            // Anything else breaks the protocol: it is not handed out.
            _ => Flow::Stop,
        });
        match read {
            Read::Drained => Health::Alive,
            // Off the protocol, gone, or unreadable.
            Read::Stopped | Read::HungUp | Read::Broken(_) | Read::Exited => Health::Dead,
        }
    }

    /// Hand it out if it is alive: it is not exiting (`/proc`), and, once ready, it answers a
    /// [`Order::Ping`] within [`PING_LIMIT`]. Otherwise it is given back, to be dropped.
    ///
    /// A child still warming up is handed out without the ping: waiting for its warm-up here
    /// would hold the caller (a `Pool` replacing a worker inside a `join`) for as long as CUDA
    /// takes to start. If it was killed meanwhile, its start fails as any child's would
    /// (`join` says it never started; a `Pool` replaces a worker that dies starting).
    pub(super) fn confirm(mut self) -> Result<NewChild, WaitingChild> {
        if self.check() == Health::Dead || self.child.exiting() {
            return Err(self);
        }
        if !self.ready {
            return Ok(self.into_new_child());
        }
        let deadline = Instant::now() + PING_LIMIT;
        if self.child.channel().send(&Order::Ping).is_err() {
            return Err(self);
        }
        let mut pong = false;
        // The first packet is the answer.
        self.child.read_reports(Some(deadline), |packet| {
            pong = matches!(packet, Packet::Report(Report::Pong, fds) if fds.is_empty());
            Flow::Stop
        });
        if pong {
            Ok(self.into_new_child())
        } else {
            // Hung up (dead), silent past the limit (stopped, or stuck), or off the protocol:
            // not handed out.
            Err(self)
        }
    }

    pub(super) fn into_new_child(self) -> NewChild {
        NewChild {
            child: self.child,
            ready: self.ready,
        }
    }
}
