//! The listening side of a named endpoint.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{Backlog, SockFlag, accept4, listen};

use super::closer::close_later;
use super::connection::{Connection, DEFAULT_TIMEOUT};
use super::creds::{Allow, Credentials, overflow_note};
use super::defuse::drain_socket;
use super::name::{Name, SocketFile, bind_abstract, bind_path, seqpacket_socket};
use crate::trace;
use crate::wire::Channel;
use crate::wire::wait::{Deadline, deadline_after, wait_readable};
use crate::{Error, Result};

/// How many refused peers a listener remembers (the most recent ones).
const REFUSALS_KEPT: usize = 64;

/// At most this many refusals are logged one line each per [`LOG_INTERVAL`]; the rest are
/// counted, and one line says how many (when the next interval's first refusal comes, or when
/// the listener is dropped).
pub const LOG_BURST: u32 = 10;

/// The interval of [`LOG_BURST`]: 10 seconds.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The first message of every connection of an endpoint, in the protocol spoken on it: what a
/// listener sends a peer it admits, and what it sends one it refuses.
///
/// The listener decides whom to admit (by the kernel's credentials); the protocol decides how
/// that is said, so the listener stays a transport: `vmm_core::peer`'s handshake (`HELLO`,
/// `REFUSED` of docs/protocol.md) is one implementation.
pub trait Greeting {
    /// The message sent to an admitted peer before [`Listener::accept`] returns its
    /// connection.
    fn admitted(&self) -> Result<Vec<u8>>;

    /// The message sent (best effort, never waiting) to a refused peer before its connection
    /// closes: `reason` names its uid and gid.
    fn refused(&self, reason: &str) -> Result<Vec<u8>>;
}

/// The refusal log's state: lines written in the current interval, and those left unwritten.
#[derive(Debug)]
struct RefusalLog {
    since: Instant,
    written: u32,
    unwritten: u64,
}

/// How a [`Listener`] admits peers and bounds their connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerOptions {
    /// Who may connect, by the kernel's credentials (`SO_PEERCRED`). Default: this process's
    /// effective uid ([`Allow::same_user`]).
    pub allow: Allow,
    /// Each accepted connection's [`timeout`](Connection::timeout) for a send or a receive
    /// (`None`: no limit). Default [`DEFAULT_TIMEOUT`].
    pub timeout: Option<Duration>,
    /// Log refused peers on stderr: one line each (its pid, uid and gid), at most
    /// [`LOG_BURST`] per [`LOG_INTERVAL`], then one line with the count of those not logged,
    /// so a flood of refused connections cannot flood the log. Default `true`.
    pub log_refusals: bool,
    /// The `listen` backlog. Default 128.
    pub backlog: i32,
}

impl Default for ListenerOptions {
    fn default() -> Self {
        ListenerOptions {
            allow: Allow::same_user(),
            timeout: Some(DEFAULT_TIMEOUT),
            log_refusals: true,
            backlog: 128,
        }
    }
}

impl ListenerOptions {
    /// Set [`ListenerOptions::allow`].
    pub fn allow(mut self, allow: Allow) -> Self {
        self.allow = allow;
        self
    }

    /// Set [`ListenerOptions::timeout`].
    pub fn timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set [`ListenerOptions::log_refusals`].
    pub fn log_refusals(mut self, log: bool) -> Self {
        self.log_refusals = log;
        self
    }
}

/// A named endpoint that admits peers by the kernel's credentials for them.
///
/// [`accept`](Self::accept) returns the next connection whose peer the allow-list admits, after
/// sending it the [`Greeting`]'s admission; refused peers are told so (the greeting's refusal,
/// naming their uid and gid: `REFUSED` in the peer protocol), disconnected,
/// logged (see [`ListenerOptions::log_refusals`]) and remembered ([`refused`](Self::refused)),
/// and `accept` goes on waiting. Nothing is read from a peer while it is accepted, so a client
/// that connects and says nothing delays no one: it gets its connection, whose receives are
/// bounded by the connection's timeout. `accept` takes `&self`, so several threads may accept
/// on one listener.
///
/// A path listener unlinks its socket file when dropped (unless the file was replaced since).
/// See [the module docs](super) for what the checks stop and what they do not.
#[derive(Debug)]
pub struct Listener {
    // Dropped in this order: the socket closes before its file is unlinked.
    socket: OwnedFd,
    _file: Option<SocketFile>,
    name: Name,
    options: ListenerOptions,
    refused: Mutex<VecDeque<Credentials>>,
    log: Mutex<RefusalLog>,
}

impl Listener {
    /// Listen on `name` with [`ListenerOptions::default`]: only this process's uid is
    /// admitted.
    pub fn bind(name: &Name) -> Result<Listener> {
        Listener::bind_with(name, ListenerOptions::default())
    }

