//! Typed errors: what the service refuses ([`Refusal`], which travels in its replies) and what
//! a client can meet ([`MemdError`]: a refusal, the service gone, or a local failure).

use serde::{Deserialize, Serialize};

/// What the service may do to a region, named in [`Refusal::AccessDenied`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Right {
    /// Attach the committed generation, see it in `list` and `status`.
    Read,
    /// Begin and commit generations.
    Write,
    /// Delete the region.
    Delete,
}

impl std::fmt::Display for Right {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Right::Read => "read",
            Right::Write => "write",
            Right::Delete => "delete",
        })
    }
}

/// Why a request broke the protocol's rules, named in [`Refusal::InvalidRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RequestRule {
    /// The bytes are not a request (postcard refused them).
    Decode,
    /// A region name that is empty, too long, or has a character outside `[A-Za-z0-9._/-]`.
    RegionName,
    /// A generation with no chunk, too many chunks, or an empty chunk.
    Chunks,
    /// A metadata key too long, too many entries, or an entry outside its chunk.
    Metadata,
    /// A request that needs a writer's pending generation on a connection that has none.
    NotWriting,
    /// `begin` on a connection that already writes a generation.
    AlreadyWriting,
    /// An ACL with too many entries.
    Acl,
    /// `Detach` of a lease this connection does not hold (ended, expired, or never its own).
    NoSuchLease,
    /// A `BeginOn` for another backend than the one the region lives on.
    Backend,
    /// A `Wake` of a generation that is awake (no sleep asked, none to call off).
    NotAsleep,
    /// A `Token` the region knows already (a landed generation's, or its pending one's).
    Token,
}

