//! Who a connection's peer is, from the kernel only: `SO_PEERCRED` (the endpoint's check
//! already read it), `SO_PEERGROUPS` (supplementary groups at connect time) and a pidfd pinned
//! to the process (`SO_PEERPIDFD`, else `pidfd_open` of the credentials' pid checked against
//! the socket once more), so that the peer's exit ends its connection even when another
//! process still holds the socket.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use vmm_core::wire::endpoint::Credentials;

/// `SO_PEERGROUPS` (Linux 4.13).
const SO_PEERGROUPS: libc::c_int = 59;
/// `SO_PEERPIDFD` (Linux 6.5).
const SO_PEERPIDFD: libc::c_int = 77;

/// A connection's peer, as the kernel knows it.
#[derive(Debug)]
pub(crate) struct Identity {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    pub(crate) groups: Vec<u32>,
    pub(crate) pid: i32,
    /// Readable once the process has exited; `None` where the kernel gives none.
    pub(crate) pidfd: Option<OwnedFd>,
}

impl Identity {
    /// The identity of the peer on `socket`, whose `SO_PEERCRED` is `creds`.
    pub(crate) fn of(socket: BorrowedFd<'_>, creds: Credentials) -> Identity {
        Identity {
            uid: creds.uid,
            gid: creds.gid,
            groups: peer_groups(socket),
            pid: creds.pid,
            pidfd: peer_pidfd(socket, creds.pid),
        }
    }

    /// Whether the identity is `uid`, or in group `gid`.
    pub(crate) fn has_gid(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

fn peer_groups(socket: BorrowedFd<'_>) -> Vec<u32> {
    let mut groups = vec![0u32; 256];
    let mut len = (groups.len() * 4) as libc::socklen_t;
    // SAFETY: a buffer of `len` bytes and its length, on a live socket.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERGROUPS,
            groups.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc != 0 {
        // ERANGE (more than 256 groups) or an old kernel: primary gid only.
        return Vec::new();
    }
    groups.truncate(len as usize / 4);
    groups
}

pub(crate) fn peer_pidfd(socket: BorrowedFd<'_>, pid: i32) -> Option<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: an int and its length, on a live socket.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc == 0 && fd >= 0 {
        // SAFETY: a fresh fd the kernel gave us.
        return Some(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    // SAFETY: a plain syscall with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, libc::PIDFD_NONBLOCK) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh fd the kernel gave us.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
    // The pid may have been reused between connect and pidfd_open: only if the socket still
    // has a live peer whose process is that pid's is the pidfd the peer's.
    (!exited(Some(&pidfd)) && peer_pid(socket) == Some(pid)).then_some(pidfd)
}

fn peer_pid(socket: BorrowedFd<'_>) -> Option<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a ucred and its length, on a live socket.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred.pid)
}

/// Whether the process behind `pidfd` has exited (a pidfd polls readable then).
pub(crate) fn exited(pidfd: Option<&OwnedFd>) -> bool {
    let Some(pidfd) = pidfd else { return false };
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd, a live local; no wait.
    unsafe { libc::poll(&mut pfd, 1, 0) > 0 }
}
