//! One authenticated connection of a named endpoint, either side:
//! [`Connection::connect_with`] makes the client's, [`Listener::accept`](super::Listener::accept)
//! the listener's.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, fcntl};

use super::closer::close_later;
use super::creds::{Allow, Credentials, overflow_note};
use super::name::{Name, seqpacket_socket};
use crate::error::PeerRefusal;
use crate::wire::Channel;
use crate::wire::Message;
use crate::wire::wait::{Deadline, deadline_after};
use crate::{Error, Result};

/// How long connecting, and each send and receive of a connection, may take unless told
/// otherwise: 10 seconds.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// How a client connects: which servers it trusts, and how long it waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Whom the listener must be, by the kernel's credentials for it (`SO_PEERCRED`): a
    /// listener that is not admitted is taken for a squatter and nothing is sent to it.
    /// Default: this process's own uid ([`Allow::same_user`]).
    pub expect: Allow,
    /// The limit on connecting plus being admitted (the admission is the protocol's first
    /// message, which `vmm_core::peer::Session` waits for), and then the connection's
    /// [`timeout`](Connection::timeout) for each send and receive (`None`: no limit). Default
    /// [`DEFAULT_TIMEOUT`].
    pub timeout: Option<Duration>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            expect: Allow::same_user(),
            timeout: Some(DEFAULT_TIMEOUT),
        }
    }
}

impl ConnectOptions {
    /// Set [`ConnectOptions::expect`].
    pub fn expect(mut self, expect: Allow) -> Self {
        self.expect = expect;
        self
    }

    /// Set [`ConnectOptions::timeout`].
    pub fn timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }
}

/// One admitted connection of a named endpoint: a `SOCK_SEQPACKET` socket whose peer's
/// credentials the kernel vouched for (an authenticated channel), one packet per message.
///
/// It moves a named endpoint's packets and knows nothing of what they say: the protocol
/// spoken on it (docs/protocol.md: the handshake, `DATA`, descriptors) is
/// `vmm_core::peer::Session`'s, which owns one. Every packet it sends or takes carries frame
/// byte `0x00`, the channel framing's mark of a peer message, so vmm-core's internal framings
/// never cross an endpoint.
///
/// Every receive takes only what a peer may send: a packet whose frame byte is not `0x00`
/// (vmm-core's internal framing, a payload spilled into a memfd in particular) or that is
/// longer than the receiver's cap is an [`Error::Protocol`] before anything is read from its
/// fds or allocated for it; the fds of a refused packet are closed on a background thread, so
/// a hostile fd whose `close` blocks holds up no caller.
///
/// Every send and receive is bounded by the connection's [`timeout`](Self::timeout), so a peer
/// that stops talking (or reading) costs a bounded wait, never a hung thread.
#[derive(Debug)]
pub struct Connection {
    channel: Channel,
    peer: Credentials,
    timeout: Option<Duration>,
    endpoint: String,
}

impl Connection {
    pub(crate) fn new(
        channel: Channel,
        peer: Credentials,
        timeout: Option<Duration>,
        endpoint: String,
    ) -> Connection {
        Connection {
            channel,
            peer,
            timeout,
            endpoint,
        }
    }

