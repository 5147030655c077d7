//! Making the close of a socket a peer sent safe to run on the caller's thread.
//!
//! Closing the last reference to a file runs code its sender chose, in the closing thread:
//! `close` runs the file's `->flush` (on every close), and the last `fput` its `->release`
//! (in the closing thread's task work, before `close` returns). For a socket, `->flush` does
//! not exist, and `->release` blocks in exactly two ways a sender controls:
//!
//! - **A socket that lingers.** A TCP socket with `SO_LINGER` on, a long `l_linger` and data
//!   its peer never reads blocks the thread that drops its last reference until the data is
//!   sent or the linger time runs out (SCTP and vsock linger the same way). Setting
//!   `SO_LINGER` to `{on, 0}` on our copy (it is the socket's option, not the fd's) makes that
//!   close abortive: the kernel drops the unsent data, sends a reset and returns at once.
//! - **A Unix socket that holds fds.** Fds queued on a Unix socket (sent to it and not yet
//!   received, or queued on a connection a listening socket never accepted) are dropped by
//!   the thread that drops the socket's last reference: a lingering TCP socket inside one
//!   blocks that thread as if it had been closed there. So a received Unix socket is shut down
//!   for reading (its peers' further sends fail with `EPIPE`, connects to a listening one are
//!   refused), then drained without waiting: what comes out is defused the same way, to a
//!   bounded depth ([`DRAIN_DEPTH`]) and count ([`DRAIN_FDS`], [`DRAIN_RECVS`]).
//!
//! A defused socket is closed at once, by the caller. What cannot be defused goes to the
//! closer threads ([`super::closer`]): files that are not sockets (a FUSE file whose server
//! never answers `FLUSH` blocks any close of any fd of it, and nothing done to the fd avoids
//! that), and Unix sockets whose drain stopped at a bound or for want of fds (each receive
//! needs room for [`MAX_FDS`]: the kernel drops the fds of a message it could not install
//! in the receiving thread, which is the very close this module avoids; short of that room, a
//! drain first peeks at the message with the room it has, defusing the sockets it finds
//! through the copies the peek installs, and takes the message only if all its fds fit).
//!
//! What it cannot stop: a sender that keeps its own copy of a TCP socket and sets `SO_LINGER`
//! again between our setting and our close, then closes its copy first, makes our close the
//! lingering one. That needs a race won against a window of a few system calls, per attempt.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use nix::errno::Errno;
use nix::sys::socket::{SockType, getsockopt, setsockopt, sockopt};
use nix::sys::stat::{SFlag, fstat};

use crate::wire::MAX_FDS;
use crate::wire::recvmsg::{recv_with_at_most, recv_with_fds};

/// How deep a drain goes: a Unix socket received inside a Unix socket received inside ...
/// at most this many levels; deeper ones go to the closer threads undrained.
pub(crate) const DRAIN_DEPTH: usize = 4;

/// The most fds one [`defuse`] call takes out of the Unix sockets it drains (at all depths);
/// past that, the sockets still to drain go to the closer threads.
pub(crate) const DRAIN_FDS: usize = 4096;

/// The most receives (or accepts) a drain makes on one Unix socket. More than a socket can
/// hold: a connected sender's queue is bounded by its send buffer (at most twice
/// `net.core.wmem_max` without `CAP_NET_ADMIN`: 425 984 bytes by default), and a packet costs
/// at least about 512 bytes of it, so under a thousand packets; other senders add at most
/// `net.unix.max_dgram_qlen` (10 by default) each. A drain that reaches the bound while still
/// getting messages stops there and hands the socket to the closer threads.
pub(crate) const DRAIN_RECVS: usize = 2048;

/// Fds kept free besides the room of one receive ([`MAX_FDS`]): a drain receives only while
/// the process has `MAX_FDS + DRAIN_RESERVE` fds to spare, so it never takes the last ones a
/// server needs, and never makes the kernel drop fds it could not install.
const DRAIN_RESERVE: usize = 16;

/// `SO_LINGER` on, with a linger time of 0: the socket's close drops unsent data and resets
/// the connection instead of waiting.
const ABORT: libc::linger = libc::linger {
    l_onoff: 1,
    l_linger: 0,
};

