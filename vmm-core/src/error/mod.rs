//! The crate's one error type.
//!
//! It is plain data as well as an error: it serialises (with serde), so that an error raised in
//! a child process, or while a value deserialises on its way in, reaches the caller as the same
//! variant it started as, not as a string.

use std::borrow::Cow;
use std::io;
use std::time::Duration;

use serde::{Deserialize, Serialize};

mod child_error;
mod cuda_failure;
mod env;
mod forkserver_failure;
mod peer_refusal;
mod rules;
mod tls_error;
mod unavailable;

pub(crate) use child_error::NotRunStage;
pub use child_error::{ChildError, ExitStatus, StartMethod};
pub use cuda_failure::{ContractBreach, CudaCode, DeviceWanted, DriverRefusal, FabricEvidence};
pub use env::MAX_ENV_LEN;
pub(crate) use env::{parse_env_uint, shown_env_value};
pub use forkserver_failure::ForkserverFailure;
pub use peer_refusal::{Credentials, PeerRefusal};
pub use rules::{
    Chunk, DescriptorRule, EndpointRule, EnvRule, ExportRule, FdlessTransport, GrowRule, IpcOp,
    IpcStep, OptionRule, ProtocolRule, SerdeStep, SpawnRule,
};
pub use tls_error::{TlsReason, TlsStep};
pub use unavailable::Unavailable;