    /// Connect to the endpoint `name`, then check the listener's credentials against
    /// `options.expect` before anything is sent or read.
    ///
    /// The connection is authenticated but not yet admitted: the listener checks this
    /// process's credentials as it accepts, and says whether it admitted it in the first
    /// message of the protocol spoken on it (`vmm_core::peer::Session::connect_with` waits for
    /// it). `options.timeout` bounds connecting here and is the connection's
    /// [`timeout`](Self::timeout).
    ///
    /// Errors: [`Error::PeerRefused`] when the listener is not whom `expect` allows (a squatter,
    /// say); [`Error::Timeout`] when the listener's backlog stayed full past
    /// `options.timeout`; [`Error::Os`] with `ENOENT` (no such endpoint) or `ECONNREFUSED` (a
    /// socket file nobody listens on).
    pub fn connect_with(name: &Name, options: &ConnectOptions) -> Result<Connection> {
        let addr = name.addr()?;
        let deadline = options.timeout.map_or(Deadline::Never, deadline_after);
        let socket = seqpacket_socket(true)?;
        loop {
            match nix::sys::socket::connect(socket.as_raw_fd(), &addr) {
                Ok(()) => break,
                Err(Errno::EINTR) => continue,
                // The listener's backlog is full: it is alive but slow; try again until the
                // deadline (a Unix socket has no connection in progress to wait on).
                Err(Errno::EAGAIN) => {
                    if matches!(deadline, Deadline::At(d) if Instant::now() >= d) {
                        return Err(Error::Timeout {
                            what: format!("connecting to endpoint {name}: its backlog stayed full"),
                            after: options.timeout.unwrap_or_default(),
                        });
                    }
                    std::thread::sleep(Duration::from_micros(500));
                }
                Err(Errno::ECONNREFUSED) => {
                    return Err(Error::Os {
                        op: format!(
                            "connect({name}): nothing listens there (a dead listener's socket file?)"
                        ),
                        source: std::io::Error::from_raw_os_error(libc::ECONNREFUSED),
                    });
                }
                Err(Errno::ENOENT) => {
                    return Err(Error::Os {
                        op: format!("connect({name}): no such endpoint"),
                        source: std::io::Error::from_raw_os_error(libc::ENOENT),
                    });
                }
                Err(e) => return Err(Error::errno(format!("connect({name})"), e)),
            }
        }
        set_blocking(socket.as_fd())?;
        let server = Credentials::of_peer(&socket)?;
        if !options.expect.admits(&server) {
            return Err(Error::PeerRefused {
                endpoint: name.to_string(),
                reason: PeerRefusal::UnexpectedListener {
                    listener: server,
                    expected: options.expect.to_string(),
                    note: overflow_note(&server),
                },
            });
        }
        Ok(Connection::new(
            Channel::from_fd(socket),
            server,
            options.timeout,
            name.to_string(),
        ))
    }

    /// The peer's credentials, as the kernel recorded them (not as the peer claims).
    pub fn peer(&self) -> Credentials {
        self.peer
    }

    /// The endpoint's name, as given to `bind` or `connect`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The limit on each send and receive (`None`: none).
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Set the limit on each send and receive (`None`: wait as long as it takes).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// Send one packet: frame byte `0x00`, then `bytes` (at most
    /// [`INLINE_MAX`](crate::wire::INLINE_MAX): an endpoint's packet is never spilled), with
    /// `fds`, within the connection's timeout.
    pub fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        match self.channel.send_peer(bytes, fds, self.timeout) {
            Err(Error::Timeout { after, .. }) => Err(Error::Timeout {
                what: format!(
                    "sending to endpoint {} ({}): it is not reading",
                    self.endpoint, self.peer
                ),
                after,
            }),
            other => other,
        }
    }

    /// Receive one packet of frame byte `0x00` and at most `max` bytes after it, within the
    /// connection's timeout; any other packet is refused (its fds closed off this thread)
    /// before anything is read from or allocated for it.
    pub fn recv(&self, max: usize) -> Result<Message> {
        match self.recv_within(self.timeout, max) {
            Err(Error::Timeout { after, .. }) => Err(Error::Timeout {
                what: format!(
                    "receiving from endpoint {} ({}): it sent nothing",
                    self.endpoint, self.peer
                ),
                after,
            }),
            other => other,
        }
    }

    /// [`recv`](Self::recv) within `timeout` rather than the connection's, with the channel's
    /// own errors (a handshake names its wait itself).
    pub(crate) fn recv_within(&self, timeout: Option<Duration>, max: usize) -> Result<Message> {
        self.channel.recv_peer(timeout, max, close_later)
    }
}

impl AsFd for Connection {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.channel.as_fd()
    }
}

/// Clear `O_NONBLOCK` (the channel's sends rely on a blocking socket when they may wait).
fn set_blocking(fd: BorrowedFd<'_>) -> Result<()> {
    let flags = fcntl(fd, FcntlArg::F_GETFL).map_err(|e| Error::errno("fcntl(F_GETFL)", e))?;
    let flags = OFlag::from_bits_retain(flags) & !OFlag::O_NONBLOCK;
    fcntl(fd, FcntlArg::F_SETFL(flags)).map_err(|e| Error::errno("fcntl(F_SETFL)", e))?;
    Ok(())
}