/// What a peek at the next message found.
enum Peeked {
    /// Its fds fit in the room left: receive it.
    Fits,
    /// Stop draining: the socket is empty (`true`), or what is next cannot be taken (`false`).
    Done(bool),
}

/// Defuse `fds`: close every socket whose close cannot block once defused, here and now, and
/// return the fds that must be closed on a closer thread (files that are not sockets, and
/// Unix sockets that could not be drained).
pub(crate) fn defuse(fds: Vec<OwnedFd>) -> Vec<OwnedFd> {
    let mut drain = Drain {
        fds_left: DRAIN_FDS,
        spare: None,
        held: 0,
        rest: Vec::new(),
    };
    for fd in fds {
        drain.defuse(fd, 0);
    }
    drain.rest
}

/// Drain the Unix socket `socket` (our own end of a connection, say) of what is queued on it,
/// defusing and closing what comes out as [`defuse`] does. Returns whether it is empty (no
/// close of it can drop a queued fd), and the fds left for the closer threads. The socket
/// should be shut down for reading first, so that nothing more can be queued.
pub(crate) fn drain_socket(socket: BorrowedFd<'_>) -> (bool, Vec<OwnedFd>) {
    let mut drain = Drain {
        fds_left: DRAIN_FDS,
        spare: None,
        held: 0,
        rest: Vec::new(),
    };
    let emptied = drain.drain_unix(socket, 0);
    (emptied, drain.rest)
}

/// How many more fds this process may open (its soft `RLIMIT_NOFILE` less those open); 0 when
/// they cannot be counted (at the limit, the listing itself needs one).
fn spare_fds() -> usize {
    let limit = usize::try_from(crate::limits::nofile_soft_limit()).unwrap_or(usize::MAX);
    crate::limits::open_fds().map_or(0, |open| limit.saturating_sub(open))
}

/// One defusing pass: its budget of fds and what it leaves for the closer threads.
struct Drain {
    /// Fds it may still take out of drained sockets ([`DRAIN_FDS`]).
    fds_left: usize,
    /// Fds the process could open when the pass first needed to know (counting them lists
    /// `/proc/self/fd`, so only a drain asks).
    spare: Option<usize>,
    /// Fds it received and has not closed (or put in `rest`) yet.
    held: usize,
    /// For the closer threads.
    rest: Vec<OwnedFd>,
}

impl Drain {
    fn defuse(&mut self, fd: OwnedFd, depth: usize) {
        if !is_socket(fd.as_fd()) {
            self.rest.push(fd);
            return;
        }
        // Abortive close: no wait for unsent data, whatever the sender set. Refused (harmlessly)
        // by the few families without the option.
        let _ = setsockopt(&fd, sockopt::Linger, &ABORT);
        if domain(fd.as_fd()) == Some(libc::AF_UNIX) {
            // Nothing more can be queued on it (its peers' sends fail, connects are refused).
            let _ = nix::sys::socket::shutdown(fd.as_raw_fd(), nix::sys::socket::Shutdown::Read);
            if !self.drain_unix(fd.as_fd(), depth) {
                self.rest.push(fd);
                return;
            }
        }
        drop(fd);
    }

    /// Take everything queued on the Unix socket `socket`, defusing it; whether it is empty.
    fn drain_unix(&mut self, socket: BorrowedFd<'_>, depth: usize) -> bool {
        if depth >= DRAIN_DEPTH {
            return false;
        }
        if getsockopt(&socket, sockopt::AcceptConn).unwrap_or(false) {
            return self.drain_listening(socket, depth);
        }
        let stream = matches!(getsockopt(&socket, sockopt::SockType), Ok(SockType::Stream));
        let mut scratch = [0u8; 4096];
        let mut last_empty = false;
        for _ in 0..DRAIN_RECVS {
            // Room for a whole message's fds, or none is received (the kernel would drop those
            // it could not install, here).
            let room = self.room();
            if room < MAX_FDS {
                match self.peek(socket, &mut scratch, room) {
                    Peeked::Fits => {}
                    Peeked::Done(emptied) => return emptied,
                }
            }
            match recv_with_fds(socket, &mut scratch, libc::MSG_DONTWAIT) {
                Ok(received) => {
                    last_empty = received.len == 0 && received.fds.is_empty();
                    // End of file on a stream; on a packet socket, an empty packet or the end.
                    if last_empty && stream {
                        return true;
                    }
                    self.fds_left = self.fds_left.saturating_sub(received.fds.len());
                    self.held += received.fds.len();
                    for fd in received.fds {
                        self.defuse(fd, depth + 1);
                        self.held -= 1;
                    }
                }
                Err(e) => match Errno::from_raw(e.raw_os_error().unwrap_or(0)) {
                    Errno::EINTR => {}
                    // Empty; or not connected, so nothing can be queued.
                    Errno::EAGAIN | Errno::ENOTCONN | Errno::EINVAL => return true,
                    _ => return false,
                },
            }
        }
        // Past the most a socket can hold, still reading empty packets: the end of file.
        last_empty
    }

