//! One admitted connection of a named endpoint, either side: [`Connection::connect`] makes the
//! client's, [`Listener::accept`](super::Listener::accept) the listener's.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, fcntl};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::closer::close_later;
use super::creds::{Allow, Credentials, overflow_note};
use super::frame::{Frame, Kind, MAX_FRAME};
use super::name::{Name, seqpacket_socket};
use crate::wire::channel::{Channel, Deadline, deadline_after};
use crate::wire::oob;
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
    /// The limit on connecting plus being admitted, and then the connection's
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
/// credentials the kernel vouched for, speaking exactly the messages of `docs/protocol.md`
/// ([`send_data`](Self::send_data) and [`send_value`](Self::send_value) here; descriptors in
/// [`peer`](crate::peer)), one packet per message.
///
/// Every receive takes only what a peer may send: a packet whose frame byte is not `0x00`
/// (vmm-core's internal framing of a payload spilled into a memfd, in particular) or that is
/// longer than the largest protocol message is an [`Error::Protocol`] before anything is read
/// from its fds or allocated for it; the fds of a refused or unwanted message are closed on a
/// background thread, so a hostile fd whose `close` blocks holds up no caller.
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

    /// Connect to the endpoint `name` with [`ConnectOptions::default`]: the listener must run as
    /// this process's uid, and connecting may take [`DEFAULT_TIMEOUT`].
    pub fn connect(name: &Name) -> Result<Connection> {
        Connection::connect_with(name, &ConnectOptions::default())
    }

    /// Connect to the endpoint `name`, then check the listener's credentials against
    /// `options.expect` before anything is sent or read, then wait for the listener to admit
    /// this process (it checks this process's credentials the same way).
    ///
    /// Errors: [`Error::PeerRefused`] when the listener is not whom `expect` allows (a squatter,
    /// say) or when it refused this process; [`Error::Timeout`] when connecting or being
    /// admitted took longer than `options.timeout` (a listener that never calls `accept`);
    /// [`Error::Os`] with `ENOENT` (no such endpoint) or `ECONNREFUSED` (a socket file nobody
    /// listens on).
    pub fn connect_with(name: &Name, options: &ConnectOptions) -> Result<Connection> {
        let addr = name.addr()?;
        let started = Instant::now();
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
                reason: format!(
                    "its listener is {server}, not whom this client expects ({}){}: another \
                     process may have taken the name first; nothing was sent to it",
                    options.expect,
                    overflow_note(&server)
                ),
            });
        }
        let channel = Channel::from_fd(socket);
        let left = match deadline {
            Deadline::Never => None,
            Deadline::At(d) => Some(d.saturating_duration_since(Instant::now())),
        };
        let message = match channel.recv_peer(left, MAX_FRAME, close_later) {
            Ok(message) => message,
            Err(Error::Timeout { .. }) => {
                return Err(Error::Timeout {
                    what: format!(
                        "waiting to be admitted by endpoint {name} (its listener, {server}, \
                         accepted no connection)"
                    ),
                    after: started.elapsed(),
                });
            }
            Err(Error::Disconnected(_)) => {
                return Err(Error::PeerRefused {
                    endpoint: name.to_string(),
                    reason: format!(
                        "its listener ({server}) closed the connection without admitting it"
                    ),
                });
            }
            Err(e) => return Err(e),
        };
        let frame = match Frame::decode(&message.bytes, message.fds.len()) {
            Ok(frame) => frame,
            Err(e) => {
                close_later(message.fds);
                return Err(e);
            }
        };
        // HELLO and REFUSED carry no fds (Frame::decode checked the count).
        match frame.kind {
            Kind::Hello => Ok(Connection::new(
                channel,
                server,
                options.timeout,
                name.to_string(),
            )),
            Kind::Refused => Err(Error::PeerRefused {
                endpoint: name.to_string(),
                reason: format!(
                    "its listener ({server}) refused this process: {}",
                    String::from_utf8_lossy(&frame.payload)
                ),
            }),
            other => Err(Error::Protocol(format!(
                "endpoint {name}: the listener's first message is {}, not HELLO",
                other.name()
            ))),
        }
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

    /// Serialise `value` with postcard and send it as the payload of a `DATA` message (at most
    /// [`MAX_DATA`](super::MAX_DATA) bytes): for Rust peers on both ends that agree on the
    /// type. Only docs/protocol.md crosses an endpoint, so a value that carries fds (a buffer,
    /// a descriptor, a queue, an [`Fd`](crate::wire::Fd)) is an [`Error::InvalidArgument`]:
    /// send descriptors with [`send_descriptor`](Self::send_descriptor).
    pub fn send_value<T: Serialize + ?Sized>(&self, value: &T) -> Result<()> {
        let encoded = oob::encode(value)?;
        if encoded.fd_count() != 0 {
            return Err(Error::InvalidArgument(format!(
                "endpoint {}: a value with {} fd(s) cannot cross a named endpoint (only the \
                 messages of docs/protocol.md do); send descriptors with send_descriptor",
                self.endpoint,
                encoded.fd_count()
            )));
        }
        self.send_data(encoded.bytes())
    }

    /// Receive a value sent with [`send_value`](Self::send_value): a `DATA` message whose
    /// payload is its postcard encoding. Any other message is an [`Error::Protocol`]; a value
    /// type that needs fds fails to deserialise (none arrive).
    pub fn recv_value<T: DeserializeOwned>(&self) -> Result<T> {
        let bytes = self.recv_data()?;
        oob::decode(&bytes, Vec::new())
    }

    /// Send application bytes as a peer-protocol `DATA` message (any language's peer reads it),
    /// at most [`MAX_DATA`](super::MAX_DATA) bytes, no fds.
    pub fn send_data(&self, bytes: &[u8]) -> Result<()> {
        self.send_frame(&Frame::with_payload(Kind::Data, bytes), &[])
    }

    /// Receive a `DATA` message's bytes. Any other message is an [`Error::Protocol`] (its fds
    /// are closed).
    pub fn recv_data(&self) -> Result<Vec<u8>> {
        let (frame, fds) = self.recv_frame()?;
        // Unwanted fds (of a descriptor that came instead) close off this thread.
        close_later(fds);
        match frame.kind {
            Kind::Data => Ok(frame.payload),
            other => Err(Error::Protocol(format!(
                "endpoint {}: expected a DATA message, got {}",
                self.endpoint,
                other.name()
            ))),
        }
    }

    /// Send one peer-protocol message with `fds` (one per chunk).
    pub(crate) fn send_frame(&self, frame: &Frame, fds: &[BorrowedFd<'_>]) -> Result<()> {
        let bytes = frame.encode()?;
        self.send_raw(&bytes, fds)
    }

    /// Receive one peer-protocol message: decoded and checked against the fds the kernel
    /// delivered, which are returned owned (and are closed on any error, on the background
    /// closer: a hostile fd's close may block).
    pub(crate) fn recv_frame(&self) -> Result<(Frame, Vec<OwnedFd>)> {
        let message = self.recv_raw()?;
        match Frame::decode(&message.bytes, message.fds.len()) {
            Ok(frame) => Ok((frame, message.fds)),
            Err(e) => {
                close_later(message.fds);
                Err(e)
            }
        }
    }

    /// Send one message's bytes (the channel adds the frame byte) and fds, within the timeout.
    pub(crate) fn send_raw(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        match self.channel.send_timeout(bytes, fds, self.timeout) {
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

    /// Receive one packet of docs/protocol.md: frame byte 0 and at most [`MAX_FRAME`] bytes,
    /// refused (fds closed off this thread) before anything is read or allocated otherwise.
    fn recv_raw(&self) -> Result<crate::wire::Message> {
        match self.channel.recv_peer(self.timeout, MAX_FRAME, close_later) {
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