/// Every fallible operation of `vmm_core` returns this error.
///
/// Variants carry enough context to act on: the system call or driver call that failed, the
/// rule an input broke, or (for [`Error::Child`]) everything known about a failed child process.
/// Match on the variant; the text is for people.
#[derive(Debug, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Error {
    /// A system call failed.
    #[error("{op} failed: {source}")]
    Os {
        /// What was being done (the call and, where useful, its object).
        op: String,
        /// The operating system's error.
        #[source]
        #[serde(with = "os_error")]
        source: io::Error,
    },
    /// The process has as many fds open as its soft `RLIMIT_NOFILE` allows, and `op` needed
    /// another (`EMFILE`).
    #[error(
        "{op}: the process is at its open-file limit (RLIMIT_NOFILE soft limit {soft_limit}, \
         {open} fds open); raise it (ulimit -n, setrlimit) or close fds sooner",
        open = match .open { Some(n) => n.to_string(), None => "?".to_owned() }
    )]
    FdLimit {
        /// What needed the fd.
        op: String,
        /// The soft limit on open fds.
        soft_limit: u64,
        /// How many fds were open when the limit was hit, if they could be counted (counting
        /// needs an fd itself).
        open: Option<usize>,
    },
    /// A message or value broke the wire protocol (truncated, malformed, wrong fds): the peer
    /// protocol of docs/protocol.md, or vmm-core's internal framing; `rule` says which rule.
    #[error("wire protocol: {message}")]
    Protocol {
        /// The rule it broke.
        rule: ProtocolRule,
        /// The rule and the values (never a payload byte), for people.
        message: String,
    },
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
    /// A value could not be serialised or deserialised: `step` says which way, `message` is
    /// the serde format's own words.
    #[error("serialisation: {message}")]
    Serde {
        /// Serialising or deserialising.
        step: SerdeStep,
        /// The format's error, for people.
        message: String,
    },
    /// The other end of a channel is gone.
    ///
    /// The variant is the whole fact (nothing more to tell apart: the peer closed); the text
    /// names the channel, for people, and is not a rule to match on.
    #[error("{0}: the other end has closed")]
    Disconnected(Cow<'static, str>),
    /// Waiting for something took longer than allowed.
    ///
    /// The variant and `after` are the fact; `what` names what was waited for, for people (a
    /// caller knows what it waited for: it made the call).
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for, for people.
        what: String,
        /// The limit that passed.
        after: Duration,
    },
    /// A named endpoint's peer was not trusted: a client found the listener is not whom it
    /// expects (by the kernel's credentials for it: a squatter, say), or the listener refused
    /// the client's credentials. Nothing was sent to the untrusted side.
    #[error("endpoint {endpoint}: {reason}")]
    PeerRefused {
        /// The endpoint's name.
        endpoint: String,
        /// Who was refused, by whom, and why.
        reason: PeerRefusal,
    },
    /// A size that another process chose (a host buffer's, say) is larger than the cap this
    /// process set for it; nothing was allocated or mapped. `raise` says how to raise the cap.
    #[error("{what}: {size} bytes is more than the cap of {cap} bytes; {raise}")]
    LimitExceeded {
        /// What was refused, e.g. `importing a host buffer`.
        what: Cow<'static, str>,
        /// The size asked for.
        size: u64,
        /// The cap in force.
        cap: u64,
        /// How the receiver raises the cap, if it trusts the sender.
        raise: Cow<'static, str>,
    },
    /// A descriptor (another process's input) broke `rule`; nothing was imported, mapped or
    /// sent.
    #[error("{message}")]
    InvalidDescriptor {
        /// The rule it broke.
        rule: DescriptorRule,
        /// The descriptor, the rule and the values, for people.
        message: String,
    },
    /// An option or argument is outside what the operation accepts; nothing was done.
    #[error("{message}")]
    InvalidOption {
        /// The option or argument, e.g. `handle_type`, `size`, `workers`.
        option: Cow<'static, str>,
        /// The rule it broke.
        rule: OptionRule,
        /// The rule and the value, for people.
        message: String,
    },
    /// An environment variable that configures vmm-core holds a value it cannot use: `rule`
    /// says which rule it broke (its form, or its documented range); nothing was done with it.
    #[error("{message}")]
    InvalidEnv {
        /// The variable, e.g. `VMM_CHILD_TIMEOUT`.
        variable: Cow<'static, str>,
        /// The rule the value broke.
        rule: EnvRule,
        /// The value (shortened if long), the rule and what the value should look like, for
        /// people.
        message: String,
    },
    /// No CUDA device in this process has the ordinal or UUID asked for.
    #[error("{message}")]
    NoSuchDevice {
        /// The device asked for.
        wanted: DeviceWanted,
        /// How many devices this process sees.
        visible: usize,
        /// Which device was asked for and what this process sees, for people.
        message: String,
    },
    /// A read or write of `len` bytes at `offset` reaches past a `size`-byte buffer.
    #[error("{op}: {len} bytes at offset {offset} are out of bounds of the {size}-byte buffer")]
    OutOfBounds {
        /// The operation, e.g. `read_at`.
        op: Cow<'static, str>,
        /// Where it starts.
        offset: usize,
        /// How many bytes.
        len: usize,
        /// The buffer's size.
        size: usize,
    },
    /// The buffer cannot be exported: it was imported (its memory belongs to its exporter), or
    /// it was allocated without the handle type the export needs.
    #[error("{op}: {message}")]
    NotExportable {
        /// The operation, e.g. `export_fabric`.
        op: Cow<'static, str>,
        /// Why.
        rule: ExportRule,
        /// Why, and what to do instead, for people.
        message: String,
    },
    /// A resource refused to grow a buffer (another device's, an imported one, a smaller size).
    #[error("grow: {message}")]
    GrowRefused {
        /// Why.
        rule: GrowRule,
        /// The values, for people.
        message: String,
    },
    /// A child was not started because of `rule`; nothing was started.
    #[error("{message}")]
    SpawnRefused {
        /// The rule.
        rule: SpawnRule,
        /// What broke it, for people.
        message: String,
    },
    /// A message is larger than the transport carries (`size` over `max`); nothing was sent.
    #[error("{message}")]
    TooLarge {
        /// The message's size, in the unit `max` counts (bytes, chunks).
        size: u64,
        /// The most the transport carries.
        max: u64,
        /// What was too large, for people.
        message: String,
    },
    /// A named endpoint's name, directory or socket file is not one vmm-core binds or
    /// connects to.
    #[error("{message}")]
    InvalidEndpoint {
        /// The rule it breaks.
        rule: EndpointRule,
        /// The name and the rule it breaks, for people.
        message: String,
    },
    /// A value that carries fds was given to something that cannot move fds: another serde
    /// format, or a named endpoint's plain values.
    #[error("{message}")]
    FdsCannotTravel {
        /// What could not move them.
        transport: FdlessTransport,
        /// What carries the fds, and the transport that moves them, for people.
        message: String,
    },
    /// The thread that keeps exported fabric allocations alive has stopped, so a fabric buffer
    /// cannot be sent.
    #[error("the fabric keeper thread has stopped; a fabric buffer cannot be sent")]
    FabricKeeperStopped,
    /// A child process failed: it panicked, exited non-zero, was killed or timed out.
    #[error(transparent)]
    Child(Box<ChildError>),
    /// The forkserver (or the launcher thread) could not be started or reached: `failure` says
    /// how.
    #[error("forkserver: {message}")]
    Forkserver {
        /// What went wrong.
        failure: ForkserverFailure,
        /// The pid, how it ended, what to do, for people.
        message: String,
    },
    /// A CUDA driver call returned an error.
    #[error("{call} failed: {name} ({code})")]
    Cuda {
        /// The driver call, e.g. `cuMemMap`.
        call: Cow<'static, str>,
        /// The CUDA error's name (`cuGetErrorName`), e.g. `CUDA_ERROR_INVALID_VALUE`.
        name: String,
        /// The CUDA error's code (match on [`CudaCode`]'s constants).
        code: CudaCode,
    },
    /// A CUDA driver call reported success but gave back something unusable (a negative fd,
    /// say): a driver defect, reported rather than trusted.
    #[error("{call} reported success but {breach}")]
    CudaContract {
        /// The driver call.
        call: Cow<'static, str>,
        /// What was wrong with its result.
        breach: ContractBreach,
    },
    /// CUDA cannot be used in this process (no libcuda, no device, or a missing capability):
    /// the [`Unavailable`] reason says which.
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(Unavailable),
    /// The device cannot share memory by fabric handle: it does not offer the handle type
    /// (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED` is 0), or the driver refuses a fabric
    /// allocation as unsupported.
    #[error(
        "{device} does not support fabric handles ({evidence}); share its memory by POSIX fd \
         (HandleType::PosixFd) instead"
    )]
    FabricUnsupported {
        /// The device, e.g. `device 0 (NVIDIA H200)`.
        device: String,
        /// What said so (the attribute, or the refused call and its error code).
        evidence: FabricEvidence,
    },
    /// The device supports fabric handles, but this process may not use them: it has no IMEX
    /// channel (the driver answers `CUDA_ERROR_NOT_PERMITTED`).
    #[error(
        "fabric handles on {device} need an IMEX channel, and this process has none \
         ({}{}). {IMEX_HELP}",
        FabricCall(.refused),
        if *.channel_dir_missing { NO_CHANNEL_DIR } else { "" }
    )]
    NoImexChannel {
        /// The device, e.g. `device 0 (NVIDIA H200)`.
        device: String,
        /// The refused call and its error code (`CUDA_ERROR_NOT_PERMITTED`).
        refused: DriverRefusal,
        /// Whether `/dev/nvidia-caps-imex-channels` (where the driver puts the channels) did not
        /// exist when the call was refused.
        channel_dir_missing: bool,
    },
    /// A fabric import of memory that another device owns failed in the driver: most likely
    /// this process's device cannot reach the owner over the fabric.
    #[error(
        "the memory's owner, device {owner}, cannot be reached from {device} ({source}): the \
         owner's GPU must be in this process's NVLink domain. On one machine, its GPUs must be \
         linked by NVLink (nvidia-smi topo -m); across machines, the IMEX service must run on \
         both nodes and grant both processes the same IMEX channel (a Kubernetes ComputeDomain \
         does that)"
    )]
    FabricUnreachable {
        /// The owner's UUID, as `nvidia-smi -L` prints it.
        owner: String,
        /// The importing device, e.g. `device 0 (NVIDIA H200)`.
        device: String,
        /// The driver's refusal.
        source: Box<Error>,
    },
    /// A mutual-TLS stream (`vmm_core::wire::tls`, feature `tls`) failed or refused its peer.
    /// A refusal at [`TlsStep::Handshake`] means no application byte crossed, either way.
    #[error("TLS {step} with {peer}: {reason}")]
    Tls {
        /// Which step.
        step: TlsStep,
        /// The peer's address (as `ip:port`).
        peer: String,
        /// Why.
        reason: TlsReason,
    },
    /// An export or import of a buffer failed part way; everything done so far was undone.
    #[error("{op} failed {step}: {source}")]
    Ipc {
        /// Export or import.
        op: IpcOp,
        /// Where it failed, naming the chunk: its `Display` is e.g.
        /// `while mapping chunk 2 of 2 (4194304 bytes)`.
        step: IpcStep,
        /// What went wrong.
        #[source]
        source: Box<Error>,
    },
}

