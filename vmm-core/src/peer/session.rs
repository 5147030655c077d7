//! [`Session`]: the peer protocol spoken on one named endpoint's connection, either side.
//!
//! A [`wire::endpoint::Connection`] is the transport: a socket whose peer's
//! credentials the kernel vouched for. A session owns one and speaks docs/protocol.md on it:
//! the handshake (the listener's `HELLO` or `REFUSED`, [`Handshake`]), then `DATA` messages
//! and descriptors in any order the applications agree on. Every message it takes is decoded
//! and checked by [`Frame::decode`] before anything is allocated for it, and every fd it does
//! not hand out is closed off the caller's thread.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::codec::from_frame;
use super::frame::{Frame, Kind, MAX_FRAME};
use super::{Descriptor, DescriptorRef, PeerMessage, encode_descriptor};
use crate::error::{FdlessTransport, PeerRefusal, ProtocolRule};
use crate::wire::endpoint::{
    ConnectOptions, Connection, Credentials, Greeting, Listener, Name, close_later,
};
use crate::wire::{self, Message};
use crate::{Error, Result};

/// The peer protocol's handshake as a listener's [`Greeting`]: `HELLO` to an admitted peer,
/// `REFUSED` with the reason to a refused one.
#[derive(Debug, Clone, Copy, Default)]
pub struct Handshake;

impl Greeting for Handshake {
    fn admitted(&self) -> Result<Vec<u8>> {
        Frame::empty(Kind::Hello).encode()
    }

    fn refused(&self, reason: &str) -> Result<Vec<u8>> {
        Frame::with_payload(Kind::Refused, reason.as_bytes()).encode()
    }
}

/// One admitted connection of a named endpoint speaking exactly the messages of
/// `docs/protocol.md`, one packet per message: application bytes with
/// [`send_data`](Self::send_data), serde values as `DATA` with
/// [`send_value`](Self::send_value), descriptors with
/// [`send_descriptor`](Self::send_descriptor). A Python process speaks to it with the standard
/// library alone (`python/vmm_ipc_peer/`).
///
/// Every send and receive is bounded by the connection's [`timeout`](Self::timeout); what a
/// receive refuses, and why, is [`Connection`]'s (the packet) and then the protocol's codec's
/// (the message, by the rules of docs/protocol.md, before anything is allocated for it).
#[derive(Debug)]
pub struct Session {
    connection: Connection,
}

impl Session {
    /// The next admitted peer of `listener`, waiting at most `timeout` (`None`: forever): see
    /// [`Listener::accept`], to which this passes the protocol's [`Handshake`].
    pub fn accept(listener: &Listener, timeout: Option<Duration>) -> Result<Session> {
        let connection = listener.accept(timeout, &Handshake)?;
        Ok(Session { connection })
    }

    /// [`accept`](Self::accept) with the server's own admission rule:
    /// see [`Listener::accept_admitting`]. A peer that `admit` refuses reads `REFUSED` with
    /// the reason (its `connect` fails with [`Error::PeerRefused`]).
    pub fn accept_admitting(
        listener: &Listener,
        timeout: Option<Duration>,
        admit: &mut dyn FnMut(&Credentials) -> std::result::Result<(), String>,
    ) -> Result<Session> {
        let connection = listener.accept_admitting(timeout, &Handshake, admit)?;
        Ok(Session { connection })
    }

    /// Connect to the endpoint `name` with [`ConnectOptions::default`]: the listener must run as
    /// this process's uid, and connecting may take
    /// [`DEFAULT_TIMEOUT`](crate::wire::endpoint::DEFAULT_TIMEOUT).
    pub fn connect(name: &Name) -> Result<Session> {
        Session::connect_with(name, &ConnectOptions::default())
    }