/// A refusal by the service: sent as the reply to the request it refuses, so a client matches
/// the same variants the service chose. Every field is the service's view (the kernel's
/// identity of the caller, the service's caps), never the client's claim.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Refusal {
    /// The generation would take `uid` past its quota; nothing was allocated.
    #[error("quota exceeded for uid {uid}: {used} bytes in use, {asked} more asked, quota {quota}")]
    QuotaExceeded {
        /// The caller's uid (from SO_PEERCRED).
        uid: u32,
        /// Bytes its generations hold now.
        used: u64,
        /// Bytes the refused generation would have added.
        asked: u64,
        /// Its quota.
        quota: u64,
    },
    /// The caller's uid and groups are not in the region's ACL for `right`. A region the
    /// caller may not read is reported as [`NoSuchRegion`](Refusal::NoSuchRegion) instead, so
    /// that its name does not leak.
    #[error("access denied: uid {uid} may not {right} region {region:?}")]
    AccessDenied {
        /// The region.
        region: String,
        /// What was asked.
        right: Right,
        /// The caller's uid.
        uid: u32,
    },
    /// No region of that name (or none the caller may read), or no committed generation yet.
    #[error("no region {region:?} (or none with a committed generation that you may read)")]
    NoSuchRegion {
        /// The name asked for.
        region: String,
    },
    /// The region exists, but that generation is not held any more (freed, or never
    /// committed).
    #[error("region {region:?} holds no generation {generation}")]
    NoSuchGeneration {
        /// The region.
        region: String,
        /// The generation asked for.
        generation: u64,
    },
    /// Another connection writes the region, and the wait for it ran out.
    #[error("region {region:?}: another writer held it for the whole wait ({waited_ms} ms)")]
    WriterBusy {
        /// The region.
        region: String,
        /// How long the request waited.
        waited_ms: u64,
    },
    /// A request (or the message carrying it) is larger than the service reads; it was not
    /// decoded.
    #[error("request of {size} bytes refused before decoding: the cap is {cap}")]
    TooLarge {
        /// Its size in bytes.
        size: u64,
        /// The service's cap.
        cap: u64,
    },
    /// The request broke a rule of the protocol.
    #[error("invalid request ({rule:?}): {detail}")]
    InvalidRequest {
        /// The rule.
        rule: RequestRule,
        /// What was wrong, in words.
        detail: String,
    },
    /// Commit refused: some process still maps the pending generation writable (the writer
    /// kept a mapping, or handed one on), so it cannot be sealed read-only. Unmap and commit
    /// again.
    #[error(
        "region {region:?}: generation {generation} is still mapped writable somewhere; unmap it and commit again"
    )]
    StillMapped {
        /// The region.
        region: String,
        /// The pending generation.
        generation: u64,
    },
    /// Sending this reply's descriptors would pass a cap on fds in flight (sent, not read yet)
    /// for the whole of the service's wait ([`IN_FLIGHT_WAIT`](crate::IN_FLIGHT_WAIT)): read
    /// earlier replies first (scope `Connection`), or let other connections of this uid (or
    /// all) read theirs. Nothing was sent or kept for the request.
    #[error("descriptor fds in flight: {in_flight} already, the cap ({scope:?}) is {cap}")]
    FdsInFlight {
        /// Which cap.
        scope: vmm_core::wire::endpoint::InFlightScope,
        /// Fds in flight in that scope now.
        in_flight: u64,
        /// The cap (0 for `Connection`: no more until the earlier reply is read).
        cap: u64,
    },
    /// The service could not do what was asked for a reason of its own (out of memory or fds);
    /// `errno` is the kernel's.
    #[error("the service failed: {op}: errno {errno}")]
    ServiceFailed {
        /// What it was doing.
        op: String,
        /// The kernel's errno.
        errno: i32,
    },
    /// The service has no CUDA device with this UUID (no driver, no such device, or one
    /// without VMM IPC support). Nothing was allocated.
    #[error("the service has no usable CUDA device with UUID {}", hex(uuid))]
    NoSuchDevice {
        /// The UUID asked for.
        uuid: [u8; 16],
    },
    /// The CUDA driver refused the service an operation on a device (out of device memory,
    /// say); `error` is vmm-core's account of it.
    #[error("device {}: {op} failed: {error}", hex(device))]
    DeviceFailed {
        /// The device's UUID.
        device: [u8; 16],
        /// What the service was doing.
        op: GpuOp,
        /// vmm-core's error, in words.
        error: String,
    },
    /// A GPU generation's bytes no longer match the digests taken at its commit: some
    /// process wrote it through a writable mapping of its own (read-only cannot be enforced
    /// on the GPU: each importer sets its own access).
    #[error(
        "region {region:?} generation {generation}: chunk {chunk} changed since its commit (digest {} now {})",
        hex(expected),
        hex(found)
    )]
    DigestMismatch {
        /// The region.
        region: String,
        /// The generation.
        generation: u64,
        /// The first chunk that differs.
        chunk: u32,
        /// Its digest at commit.
        expected: [u8; 32],
        /// Its digest now.
        found: [u8; 32],
    },
    /// `AttachFabric` of a generation whose chunks cannot be exported as fabric handles here
    /// (a host region, a device or service without fabric support, or a generation taken
    /// back from the keeper after a restart). Nothing was kept for the request.
    #[error("region {region:?} generation {generation}: no fabric handles to give")]
    FabricUnavailable {
        /// The region.
        region: String,
        /// The generation.
        generation: u64,
    },
    /// An operator's request (`ReleaseAll`, `SetQuota`, or `SetAcl` of a region the caller
    /// does not own) from a uid that is no admin of the service (`--admin-uid`,
    /// `--admin-gid`; root by default).
    #[error("uid {uid} is no admin of this service")]
    NotAdmin {
        /// The caller's uid.
        uid: u32,
    },
}

impl Refusal {
    /// The variant's name (`"AccessDenied"`, `"QuotaExceeded"`, ...): what logs and the
    /// `tracing` events call the reason.
    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::QuotaExceeded { .. } => "QuotaExceeded",
            Refusal::AccessDenied { .. } => "AccessDenied",
            Refusal::NoSuchRegion { .. } => "NoSuchRegion",
            Refusal::NoSuchGeneration { .. } => "NoSuchGeneration",
            Refusal::WriterBusy { .. } => "WriterBusy",
            Refusal::TooLarge { .. } => "TooLarge",
            Refusal::InvalidRequest { .. } => "InvalidRequest",
            Refusal::StillMapped { .. } => "StillMapped",
            Refusal::FdsInFlight { .. } => "FdsInFlight",
            Refusal::ServiceFailed { .. } => "ServiceFailed",
            Refusal::NoSuchDevice { .. } => "NoSuchDevice",
            Refusal::DeviceFailed { .. } => "DeviceFailed",
            Refusal::DigestMismatch { .. } => "DigestMismatch",
            Refusal::FabricUnavailable { .. } => "FabricUnavailable",
            Refusal::NotAdmin { .. } => "NotAdmin",
        }
    }

    /// The region the refusal names, if it names one.
    pub fn region(&self) -> Option<&str> {
        match self {
            Refusal::AccessDenied { region, .. }
            | Refusal::NoSuchRegion { region }
            | Refusal::NoSuchGeneration { region, .. }
            | Refusal::WriterBusy { region, .. }
            | Refusal::StillMapped { region, .. }
            | Refusal::DigestMismatch { region, .. }
            | Refusal::FabricUnavailable { region, .. } => Some(region),
            _ => None,
        }
    }
}

