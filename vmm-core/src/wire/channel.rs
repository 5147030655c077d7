//! One end of a `SOCK_SEQPACKET` socketpair that sends whole messages: bytes plus fds.
//!
//! A message is one packet, so with several readers on one socket every message goes whole to
//! exactly one of them. Payloads larger than [`INLINE_MAX`] travel in a sealed memfd that rides
//! along as the message's last fd; the packet itself stays small, so nothing is ever fragmented
//! or truncated.

use std::cell::RefCell;
use std::fs::File;
use std::io::{IoSlice, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::socket::{
    AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, sendmsg, socketpair,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::oob;
use super::sys;
use crate::{Error, Result};

/// The most fds one message can carry: the kernel's `SCM_MAX_FD`.
///
/// A payload larger than [`INLINE_MAX`] uses one of them for its memfd, leaving 252.
pub const MAX_FDS: usize = 253;

/// Payloads up to this many bytes travel inside the packet; larger ones in a sealed memfd.
pub const INLINE_MAX: usize = 64 * 1024;

const TAG_INLINE: u8 = 0;
const TAG_SPILLED: u8 = 1;
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

    /// Send one message. Blocks while the socket's buffer is full.
    ///
    /// Fails with [`Error::TooManyFds`] when the fds (plus a memfd for a large payload) exceed
    /// [`MAX_FDS`], and with [`Error::Disconnected`] when the other end is gone.
    pub fn send(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
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
        let mut spilled_header = [TAG_SPILLED; HEADER_SPILLED];
        spilled_header[1..].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
        // The memfd (if any) stays open in `spill` until the message is sent.
        let (header, payload): (&[u8], &[u8]) = if spill.is_some() {
            (&spilled_header, &[])
        } else {
            (&[TAG_INLINE], bytes)
        };
        let iov = [IoSlice::new(header), IoSlice::new(payload)];
        let cmsgs = [ControlMessage::ScmRights(raw)];
        let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsgs };
        loop {
            match sendmsg::<UnixAddr>(
                self.fd.as_raw_fd(),
                &iov,
                cmsgs,
                MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                Ok(_) => return Ok(()),
                Err(Errno::EINTR) => continue,
                Err(Errno::EPIPE | Errno::ECONNRESET) => {
                    return Err(Error::Disconnected("send".into()));
                }
                Err(Errno::ETOOMANYREFS) => {
                    return Err(Error::Protocol(format!(
                        "sendmsg refused {} fds: too many fds in flight (ETOOMANYREFS); \
                         the receiver must take messages before more are sent",
                        raw.len()
                    )));
                }
                Err(e) => return Err(Error::errno("sendmsg(SCM_RIGHTS)", e)),
            }
        }
    }

    /// Receive one message, waiting at most `timeout` (`None`: forever).
    ///
    /// [`Error::Timeout`] when nothing came in time, [`Error::Disconnected`] when every other
    /// end is closed.
    pub fn recv(&self, timeout: Option<Duration>) -> Result<Message> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if !wait_readable(self.fd.as_fd(), deadline)? {
                return Err(Error::Timeout {
                    what: "receiving a message".into(),
                    after: timeout.unwrap_or_default(),
                });
            }
            // Several processes may read the same socket: another may have taken the message.
            if let Some(message) = self.try_recv()? {
                return Ok(message);
            }
        }
    }

    /// Receive one message if one is waiting.
    pub fn try_recv(&self) -> Result<Option<Message>> {
        // One receive buffer per thread, zeroed once: a message costs a copy of its own length,
        // not a fresh 64 KiB allocation (this is on every hand-off's path).
        thread_local! {
            static RECEIVE: RefCell<Vec<u8>> = RefCell::new(vec![0u8; 1 + INLINE_MAX]);
        }
        let received = RECEIVE.with(|buf| {
            let mut buf = buf.borrow_mut();
            loop {
                match sys::recv_with_fds(self.fd.as_fd(), &mut buf, libc::MSG_DONTWAIT) {
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
            return Ok(None);
        };
        let (len, flags, fds) = (
            received.len,
            MsgFlags::from_bits_retain(received.flags),
            received.fds,
        );
        if flags.contains(MsgFlags::MSG_CTRUNC) {
            return Err(Error::Protocol(format!(
                "control message truncated (MSG_CTRUNC): the sender's fds did not all arrive \
                 ({} did, and were closed); is the process near its fd limit?",
                fds.len()
            )));
        }
        if flags.contains(MsgFlags::MSG_TRUNC) {
            return Err(Error::Protocol(format!(
                "packet larger than {} bytes: not sent by vmm_core::wire",
                1 + INLINE_MAX
            )));
        }
        // A zero-length read: the peer hung up (no tag was received).
        let Some(tag) = tag else {
            return Err(Error::Disconnected("recv".into()));
        };
        match tag {
            TAG_INLINE => Ok(Some(Message {
                bytes: payload,
                fds,
            })),
            TAG_SPILLED if len == HEADER_SPILLED => {
                let size = u64::from_le_bytes(payload[..].try_into().expect("8 bytes"));
                let mut fds = fds;
                let spill = fds.pop().ok_or_else(|| {
                    Error::Protocol("large message arrived without its memfd".into())
                })?;
                let bytes = read_spill(spill, size)?;
                Ok(Some(Message { bytes, fds }))
            }
            tag => Err(Error::Protocol(format!(
                "unknown message tag {tag} ({len} bytes): not sent by vmm_core::wire"
            ))),
        }
    }

    /// Serialise `value` (fds out of band) and send it as one message.
    pub fn send_value<T: Serialize + ?Sized>(&self, value: &T) -> Result<()> {
        let encoded = oob::encode(value)?;
        if encoded.fd_count() == 0 {
            return self.send(encoded.bytes(), &[]);
        }
        let fds: Vec<BorrowedFd<'_>> = encoded.fds().collect();
        self.send(encoded.bytes(), &fds)
    }

    /// Receive one message and deserialise it, handing the value its fds.
    pub fn recv_value<T: DeserializeOwned>(&self, timeout: Option<Duration>) -> Result<T> {
        let message = self.recv(timeout)?;
        oob::decode(&message.bytes, message.fds)
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

/// Block until `fd` is readable (or hung up) or `deadline` passes; `false` on timeout.
pub(crate) fn wait_readable(fd: BorrowedFd<'_>, deadline: Option<Instant>) -> Result<bool> {
    wait_for(fd, PollFlags::POLLIN, deadline)
}

/// Block until every other end of `fd`'s socket is closed (messages may still be queued) or
/// `deadline` passes; `false` on timeout.
pub(crate) fn wait_hangup(fd: BorrowedFd<'_>, deadline: Option<Instant>) -> Result<bool> {
    // POLLHUP is always reported; asking for nothing else sleeps through queued messages.
    wait_for(fd, PollFlags::empty(), deadline)
}

fn wait_for(fd: BorrowedFd<'_>, events: PollFlags, deadline: Option<Instant>) -> Result<bool> {
    loop {
        let timeout = match deadline {
            None => PollTimeout::NONE,
            Some(deadline) => {
                let left = deadline.saturating_duration_since(Instant::now());
                // Round up so that a wait never ends before the deadline.
                let ms = left.as_nanos().div_ceil(1_000_000);
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
            }
        };
        let mut pfd = [PollFd::new(fd, events)];
        match poll(&mut pfd, timeout) {
            Ok(0) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(false);
                }
            }
            Ok(_) => return Ok(true),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(Error::errno("poll", e)),
        }
    }
}

fn spill_to_memfd(bytes: &[u8]) -> Result<OwnedFd> {
    let fd = memfd_create(
        c"vmm-ipc-message",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .map_err(|e| Error::errno("memfd_create(message)", e))?;
    let mut file = File::from(fd);
    file.write_all(bytes)
        .map_err(|e| Error::io("write(message memfd)", e))?;
    let fd = OwnedFd::from(file);
    let seals = SealFlag::F_SEAL_WRITE
        | SealFlag::F_SEAL_GROW
        | SealFlag::F_SEAL_SHRINK
        | SealFlag::F_SEAL_SEAL;
    fcntl(&fd, FcntlArg::F_ADD_SEALS(seals))
        .map_err(|e| Error::errno("fcntl(F_ADD_SEALS, message)", e))?;
    Ok(fd)
}

fn read_spill(fd: OwnedFd, size: u64) -> Result<Vec<u8>> {
    let mut file = File::from(fd);
    let actual = file
        .seek(SeekFrom::End(0))
        .and_then(|end| file.seek(SeekFrom::Start(0)).map(|_| end))
        .map_err(|e| Error::io("lseek(message memfd)", e))?;
    if actual != size {
        return Err(Error::Protocol(format!(
            "large message's memfd holds {actual} bytes, its header says {size}"
        )));
    }
    let len = usize::try_from(size).map_err(|_| Error::Protocol("message too large".into()))?;
    let mut bytes = vec![0u8; len];
    file.read_exact(&mut bytes)
        .map_err(|e| Error::io("read(message memfd)", e))?;
    Ok(bytes)
}
