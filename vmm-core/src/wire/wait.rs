//! Waiting on a socket with a deadline: `poll` for readable, writable or hung up, restarted on
//! `EINTR`, rounded up so that a wait never ends early. Every bounded wait of `wire` (a
//! channel's send and receive, an endpoint's accept and connect) is one of these.

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use crate::{Error, Result};

/// When a wait ends: never, or at an instant. A timeout too large to add to now (such as
/// `Duration::MAX`) saturates to never, rather than overflowing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Deadline {
    Never,
    At(Instant),
}

/// The deadline `timeout` from now.
pub(crate) fn deadline_after(timeout: Duration) -> Deadline {
    Instant::now()
        .checked_add(timeout)
        .map_or(Deadline::Never, Deadline::At)
}

impl From<Option<Instant>> for Deadline {
    fn from(deadline: Option<Instant>) -> Self {
        deadline.map_or(Deadline::Never, Deadline::At)
    }
}

/// Block until `fd` is readable (or hung up) or `deadline` passes; `false` on timeout.
pub(crate) fn wait_readable(fd: BorrowedFd<'_>, deadline: impl Into<Deadline>) -> Result<bool> {
    wait_for(fd, PollFlags::POLLIN, deadline.into())
}

/// Block until every other end of `fd`'s socket is closed (messages may still be queued) or
/// `deadline` passes; `false` on timeout.
pub(crate) fn wait_hangup(fd: BorrowedFd<'_>, deadline: impl Into<Deadline>) -> Result<bool> {
    // POLLHUP is always reported; asking for nothing else sleeps through queued messages.
    wait_for(fd, PollFlags::empty(), deadline.into())
}

pub(crate) fn wait_for(fd: BorrowedFd<'_>, events: PollFlags, deadline: Deadline) -> Result<bool> {
    loop {
        let timeout = match deadline {
            Deadline::Never => PollTimeout::NONE,
            Deadline::At(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                // Round up so that a wait never ends before the deadline.
                let ms = left.as_nanos().div_ceil(1_000_000);
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
            }
        };
        let mut pfd = [PollFd::new(fd, events)];
        match poll(&mut pfd, timeout) {
            Ok(0) => {
                if matches!(deadline, Deadline::At(d) if Instant::now() >= d) {
                    return Ok(false);
                }
            }
            Ok(_) => return Ok(true),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(Error::errno("poll", e)),
        }
    }
}

/// Whether the peer of `fd` has hung up: told apart from an empty packet, which reads the same
/// (zero bytes) but leaves the connection open.
pub(crate) fn peer_hung_up(fd: BorrowedFd<'_>) -> bool {
    // POLLHUP is reported whatever is asked for; asking for nothing keeps revents to the bits
    // nix knows (it drops revents with unknown bits such as POLLRDHUP altogether).
    let mut pfd = [PollFd::new(fd, PollFlags::empty())];
    match poll(&mut pfd, PollTimeout::ZERO) {
        Ok(_) => pfd[0]
            .revents()
            .is_some_and(|r| r.contains(PollFlags::POLLHUP)),
        Err(_) => true,
    }
}
