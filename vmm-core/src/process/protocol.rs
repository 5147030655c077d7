//! Messages between a parent, its children and the forkserver.

use serde::{Deserialize, Serialize};

use super::method::StartMethod;
use super::status::{ExitStatus, Outcome};
use crate::Error;

/// The environment variable that tells a process started by vmm-core its role:
/// `spawn:<channel fd>:<parent pid>` or `forkserver:<channel fd>:<parent pid>`.
pub(crate) const ROLE_VAR: &str = "VMM_IPC_CHILD";

/// Parent -> child, first message on the child's channel, sent once the parent holds the child
/// (the child waits for it); the argument's fds ride along.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Start {
    /// Offset of `sys::layout_probe` in the parent, to check that the child runs the same image.
    pub layout: isize,
    /// Offset of the monomorphised trampoline.
    pub trampoline: isize,
    /// Offset of the user's `fn(A)`.
    pub func: isize,
    pub method: StartMethod,
    /// Extra environment variables for the child.
    pub env: Vec<(String, String)>,
    /// The argument, postcard with fds out of band.
    pub args: Vec<u8>,
}

/// Child (or, for `Exited`, the forkserver) -> parent.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Report {
    /// The child reached its entry and read its start message (a start message it could not
    /// take is reported next, as `Finished(NotRun)`).
    Started,
    /// The child's function returned or panicked, or could not run; the child exits next.
    Finished(Outcome),
    /// The forkserver reaped the child.
    Exited(ExitStatus),
}

/// Parent -> forkserver: fork a child. Fds: the child's channel, its stdout, its stderr.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ForkRequest {
    pub parent: i32,
}

/// Forkserver -> parent. `Forked` carries a pidfd for the child when the kernel has pidfds.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum ForkReply {
    Ready {
        pid: i32,
    },
    Forked {
        pid: i32,
    },
    /// The request was refused ([`Error::Protocol`]) or `fork()` failed ([`Error::Os`], say
    /// `EAGAIN` at a process limit): the server's error, as it raised it.
    Failed(Error),
}
