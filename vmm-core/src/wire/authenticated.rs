//! Which byte streams carry peer messages: those whose peer is known. A byte stream itself
//! authenticates no one (on TCP, loopback included, whoever connects first gets the bytes), so
//! `vmm_core::peer::stream`'s reader and writer take an [`AuthenticatedStream`]: a mutual-TLS
//! stream (feature `tls`), whose peer passed its certificate checks, or a stream the caller
//! names [`CallerAuthenticated`], an explicit statement that only the intended peer can reach it
//! (a socketpair between the caller's own processes, an SSH tunnel, a VPN). There is no
//! default path for a plain socket.

use std::io::{self, IoSlice, Read, Write};
use std::time::Instant;

use super::TimedStream;

/// A byte stream whose peer is known, with deadlines: what the peer stream reader and writer
/// speak on.
///
/// Implemented by the mutual-TLS stream (`wire::tls::TlsStream`, feature `tls`) and by
/// [`CallerAuthenticated`]. Implement it for a stream of your own only if its peer is
/// authenticated by the time you hand it over (the implementation is that promise).
pub trait AuthenticatedStream: TimedStream {}

impl<T: AuthenticatedStream + ?Sized> AuthenticatedStream for &T {}
impl<T: AuthenticatedStream + ?Sized> AuthenticatedStream for &mut T {}

/// A plain stream (TCP, a Unix stream, a pipe...) that the caller states is reachable only by
/// the intended peer: the explicit, named way to speak peer messages on a channel whose
/// authentication is the caller's business. Across a network, or wherever another user can
/// connect, use mutual TLS instead.
#[derive(Debug)]
pub struct CallerAuthenticated<S> {
    stream: S,
}

impl<S> CallerAuthenticated<S> {
    /// `stream`, which the caller has authenticated by its own means.
    pub fn new(stream: S) -> Self {
        CallerAuthenticated { stream }
    }

    /// The stream.
    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    /// The stream, given back.
    pub fn into_inner(self) -> S {
        self.stream
    }
}

impl<S: Read> Read for CallerAuthenticated<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.read(buf)
    }
}

impl<S: Write> Write for CallerAuthenticated<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.stream.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

impl<S: TimedStream> TimedStream for CallerAuthenticated<S> {
    fn set_read_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        self.stream.set_read_deadline(deadline)
    }

    fn set_write_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        self.stream.set_write_deadline(deadline)
    }
}

impl<S: TimedStream> AuthenticatedStream for CallerAuthenticated<S> {}