/// Where the driver puts the IMEX channels a process may use (as device nodes).
pub(crate) const IMEX_CHANNEL_DIR: &str = "/dev/nvidia-caps-imex-channels";

/// [`Error::NoImexChannel`]'s note when [`IMEX_CHANNEL_DIR`] does not exist.
const NO_CHANNEL_DIR: &str = "; /dev/nvidia-caps-imex-channels does not exist";

/// A fabric call's refusal as the fabric errors print it.
struct FabricCall<'a>(&'a DriverRefusal);

impl std::fmt::Display for FabricCall<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        cuda_failure::fabric_call(f, self.0)
    }
}

/// How a process gets an IMEX channel, for [`Error::NoImexChannel`].
const IMEX_HELP: &str = "The driver grants channels as device nodes under \
    /dev/nvidia-caps-imex-channels/ (the node must be readable by this process, and passed into \
    a container). On one machine, as root: maj=$(awk '/nvidia-caps-imex-channels/ {print $1}' \
    /proc/devices); mkdir -p /dev/nvidia-caps-imex-channels && mknod \
    /dev/nvidia-caps-imex-channels/channel0 c \"$maj\" 0. Between machines on an NVLink fabric \
    the channels come from NVIDIA's IMEX service (nvidia-imex), which must be running.";

