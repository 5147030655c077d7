//! Typed ends of the sockets between a parent, its children and the forkserver: each end sends
//! only its own direction's messages and decodes only the other direction's.
//!
//! | socket                     | this end         | sends          | receives       |
//! |----------------------------|------------------|----------------|----------------|
//! | a child's channel          | [`ParentEnd`]    | [`Order`]      | [`Report`]     |
//! |                            | [`ChildEnd`]     | [`Report`]     | [`Order`]      |
//! | the forkserver's requests  | [`RequestEnd`]   | [`ForkRequest`]| [`ForkReply`]  |
//! |                            | [`ServerEnd`]    | [`ForkReply`]  | [`ForkRequest`]|
//! | a pool worker's task socket| [`TaskSender`]   | [`Call`]       | nothing        |
//! |                            | [`TaskReceiver`] | nothing        | [`Call`]       |
//!
//! How the wrong direction is kept from compiling: an [`End<S>`] sends only `&S::Sends` and
//! receives only `S::Receives`, both associated types of its [`Side`] `S`, so each end has
//! exactly one message type per direction; a parent's [`ParentEnd::send`] takes an `&Order`,
//! and a `Report` is a type error there. The table above is checked at compile time (the
//! `const` below names each side's types), and a peer's side is the mirror of its own
//! ([`Side::Peer`] must send what this side receives and receive what it sends), so a
//! [`End::pair`] cannot be mismatched either. These types are internal to the crate, so a
//! `compile_fail` doctest cannot name them; the type checks here are the proof.
//!
//! Every message goes as one packet: its postcard bytes, with the fds given beside it. A
//! protocol message holds no fd-backed value of its own ([`Sealed::new`] refuses one).

use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::protocol::{Call, ForkReply, ForkRequest, Order, Report};
use crate::error::ProtocolRule;
use crate::wire::{self, Channel};
use crate::{Error, Result};

/// One end of a socket: the message type it sends, the one it receives, and the side of its
/// peer (at the socket's other end).
pub(crate) trait Side {
    type Sends: Serialize;
    type Receives: DeserializeOwned;
    /// The other end's side: it sends what this one receives, and receives what this one sends.
    type Peer: Side<Sends = Self::Receives, Receives = Self::Sends>;
    /// The message type this side receives, for errors ("a packet that is not a report").
    const RECEIVES: &'static str;
}

/// A message that is never sent: what each end of a task socket sends the other way.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) enum Nothing {}