/// What the service was doing on a device when the driver refused ([`Refusal::DeviceFailed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuOp {
    /// Creating or exporting a chunk.
    Allocate,
    /// Importing a chunk to read it (digest).
    Import,
    /// Reading a chunk to the host (digest).
    Read,
    /// Copying a chunk on the device into a fresh fabric-shareable one (a generation taken
    /// back from the keeper, attached as fabric handles).
    Copy,
}

impl std::fmt::Display for GpuOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GpuOp::Allocate => "allocating a chunk",
            GpuOp::Import => "importing a chunk",
            GpuOp::Read => "reading a chunk",
            GpuOp::Copy => "copying a chunk into a fabric-shareable one",
        })
    }
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Everything a [`Client`](crate::Client) call can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemdError {
    /// The service refused the request.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// The service's end of the connection is gone (it stopped or died). Memory already
    /// mapped stays valid; reconnect to go on.
    #[error("the service is gone: {0}")]
    ServiceGone(String),
    /// The service's reply broke the protocol (a reply of the wrong kind, too many entries).
    #[error("the service's reply broke the protocol: {0}")]
    BadReply(String),
    /// A descriptor the service sent could not be mapped as the protocol promises (not a
    /// memfd, not sealed against writes, shorter than said).
    #[error("a descriptor from the service is refused: {0}")]
    BadDescriptor(String),
    /// A system call of this process failed.
    #[error("{op} failed: {source}")]
    Os {
        /// The call.
        op: &'static str,
        /// The kernel's error.
        source: std::io::Error,
    },
    /// The transport (vmm-core) failed: connect, send, receive.
    #[error(transparent)]
    Core(vmm_core::Error),
    /// A wake found the region's current generation laid out otherwise than the one that
    /// slept (other chunk sizes or metadata): it is not mapped at the slept addresses.
    #[error(
        "region {region:?} generation {generation} has layout {found:#018x}, the sleeper {expected:#018x}"
    )]
    StaleLayout {
        /// The region.
        region: String,
        /// The generation the wake found.
        generation: u64,
        /// The layout hash of what slept.
        expected: u64,
        /// The layout hash of what the wake found.
        found: u64,
    },
    /// A GPU sleep could not keep the region's addresses: another handle to its mapping
    /// lives (a clone of `GpuChunks::buffer`), so the mapping cannot be taken apart. The
    /// attachment is dropped (its lease ends with the connection or by TTL; the clone keeps
    /// the memory mapped); drop the clones before a sleep.
    #[error("region {region:?}: its GPU mapping is shared with another handle; cannot sleep it")]
    MappingShared {
        /// The region.
        region: String,
    },
}

impl From<vmm_core::Error> for MemdError {
    fn from(e: vmm_core::Error) -> Self {
        match e {
            vmm_core::Error::Disconnected(why) => MemdError::ServiceGone(why.into_owned()),
            e if e.raw_os_error() == Some(libc::ECONNRESET)
                || e.raw_os_error() == Some(libc::EPIPE) =>
            {
                MemdError::ServiceGone(e.to_string())
            }
            e => MemdError::Core(e),
        }
    }
}

impl MemdError {
    /// `op` failed with the calling thread's errno.
    pub(crate) fn last_os(op: &'static str) -> MemdError {
        MemdError::Os {
            op,
            source: std::io::Error::last_os_error(),
        }
    }
}

/// This crate's result.
pub type Result<T, E = MemdError> = std::result::Result<T, E>;