/// Shorthand for `Result<T, vmm_core::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::Os`] for `op` from the calling thread's `errno`.
    pub(crate) fn last_os(op: impl Into<String>) -> Self {
        Self::io(op, io::Error::last_os_error())
    }

    /// An [`Error::Os`] for `op` from a `nix` errno.
    pub(crate) fn errno(op: impl Into<String>, errno: nix::errno::Errno) -> Self {
        Self::io(op, io::Error::from_raw_os_error(errno as i32))
    }

    /// An [`Error::InvalidDescriptor`]: a descriptor broke `rule`.
    pub(crate) fn descriptor(rule: DescriptorRule, message: impl Into<String>) -> Self {
        Error::InvalidDescriptor {
            rule,
            message: message.into(),
        }
    }

    /// An [`Error::Protocol`]: a message broke `rule`.
    pub(crate) fn protocol(rule: ProtocolRule, message: impl Into<String>) -> Self {
        Error::Protocol {
            rule,
            message: message.into(),
        }
    }

    /// An [`Error::InvalidOption`]: `option`'s value broke `rule`.
    pub(crate) fn option(
        option: impl Into<Cow<'static, str>>,
        rule: OptionRule,
        message: impl Into<String>,
    ) -> Self {
        Error::InvalidOption {
            option: option.into(),
            rule,
            message: message.into(),
        }
    }

    /// An [`Error::Serde`]: the serde format's error `message`, met at `step`.
    pub(crate) fn serde(step: SerdeStep, message: impl std::fmt::Display) -> Self {
        Error::Serde {
            step,
            message: message.to_string(),
        }
    }

    /// An [`Error::Forkserver`]: `failure`, told in `message`.
    pub(crate) fn forkserver(failure: ForkserverFailure, message: impl Into<String>) -> Self {
        Error::Forkserver {
            failure,
            message: message.into(),
        }
    }

    /// An [`Error::InvalidEnv`]: `variable`'s `value` broke `rule`; `why` says how, `expected`
    /// what a valid value looks like.
    pub(crate) fn env(
        variable: &'static str,
        value: &str,
        rule: EnvRule,
        why: impl std::fmt::Display,
        expected: &str,
    ) -> Self {
        Error::InvalidEnv {
            variable: variable.into(),
            rule,
            message: format!("{variable}={}: {why}; {expected}", shown_env_value(value)),
        }
    }

    /// An [`Error::Ipc`]: `op` failed at `step` because of `source`.
    pub(crate) fn ipc(op: IpcOp, step: IpcStep, source: Error) -> Self {
        Error::Ipc {
            op,
            step,
            source: Box::new(source),
        }
    }

    /// An [`Error::FdLimit`] for `op`, with the limit and (where it can still be counted) the
    /// number of open fds.
    pub(crate) fn fd_limit(op: String) -> Self {
        Error::FdLimit {
            op,
            soft_limit: crate::limits::nofile_soft_limit(),
            open: crate::limits::open_fds().ok(),
        }
    }

    /// An [`Error::Os`] for `op`, or [`Error::FdLimit`] when the error is `EMFILE`.
    pub(crate) fn io(op: impl Into<String>, source: io::Error) -> Self {
        let op = op.into();
        if source.raw_os_error() == Some(libc::EMFILE) {
            return Self::fd_limit(op);
        }
        Error::Os { op, source }
    }

    /// Whether the operation was refused before it did anything, because an input broke a
    /// rule: a descriptor, an option, an environment variable, a range, a size, a name (the
    /// typed refusals: [`Error::InvalidDescriptor`], [`Error::InvalidOption`],
    /// [`Error::InvalidEnv`], [`Error::NoSuchDevice`], [`Error::OutOfBounds`],
    /// [`Error::NotExportable`], [`Error::GrowRefused`], [`Error::SpawnRefused`],
    /// [`Error::TooLarge`], [`Error::LimitExceeded`], [`Error::InvalidEndpoint`],
    /// [`Error::FdsCannotTravel`]). Retrying with the same input fails the same way.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            Error::InvalidDescriptor { .. }
                | Error::InvalidOption { .. }
                | Error::InvalidEnv { .. }
                | Error::NoSuchDevice { .. }
                | Error::OutOfBounds { .. }
                | Error::NotExportable { .. }
                | Error::GrowRefused { .. }
                | Error::SpawnRefused { .. }
                | Error::TooLarge { .. }
                | Error::LimitExceeded { .. }
                | Error::InvalidEndpoint { .. }
                | Error::FdsCannotTravel { .. }
        )
    }

    /// The error's `errno`, where it has one (an [`Error::Os`], or `EMFILE` for
    /// [`Error::FdLimit`]); looks through [`Error::Ipc`]'s context.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Os { source, .. } => source.raw_os_error(),
            Error::FdLimit { .. } => Some(libc::EMFILE),
            Error::Ipc { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// An `io::Error` on the wire: its errno where it has one (rebuilt as the same errno), else its
/// kind's message.
mod os_error {
    use std::io;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct Wire {
        errno: Option<i32>,
        message: String,
    }

    pub(super) fn serialize<S: Serializer>(error: &io::Error, s: S) -> Result<S::Ok, S::Error> {
        Wire {
            errno: error.raw_os_error(),
            message: error.to_string(),
        }
        .serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<io::Error, D::Error> {
        let wire = Wire::deserialize(d)?;
        Ok(match wire.errno {
            Some(errno) => io::Error::from_raw_os_error(errno),
            None => io::Error::other(wire.message),
        })
    }
}

#[cfg(test)]
mod round_trip_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(error: &Error) -> Error {
        postcard::from_bytes(&postcard::to_stdvec(error).unwrap()).unwrap()
    }

    #[test]
    fn errors_cross_serde_as_the_same_variant() {
        let os = Error::errno("open(x)", nix::errno::Errno::ENOENT);
        let step = IpcStep::Import(Chunk {
            index: 1,
            count: 3,
            size: 1 << 21,
        });
        let ipc = Error::Ipc {
            op: IpcOp::Import,
            step,
            source: Box::new(os),
        };
        assert_eq!(
            ipc.to_string(),
            "import failed while importing chunk 2 of 3 (2097152 bytes): open(x) failed: No such \
             file or directory (os error 2)"
        );
        match round_trip(&ipc) {
            Error::Ipc {
                op: IpcOp::Import,
                step: got,
                source,
            } => {
                assert_eq!(got, step);
                assert!(matches!(*source, Error::Os { ref op, .. } if op == "open(x)"));
                assert_eq!(source.raw_os_error(), Some(libc::ENOENT));
            }
            other => panic!("became {other:?}"),
        }
        let limit = Error::FdLimit {
            op: "export".into(),
            soft_limit: 64,
            open: None,
        };
        assert!(matches!(
            round_trip(&limit),
            Error::FdLimit {
                soft_limit: 64,
                open: None,
                ..
            }
        ));
        assert!(limit.to_string().contains("soft limit 64, ? fds open"));
        let protocol = Error::protocol(ProtocolRule::Fds, "2 fds, want 1");
        assert_eq!(protocol.to_string(), "wire protocol: 2 fds, want 1");
        assert!(matches!(
            round_trip(&protocol),
            Error::Protocol { rule: ProtocolRule::Fds, ref message } if message == "2 fds, want 1"
        ));
    }

    #[test]
    fn emfile_becomes_fd_limit() {
        let e = Error::errno("dup", nix::errno::Errno::EMFILE);
        assert!(
            matches!(e, Error::FdLimit { ref op, .. } if op == "dup"),
            "{e:?}"
        );
        assert_eq!(e.raw_os_error(), Some(libc::EMFILE));
    }
}