    /// Connect to the endpoint `name`, then check the listener's credentials against
    /// `options.expect` before anything is sent or read
    /// ([`Connection::connect_with`]), then wait for the listener to admit this process (it
    /// checks this process's credentials the same way, and says so with `HELLO`).
    ///
    /// Errors: [`Error::PeerRefused`] when the listener is not whom `expect` allows (a squatter,
    /// say) or when it refused this process; [`Error::Timeout`] when connecting or being
    /// admitted took longer than `options.timeout` (a listener that never calls `accept`);
    /// [`Error::Os`] with `ENOENT` (no such endpoint) or `ECONNREFUSED` (a socket file nobody
    /// listens on).
    pub fn connect_with(name: &Name, options: &ConnectOptions) -> Result<Session> {
        let started = Instant::now();
        let connection = Connection::connect_with(name, options)?;
        let server = connection.peer();
        let left = options
            .timeout
            .map(|timeout| timeout.saturating_sub(started.elapsed()));
        let message = match connection.recv_within(left, MAX_FRAME) {
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
                    reason: PeerRefusal::ListenerClosed { listener: server },
                });
            }
            Err(e) => return Err(e),
        };
        // HELLO and REFUSED carry no fds (Frame::decode checks the count).
        let (frame, fds) = decode(message)?;
        close_later(fds);
        match frame.kind {
            Kind::Hello => Ok(Session { connection }),
            Kind::Refused => Err(Error::PeerRefused {
                endpoint: name.to_string(),
                reason: PeerRefusal::RefusedByListener {
                    listener: server,
                    said: String::from_utf8_lossy(&frame.payload).into_owned(),
                },
            }),
            other => Err(Error::protocol(
                ProtocolRule::UnexpectedKind,
                format!(
                    "endpoint {name}: the listener's first message is {}, not HELLO",
                    other.name()
                ),
            )),
        }
    }

    /// The authenticated connection the session speaks on.
    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    /// The peer's credentials, as the kernel recorded them (not as the peer claims).
    pub fn peer(&self) -> Credentials {
        self.connection.peer()
    }

    /// The endpoint's name, as given to `bind` or `connect`.
    pub fn endpoint(&self) -> &str {
        self.connection.endpoint()
    }

    /// The limit on each send and receive (`None`: none).
    pub fn timeout(&self) -> Option<Duration> {
        self.connection.timeout()
    }

    /// Set the limit on each send and receive (`None`: wait as long as it takes).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.connection.set_timeout(timeout);
    }

    /// Serialise `value` with postcard and send it as the payload of a `DATA` message (at most
    /// [`MAX_DATA`](super::MAX_DATA) bytes): for Rust peers on both ends that agree on the
    /// type. Only docs/protocol.md crosses an endpoint, so a value that carries fds (a buffer,
    /// a descriptor, a queue, an [`Fd`](crate::wire::Fd)) is an [`Error::FdsCannotTravel`]:
    /// send descriptors with [`send_descriptor`](Self::send_descriptor).
    pub fn send_value<T: Serialize + ?Sized>(&self, value: &T) -> Result<()> {
        let encoded = wire::encode(value)?;
        if encoded.fd_count() != 0 {
            return Err(Error::FdsCannotTravel {
                transport: FdlessTransport::EndpointValue,
                message: format!(
                    "endpoint {}: a value with {} fd(s) cannot cross a named endpoint (only the \
                     messages of docs/protocol.md do); send descriptors with send_descriptor",
                    self.endpoint(),
                    encoded.fd_count()
                ),
            });
        }
        self.send_data(encoded.bytes())
    }

    /// Receive a value sent with [`send_value`](Self::send_value): a `DATA` message whose
    /// payload is its postcard encoding. Any other message is an [`Error::Protocol`]; a value
    /// type that needs fds fails to deserialise (none arrive).
    pub fn recv_value<T: DeserializeOwned>(&self) -> Result<T> {
        let bytes = self.recv_data()?;
        wire::decode(&bytes, Vec::new())
    }

    /// Send application bytes as a peer-protocol `DATA` message (any language's peer reads it),
    /// at most [`MAX_DATA`](super::MAX_DATA) bytes, no fds.
    pub fn send_data(&self, bytes: &[u8]) -> Result<()> {
        let message = Frame::with_payload(Kind::Data, bytes).encode()?;
        self.connection.send(&message, &[])
    }

    /// Receive a `DATA` message's bytes. Any other message is an [`Error::Protocol`] (its fds
    /// are closed).
    pub fn recv_data(&self) -> Result<Vec<u8>> {
        let (frame, fds) = decode(self.connection.recv(MAX_FRAME)?)?;
        // Unwanted fds (of a descriptor that came instead) close off this thread.
        close_later(fds);
        match frame.kind {
            Kind::Data => Ok(frame.payload),
            other => Err(Error::protocol(
                ProtocolRule::UnexpectedKind,
                format!(
                    "endpoint {}: expected a DATA message, got {}",
                    self.endpoint(),
                    other.name()
                ),
            )),
        }
    }

    /// Send a CUDA, fabric or host descriptor as a protocol message (a peer in any language
    /// reads it); the descriptor keeps its fds. A
    /// [`FabricDescriptor`](crate::cuda::FabricDescriptor) travels as `CUDA_FABRIC` (protocol
    /// version 2, no fds): send it only to a peer that takes version 2 (a version 1 peer
    /// refuses it) and that you would give the memory. See [`encode_descriptor`] for what is
    /// refused.
    pub fn send_descriptor<'a>(&self, descriptor: impl Into<DescriptorRef<'a>>) -> Result<()> {
        let (bytes, fds) = encode_descriptor(descriptor)?;
        self.connection.send(&bytes, &fds)
    }

    /// Receive a descriptor (CUDA, fabric or host), validated as described in [the module
    /// docs](crate::peer). A `DATA` message instead is an [`Error::Protocol`].
    pub fn recv_descriptor(&self) -> Result<Descriptor> {
        match self.recv_message()? {
            PeerMessage::Descriptor(d) => Ok(d),
            PeerMessage::Data(bytes) => Err(Error::protocol(
                ProtocolRule::UnexpectedKind,
                format!(
                    "endpoint {}: expected a descriptor, got a DATA message of {} bytes",
                    self.endpoint(),
                    bytes.len()
                ),
            )),
        }
    }

    /// Receive the next protocol message: a descriptor or application bytes.
    pub fn recv_message(&self) -> Result<PeerMessage> {
        let (frame, fds) = decode(self.connection.recv(MAX_FRAME)?)?;
        from_frame(frame, fds)
    }
}

impl AsFd for Session {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.connection.as_fd()
    }
}

/// One received packet as a protocol message: decoded and checked against the fds the kernel
/// delivered, which are returned owned (and are closed on any error, on the background
/// closer: a hostile fd's close may block).
fn decode(message: Message) -> Result<(Frame, Vec<OwnedFd>)> {
    match Frame::decode(&message.bytes, message.fds.len()) {
        Ok(frame) => Ok((frame, message.fds)),
        Err(e) => {
            close_later(message.fds);
            Err(e)
        }
    }
}
