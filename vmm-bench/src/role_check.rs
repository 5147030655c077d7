//! The pre-`main` role check alone (`child-start/exec-self-role-refused`): what a spawned child
//! pays, before `main`, to decide whether to take the role its environment names.
//!
//! Every executable that links vmm-core runs a hook before `main` that, when the role variable
//! is set, checks it (not secure-exec, vmm-core in the main executable, a well-formed value,
//! the named parent is `getppid()`, the named fd open, a socket, Unix `SOCK_SEQPACKET`, its
//! `SO_PEERCRED` peer) and removes it from the environment. To time those checks without the
//! rest of a child's start, this executable is exec'd with a role value that passes every check
//! up to the peer's pid and is refused there: the fd it names is a `SOCK_SEQPACKET` socket made
//! by another process (a helper that has exited), so `SO_PEERCRED` names that process, not the
//! parent. The refused process then goes on as `VMM_BENCH_BASELINE=noop` does, so the figure
//! minus `exec-self-noop` (interleaved with it) is the hook's cost. What follows the peer check
//! when a role is taken (the uid checks, which read `/proc/sys/kernel/overflowuid`, adopting
//! the fd, `PR_SET_PDEATHSIG`) is not in it.
//!
//! The role variable and its format are vmm-core's own (not public): the figure checks once,
//! before it is measured, that the child refused the value for the reason above, so that a
//! change there fails the bench instead of timing something else.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};

use nix::fcntl::{FcntlArg, FdFlag, fcntl};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};

use crate::{BASELINE_VAR, raw};

/// vmm-core's role variable (`VMM_IPC_CHILD`, private to vmm-core).
pub const ROLE_VAR: &str = "VMM_IPC_CHILD";

/// The [`BASELINE_VAR`] value of the helper that makes the socket (see [`peer_socket_main`]).
pub const PEER_SOCKET: &str = "peer-socket";

/// In the helper process: make a Unix `SOCK_SEQPACKET` socketpair and send one end over
/// stdout, which the bench made a Unix socket; returns the exit status. The socket's
/// `SO_PEERCRED` names this process for as long as it lives.
pub fn peer_socket_main() -> i32 {
    let pair = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    );
    match pair {
        Ok((end, _other)) => {
            raw::send_fd(std::io::stdout().as_fd(), end.as_fd(), 0);
            0
        }
        Err(e) => {
            eprintln!("vmm-bench {PEER_SOCKET}: socketpair: {e}");
            3
        }
    }
}

/// A `SOCK_SEQPACKET` socket whose peer (by `SO_PEERCRED`) is not this process: made by a
/// helper (this executable with `VMM_BENCH_BASELINE=peer-socket`) and received here.
#[derive(Debug)]
pub struct ForeignSocket {
    fd: OwnedFd,
}

impl ForeignSocket {
    /// Start the helper `exe`, receive its socket, reap it.
    pub fn new(exe: &Path) -> ForeignSocket {
        let (ours, theirs) = raw::socketpair();
        let status = Command::new(exe)
            .env(BASELINE_VAR, PEER_SOCKET)
            .stdin(Stdio::null())
            .stdout(Stdio::from(theirs))
            .status()
            .expect("start the peer-socket helper");
        assert!(status.success(), "peer-socket helper failed: {status}");
        let (fd, _) = raw::recv_fd(ours.as_fd()).expect("the helper's socket");
        ForeignSocket { fd }
    }

    /// This executable, as `VMM_BENCH_BASELINE=noop`, with a well-formed spawn role naming this
    /// socket and this process as the parent; stdin and stderr (the refusal line) `/dev/null`.
    pub fn refused_command(&self, exe: &Path) -> Command {
        let mut command = Command::new(exe);
        command
            .env(BASELINE_VAR, "noop")
            .env(
                ROLE_VAR,
                format!("spawn:{}:{}", self.fd.as_raw_fd(), std::process::id()),
            )
            .stdin(Stdio::null())
            .stderr(Stdio::null());
        command
    }

    /// Run `f` while the socket is inheritable (CLOEXEC cleared), so that a process `f` starts
    /// has it at the same number. The flag is set again before this returns; both changes
    /// happen outside whatever `f` times.
    pub fn inherited<R>(&self, f: impl FnOnce() -> R) -> R {
        fcntl(&self.fd, FcntlArg::F_SETFD(FdFlag::empty())).expect("clear FD_CLOEXEC");
        let result = f();
        fcntl(&self.fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC)).expect("set FD_CLOEXEC");
        result
    }

    /// Check, once, that a child of [`refused_command`](Self::refused_command) refuses the role
    /// at the peer check (its stderr says why) and exits 0: panics otherwise.
    pub fn assert_refused_at_peer_check(&self, exe: &Path) {
        let output = self.inherited(|| {
            self.refused_command(exe)
                .stderr(Stdio::piped())
                .output()
                .expect("start the refused child")
        });
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success()
                && stderr.contains(&format!("ignoring {ROLE_VAR}"))
                && stderr.contains("not the parent")
                && stderr.contains("peer is pid"),
            "child-start/exec-self-role-refused: the child did not refuse the role at the peer \
             check (vmm-core's role variable or its checks changed?): {}; stderr: {stderr}",
            output.status
        );
    }
}