/// The two sides of one socket, each stated once: a side sends its own message type and
/// receives its peer's, so the pair cannot be declared mismatched.
macro_rules! socket_sides {
    (
        $(#[$a_doc:meta])* $a:ident sends $a_sends:ty, calls what it receives $a_name:literal;
        $(#[$b_doc:meta])* $b:ident sends $b_sends:ty, calls what it receives $b_name:literal;
    ) => {
        $(#[$a_doc])*
        #[derive(Debug)]
        pub(crate) enum $a {}
        $(#[$b_doc])*
        #[derive(Debug)]
        pub(crate) enum $b {}
        impl Side for $a {
            type Sends = $a_sends;
            type Receives = $b_sends;
            type Peer = $b;
            const RECEIVES: &'static str = $a_name;
        }
        impl Side for $b {
            type Sends = $b_sends;
            type Receives = $a_sends;
            type Peer = $a;
            const RECEIVES: &'static str = $b_name;
        }
    };
}

socket_sides! {
    /// The parent's side of a child's channel.
    ParentSide sends Order, calls what it receives "report";
    /// A child's side of its channel (and the forkserver's copy of it, for [`Report::Exited`]).
    ChildSide sends Report, calls what it receives "order";
}
socket_sides! {
    /// The parent's side of the forkserver's request channel.
    RequestSide sends ForkRequest, calls what it receives "fork reply";
    /// The forkserver's side of its request channel.
    ServerSide sends ForkReply, calls what it receives "fork request";
}
socket_sides! {
    /// The pool's side of a worker's task socket.
    TaskSenderSide sends Call, calls what it receives "nothing";
    /// A pool worker's side of its task socket.
    TaskReceiverSide sends Nothing, calls what it receives "task";
}

/// The table in the module docs, checked by the compiler: each side names exactly these types.
const _: () = {
    fn sides<P, C, Q, S, T, R>()
    where
        P: Side<Sends = Order, Receives = Report, Peer = C>,
        C: Side<Sends = Report, Receives = Order, Peer = P>,
        Q: Side<Sends = ForkRequest, Receives = ForkReply, Peer = S>,
        S: Side<Sends = ForkReply, Receives = ForkRequest, Peer = Q>,
        T: Side<Sends = Call, Receives = Nothing, Peer = R>,
        R: Side<Sends = Nothing, Receives = Call, Peer = T>,
    {
    }
    let _ =
        sides::<ParentSide, ChildSide, RequestSide, ServerSide, TaskSenderSide, TaskReceiverSide>;
};

/// The parent's end of a child's channel: sends [`Order`]s, receives [`Report`]s.
pub(crate) type ParentEnd = End<ParentSide>;
/// A child's end of its channel: sends [`Report`]s, receives [`Order`]s.
pub(crate) type ChildEnd = End<ChildSide>;
/// The parent's end of the forkserver's request channel.
pub(crate) type RequestEnd = End<RequestSide>;
/// The forkserver's end of its request channel.
pub(crate) type ServerEnd = End<ServerSide>;
/// The pool's end of a worker's task socket: sends [`Call`]s.
pub(crate) type TaskSender = End<TaskSenderSide>;
/// A pool worker's end of its task socket: receives [`Call`]s.
pub(crate) type TaskReceiver = End<TaskReceiverSide>;

/// One end of a socket, typed by its [`Side`]: see the module docs.
pub(crate) struct End<S: Side> {
    channel: Channel,
    side: PhantomData<fn() -> S>,
}

impl<S: Side> std::fmt::Debug for End<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("End")
            .field("side", &std::any::type_name::<S>())
            .field("fd", &self.channel.as_raw_fd())
            .finish()
    }
}

/// A message received, with the fds its packet carried.
#[derive(Debug)]
pub(crate) struct Received<M> {
    pub message: M,
    pub fds: Vec<OwnedFd>,
}

/// A message encoded ahead of sending (a pool task, sent again if its worker dies before taking
/// it): only an end of a side that sends `M` sends it.
pub(crate) struct Sealed<M> {
    bytes: Vec<u8>,
    message: PhantomData<fn() -> M>,
}

/// Its length only: the bytes may hold the user's data, a bearer token even (see `Payload`).
impl<M> std::fmt::Debug for Sealed<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = std::any::type_name::<M>().rsplit("::").next().unwrap_or("");
        write!(f, "Sealed<{name}>(<{} bytes>)", self.bytes.len())
    }
}

impl<M: Serialize> Sealed<M> {
    /// Encode `message`. A protocol message carries fds only beside it, never inside:
    /// [`Error::Protocol`] if it holds an fd-backed value.
    pub(crate) fn new(message: &M) -> Result<Sealed<M>> {
        let encoded = wire::encode(message)?;
        if encoded.fd_count() != 0 {
            return Err(Error::protocol(
                ProtocolRule::Fds,
                "an internal protocol message holds fds of its own",
            ));
        }
        // No fds to move: the bytes move out, uncopied.
        let (bytes, _) = encoded.into_owned()?;
        Ok(Sealed {
            bytes,
            message: PhantomData,
        })
    }
}

impl<S: Side> End<S> {
    /// A connected pair: this side's end and its peer's.
    pub(crate) fn pair() -> Result<(End<S>, End<S::Peer>)> {
        let (ours, theirs) = Channel::pair()?;
        Ok((End::from_channel(ours), End::from_channel(theirs)))
    }

    /// Type `channel` as this side's end (a child's inherited fd, say).
    pub(crate) fn from_channel(channel: Channel) -> End<S> {
        End {
            channel,
            side: PhantomData,
        }
    }

    /// [`from_channel`](Self::from_channel) for an fd.
    pub(crate) fn from_fd(fd: OwnedFd) -> End<S> {
        End::from_channel(Channel::from_fd(fd))
    }

    /// The fd (to hand the end to a child).
    pub(crate) fn into_fd(self) -> OwnedFd {
        self.channel.into_fd()
    }

    /// Send `message` alone.
    pub(crate) fn send(&self, message: &S::Sends) -> Result<()> {
        self.send_with(message, &[], None)
    }

