//! One end of a `SOCK_SEQPACKET` socketpair that sends whole messages: bytes plus fds.
//!
//! A message is one packet, so with several readers on one socket every message goes whole to
//! exactly one of them. Payloads larger than [`INLINE_MAX`] travel in a sealed memfd that rides
//! along as the message's last fd; the packet itself stays small, so nothing is ever fragmented
//! or truncated.
//!
//! # One framing
//!
//! Every packet vmm-core sends or takes starts with one frame byte that says what follows, and
//! every reader refuses, with an [`Error::Protocol`] naming the byte, what it does not expect
//! before it reads anything more of the packet or its fds:
//!
//! | byte | what follows | sent by | taken by |
//! |---:|---|---|---|
//! | `0x00` | a peer message of docs/protocol.md (its own header says its kind) | a named endpoint's [`Connection`](super::endpoint::Connection) (and the Python peer) | a named endpoint's connection |
//! | `0x01` | the length (`u64` LE) of a payload spilled into a sealed memfd, the packet's last fd | [`Channel::send`] of more than [`INLINE_MAX`] bytes | [`Channel::recv`] |
//! | `0x02` | the payload, inline | [`Channel::send`] | [`Channel::recv`] |
//!
//! So a peer message that reaches a channel between processes vmm-core started, or vmm-core's
//! internal framing that reaches a named endpoint, is recognisably the wrong thing, not a
//! garbled message. The byte `0x00` is the peer protocol's (docs/protocol.md, whose bytes must
//! not change); the internal framing uses the other two, at no cost (one byte, as before).
//! A payload on a channel is whatever its user put there: postcard values with fds out of band
//! ([`send_value`](Channel::send_value), [`Queue`](super::Queue)), or the process protocol's
//! messages.

