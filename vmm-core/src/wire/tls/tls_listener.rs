//! A TCP listener that hands out only mutually authenticated streams, and whose handshakes run
//! side by side, so that a peer who connects first and then stalls (or never speaks TLS)
//! delays nobody: [`TlsListener`].

use std::collections::VecDeque;
use std::fmt;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use rustls::ServerConnection;

use super::handshake::TlsAcceptor;
use super::tls_options::TlsOptions;
use super::tls_stream::{DeadlineSocket, TlsStream, reason};
use crate::error::{OptionRule, TlsReason};
use crate::trace;
use crate::wire::endpoint::{LOG_BURST, LOG_INTERVAL};
use crate::{Error, Result};

/// The most handshakes a listener runs at once: a connection past that many ends the oldest
/// unfinished one (a peer cannot hold more than this many of the listener's fds by stalling).
pub const MAX_HANDSHAKES: usize = 64;

/// How many refused peers a listener remembers (the most recent ones).
const REFUSALS_KEPT: usize = 64;

/// A peer a [`TlsListener`] turned away, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TlsRefusal {
    /// Its address.
    pub peer: SocketAddr,
    /// What was wrong (its certificate, its TLS); `None` when its handshake timed out, or was
    /// ended to make room for a newer one ([`MAX_HANDSHAKES`]).
    pub reason: Option<TlsReason>,
}

/// A handshake under way.
struct Pending {
    conn: ServerConnection,
    tcp: TcpStream,
    peer: SocketAddr,
    /// `None` for a handshake timeout too large to add to now (`Duration::MAX`): no deadline.
    deadline: Option<Instant>,
}

/// What one step of a handshake came to.
enum Progress {
    Waiting,
    Done,
    Failed(Option<TlsReason>),
}

/// A TCP listener for mutual TLS: [`accept`](Self::accept) returns the next stream whose
/// client passed every check of the [`TlsOptions`] (chain, validity, `clientAuth`, CRLs,
/// allowed name or pin); every other client is refused inside its handshake (a TLS alert and a
/// close, never an application byte), remembered and logged (at most
/// [`LOG_BURST`] lines per [`LOG_INTERVAL`]), and `accept` goes on waiting.
///
/// Handshakes are driven side by side on non-blocking sockets, at most [`MAX_HANDSHAKES`] at a
/// time, each within the handshake timeout: a client that connects and says nothing, or
/// trickles its handshake, holds one slot until its deadline and delays no other client.
/// `accept` takes `&self`; concurrent calls take turns.
pub struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    pending: Mutex<Vec<Pending>>,
    refused: Mutex<VecDeque<TlsRefusal>>,
    log: Mutex<(Instant, u32)>,
}

impl fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsListener")
            .field("local_addr", &self.tcp.local_addr().ok())
            .finish_non_exhaustive()
    }
}

impl TlsListener {
    /// Listen on `addr` (port 0: any free port; [`local_addr`](Self::local_addr) says which).
    pub fn bind(addr: impl ToSocketAddrs, options: &TlsOptions) -> Result<TlsListener> {
        let acceptor = TlsAcceptor::new(options)?;
        let tcp = TcpListener::bind(addr).map_err(|e| Error::io("binding a TLS listener", e))?;
        TlsListener::from_listener(tcp, acceptor)
    }