    /// Listen on `name`.
    ///
    /// For a path: its directory must be owned by this process's effective uid and closed to
    /// group and others (a missing last directory is created 0700), else
    /// [`Error::InvalidEndpoint`] says which rule it breaks; a socket file nobody listens on
    /// (a dead listener's: `connect` is refused) is replaced; a live listener's is never taken
    /// ([`Error::Os`] with `EADDRINUSE`), nor is a file that is not a socket. The new socket
    /// file is mode 0600. For an abstract name: `EADDRINUSE` when it is taken.
    pub fn bind_with(name: &Name, options: ListenerOptions) -> Result<Listener> {
        let socket = seqpacket_socket(true)?;
        let file = match name {
            Name::Path(path) => Some(bind_path(&socket, name, path)?),
            Name::Abstract(_) => {
                bind_abstract(&socket, name)?;
                None
            }
        };
        listen(
            &socket,
            Backlog::new(options.backlog).unwrap_or(Backlog::MAXCONN),
        )
        .map_err(|e| Error::errno(format!("listen({name})"), e))?;
        Ok(Listener {
            socket,
            _file: file,
            name: name.clone(),
            options,
            refused: Mutex::new(VecDeque::new()),
            log: Mutex::new(RefusalLog {
                since: Instant::now(),
                written: 0,
                unwritten: 0,
            }),
        })
    }

    /// The name it listens on.
    pub fn name(&self) -> &Name {
        &self.name
    }

    /// Its options.
    pub fn options(&self) -> &ListenerOptions {
        &self.options
    }

    /// The next admitted connection, waiting at most `timeout` (`None`: forever);
    /// [`Error::Timeout`] if none came. `greeting` says what an admitted and a refused peer
    /// are sent (`vmm_core::peer::Session::accept` passes the peer protocol's handshake). Refused peers do not end the wait (see the type's
    /// docs); a peer that hung up before it was admitted is skipped.
    ///
    /// Out of fds, it returns at once, and the pending connection stays queued:
    /// [`Error::FdLimit`] when this process is at its open-file limit (`EMFILE`), [`Error::Os`]
    /// with `ENFILE` (see [`Error::raw_os_error`]) at the system's. Both are transient: a
    /// server pauses briefly (or until some of its connections close) and calls `accept`
    /// again, rather than giving up.
    pub fn accept(&self, timeout: Option<Duration>, greeting: &dyn Greeting) -> Result<Connection> {
        self.accept_admitting(timeout, greeting, &mut |_| Ok(()))
    }

    /// [`accept`](Self::accept), with the server's own rule for peers the allow-list admits:
    /// `admit` is asked about each, before it is sent the greeting's admission, and a peer it
    /// answers `Err(reason)` is refused as the allow-list refuses (the greeting's refusal,
    /// naming `reason`; logged and remembered). It is how a server bounds its connections per
    /// uid (vmm-memd's `--max-connections-per-uid`): the peer hears at once that it
    /// may not connect now, instead of waiting in the backlog. `admit` runs on the accepting
    /// thread and should not block.
    pub fn accept_admitting(
        &self,
        timeout: Option<Duration>,
        greeting: &dyn Greeting,
        admit: &mut dyn FnMut(&Credentials) -> std::result::Result<(), String>,
    ) -> Result<Connection> {
        // The whole wait, refusals nested in it; the admitted peer's pid and uid once known.
        let span = trace::span!(
            INFO,
            "endpoint.accept",
            endpoint = %self.name,
            pid = trace::Empty,
            uid = trace::Empty
        );
        let started = Instant::now();
        let deadline = timeout.map_or(Deadline::Never, deadline_after);
        let timed_out = || Error::Timeout {
            what: format!("accepting a connection on endpoint {}", self.name),
            after: started.elapsed(),
        };
        loop {
            if matches!(deadline, Deadline::At(d) if Instant::now() >= d) {
                return Err(timed_out());
            }
            let socket = match accept4(self.socket.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
                // SAFETY: accept4 returned a new fd, installed in this process for this call
                // alone: nothing else owns it.
                Ok(raw) => unsafe { OwnedFd::from_raw_fd(raw) },
                Err(Errno::EAGAIN) => {
                    if !wait_readable(self.socket.as_fd(), deadline)? {
                        return Err(timed_out());
                    }
                    continue;
                }
                Err(Errno::EINTR | Errno::ECONNABORTED | Errno::EPROTO) => continue,
                // Error::errno makes EMFILE an Error::FdLimit.
                Err(e @ (Errno::EMFILE | Errno::ENFILE)) => {
                    return Err(Error::errno(
                        format!(
                            "accept4({}): no fd for the next connection (it stays queued; \
                             accept again once fds are free)",
                            self.name
                        ),
                        e,
                    ));
                }
                Err(e) => return Err(Error::errno(format!("accept4({})", self.name), e)),
            };
            let peer = Credentials::of_peer(&socket)?;
            let channel = Channel::from_fd(socket);
            if !self.options.allow.admits(&peer) {
                let reason = format!(
                    "uid {} (gid {}) is not allowed to connect to this endpoint{}",
                    peer.uid,
                    peer.gid,
                    overflow_note(&peer)
                );
                let why = format!(
                    "not in its allow-list ({}){}",
                    self.options.allow,
                    overflow_note(&peer)
                );
                self.refuse(channel, peer, greeting, &reason, &why);
                continue;
            }
            if let Err(reason) = admit(&peer) {
                let reason = format!("uid {} (gid {}): {reason}", peer.uid, peer.gid);
                self.refuse(channel, peer, greeting, &reason, &reason);
                continue;
            }
            // A fresh socket's buffer is empty, so this never waits; a peer that already hung
            // up is skipped.
            let hello = greeting.admitted()?;
            match channel.send_peer(&hello, &[], Some(Duration::ZERO)) {
                Ok(()) => {}
                Err(Error::Disconnected(_) | Error::Timeout { .. }) => continue,
                Err(e) => return Err(e),
            }
            trace::record!(span, "pid", peer.pid);
            trace::record!(span, "uid", peer.uid);
            return Ok(Connection::new(
                channel,
                peer,
                self.options.timeout,
                self.name.to_string(),
            ));
        }
    }

