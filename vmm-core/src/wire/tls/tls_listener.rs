//! A TCP listener that hands out only mutually authenticated streams, and whose handshakes run
//! side by side, so that a peer who connects first and then stalls (or never speaks TLS)
//! delays nobody: [`TlsListener`].

use std::collections::VecDeque;
use std::fmt;
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
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

/// The most handshakes a listener runs at once: a connection past that many ends one of them
/// (a peer cannot hold more than this many of the listener's fds by stalling). The one ended
/// is chosen so that a flood of stalled connections cannot starve a legitimate client (see
/// [`TlsListener`]): a handshake the listener has answered (its client sent a whole ClientHello)
/// goes only when no unanswered one is left; of those that have made the least progress, the
/// oldest of the address that holds the most goes first.
pub const MAX_HANDSHAKES: usize = 64;

/// The kernel's queue of connections not yet accepted, for a listener [`TlsListener::bind`]
/// makes (the kernel clamps it to `net.core.somaxconn`): deep enough that a burst of
/// connections does not fill it while the listener drives handshakes.
pub const LISTEN_BACKLOG: i32 = 1024;

/// New connections accepted per turn of the listener's loop, before it drives the handshakes
/// that can move again: so a flood of new connections never keeps a client's ClientHello, or
/// its last flight, waiting.
const ACCEPT_BATCH: usize = 16;

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
    /// Made when its first bytes arrive: a connection that says nothing costs its fd alone.
    conn: Option<ServerConnection>,
    tcp: TcpStream,
    peer: SocketAddr,
    /// `None` for a handshake timeout too large to add to now (`Duration::MAX`): no deadline.
    deadline: Option<Instant>,
    /// When it was accepted.
    accepted: Instant,
    /// Whether the listener has answered it (sent its first flight, which takes a whole and
    /// valid ClientHello): a client that made that much progress is kept before one that has
    /// not when a handshake must end to make room.
    answered: bool,
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
///
/// A flood of such connections starves no one. The listener never stops accepting: with every
/// slot taken, a new connection ends a pending handshake, chosen by progress: first one the
/// listener has not answered yet (its client has not sent a whole ClientHello, which a
/// legitimate client sends at once), of those the oldest of the address that holds the most;
/// a handshake the listener has answered ends only when all are answered. A new connection is
/// driven as soon as it is accepted (its ClientHello is usually there already), and each turn
/// of the loop drives the handshakes that can move before it accepts at most a few more, so a
/// legitimate client's ClientHello is read and answered while a flood's connections come and
/// go around it. Tested with one local process opening stalled connections as fast as it can
/// (`tests/tests/tls/flood.rs`; the rate is in `docs/security.md`).
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
        // std listens with a backlog of 128; listening again sets the deeper one.
        nix::sys::socket::listen(
            &tcp,
            nix::sys::socket::Backlog::new(LISTEN_BACKLOG)
                .map_err(|e| Error::errno("the TLS listener's backlog", e))?,
        )
        .map_err(|e| Error::errno("listening on a TLS listener", e))?;
        TlsListener::from_listener(tcp, acceptor)
    }

    /// Serve TLS on a listener of the caller's (listening with the backlog it chose).
    pub fn from_listener(tcp: TcpListener, acceptor: TlsAcceptor) -> Result<TlsListener> {
        tcp.set_nonblocking(true)
            .map_err(|e| Error::io("making a TLS listener non-blocking", e))?;
        // Its handshakes' connections are made as their first bytes arrive: one made now
        // says whether the configuration can make them.
        new_connection(&acceptor)?;
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
            // The handshakes that can move first, then the new connections: a flood of new
            // ones never keeps a client's ClientHello or last flight waiting.
            for i in (0..pending.len()).rev() {
                if !ready.get(i).copied().unwrap_or(true) {
                    continue;
                }
                if let Some(stream) = self.step(&mut pending, i) {
                    trace::record!(span, "peer", trace::display(stream.peer_addr()));
                    return Ok(stream);
                }
            }
            if listener_ready && let Some(stream) = self.take_new(&mut pending)? {
                trace::record!(span, "peer", trace::display(stream.peer_addr()));
                return Ok(stream);
            }
        }
    }

    /// Drive handshake `i` one step: its stream once it has finished (and left `pending`); a
    /// failed one is refused and leaves `pending` too.
    fn step(&self, pending: &mut Vec<Pending>, i: usize) -> Option<TlsStream> {
        match drive(&mut pending[i], &self.acceptor) {
            Progress::Waiting => None,
            Progress::Failed(why) => {
                let p = pending.swap_remove(i);
                self.refuse(p.peer, why);
                None
            }
            Progress::Done => {
                let p = pending.swap_remove(i);
                self.finish(p)
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
            if p.conn.as_ref().is_some_and(|c| c.wants_write()) {
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

    /// Start a handshake for the queued connections (at most [`ACCEPT_BATCH`]), driving each
    /// once at once; past [`MAX_HANDSHAKES`], the pending handshake [`evictee`] picks ends.
    fn take_new(&self, pending: &mut Vec<Pending>) -> Result<Option<TlsStream>> {
        for _ in 0..ACCEPT_BATCH {
            let (tcp, peer) = match self.tcp.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
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
            if pending.len() >= MAX_HANDSHAKES {
                let ended = pending.swap_remove(evictee(pending));
                self.refuse(ended.peer, None);
            }
            let accepted = Instant::now();
            // Its ClientHello is usually there already: answered now, it is kept before the
            // connections that have said nothing. (A peek, so that one that said nothing
            // costs no TLS state.)
            let said = match tcp.peek(&mut [0u8; 1]) {
                Ok(_) => true,
                Err(e) => e.kind() != ErrorKind::WouldBlock,
            };
            pending.push(Pending {
                conn: None,
                tcp,
                peer,
                deadline: accepted.checked_add(self.acceptor.handshake_timeout),
                accepted,
                answered: false,
            });
            let last = pending.len() - 1;
            if said && let Some(stream) = self.step(pending, last) {
                return Ok(Some(stream));
            }
        }
        Ok(None)
    }

    /// A finished handshake as a blocking stream (`None` if its last flight cannot be sent).
    fn finish(&self, p: Pending) -> Option<TlsStream> {
        let Pending {
            conn,
            tcp,
            peer,
            deadline,
            ..
        } = p;
        let Some(mut conn) = conn else {
            // Done is only said of a handshake that has its connection.
            self.refuse(peer, Some(TlsReason::Protocol));
            return None;
        };
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

/// The server side of one connection of `acceptor`'s.
fn new_connection(acceptor: &TlsAcceptor) -> Result<ServerConnection> {
    ServerConnection::new(Arc::clone(&acceptor.config)).map_err(|e| {
        Error::option(
            "tls server connection",
            OptionRule::Unsupported,
            e.to_string(),
        )
    })
}

/// One step of a handshake on its non-blocking socket: send what is due, read what came,
/// process it, send the answer. Its connection is made on its first step (when its first
/// bytes, or its end, have come).
fn drive(p: &mut Pending, acceptor: &TlsAcceptor) -> Progress {
    let Pending { conn, tcp, .. } = p;
    let conn = match conn {
        Some(conn) => conn,
        None => match new_connection(acceptor) {
            Ok(made) => conn.insert(made),
            // The same configuration made one when the listener was made.
            Err(_) => return Progress::Failed(Some(TlsReason::Protocol)),
        },
    };
    if let Err(failed) = flush(conn, tcp, &mut p.answered) {
        return failed;
    }
    if conn.wants_read() {
        match conn.read_tls(tcp) {
            Ok(0) => return Progress::Failed(Some(TlsReason::Truncated)),
            Ok(_) => {
                if let Err(e) = conn.process_new_packets() {
                    // The alert that tells the peer why (best effort: never waits).
                    let _ = conn.write_tls(tcp);
                    return Progress::Failed(Some(reason(&e)));
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Progress::Failed(Some(TlsReason::Truncated)),
        }
    }
    if let Err(failed) = flush(conn, tcp, &mut p.answered) {
        return failed;
    }
    if conn.is_handshaking() {
        Progress::Waiting
    } else {
        Progress::Done
    }
}

/// Which pending handshake ends to make room for a new connection: of the handshakes the
/// listener has not answered (none, only when every one is answered: then of all), the oldest
/// of the address that holds the most of them. A flood from one address thus ends its own
/// connections first, and one from the same address as a legitimate client (a local process)
/// ends connections that said nothing before the client's, which the listener has answered.
fn evictee(pending: &[Pending]) -> usize {
    let unanswered = pending.iter().any(|p| !p.answered);
    let candidate = |p: &Pending| !unanswered || !p.answered;
    // How many candidates each address holds (a short list: a flood comes from few).
    let mut held: Vec<(IpAddr, usize)> = Vec::new();
    for p in pending.iter().filter(|p| candidate(p)) {
        match held.iter_mut().find(|(ip, _)| *ip == p.peer.ip()) {
            Some((_, n)) => *n += 1,
            None => held.push((p.peer.ip(), 1)),
        }
    }
    let mut chosen: Option<(usize, usize, Instant)> = None;
    for (i, p) in pending.iter().enumerate() {
        if !candidate(p) {
            continue;
        }
        let count = held
            .iter()
            .find(|(ip, _)| *ip == p.peer.ip())
            .map_or(0, |(_, n)| *n);
        let better = chosen.is_none_or(|(_, c, at)| count > c || (count == c && p.accepted < at));
        if better {
            chosen = Some((i, count, p.accepted));
        }
    }
    chosen.map_or(0, |(i, _, _)| i)
}

/// Write what the handshake has to send, until done or the socket is full (`answered` once
/// anything was sent).
fn flush(
    conn: &mut ServerConnection,
    tcp: &mut TcpStream,
    answered: &mut bool,
) -> std::result::Result<(), Progress> {
    while conn.wants_write() {
        match conn.write_tls(tcp) {
            Ok(_) => *answered = true,
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
