//! An established mutual-TLS stream ([`TlsStream`]) over a TCP socket whose every read and
//! write ends by a deadline, and the translation of rustls's and the socket's failures into
//! typed [`Error::Tls`] reasons.

use std::cell::Cell;
use std::fmt;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use rustls::{CertificateError, ClientConnection, InvalidMessage, ServerConnection, StreamOwned};

use super::verify::TrustRule;
use crate::error::{TlsReason, TlsStep};
use crate::wire::AuthenticatedStream;
use crate::wire::timed::{TimedStream, time_left};
use crate::{Error, Result};

/// A TCP socket whose reads and writes end by the deadline last set: what rustls's
/// `StreamOwned` reads and writes through, so that a peer that trickles bytes holds a read no
/// longer than the deadline, however many socket reads one TLS record takes.
pub(super) struct DeadlineSocket {
    tcp: TcpStream,
    read_deadline: Cell<Option<Instant>>,
    write_deadline: Cell<Option<Instant>>,
    /// Applied per call when no deadline is set.
    fallback: Option<Duration>,
}

impl DeadlineSocket {
    pub(super) fn new(tcp: TcpStream, fallback: Option<Duration>) -> DeadlineSocket {
        DeadlineSocket {
            tcp,
            read_deadline: Cell::new(None),
            write_deadline: Cell::new(None),
            fallback,
        }
    }

    pub(super) fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    pub(super) fn set_deadlines(&self, deadline: Option<Instant>) {
        self.read_deadline.set(deadline);
        self.write_deadline.set(deadline);
    }

    fn timeout(&self, deadline: Option<Instant>) -> io::Result<Option<Duration>> {
        match deadline {
            Some(_) => time_left(deadline),
            None => Ok(self.fallback),
        }
    }
}

/// A socket timeout reads as `WouldBlock`; past a deadline it is a timeout.
fn timed_out(e: io::Error) -> io::Error {
    if e.kind() == ErrorKind::WouldBlock {
        io::Error::new(ErrorKind::TimedOut, "the deadline passed")
    } else {
        e
    }
}

impl Read for DeadlineSocket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.tcp
            .set_read_timeout(self.timeout(self.read_deadline.get())?)?;
        self.tcp.read(buf).map_err(timed_out)
    }
}

impl Write for DeadlineSocket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tcp
            .set_write_timeout(self.timeout(self.write_deadline.get())?)?;
        self.tcp.write(buf).map_err(timed_out)
    }

    /// rustls hands over a record's parts together: one system call (one segment), not one
    /// per part, which would wake the reader once per part.
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.tcp
            .set_write_timeout(self.timeout(self.write_deadline.get())?)?;
        self.tcp.write_vectored(bufs).map_err(timed_out)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The two sides' connections, each in rustls's synchronous `StreamOwned`.
enum Side {
    Client(Box<StreamOwned<ClientConnection, DeadlineSocket>>),
    Server(Box<StreamOwned<ServerConnection, DeadlineSocket>>),
}

/// An established mutual-TLS stream: both certificates were checked in the handshake, this
/// side's [`PeerCheck`](super::PeerCheck) admitted the peer, and only then was it made.
///
/// It is a byte stream ([`Read`], [`Write`], [`TimedStream`]) for
/// `vmm_core::peer::stream`'s reader and writer, which put a deadline on every message. A
/// read or write made with no deadline set is bounded per call by the options'
/// [`message_timeout`](super::TlsOptions::message_timeout). Errors are [`Error::Tls`] (inside an
/// `io::Error` where the `Read`/`Write` traits need one; the peer stream reader takes it out
/// again) or [`Error::Timeout`]. Its `Debug` shows the peer's address only.
pub struct TlsStream {
    side: Side,
    peer: SocketAddr,
}

impl fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsStream")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl TlsStream {
    pub(super) fn client(conn: ClientConnection, sock: DeadlineSocket, peer: SocketAddr) -> Self {
        TlsStream {
            side: Side::Client(Box::new(StreamOwned::new(conn, sock))),
            peer,
        }
    }

    pub(super) fn server(conn: ServerConnection, sock: DeadlineSocket, peer: SocketAddr) -> Self {
        TlsStream {
            side: Side::Server(Box::new(StreamOwned::new(conn, sock))),
            peer,
        }
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The peer's certificate (DER), as checked in the handshake.
    pub fn peer_certificate(&self) -> Option<&[u8]> {
        let certs = match &self.side {
            Side::Client(s) => s.conn.peer_certificates(),
            Side::Server(s) => s.conn.peer_certificates(),
        };
        certs.and_then(|c| c.first()).map(|c| c.as_ref())
    }

    fn socket(&self) -> &DeadlineSocket {
        match &self.side {
            Side::Client(s) => &s.sock,
            Side::Server(s) => &s.sock,
        }
    }

    /// Send TLS's closing message (so the peer reads a clean end, not a cut stream), then
    /// shut the socket down. Bounded by the write deadline.
    pub fn close(mut self) -> Result<()> {
        match &mut self.side {
            Side::Client(s) => s.conn.send_close_notify(),
            Side::Server(s) => s.conn.send_close_notify(),
        }
        self.flush()
            .map_err(|e| io_to_error(e, TlsStep::Write, self.peer))?;
        let _ = self.socket().tcp().shutdown(Shutdown::Both);
        Ok(())
    }

    fn wrap(&self, step: TlsStep, e: io::Error) -> io::Error {
        if e.get_ref().is_some_and(|inner| inner.is::<Error>()) {
            return e;
        }
        let kind = e.kind();
        io::Error::new(kind, io_to_error(e, step, self.peer))
    }
}

impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let read = match &mut self.side {
            Side::Client(s) => s.read(buf),
            Side::Server(s) => s.read(buf),
        };
        read.map_err(|e| self.wrap(TlsStep::Read, e))
    }
}

impl Write for TlsStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let written = match &mut self.side {
            Side::Client(s) => s.write(buf),
            Side::Server(s) => s.write(buf),
        };
        written.map_err(|e| self.wrap(TlsStep::Write, e))
    }

    fn flush(&mut self) -> io::Result<()> {
        let flushed = match &mut self.side {
            Side::Client(s) => s.flush(),
            Side::Server(s) => s.flush(),
        };
        flushed.map_err(|e| self.wrap(TlsStep::Write, e))
    }
}

impl TimedStream for TlsStream {
    fn set_read_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        time_left(deadline)?;
        self.socket().read_deadline.set(deadline);
        Ok(())
    }

    fn set_write_deadline(&self, deadline: Option<Instant>) -> io::Result<()> {
        time_left(deadline)?;
        self.socket().write_deadline.set(deadline);
        Ok(())
    }
}

/// Its peer passed every certificate check of the handshake.
impl AuthenticatedStream for TlsStream {}

/// A failure of a TLS stream's `step` with `peer` as the crate's error: a timeout, a typed TLS
/// reason, or (for other socket failures) [`Error::Os`].
pub(super) fn io_to_error(e: io::Error, step: TlsStep, peer: SocketAddr) -> Error {
    let kind = e.kind();
    if kind == ErrorKind::TimedOut || kind == ErrorKind::WouldBlock {
        return Error::Timeout {
            what: format!("TLS {step} with {peer}"),
            after: Duration::ZERO,
        };
    }
    let tls = |reason| Error::Tls {
        step,
        peer: peer.to_string(),
        reason,
    };
    match e.into_inner() {
        Some(inner) => match inner.downcast::<Error>() {
            Ok(error) => *error,
            Err(inner) => match inner.downcast::<rustls::Error>() {
                Ok(rustls) => tls(reason(&rustls)),
                Err(inner) => match kind {
                    ErrorKind::UnexpectedEof => tls(TlsReason::Truncated),
                    _ => Error::io(
                        format!("TLS {step} with {peer}"),
                        io::Error::new(kind, inner),
                    ),
                },
            },
        },
        None => match kind {
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
                tls(TlsReason::Truncated)
            }
            _ => Error::io(format!("TLS {step} with {peer}"), io::Error::from(kind)),
        },
    }
}

/// Why rustls refused, as a [`TlsReason`].
pub(super) fn reason(e: &rustls::Error) -> TlsReason {
    use rustls::Error as R;
    match e {
        R::NoCertificatesPresented => TlsReason::NoCertificate,
        R::InvalidCertificate(c) => {
            match c {
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    TlsReason::Expired
                }
                CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                    TlsReason::NotYetValid
                }
                CertificateError::UnknownIssuer => TlsReason::UnknownIssuer,
                CertificateError::Revoked => TlsReason::Revoked,
                CertificateError::InvalidPurpose
                | CertificateError::InvalidPurposeContext { .. } => TlsReason::WrongUsage,
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => TlsReason::NameNotAllowed,
                CertificateError::ApplicationVerificationFailure => TlsReason::PinMismatch,
                CertificateError::ExpiredRevocationList
                | CertificateError::ExpiredRevocationListContext { .. } => TlsReason::CrlExpired,
                CertificateError::UnknownRevocationStatus => TlsReason::RevocationUnknown,
                CertificateError::Other(other) => other
                    .0
                    .downcast_ref::<TrustRule>()
                    .map_or(TlsReason::BadCertificate, |rule| rule.0),
                _ => TlsReason::BadCertificate,
            }
        }
        R::AlertReceived(alert) => TlsReason::RefusedByPeer {
            alert: u8::from(*alert),
        },
        R::DecryptError => TlsReason::Corrupted,
        R::InvalidMessage(InvalidMessage::InvalidContentType)
        | R::InvalidMessage(InvalidMessage::UnknownProtocolVersion)
        | R::PeerSentOversizedRecord => TlsReason::NotTls,
        _ => TlsReason::Protocol,
    }
}
