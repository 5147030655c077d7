//! Who a connection's peer is beyond `SO_PEERCRED`, from the kernel only: its supplementary
//! groups (`SO_PEERGROUPS`, as they were at connect time) and a pidfd pinned to its process
//! (`SO_PEERPIDFD`, else `pidfd_open` of the credentials' pid checked against the socket once
//! more). A server that serves a peer for a long time (a memory service holding leases) needs
//! both: groups for per-group rights, and the pidfd so that the peer's exit ends what it holds
//! even when another process (a forked child) still holds the socket.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use super::creds::Credentials;

/// `SO_PEERGROUPS` (Linux 4.13).
const SO_PEERGROUPS: libc::c_int = 59;
/// `SO_PEERPIDFD` (Linux 6.5).
const SO_PEERPIDFD: libc::c_int = 77;
/// The most supplementary groups read (`NGROUPS_MAX` is 65536; a peer with more than this
/// many is treated as having its primary group only).
const MAX_GROUPS: usize = 256;

/// A connected Unix socket's peer, as the kernel knows it.
#[derive(Debug)]
pub struct PeerProcess {
    /// `SO_PEERCRED`: pid, uid and primary gid at connect time.
    pub credentials: Credentials,
    /// `SO_PEERGROUPS`: the supplementary groups at connect time (empty where the kernel gives
    /// none, or past 256 groups).
    pub groups: Vec<u32>,
    /// The peer's process, pinned: readable once it has exited. `None` where the kernel gives
    /// none (no `SO_PEERPIDFD`, and the pid exited or was reused before `pidfd_open`).
    pub pidfd: Option<OwnedFd>,
}

impl PeerProcess {
    /// The peer on `socket`, whose `SO_PEERCRED` is `credentials` (as the endpoint's check
    /// read them).
    pub fn of(socket: impl AsFd, credentials: Credentials) -> PeerProcess {
        let socket = socket.as_fd();
        PeerProcess {
            groups: peer_groups(socket),
            pidfd: peer_pidfd(socket, credentials.pid),
            credentials,
        }
    }

    /// Whether the peer's primary or a supplementary group is `gid`.
    pub fn has_gid(&self, gid: u32) -> bool {
        self.credentials.gid == gid || self.groups.contains(&gid)
    }

    /// Whether the peer's process has exited (never, as far as is known, without a pidfd).
    pub fn has_exited(&self) -> bool {
        self.pidfd.as_ref().is_some_and(pidfd_exited)
    }
}

/// A pidfd for the process at the other end of `socket`, whose `SO_PEERCRED` pid is `pid`:
/// `SO_PEERPIDFD` where the kernel has it; else `pidfd_open(pid)`, kept only if that process
/// is alive and the socket's peer is still that pid (so a pid reused between connect and
/// `pidfd_open` is not taken for the peer).
pub fn peer_pidfd(socket: impl AsFd, pid: i32) -> Option<OwnedFd> {
    let socket = socket.as_fd();
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
        // SAFETY: a fresh fd the kernel gave us; nothing else knows it.
        return Some(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    pidfd_if_peer(socket, pid)
}

/// `pidfd_open(pid)`, kept only if that process is alive and the socket's peer is still `pid`.
fn pidfd_if_peer(socket: BorrowedFd<'_>, pid: i32) -> Option<OwnedFd> {
    // SAFETY: a plain syscall with integer arguments; it touches no memory.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, libc::PIDFD_NONBLOCK) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh fd the kernel gave us; nothing else knows it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
    let same_peer = Credentials::of_peer(socket).is_ok_and(|now| now.pid == pid);
    (!pidfd_exited(&pidfd) && same_peer).then_some(pidfd)
}

/// Whether the process behind `pidfd` has exited (a pidfd polls readable then). Does not wait.
pub fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd, a live local; no wait.
    unsafe { libc::poll(&mut pfd, 1, 0) > 0 }
}

fn peer_groups(socket: BorrowedFd<'_>) -> Vec<u32> {
    let mut groups = vec![0u32; MAX_GROUPS];
    let mut len = (groups.len() * size_of::<u32>()) as libc::socklen_t;
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
        // ERANGE (more than MAX_GROUPS) or an old kernel: the primary gid only.
        return Vec::new();
    }
    groups.truncate(len as usize / size_of::<u32>());
    groups
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn a_socket_pair_is_this_process() {
        let (a, _b) = UnixStream::pair().unwrap();
        let credentials = Credentials::of_peer(&a).unwrap();
        assert_eq!(credentials, Credentials::of_this_process());
        let peer = PeerProcess::of(&a, credentials);
        assert!(peer.has_gid(credentials.gid));
        assert!(peer.pidfd.is_some(), "a pidfd for a live peer");
        assert!(!peer.has_exited());
    }

    #[test]
    fn pidfd_exited_sees_an_exit() {
        // SAFETY: the child only calls _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: leaves at once, running nothing of the parent's.
            unsafe { libc::_exit(0) };
        }
        // SAFETY: a plain syscall with integer arguments.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        assert!(fd >= 0);
        // SAFETY: the kernel just returned it.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
        let mut status = 0;
        // SAFETY: reaps our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(pidfd_exited(&pidfd));
    }

    #[test]
    fn a_live_pid_that_is_not_the_peer_gets_no_pidfd() {
        let (a, _b) = UnixStream::pair().unwrap();
        // pid 1 is alive, and is not this socket's peer (this process is).
        assert_ne!(std::process::id(), 1);
        assert!(pidfd_if_peer(a.as_fd(), 1).is_none());
        assert!(pidfd_if_peer(a.as_fd(), std::process::id() as i32).is_some());
    }
}