use std::cell::RefCell;
use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::PollFlags;
use nix::sys::socket::{
    AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, sendmsg, socketpair,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::oob;
use super::recvmsg::{self, MAX_FDS};
use super::spill::{MAX_MESSAGE, read_spill, spill_to_memfd};
use super::wait::{Deadline, deadline_after, peer_hung_up, wait_for, wait_readable};
use crate::error::ProtocolRule;
use crate::{Error, Result};

mod spin;
pub(crate) use spin::spin_window;
pub use spin::{MAX_SPIN_US, SPIN_VAR};

/// Payloads up to this many bytes travel inside the packet; larger ones in a sealed memfd.
pub const INLINE_MAX: usize = 64 * 1024;

/// Frame byte: a named endpoint's peer message (docs/protocol.md), inline.
const FRAME_PEER: u8 = 0x00;
/// Frame byte: vmm-core's internal framing, a payload spilled into a sealed memfd.
const FRAME_SPILLED: u8 = 0x01;
/// Frame byte: vmm-core's internal framing, a payload inline.
const FRAME_INLINE: u8 = 0x02;
/// A spilled packet: its frame byte and the payload's length.
const HEADER_SPILLED: usize = 1 + 8;

/// A received message: its bytes and the fds it carried, each already owned (and CLOEXEC).
#[derive(Debug, Default)]
pub struct Message {
    /// The payload.
    pub bytes: Vec<u8>,
    /// The fds, in the order they were sent.
    pub fds: Vec<OwnedFd>,
}

/// One end of an anonymous `SOCK_SEQPACKET` socketpair.
///
/// ```
/// use vmm_core::wire::Channel;
/// let (a, b) = Channel::pair().unwrap();
/// a.send(b"hello", &[]).unwrap();
/// let message = b.recv(None).unwrap();
/// assert_eq!(message.bytes, b"hello");
/// ```
#[derive(Debug)]
pub struct Channel {
    fd: OwnedFd,
}

impl Channel {
    /// A connected pair, both ends CLOEXEC.
    pub fn pair() -> Result<(Channel, Channel)> {
        let (a, b) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| Error::errno("socketpair(AF_UNIX, SOCK_SEQPACKET)", e))?;
        Ok((Channel { fd: a }, Channel { fd: b }))
    }

    /// Wrap an fd that is one end of a `SOCK_SEQPACKET` socketpair.
    pub fn from_fd(fd: OwnedFd) -> Channel {
        Channel { fd }
    }

    /// Give the socket back.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// Another handle to the same socket (a dup, CLOEXEC).
    pub fn try_clone(&self) -> Result<Channel> {
        let fd = self
            .fd
            .try_clone()
            .map_err(|e| Error::io("dup(channel)", e))?;
        Ok(Channel { fd })
    }

    /// Send one message. Blocks while the socket's buffer is full, for as long as that takes
    /// (see [`send_timeout`](Self::send_timeout) for a bound).
    ///
    /// Fails with [`Error::TooManyFds`] when the fds (plus a memfd for a large payload) exceed
    /// [`MAX_FDS`], [`Error::TooLarge`] for a payload over [`MAX_MESSAGE`], and
    /// [`Error::Disconnected`] when the other end is gone.
    pub fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        self.send_timeout(bytes, fds, None)
    }

    /// [`send`](Self::send), waiting at most `timeout` (`None`: forever) for room in the
    /// socket's buffer; [`Error::Timeout`] if none came. `Some(Duration::ZERO)` never waits.
    pub fn send_timeout(
        &self,
        bytes: &[u8],
        fds: &[BorrowedFd<'_>],
        timeout: Option<Duration>,
    ) -> Result<()> {
        self.send_framed(FRAME_INLINE, bytes, fds, timeout)
    }

    /// Send one peer message of docs/protocol.md (frame byte `0x00`), inline: at most
    /// [`INLINE_MAX`] bytes (a peer message is never spilled), waiting at most `timeout`.
    pub(crate) fn send_peer(
        &self,
        bytes: &[u8],
        fds: &[BorrowedFd<'_>],
        timeout: Option<Duration>,
    ) -> Result<()> {
        self.send_framed(FRAME_PEER, bytes, fds, timeout)
    }

    /// Send `bytes` under frame byte `inline`: a peer message only inline, an internal payload
    /// spilled into a memfd (frame byte `0x01`) when longer than [`INLINE_MAX`].
    fn send_framed(
        &self,
        inline: u8,
        bytes: &[u8],
        fds: &[BorrowedFd<'_>],
        timeout: Option<Duration>,
    ) -> Result<()> {
        let (max, what) = if inline == FRAME_PEER {
            (
                INLINE_MAX,
                "a named endpoint's packet carries (wire::INLINE_MAX",
            )
        } else {
            (MAX_MESSAGE, "one message may carry (wire::MAX_MESSAGE")
        };
        if bytes.len() > max {
            return Err(Error::TooLarge {
                size: bytes.len() as u64,
                max: max as u64,
                message: format!(
                    "a message of {} bytes exceeds the most {what}, {max} bytes)",
                    bytes.len()
                ),
            });
        }
        let deadline = timeout.map(deadline_after);
        let spilled = bytes.len() > INLINE_MAX;
        let needed = fds.len() + usize::from(spilled);
        if needed > MAX_FDS {
            return Err(Error::TooManyFds {
                count: needed,
                max: MAX_FDS,
            });
        }
        let spill = if spilled {
            Some(spill_to_memfd(bytes)?)
        } else {
            None
        };
        // The fd numbers on the stack: no allocation per message.
        let mut numbers = [0 as RawFd; MAX_FDS];
        for (slot, fd) in numbers.iter_mut().zip(
            fds.iter()
                .map(AsRawFd::as_raw_fd)
                .chain(spill.as_ref().map(AsRawFd::as_raw_fd)),
        ) {
            *slot = fd;
        }
        let raw = &numbers[..needed];
        let mut spilled_header = [FRAME_SPILLED; HEADER_SPILLED];
        spilled_header[1..].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
        // The memfd (if any) stays open in `spill` until the message is sent.
        let (header, payload): (&[u8], &[u8]) = if spill.is_some() {
            (&spilled_header, &[])
        } else {
            (std::slice::from_ref(&inline), bytes)
        };
        let iov = [IoSlice::new(header), IoSlice::new(payload)];
        let cmsgs = [ControlMessage::ScmRights(raw)];
        let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsgs };
        let flags = match deadline {
            None => MsgFlags::MSG_NOSIGNAL,
            Some(_) => MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
        };
        loop {
            match sendmsg::<UnixAddr>(self.fd.as_raw_fd(), &iov, cmsgs, flags, None) {
                Ok(_) => return Ok(()),
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => {
                    let deadline = deadline.expect("only non-blocking sends see EAGAIN");
                    if !wait_for(self.fd.as_fd(), PollFlags::POLLOUT, deadline)? {
                        return Err(Error::Timeout {
                            what: "sending a message: the socket's buffer stayed full (is \
                                   anyone receiving?)"
                                .into(),
                            after: timeout.unwrap_or_default(),
                        });
                    }
                }
                Err(Errno::EPIPE | Errno::ECONNRESET) => {
                    return Err(Error::Disconnected("send".into()));
                }
                Err(Errno::ETOOMANYREFS) => {
                    return Err(Error::protocol(
                        ProtocolRule::Fds,
                        format!(
                            "sendmsg refused {} fds: too many fds in flight (ETOOMANYREFS); \
                         the receiver must take messages before more are sent",
                            raw.len()
                        ),
                    ));
                }
                Err(e) => return Err(Error::errno("sendmsg(SCM_RIGHTS)", e)),
            }
        }
    }

    /// Receive one message, waiting at most `timeout` (`None`: forever).
    ///
    /// [`Error::Timeout`] when nothing came in time, [`Error::Disconnected`] when every other
    /// end is closed.
    ///
    /// Before it sleeps, a receive keeps trying for a short while ([`SPIN_VAR`], default 20 us
    /// where the machine has more than one CPU): a process woken from sleep pays the kernel's
    /// wake-up (5-8 us on a VM, twice per request and reply), which is most of a hand-off's
    /// latency; a reply that comes within the window pays none. The window costs at most that
    /// much CPU per receive.
    pub fn recv(&self, timeout: Option<Duration>) -> Result<Message> {
        self.recv_with(timeout, Accept::Internal)
    }

    /// Receive one message of a named endpoint's peer (docs/protocol.md), waiting at most
    /// `timeout`: only inline packets (frame byte `0x00`) of at most `1 + max` bytes. A packet
    /// with any other frame byte (vmm-core's spilled payloads, `0x01`, in particular) or a
    /// longer one is an [`Error::Protocol`] before anything is read from or allocated for it;
    /// the fds of every refused packet go to `discard` (which closes them off the caller's
    /// path: a hostile fd's `close` may block).
    pub(crate) fn recv_peer(
        &self,
        timeout: Option<Duration>,
        max: usize,
        discard: fn(Vec<OwnedFd>),
    ) -> Result<Message> {
        self.recv_with(timeout, Accept::Peer { max, discard })
    }

    fn recv_with(&self, timeout: Option<Duration>, accept: Accept) -> Result<Message> {
        let deadline = timeout.map(deadline_after).unwrap_or(Deadline::Never);
        let window = spin_window();
        if !window.is_zero() {
            let started = Instant::now();
            loop {
                if let Some(message) = self.try_recv_with(accept)? {
                    return Ok(message);
                }
                let now = Instant::now();
                if now.duration_since(started) >= window
                    || matches!(deadline, Deadline::At(d) if now >= d)
                {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        loop {
            if !wait_readable(self.fd.as_fd(), deadline)? {
                return Err(Error::Timeout {
                    what: "receiving a message".into(),
                    after: timeout.unwrap_or_default(),
                });
            }
            // Several processes may read the same socket: another may have taken the message.
            if let Some(message) = self.try_recv_with(accept)? {
                return Ok(message);
            }
        }
    }

    /// Receive one message if one is waiting.
    pub fn try_recv(&self) -> Result<Option<Message>> {
        self.try_recv_with(Accept::Internal)
    }

    fn try_recv_with(&self, accept: Accept) -> Result<Option<Message>> {
        match self.try_recv_once(accept)? {
            Received::Message(message) => Ok(message),
            // A non-blocking read can report end-of-file while a message that raced with the
            // hang-up is queued (the kernel finds the queue empty, the peer sends and closes,
            // then the read sees the shutdown): read once more before believing it. A real
            // end-of-file reads as one again.
            Received::EndOfFile => match self.try_recv_once(accept)? {
                Received::Message(message) => Ok(message),
                Received::EndOfFile => Err(Error::Disconnected("recv".into())),
            },
        }
    }

    fn try_recv_once(&self, accept: Accept) -> Result<Received> {
        // One receive buffer per thread, zeroed once: a message costs a copy of its own length,
        // not a fresh 64 KiB allocation (this is on every hand-off's path).
        thread_local! {
            static RECEIVE: RefCell<Vec<u8>> = RefCell::new(vec![0u8; 1 + INLINE_MAX]);
        }
        let received = RECEIVE.with(|buf| {
            let mut buf = buf.borrow_mut();
            // A peer's packet is read into at most `1 + max` bytes: a longer one is truncated
            // by the kernel (MSG_TRUNC) and refused, never copied whole.
            let room = match accept {
                Accept::Internal => buf.len(),
                Accept::Peer { max, .. } => buf.len().min(max.saturating_add(1)),
            };
            let buf = &mut buf[..room];
            loop {
                match recvmsg::recv_with_fds(self.fd.as_fd(), buf, libc::MSG_DONTWAIT) {
                    Ok(received) => {
                        // The tag stays in `buf`; the payload is copied once, without it.
                        let tag = buf.first().copied().filter(|_| received.len > 0);
                        let payload = buf[1.min(received.len)..received.len].to_vec();
                        return Ok(Some((received, tag, payload)));
                    }
                    Err(e) => match Errno::from_raw(e.raw_os_error().unwrap_or(0)) {
                        Errno::EINTR => continue,
                        Errno::EAGAIN => return Ok(None),
                        Errno::ECONNRESET => return Err(Error::Disconnected("recv".into())),
                        errno => return Err(Error::errno("recvmsg(SCM_RIGHTS)", errno)),
                    },
                }
            }
        })?;
        let Some((received, tag, payload)) = received else {
            return Ok(Received::Message(None));
        };
        let (len, flags, fds) = (
            received.len,
            MsgFlags::from_bits_retain(received.flags),
            received.fds,
        );
        // Every refusal below hands the packet's fds to `accept`'s discard.
        let refuse = |fds: Vec<OwnedFd>, rule: ProtocolRule, why: String| -> Result<Received> {
            accept.discard(fds);
            Err(Error::protocol(rule, why))
        };
        if flags.contains(MsgFlags::MSG_CTRUNC) {
            let n = fds.len();
            return refuse(
                fds,
                ProtocolRule::Fds,
                format!(
                    "control message truncated (MSG_CTRUNC): the sender's fds did not all \
                     arrive ({n} did, and were closed); is the process near its fd limit?"
                ),
            );
        }
        if flags.contains(MsgFlags::MSG_TRUNC) {
            let why = match accept {
                Accept::Internal => format!(
                    "packet larger than {} bytes: not sent by vmm_core::wire",
                    1 + INLINE_MAX
                ),
                Accept::Peer { max, .. } => format!(
                    "packet larger than {} bytes (a frame byte and the largest peer message of \
                     docs/protocol.md): refused unread",
                    1 + max
                ),
            };
            return refuse(fds, ProtocolRule::TooLarge, why);
        }
        // A zero-length read: the peer hung up, or sent an empty packet (which vmm_core::wire
        // never does: every packet has a tag).
        let Some(tag) = tag else {
            if !fds.is_empty() || !peer_hung_up(self.fd.as_fd()) {
                let n = fds.len();
                return refuse(
                    fds,
                    ProtocolRule::FrameByte,
                    format!(
                        "an empty packet ({n} fds, closed) from a peer that is still \
                         connected: not sent by vmm_core::wire"
                    ),
                );
            }
            return Ok(Received::EndOfFile);
        };
        let message = match (tag, accept) {
            (FRAME_INLINE, Accept::Internal) | (FRAME_PEER, Accept::Peer { .. }) => {
                Ok(Some(Message {
                    bytes: payload,
                    fds,
                }))
            }
            // A peer of a named endpoint speaks docs/protocol.md only: vmm-core's internal
            // framing is refused before a spilled header's size or its memfd is looked at.
            (FRAME_SPILLED | FRAME_INLINE, Accept::Peer { .. }) => {
                let n = fds.len();
                let what = if tag == FRAME_SPILLED {
                    "a payload spilled into a memfd"
                } else {
                    "a payload inline"
                };
                return refuse(
                    fds,
                    ProtocolRule::FrameByte,
                    format!(
                        "frame byte {tag} (vmm-core's internal framing: {what}; {len} bytes, \
                         {n} fd(s), closed unread) from an endpoint's peer: a peer message \
                         starts with frame byte 0 (docs/protocol.md)"
                    ),
                );
            }
            // A channel between processes vmm-core started carries its internal framing
            // only: a peer message here was sent to the wrong socket.
            (FRAME_PEER, Accept::Internal) => {
                let n = fds.len();
                return refuse(
                    fds,
                    ProtocolRule::FrameByte,
                    format!(
                        "frame byte 0 (a named endpoint's peer message of docs/protocol.md; \
                         {len} bytes, {n} fd(s), closed) on a channel between processes \
                         vmm-core started, which carries frame bytes 1 and 2 only"
                    ),
                );
            }
            (FRAME_SPILLED, Accept::Internal) if len == HEADER_SPILLED => {
                let size = u64::from_le_bytes(payload[..].try_into().expect("8 bytes"));
                let mut fds = fds;
                let spill = fds.pop().ok_or_else(|| {
                    Error::protocol(ProtocolRule::Fds, "large message arrived without its memfd")
                })?;
                let bytes = read_spill(spill, size)?;
                Ok(Some(Message { bytes, fds }))
            }
            (tag, _) => {
                return refuse(
                    fds,
                    ProtocolRule::FrameByte,
                    format!("unknown message tag {tag} ({len} bytes): not sent by vmm_core::wire"),
                );
            }
        };
        message.map(Received::Message)
    }

    /// Serialise `value` (fds out of band) and send it as one message.
    pub fn send_value<T: Serialize + ?Sized>(&self, value: &T) -> Result<()> {
        self.send_value_timeout(value, None)
    }

    /// [`send_value`](Self::send_value), waiting at most `timeout` for room, as
    /// [`send_timeout`](Self::send_timeout) does: the typed send a [`Queue`](super::Queue)'s
    /// `put` is.
    pub(crate) fn send_value_timeout<T: Serialize + ?Sized>(
        &self,
        value: &T,
        timeout: Option<Duration>,
    ) -> Result<()> {
        let encoded = oob::encode(value)?;
        if encoded.fd_count() == 0 {
            return self.send_timeout(encoded.bytes(), &[], timeout);
        }
        let fds: Vec<BorrowedFd<'_>> = encoded.fds().collect();
        self.send_timeout(encoded.bytes(), &fds, timeout)
    }

    /// Receive one message and deserialise it, handing the value its fds.
    pub fn recv_value<T: DeserializeOwned>(&self, timeout: Option<Duration>) -> Result<T> {
        let message = self.recv(timeout)?;
        oob::decode(&message.bytes, message.fds)
    }

    /// Receive and deserialise one message if one is waiting.
    pub(crate) fn try_recv_value<T: DeserializeOwned>(&self) -> Result<Option<T>> {
        match self.try_recv()? {
            Some(message) => oob::decode(&message.bytes, message.fds).map(Some),
            None => Ok(None),
        }
    }
}

impl AsFd for Channel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Channel {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// What a receive accepts: vmm-core's own framing (from a process it started), or a named
/// endpoint's peer messages only.
#[derive(Clone, Copy)]
enum Accept {
    /// Inline packets and payloads spilled into a sealed memfd (up to [`MAX_MESSAGE`]).
    Internal,
    /// Inline packets of at most `1 + max` bytes; the fds of a refused packet go to `discard`.
    Peer {
        max: usize,
        discard: fn(Vec<OwnedFd>),
    },
}

impl Accept {
    fn discard(self, fds: Vec<OwnedFd>) {
        match self {
            Accept::Internal => drop(fds),
            Accept::Peer { discard, .. } => discard(fds),
        }
    }
}

/// What one non-blocking read gave: a message (or none waiting), or an end-of-file to confirm.
enum Received {
    Message(Option<Message>),
    EndOfFile,
}

#[cfg(test)]
mod channel_tests;
