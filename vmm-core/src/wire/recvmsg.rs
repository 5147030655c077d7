//! The one unsafe piece of `wire`: `recvmsg` that owns every fd the kernel installed, even when
//! the control message was truncated (nix refuses to parse a truncated one, which would leak
//! the fds that did arrive).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// The most fds one message can carry: the kernel's `SCM_MAX_FD`.
///
/// A payload larger than [`INLINE_MAX`](super::INLINE_MAX) uses one of them for its memfd,
/// leaving 252.
pub const MAX_FDS: usize = 253;

/// What one `recvmsg` gave: the payload length, the message flags, and the fds, already owned.
#[derive(Debug)]
pub(crate) struct Received {
    pub len: usize,
    pub flags: libc::c_int,
    pub fds: Vec<OwnedFd>,
}

/// Space for `MAX_FDS` fds in one SCM_RIGHTS message, in `cmsghdr`-aligned words.
fn control_space() -> usize {
    // SAFETY: CMSG_SPACE is pure arithmetic.
    unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<RawFd>()) as u32) as usize }
}

/// [`control_space`] in `u64` words, rounded up: `CMSG_SPACE` is the header (16 bytes on 64-bit
/// Linux) plus the fds, aligned to 8.
const CONTROL_WORDS: usize = (16 + MAX_FDS * size_of::<RawFd>()).div_ceil(8) + 1;

/// `recvmsg(fd, buf, flags | MSG_CMSG_CLOEXEC)`, taking ownership of every received fd at once.
pub(crate) fn recv_with_fds(
    fd: BorrowedFd<'_>,
    buf: &mut [u8],
    flags: libc::c_int,
) -> io::Result<Received> {
    recv_with_at_most(fd, buf, flags, MAX_FDS)
}

/// [`recv_with_fds`] with room for at most `max_fds` fds (at most [`MAX_FDS`]): the kernel
/// installs that many and sets `MSG_CTRUNC` if the message carried more (with `MSG_PEEK`, the
/// others stay queued; without it, they are dropped, by this thread).
pub(crate) fn recv_with_at_most(
    fd: BorrowedFd<'_>,
    buf: &mut [u8],
    flags: libc::c_int,
    max_fds: usize,
) -> io::Result<Received> {
    // Room for MAX_FDS fds on the stack (1 KiB): no allocation per message.
    let mut control = [0u64; CONTROL_WORDS];
    debug_assert!(control_space() <= size_of_val(&control));
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; zeroed is its "no name, no control" state.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = match max_fds.min(MAX_FDS) {
        0 => 0,
        // SAFETY: CMSG_SPACE is pure arithmetic; it is at most `control`'s size (above).
        n => unsafe { libc::CMSG_SPACE((n * size_of::<RawFd>()) as u32) as usize },
    };
    // SAFETY: every pointer in `msg` refers to a live local buffer of the stated length.
    let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, flags | libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `control` up to `msg.msg_controllen`; CMSG_FIRSTHDR/NXTHDR stay
    // within it, and a truncated message's headers describe only the fds actually installed.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&msg);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*header).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(header).cast::<RawFd>();
                for i in 0..bytes / size_of::<RawFd>() {
                    // Each is a new fd installed in this process for this message: ours alone.
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            header = libc::CMSG_NXTHDR(&msg, header);
        }
    }
    Ok(Received {
        len: n as usize,
        flags: msg.msg_flags,
        fds,
    })
}