    /// The most recent refused peers (at most 64), oldest first.
    pub fn refused(&self) -> Vec<Credentials> {
        self.refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect()
    }

    /// Turn a refused peer away: stop it sending more, drain what it already sent (so that
    /// closing does not reset the connection under the `REFUSED` message: a Unix socket closed
    /// with unread messages makes its peer's next read fail with `ECONNRESET` before it sees
    /// what is queued for it), tell it why (best effort: never waits), remember and log it,
    /// then close. Nothing it sent is looked at; its fds are defused and closed (see
    /// `closer`).
    /// `reason` is what the peer is told, `why` what the log says.
    fn refuse(
        &self,
        channel: Channel,
        peer: Credentials,
        greeting: &dyn Greeting,
        reason: &str,
        why: &str,
    ) {
        let _span = trace::span!(
            INFO,
            "endpoint.refuse",
            endpoint = %self.name,
            pid = peer.pid,
            uid = peer.uid,
            gid = peer.gid
        );
        // Its further sends fail (EPIPE), so the drain below ends. What it queued comes out
        // defused (see `defuse`): sockets closed here without waiting, the rest to the closers.
        let _ = nix::sys::socket::shutdown(channel.as_raw_fd(), nix::sys::socket::Shutdown::Read);
        let (emptied, rest) = drain_socket(channel.as_fd());
        close_later(rest);
        if let Ok(bytes) = greeting.refused(reason) {
            let _ = channel.send_peer(&bytes, &[], Some(Duration::ZERO));
        }
        {
            let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
            if refused.len() == REFUSALS_KEPT {
                refused.pop_front();
            }
            refused.push_back(peer);
        }
        if self.options.log_refusals {
            self.log_refusal(peer, why);
        }
        // A message sent between the drain and here (none can be: reading is shut down) would
        // reset the connection. Emptied, its close cannot block; not emptied (a bound, or too
        // few fds to receive), its close would drop what is queued here: the closers do it.
        if emptied {
            drop(channel);
        } else {
            close_later(vec![channel.into_fd()]);
        }
    }

    /// One line for `peer`, within [`LOG_BURST`] lines per [`LOG_INTERVAL`].
    fn log_refusal(&self, peer: Credentials, why: &str) {
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if now.duration_since(log.since) >= LOG_INTERVAL {
            self.log_unwritten(&mut log);
            log.since = now;
            log.written = 0;
        }
        if log.written < LOG_BURST {
            log.written += 1;
            eprintln!(
                "vmm-ipc endpoint {}: refused a connection from {peer}: {why}",
                self.name
            );
        } else {
            log.unwritten += 1;
        }
    }

    /// The line that counts the refusals not logged, if any.
    fn log_unwritten(&self, log: &mut RefusalLog) {
        if log.unwritten > 0 {
            eprintln!(
                "vmm-ipc endpoint {}: {} more refused connection(s) not logged (at most {} \
                 lines per {:?})",
                self.name, log.unwritten, LOG_BURST, LOG_INTERVAL
            );
            log.unwritten = 0;
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        self.log_unwritten(&mut log);
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}
