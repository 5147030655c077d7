//! The one loop that reads a child's channel ([`read_channel`]): each packet to the caller's
//! closure, the forkserver's `Exited` taken as the child's status.

use std::os::fd::OwnedFd;
use std::time::Instant;

use super::super::ends::{ParentEnd, Received};
use super::super::protocol::Report;
use super::child_proc::{Proc, Reaper, State};
use crate::Error;

/// The most packets [`Child::read_reports`](super::Child::read_reports) reads in one call, so that a flood from whatever
/// holds the child's end (a process it forked) cannot keep a reader from its other work.
pub(crate) const READ_MAX: usize = 1024;

/// One packet from a child's channel, as [`Child::read_reports`](super::Child::read_reports) hands it over.
#[derive(Debug)]
pub(crate) enum Packet {
    /// A report, with the fds its packet carried.
    Report(Report, Vec<OwnedFd>),
    /// A packet that is not a report (consumed), and what was wrong with it.
    NotAReport(String),
}

/// What a [`Child::read_reports`](super::Child::read_reports) closure says after a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flow {
    Continue,
    Stop,
}

/// Why [`Child::read_reports`](super::Child::read_reports) returned.
#[derive(Debug)]
pub(crate) enum Read {
    /// The closure said [`Flow::Stop`].
    Stopped,
    /// Nothing more is queued (by the deadline, where one was given), or [`READ_MAX`] packets
    /// were read: reading may go on later.
    Drained,
    /// The forkserver reported the child's exit status (now known: [`Child::status`](super::Child::status)).
    Exited,
    /// Every other end is closed: nothing more will come.
    HungUp,
    /// Reading failed in a way that may repeat.
    Broken(Error),
}

/// The one loop that reads a child's channel: see [`Child::read_reports`](super::Child::read_reports).
pub(super) fn read_channel(
    channel: &ParentEnd,
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
fn next_packet(channel: &ParentEnd, until: Option<Instant>) -> Next {
    let received = match until {
        None => channel.try_recv(),
        Some(deadline) => {
            match channel.recv(Some(deadline.saturating_duration_since(Instant::now()))) {
                Ok(received) => Ok(Some(received)),
                Err(Error::Timeout { .. }) => Ok(None),
                Err(error) => Err(error),
            }
        }
    };
    match received {
        Ok(Some(Received { message, fds })) => Next::Packet(Packet::Report(message, fds)),
        Ok(None) => Next::Empty,
        Err(Error::Disconnected(_)) => Next::HungUp,
        // The offending packet (not a report, say) was consumed.
        Err(Error::Protocol { message, .. }) => Next::Packet(Packet::NotAReport(message)),
        Err(error) => Next::Broken(error),
    }
}
