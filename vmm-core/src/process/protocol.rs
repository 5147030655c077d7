//! Messages between a parent, its children and the forkserver.

use serde::{Deserialize, Serialize};

use super::StartMethod;
use super::status::{ExitStatus, NotRunStage, Outcome};
use crate::Error;

/// The environment variable that tells a process started by vmm-core its role:
/// `spawn:<channel fd>:<parent pid>`, `forkserver:<channel fd>:<parent pid>` or
/// `warm:<channel fd>:<parent pid>:<devices>` (`devices`: the CUDA ordinals to initialise while
/// waiting, comma-separated, possibly none).
pub(crate) const ROLE_VAR: &str = "VMM_IPC_CHILD";

/// Parent -> child, first message on the child's channel, sent once the parent holds the child
/// (the child waits for it).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Begin {
    /// Run one function and exit; the argument's fds ride along.
    Once(Start),
    /// Become a [`Pool`](super::Pool) worker: warm up, say [`Report::Serving`], then run
    /// [`Call`]s from its task socket until the pool closes it.
    Serve(Serve),
    /// Not a beginning: a waiting warm child answers [`Report::Pong`] and waits on. The warm
    /// pool asks before it hands a child out, since a killed child's pidfd and channel can stay
    /// quiet for as long as its teardown takes (a CUDA context's can take hundreds of ms), while
    /// only a live child can answer.
    Ping,
}

/// What a single-use child runs. It carries no environment: a child gets its environment
/// where it is made (at exec, or from the forkserver as it forks), never from a message.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Start {
    pub call: Call,
    pub method: StartMethod,
}

/// A function to run in a child: a single-use child's ([`Start`]), or a pool task (alone on
/// a worker's task socket, the argument's fds riding along).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Call {
    /// Offset of `sys::layout_probe` in the parent, to check that the child runs the same image.
    pub layout: isize,
    /// Offset of the entry point (`remote::registered`); the child calls it only if it is in
    /// its entry table (`entries::find`).
    pub entry: isize,
    /// The argument, postcard with fds out of band.
    pub args: Payload,
}

/// How a pool worker prepares. The message carries one fd: the worker's end of its task
/// socket, where its tasks ([`Call`]s) arrive (the pool keeps a reference to it too: see `pool`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Serve {
    /// The CUDA devices (ordinals) whose primary context the worker retains before it serves.
    pub devices: Vec<usize>,
}

/// A serialised argument or result. Its `Debug` shows only its length: what it holds is the
/// user's data, possibly a bearer token (a fabric handle), and a message shows up in
/// diagnostics (a report out of turn, say).
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub(crate) struct Payload(pub Vec<u8>);

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "<{} bytes>", self.0.len())
    }
}

impl std::ops::Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

/// Child (or, for `Exited`, the forkserver) -> parent.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Report {
    /// A warm child has initialised CUDA (or found none to initialise) and waits for its
    /// [`Begin`].
    Ready,
    /// The child reached its entry and read its start message (a start message it could not
    /// take is reported next, as `Finished(NotRun)`).
    Started,
    /// The child's function returned or panicked, or could not run; the child exits next.
    Finished(Outcome),
    /// The forkserver reaped the child.
    Exited(ExitStatus),
    /// A pool worker is warm and waits for tasks.
    Serving,
    /// A pool worker's task ended. With `Returned`, the message's fds are the result's.
    TaskDone(TaskOutcome),
    /// The answer to [`Begin::Ping`]: this child is alive and still waits for its `Begin`.
    Pong,
}

/// How one pool task ended, as the worker reports it.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum TaskOutcome {
    /// The function returned this result (postcard, fds out of band).
    Returned(Payload),
    /// The function returned, but its result could not be sent (an fd-backed value that could
    /// not be serialised, more fds than a message carries): the error, as raised. The worker
    /// serves on.
    Unsendable(Error),
    /// The function panicked; the worker exits next.
    Panicked {
        message: String,
        location: Option<String>,
    },
    /// The function could not run (its argument could not be received, say): the worker's own
    /// error. The worker serves on.
    NotRun { stage: NotRunStage, error: Error },
}

/// Parent -> forkserver: fork a child. Fds: the child's channel, its stdout, its stderr.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ForkRequest {
    pub parent: i32,
    /// Environment variables the forked child sets before it waits for its start message
    /// (checked by `launch::check_env` in the parent; the server skips any that is not valid).
    pub env: Vec<(String, String)>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_never_show_the_bytes_they_carry() {
        // A stand-in for a fabric handle: 64 bytes of a pattern no other field shows.
        let secret = vec![0xA7u8; 64];
        let shown = [
            format!(
                "{:?}",
                Report::TaskDone(TaskOutcome::Returned(Payload(secret.clone())))
            ),
            format!(
                "{:?}",
                Begin::Once(Start {
                    call: Call {
                        layout: 1,
                        entry: 2,
                        args: Payload(secret.clone()),
                    },
                    method: StartMethod::Spawn,
                })
            ),
            format!(
                "{:?}",
                Call {
                    layout: 1,
                    entry: 2,
                    args: Payload(secret.clone()),
                }
            ),
        ];
        for shown in shown {
            assert!(shown.contains("<64 bytes>"), "{shown}");
            assert!(!shown.contains("167") && !shown.contains("a7"), "{shown}");
        }
    }
}
