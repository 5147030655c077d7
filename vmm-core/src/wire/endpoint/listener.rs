//! The listening side of a named endpoint.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{Backlog, SockFlag, accept4, listen};

use super::connection::{Connection, DEFAULT_TIMEOUT};
use super::creds::{Allow, Credentials};
use super::frame::{Frame, Kind};
use super::name::{Name, SocketFile, bind_abstract, bind_path, seqpacket_socket};
use crate::wire::channel::{Channel, Deadline, deadline_after, wait_readable};
use crate::{Error, Result};

/// How many refused peers a listener remembers (the most recent ones).
const REFUSALS_KEPT: usize = 64;

/// How a [`Listener`] admits peers and bounds their connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerOptions {
    /// Who may connect, by the kernel's credentials (`SO_PEERCRED`). Default: this process's
    /// effective uid ([`Allow::same_user`]).
    pub allow: Allow,
    /// Each accepted connection's [`timeout`](Connection::timeout) for a send or a receive
    /// (`None`: no limit). Default [`DEFAULT_TIMEOUT`].
    pub timeout: Option<Duration>,
    /// Write one line on stderr for each refused peer (its pid, uid and gid). Default `true`.
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
/// [`accept`](Self::accept) returns the next connection whose peer the allow-list admits;
/// refused peers are told so (a `REFUSED` message naming their uid and gid), disconnected,
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
    /// [`Error::InvalidArgument`] says which rule it breaks; a socket file nobody listens on
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
    /// [`Error::Timeout`] if none came. Refused peers do not end the wait (see the type's
    /// docs); a peer that hung up before it was admitted is skipped.
    pub fn accept(&self, timeout: Option<Duration>) -> Result<Connection> {
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
                Err(e) => return Err(Error::errno(format!("accept4({})", self.name), e)),
            };
            let peer = Credentials::of_peer(&socket)?;
            let channel = Channel::from_fd(socket);
            if !self.options.allow.admits(&peer) {
                self.refuse(&channel, peer);
                continue;
            }
            // A fresh socket's buffer is empty, so this never waits; a peer that already hung
            // up is skipped.
            let hello = Frame::empty(Kind::Hello).encode()?;
            match channel.send_timeout(&hello, &[], Some(Duration::ZERO)) {
                Ok(()) => {}
                Err(Error::Disconnected(_) | Error::Timeout { .. }) => continue,
                Err(e) => return Err(e),
            }
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

    /// Tell a refused peer why (best effort: never waits), remember and log it; the
    /// connection closes when `channel` drops.
    fn refuse(&self, channel: &Channel, peer: Credentials) {
        let reason = format!(
            "uid {} (gid {}) is not allowed to connect to this endpoint",
            peer.uid, peer.gid
        );
        if let Ok(bytes) = Frame::with_payload(Kind::Refused, reason.as_bytes()).encode() {
            let _ = channel.send_timeout(&bytes, &[], Some(Duration::ZERO));
        }
        {
            let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
            if refused.len() == REFUSALS_KEPT {
                refused.pop_front();
            }
            refused.push_back(peer);
        }
        if self.options.log_refusals {
            eprintln!(
                "vmm-ipc endpoint {}: refused a connection from {peer}: not in its allow-list \
                 ({})",
                self.name, self.options.allow
            );
        }
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}
