//! The crate's one error type.

use std::io;
use std::time::Duration;

use crate::process::ChildError;

/// Every fallible operation of `vmm_core` returns this error.
///
/// Variants carry enough context to act on: the system call or driver call that failed, the
/// rule an input broke, or (for [`Error::Child`]) everything known about a failed child process.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A system call failed.
    #[error("{op} failed: {source}")]
    Os {
        /// What was being done (the call and, where useful, its object).
        op: String,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// A message or value broke the wire protocol (truncated, malformed, wrong fds).
    #[error("wire protocol: {0}")]
    Protocol(String),
    /// A message would carry more file descriptors than the kernel lets one message carry.
    #[error(
        "a message can carry at most {max} file descriptors, this one needs {count}; \
         send the values in several messages"
    )]
    TooManyFds {
        /// How many the message needed.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A value could not be serialised or deserialised.
    #[error("serialisation: {0}")]
    Serde(String),
    /// The other end of a channel is gone.
    #[error("{0}: the other end has closed")]
    Disconnected(&'static str),
    /// Waiting for something took longer than allowed.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: String,
        /// The limit that passed.
        after: Duration,
    },
    /// An argument was refused before anything was done.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A child process failed: it panicked, exited non-zero, was killed or timed out.
    #[error(transparent)]
    Child(Box<ChildError>),
    /// The forkserver could not be started or reached.
    #[error("forkserver: {0}")]
    Forkserver(String),
    /// A CUDA driver call returned an error.
    #[error("{call} failed: {name} ({code})")]
    Cuda {
        /// The driver call, e.g. `cuMemMap`.
        call: &'static str,
        /// The CUDA error's name (`cuGetErrorName`), e.g. `CUDA_ERROR_INVALID_VALUE`.
        name: String,
        /// The CUDA error's number.
        code: u32,
    },
    /// CUDA cannot be used in this process (no libcuda, no device, or a missing capability).
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(String),
    /// An export or import of a CUDA buffer failed part way; everything done so far was undone.
    #[error("{op} failed {step}: {source}")]
    Ipc {
        /// `"export"` or `"import"`.
        op: &'static str,
        /// Where it failed, naming the chunk and the step, e.g.
        /// `while mapping chunk 2 of 2 (4194304 bytes)`.
        step: String,
        /// What went wrong.
        #[source]
        source: Box<Error>,
    },
}

/// Shorthand for `Result<T, vmm_core::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::Os`] for `op` from the calling thread's `errno`.
    pub(crate) fn last_os(op: impl Into<String>) -> Self {
        Error::Os {
            op: op.into(),
            source: io::Error::last_os_error(),
        }
    }

    /// An [`Error::Os`] for `op` from a `nix` errno.
    pub(crate) fn errno(op: impl Into<String>, errno: nix::errno::Errno) -> Self {
        Error::Os {
            op: op.into(),
            source: io::Error::from_raw_os_error(errno as i32),
        }
    }
}
