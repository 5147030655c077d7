//! Byte streams whose blocking reads and writes end by a deadline.
//!
//! A socket's own timeout (`SO_RCVTIMEO`) bounds one read: a peer that sends one byte just
//! before each read would time out holds a reader of a 100-byte message a hundred timeouts
//! long. A reader that must finish a whole message by one deadline sets that deadline before
//! every read it makes ([`TimedStream::set_read_deadline`]): each read is then bounded by what
//! is left, so the message is bounded by the deadline, whatever the peer does.
//! `vmm_core::peer::stream`'s reader and writer do so for every message.

use std::io::{self, ErrorKind};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// A byte stream whose blocking reads and writes can be bounded by a deadline.
///
/// Implemented for `TcpStream` and `UnixStream` (through their socket timeouts: call the
/// setter before each read or write, as the peer stream reader and writer do, and the timeout
/// is what is left until the deadline), for the mutual-TLS stream of the `tls` feature (which
/// keeps the deadline and applies it to every read and write of its socket, the handshake's
/// included), and through references.
pub trait TimedStream {
    /// Reads from now on return by `deadline` (`None`: no bound) with an error of kind
    /// [`ErrorKind::TimedOut`] or [`ErrorKind::WouldBlock`]. A deadline that has passed is
    /// refused with [`ErrorKind::TimedOut`].
    fn set_read_deadline(&self, deadline: Option<Instant>) -> io::Result<()>;

    /// Writes from now on return by `deadline` (`None`: no bound), as
    /// [`set_read_deadline`](Self::set_read_deadline) for reads.
    fn set_write_deadline(&self, deadline: Option<Instant>) -> io::Result<()>;
}

/// What is left until `deadline`, as a socket timeout: `None` for no deadline, an error of
/// kind [`ErrorKind::TimedOut`] once it has passed (a socket takes no zero timeout).
pub(crate) fn time_left(deadline: Option<Instant>) -> io::Result<Option<Duration>> {
    match deadline {
        None => Ok(None),
        Some(deadline) => {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                Err(io::Error::new(
                    ErrorKind::TimedOut,
                    "the deadline of the message passed",
                ))
            } else {
                Ok(Some(left))
            }
        }
    }
}

impl TimedStream for TcpStream {
    fn set_read_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        self.set_read_timeout(time_left(deadline)?)
    }

    fn set_write_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        self.set_write_timeout(time_left(deadline)?)
    }
}

impl TimedStream for UnixStream {
    fn set_read_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        self.set_read_timeout(time_left(deadline)?)
    }

    fn set_write_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        self.set_write_timeout(time_left(deadline)?)
    }
}

impl<T: TimedStream + ?Sized> TimedStream for &T {
    fn set_read_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        (**self).set_read_deadline(deadline)
    }

    fn set_write_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        (**self).set_write_deadline(deadline)
    }
}

impl<T: TimedStream + ?Sized> TimedStream for &mut T {
    fn set_read_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        (**self).set_read_deadline(deadline)
    }

    fn set_write_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        (**self).set_write_deadline(deadline)
    }
}