    /// How many fds a receive may install now.
    fn room(&mut self) -> usize {
        let spare = *self.spare.get_or_insert_with(spare_fds);
        self.fds_left
            .min(spare.saturating_sub(DRAIN_RESERVE + DRAIN_DEPTH + self.rest.len() + self.held))
    }

    /// Short of room for a whole message's fds: look at the next message without taking it,
    /// with room for `room` fds. Those it installs are copies (the queue keeps its own
    /// references, so closing them is never the last close): its sockets are defused through
    /// them (the option is the socket's) and closed, its other files go to the closers (a close
    /// of any fd of a FUSE file asks its server). Whether all of its fds fit; if not, the drain
    /// stops.
    fn peek(&mut self, socket: BorrowedFd<'_>, scratch: &mut [u8], room: usize) -> Peeked {
        match recv_with_at_most(socket, scratch, libc::MSG_DONTWAIT | libc::MSG_PEEK, room) {
            Ok(peeked) => {
                let fits = peeked.flags & libc::MSG_CTRUNC == 0;
                let count = peeked.fds.len();
                for copy in peeked.fds {
                    if is_socket(copy.as_fd()) {
                        let _ = setsockopt(&copy, sockopt::Linger, &ABORT);
                    } else {
                        self.rest.push(copy);
                    }
                }
                if fits && self.room() >= count {
                    Peeked::Fits
                } else {
                    Peeked::Done(false)
                }
            }
            Err(e) => match Errno::from_raw(e.raw_os_error().unwrap_or(0)) {
                Errno::EINTR => Peeked::Fits,
                Errno::EAGAIN | Errno::ENOTCONN | Errno::EINVAL => Peeked::Done(true),
                _ => Peeked::Done(false),
            },
        }
    }