    /// Serve TLS on a listener of the caller's.
    pub fn from_listener(tcp: TcpListener, acceptor: TlsAcceptor) -> Result<TlsListener> {
        tcp.set_nonblocking(true)
            .map_err(|e| Error::io("making a TLS listener non-blocking", e))?;
        Ok(TlsListener {
            tcp,
            acceptor,
            pending: Mutex::new(Vec::new()),
            refused: Mutex::new(VecDeque::new()),
            log: Mutex::new((Instant::now(), 0)),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.tcp
            .local_addr()
            .map_err(|e| Error::io("reading a TLS listener's address", e))
    }

    /// The most recent refused peers (at most 64), oldest first.
    pub fn refused(&self) -> Vec<TlsRefusal> {
        lock(&self.refused).iter().copied().collect()
    }

    /// The next stream whose client passed every check, waiting at most `timeout` (`None`:
    /// forever); [`Error::Timeout`] when none did in time. Refused clients do not end the
    /// wait. Out of fds, it returns [`Error::FdLimit`] at once (the connection stays queued).
    pub fn accept(&self, timeout: Option<Duration>) -> Result<TlsStream> {
        // The whole wait, refusals nested in it; the admitted client's address once known.
        let span = trace::span!(INFO, "tls.accept", peer = trace::Empty);
        let started = Instant::now();
        let deadline = timeout.and_then(|t| started.checked_add(t));
        let mut pending = lock(&self.pending);
        loop {
            let now = Instant::now();
            pending.retain(|p| {
                let alive = p.deadline.is_none_or(|d| now < d);
                if !alive {
                    self.refuse(p.peer, None);
                }
                alive
            });
            if deadline.is_some_and(|d| now >= d) {
                return Err(Error::Timeout {
                    what: "accepting a mutually authenticated TLS connection".into(),
                    after: started.elapsed(),
                });
            }
            let wake = pending
                .iter()
                .filter_map(|p| p.deadline)
                .chain(deadline)
                .min();
            let (listener_ready, ready) = self.wait(&pending, wake)?;
            if listener_ready {
                self.take_new(&mut pending)?;
            }
            for i in (0..pending.len()).rev() {
                if !ready.get(i).copied().unwrap_or(true) {
                    continue;
                }
                match drive(&mut pending[i]) {
                    Progress::Waiting => {}
                    Progress::Failed(why) => {
                        let p = pending.swap_remove(i);
                        self.refuse(p.peer, why);
                    }
                    Progress::Done => {
                        let p = pending.swap_remove(i);
                        if let Some(stream) = self.finish(p) {
                            trace::record!(span, "peer", trace::display(stream.peer_addr()));
                            return Ok(stream);
                        }
                    }
                }
            }
        }
    }

    /// Poll the listener and every handshake until one can move or `wake` passes: whether the
    /// listener has connections, and which handshakes can move.
    fn wait(&self, pending: &[Pending], wake: Option<Instant>) -> Result<(bool, Vec<bool>)> {
        let mut fds = Vec::with_capacity(1 + pending.len());
        fds.push(PollFd::new(self.tcp.as_fd(), PollFlags::POLLIN));
        for p in pending {
            let mut events = PollFlags::POLLIN;
            if p.conn.wants_write() {
                events |= PollFlags::POLLOUT;
            }
            fds.push(PollFd::new(p.tcp.as_fd(), events));
        }
        let timeout = match wake {
            None => PollTimeout::NONE,
            Some(at) => {
                let ms = at
                    .saturating_duration_since(Instant::now())
                    .as_nanos()
                    .div_ceil(1_000_000);
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
            }
        };
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(Error::errno("poll on a TLS listener", e)),
        }
        let moved = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        Ok((moved(&fds[0]), fds[1..].iter().map(moved).collect()))
    }

    /// Start a handshake for every queued connection; past [`MAX_HANDSHAKES`], the oldest
    /// unfinished one ends.
    fn take_new(&self, pending: &mut Vec<Pending>) -> Result<()> {
        loop {
            let (tcp, peer) = match self.tcp.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::ConnectionAborted => continue,
                Err(e) => {
                    // EMFILE becomes Error::FdLimit; the connection stays queued.
                    return Err(Error::io("accepting a TLS connection", e));
                }
            };
            if tcp.set_nonblocking(true).is_err() {
                continue;
            }
            let _ = tcp.set_nodelay(true);
            let conn = ServerConnection::new(Arc::clone(&self.acceptor.config)).map_err(|e| {
                Error::option(
                    "tls server connection",
                    OptionRule::Unsupported,
                    e.to_string(),
                )
            })?;
            if pending.len() >= MAX_HANDSHAKES {
                let oldest = pending.remove(0);
                self.refuse(oldest.peer, None);
            }
            pending.push(Pending {
                conn,
                tcp,
                peer,
                deadline: Instant::now().checked_add(self.acceptor.handshake_timeout),
            });
        }
    }

    /// A finished handshake as a blocking stream (`None` if its last flight cannot be sent).
    fn finish(&self, p: Pending) -> Option<TlsStream> {
        let Pending {
            mut conn,
            tcp,
            peer,
            deadline,
        } = p;
        if tcp.set_nonblocking(false).is_err() {
            self.refuse(peer, Some(TlsReason::Truncated));
            return None;
        }
        let mut sock = DeadlineSocket::new(tcp, self.acceptor.message_timeout);
        sock.set_deadlines(deadline);
        while conn.wants_write() {
            if conn.write_tls(&mut sock).is_err() {
                self.refuse(peer, Some(TlsReason::Truncated));
                return None;
            }
        }
        sock.set_deadlines(None);
        Some(TlsStream::server(conn, sock, peer))
    }

    fn refuse(&self, peer: SocketAddr, reason: Option<TlsReason>) {
        // `reason` is a kind (a certificate rule, a timeout), never certificate or key bytes.
        let _span = trace::span!(INFO, "tls.refuse", peer = %peer, reason = ?reason);
        {
            let mut refused = lock(&self.refused);
            if refused.len() == REFUSALS_KEPT {
                refused.pop_front();
            }
            refused.push_back(TlsRefusal { peer, reason });
        }
        let mut log = lock(&self.log);
        if log.0.elapsed() >= LOG_INTERVAL {
            *log = (Instant::now(), 0);
        }
        if log.1 < LOG_BURST {
            log.1 += 1;
            match reason {
                Some(reason) => eprintln!("vmm-ipc TLS listener: refused {peer}: {reason}"),
                None => eprintln!(
                    "vmm-ipc TLS listener: dropped {peer}: its handshake did not finish in time"
                ),
            }
        }
    }
}

/// One step of a handshake on its non-blocking socket: send what is due, read what came,
/// process it, send the answer.
fn drive(p: &mut Pending) -> Progress {
    if let Err(failed) = flush(p) {
        return failed;
    }
    if p.conn.wants_read() {
        match p.conn.read_tls(&mut p.tcp) {
            Ok(0) => return Progress::Failed(Some(TlsReason::Truncated)),
            Ok(_) => {
                if let Err(e) = p.conn.process_new_packets() {
                    // The alert that tells the peer why (best effort: never waits).
                    let _ = p.conn.write_tls(&mut p.tcp);
                    return Progress::Failed(Some(reason(&e)));
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Progress::Failed(Some(TlsReason::Truncated)),
        }
    }
    if let Err(failed) = flush(p) {
        return failed;
    }
    if p.conn.is_handshaking() {
        Progress::Waiting
    } else {
        Progress::Done
    }
}

/// Write what the handshake has to send, until done or the socket is full.
fn flush(p: &mut Pending) -> std::result::Result<(), Progress> {
    while p.conn.wants_write() {
        match p.conn.write_tls(&mut p.tcp) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Err(Progress::Failed(Some(TlsReason::Truncated))),
        }
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