    /// Send `message` with `fds` beside it, waiting at most `timeout` for room (`None`:
    /// as long as it takes).
    pub(crate) fn send_with(
        &self,
        message: &S::Sends,
        fds: &[BorrowedFd<'_>],
        timeout: Option<Duration>,
    ) -> Result<()> {
        self.send_sealed(&Sealed::new(message)?, fds, timeout)
    }

    /// Send a message encoded ahead, with `fds` beside it.
    pub(crate) fn send_sealed(
        &self,
        message: &Sealed<S::Sends>,
        fds: &[BorrowedFd<'_>],
        timeout: Option<Duration>,
    ) -> Result<()> {
        self.channel.send_timeout(&message.bytes, fds, timeout)
    }

    /// Receive one message, waiting at most `timeout` (`None`: forever). A packet that is not a
    /// `S::Receives` is consumed and refused ([`Error::Protocol`]); reading may go on.
    pub(crate) fn recv(&self, timeout: Option<Duration>) -> Result<Received<S::Receives>> {
        decode::<S>(self.channel.recv(timeout)?)
    }

    /// [`recv`](Self::recv) if a packet is queued; `Ok(None)` if none is.
    pub(crate) fn try_recv(&self) -> Result<Option<Received<S::Receives>>> {
        self.channel.try_recv()?.map(decode::<S>).transpose()
    }

    /// The untyped channel: a test writes what no end sends.
    #[cfg(test)]
    pub(crate) fn channel(&self) -> &Channel {
        &self.channel
    }
}

/// Decode a packet `S` receives; its fds stay beside the message.
fn decode<S: Side>(message: wire::Message) -> Result<Received<S::Receives>> {
    match wire::decode::<S::Receives>(&message.bytes, Vec::new()) {
        Ok(decoded) => Ok(Received {
            message: decoded,
            fds: message.fds,
        }),
        Err(error) => Err(Error::protocol(
            ProtocolRule::Internal,
            format!(
                "a packet that is not a {} ({} bytes, {} fds): {error}",
                S::RECEIVES,
                message.bytes.len(),
                message.fds.len()
            ),
        )),
    }
}

impl<S: Side> AsFd for End<S> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.channel.as_fd()
    }
}

impl<S: Side> AsRawFd for End<S> {
    fn as_raw_fd(&self) -> RawFd {
        self.channel.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::protocol::{Outcome, Payload};

    #[test]
    fn each_end_reads_what_the_other_sends() {
        let (parent, child) = ParentEnd::pair().unwrap();
        parent.send(&Order::Ping).unwrap();
        assert!(matches!(child.recv(None).unwrap().message, Order::Ping));
        child
            .send(&Report::Finished(Outcome::Returned(Payload(vec![1, 2]))))
            .unwrap();
        let received = parent.recv(None).unwrap();
        assert!(
            matches!(&received.message, Report::Finished(Outcome::Returned(p)) if **p == [1, 2]),
            "{received:?}"
        );
        assert!(parent.try_recv().unwrap().is_none());
    }

    #[test]
    fn a_packet_that_is_not_the_other_directions_message_is_refused_and_consumed() {
        let (parent, child) = ParentEnd::pair().unwrap();
        child.channel().send(&[0xFF; 8], &[]).unwrap();
        match parent.try_recv() {
            Err(Error::Protocol {
                rule: ProtocolRule::Internal,
                message,
            }) => assert!(
                message.contains("not a report (8 bytes, 0 fds)"),
                "{message}"
            ),
            other => panic!("{other:?}"),
        }
        // It was consumed: the channel reads on.
        child.send(&Report::Pong).unwrap();
        assert!(matches!(parent.recv(None).unwrap().message, Report::Pong));
    }

    #[test]
    fn a_sealed_message_never_shows_its_bytes() {
        let task = Call {
            layout: 1,
            entry: 2,
            args: Payload(vec![0xA7; 64]),
        };
        let shown = format!("{:?}", Sealed::new(&task).unwrap());
        assert!(shown.starts_with("Sealed<Call>(<"), "{shown}");
        assert!(!shown.contains("167") && !shown.contains("a7"), "{shown}");
    }

    #[test]
    fn a_message_with_fds_of_its_own_is_refused() {
        // No protocol message holds an fd-backed value; `Sealed` is generic, so try one that
        // does.
        let (ours, _theirs) = Channel::pair().unwrap();
        let error = Sealed::new(&wire::Fd::from(ours.into_fd())).unwrap_err();
        assert!(
            matches!(
                error,
                Error::Protocol {
                    rule: ProtocolRule::Fds,
                    ..
                }
            ),
            "{error:?}"
        );
    }
}