    /// Accept every connection queued on the listening Unix socket `socket` (each may hold
    /// fds its client sent before it was accepted) and defuse it; whether none is left.
    fn drain_listening(&mut self, socket: BorrowedFd<'_>, depth: usize) -> bool {
        // accept4 has no "don't wait" flag of its own: make the socket non-blocking (the file's
        // flag, shared with the sender's copies: a socket about to be closed).
        // SAFETY: fcntl on a borrowed fd; no memory arguments.
        let nonblocking = unsafe {
            let flags = libc::fcntl(socket.as_raw_fd(), libc::F_GETFL);
            flags >= 0
                && libc::fcntl(socket.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !nonblocking {
            return false;
        }
        for _ in 0..DRAIN_RECVS {
            if self.room() == 0 {
                return false;
            }
            // SAFETY: accept4 has no memory arguments here (no address asked for).
            let raw = unsafe {
                libc::accept4(
                    socket.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                )
            };
            if raw < 0 {
                match Errno::last() {
                    Errno::EINTR | Errno::ECONNABORTED => continue,
                    // Empty (EINVAL: empty and shut down for reading).
                    Errno::EAGAIN | Errno::EINVAL => return true,
                    _ => return false,
                }
            }
            // SAFETY: accept4 returned a new fd, installed for this call alone.
            let connection = unsafe { OwnedFd::from_raw_fd(raw) };
            self.fds_left -= 1;
            self.held += 1;
            self.defuse(connection, depth + 1);
            self.held -= 1;
        }
        false
    }
}

/// Whether `fd` is a socket (by `fstat`: no other call on it runs the sender's code).
fn is_socket(fd: BorrowedFd<'_>) -> bool {
    fstat(fd)
        .is_ok_and(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFSOCK)
}

/// A socket's address family (`SO_DOMAIN`).
fn domain(socket: BorrowedFd<'_>) -> Option<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `value` and `len` are live locals of the sizes given.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_DOMAIN,
            (&raw mut value).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(value)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::time::Duration;

    use nix::sys::socket::{
        AddressFamily, Backlog, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, bind,
        connect, listen, sendmsg, setsockopt, socket, socketpair, sockopt,
    };

    use super::{DRAIN_DEPTH, defuse};

    /// A TCP socket whose last close would linger ten minutes (unsent data its peer never
    /// reads), and that peer.
    fn lingering() -> (OwnedFd, TcpStream) {
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(server.local_addr().unwrap()).unwrap();
        let (peer, _) = server.accept().unwrap();
        setsockopt(&stream, sockopt::SndBuf, &4096).unwrap();
        setsockopt(&peer, sockopt::RcvBuf, &4096).unwrap();
        stream.set_nonblocking(true).unwrap();
        while (&stream).write(&[0u8; 4096]).is_ok() {}
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 600,
        };
        setsockopt(&stream, sockopt::Linger, &linger).unwrap();
        (OwnedFd::from(stream), peer)
    }

    fn send_fds(socket: &OwnedFd, fds: &[&OwnedFd]) {
        let raw: Vec<_> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
        let cmsgs = [ControlMessage::ScmRights(&raw)];
        let iov = [std::io::IoSlice::new(b"x")];
        sendmsg::<UnixAddr>(socket.as_raw_fd(), &iov, &cmsgs, MsgFlags::empty(), None).unwrap();
    }

    fn pair() -> (OwnedFd, OwnedFd) {
        socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap()
    }

    /// The peer of a defused socket reads a reset (an abortive close), not ten minutes later.
    fn reset(mut peer: TcpStream) -> bool {
        peer.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut sink = vec![0u8; 1 << 16];
        loop {
            match peer.read(&mut sink) {
                Ok(0) => return false,
                Ok(_) => {}
                Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
            }
        }
    }

    #[test]
    fn a_listening_unix_socket_with_a_queued_connection_holding_a_lingering_socket() {
        let listening = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        let name = format!("vmm-defuse-test-{}", std::process::id());
        let addr = UnixAddr::new_abstract(name.as_bytes()).unwrap();
        bind(listening.as_raw_fd(), &addr).unwrap();
        listen(&listening, Backlog::new(4).unwrap()).unwrap();
        let client = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        connect(client.as_raw_fd(), &addr).unwrap();
        let (tcp, peer) = lingering();
        send_fds(&client, &[&tcp]);
        drop((tcp, client));
        // The listening socket's last close would drop the queued connection, and with it
        // the lingering socket, on this thread.
        assert!(defuse(vec![listening]).is_empty());
        assert!(reset(peer));
    }

    #[test]
    fn nesting_deeper_than_the_bound_goes_to_the_closers() {
        let (tcp, peer) = lingering();
        // tcp inside DRAIN_DEPTH + 1 Unix sockets, each inside the next.
        let (mut outer_keep, mut outer) = pair();
        send_fds(&outer_keep, &[&tcp]);
        drop(tcp);
        for _ in 0..DRAIN_DEPTH {
            let (keep, inner) = pair();
            send_fds(&keep, &[&outer]);
            drop((outer, outer_keep));
            (outer_keep, outer) = (keep, inner);
        }
        drop(outer_keep);
        let rest = defuse(vec![outer]);
        assert_eq!(rest.len(), 1, "the socket at the bound is left undrained");
        // One level shallower, everything is defused.
        let (tcp, peer2) = lingering();
        let (keep, inner) = pair();
        send_fds(&keep, &[&tcp]);
        drop((tcp, keep));
        assert!(defuse(vec![inner]).is_empty());
        assert!(reset(peer2));
        // The socket left undrained would linger on its close (a closer's): let the TCP peer
        // hang up first (with unread data: a reset), so that it does not here.
        drop(peer);
        std::thread::sleep(Duration::from_millis(50));
        drop(rest);
    }
}
