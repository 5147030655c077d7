//! The typed parts of [`Error`](super::Error)'s refusals: which rule an input broke, and which
//! step of an export or import failed. A caller matches on these; the variants' text is for
//! people.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Which rule a descriptor broke ([`Error::InvalidDescriptor`](super::Error::InvalidDescriptor)).
///
/// A descriptor is input another process chose (an [`IpcDescriptor`](crate::cuda::IpcDescriptor),
/// a [`FabricDescriptor`](crate::cuda::FabricDescriptor), a
/// [`HostDescriptor`](crate::shm::HostDescriptor), or a peer-protocol message that carries one):
/// each is checked against these rules before anything is imported, mapped or sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DescriptorRule {
    /// The handle type is not one this kind of descriptor (or transport) carries.
    HandleType,
    /// Too many chunks, none where one is needed, or not one handle per chunk.
    ChunkCount,
    /// A chunk's size is zero, not a multiple of the granularity, or does not fit.
    ChunkSize,
    /// The total size is wrong: it does not add up, does not fit this platform, or disagrees
    /// with the memory behind the descriptor.
    Size,
    /// The fds are wrong: missing, extra, or not open.
    Fds,
    /// The memory lives somewhere the importer does not map (another device, another kind of
    /// location).
    Location,
    /// The device the descriptor names cannot be represented or used here.
    Device,
    /// A host descriptor's fd is not a size-sealed memfd on tmpfs, the only kind mapped.
    Memfd,
}

/// Why a child could not be started ([`Error::SpawnRefused`](super::Error::SpawnRefused)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum SpawnRule {
    /// An environment variable (or argument) cannot be handed to a child: a key with `=` or
    /// NUL, a value with NUL, or vmm-core's own role variable.
    Environment,
    /// The function is not code a child can find: it is not in the main executable.
    Entry,
}

/// Which rule a message broke ([`Error::Protocol`](super::Error::Protocol)): the peer
/// protocol of docs/protocol.md (on a named endpoint or a byte stream), or vmm-core's internal
/// framing between the processes it started.
///
/// The rules follow the order a receiver checks them in: the frame byte, the header's fields,
/// the counts, the fds, the kind's own fields, then whether the message was the one expected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ProtocolRule {
    /// A packet's (or a stream message's) first byte is not one this reader takes: a peer
    /// message on a channel between vmm-core's processes, vmm-core's internal framing on a
    /// named endpoint, an unknown byte, or an empty packet.
    FrameByte,
    /// A peer message does not start with the magic `VMMI`.
    Magic,
    /// The protocol version is not one spoken here, or not the version of the message's kind.
    Version,
    /// The message kind is not one the protocol defines.
    UnknownKind,
    /// A message of a kind the protocol defines, where another was expected (a handshake
    /// message after the handshake, a kind with fds on a byte stream, `DATA` where a
    /// descriptor was asked for, one descriptor kind for another).
    UnexpectedKind,
    /// The header's length field is not the header length of the message's version.
    HeaderLength,
    /// The header sets flags the protocol does not define.
    Flags,
    /// A reserved field, or a field the message's kind does not use, is not zero.
    Reserved,
    /// A count or length is larger than its documented maximum (chunks, payload bytes, a
    /// packet, a spilled payload); refused before anything is allocated for it.
    TooLarge,
    /// The counts do not fit the message's kind (a descriptor with payload bytes, a fabric
    /// message with no chunks or not one handle per chunk, a memfd message with more than one).
    Counts,
    /// The message ended before the length its header announces (a partial header, a message
    /// cut short).
    Truncated,
    /// The message is longer than its header announces.
    TrailingBytes,
    /// The fds are wrong: not as many as the message needs, cut short by the kernel
    /// (`MSG_CTRUNC`), refused by it (`ETOOMANYREFS`), referred to but absent, taken twice, or
    /// not the kind of fd (a sealed memfd) the message needs.
    Fds,
    /// A descriptor's fields break its kind's rules: the handle type, the owner device, the
    /// location, the size or the chunk sizes.
    Descriptor,
    /// An earlier message on this stream was refused or cut short, or a write failed part
    /// way through one: nobody knows where the next message starts, so the stream carries no
    /// more.
    StreamFailed,
    /// The parent asked a child to run code that its executable did not register, or the
    /// child runs a different executable image than its parent; nothing was called.
    Entry,
    /// vmm-core's own messages between the processes it started broke their framing (a
    /// malformed fork request, a reply out of turn, a task the pool does not know, a child
    /// nothing is left to watch by).
    Internal,
}

/// Which rule an option or argument broke
/// ([`Error::InvalidOption`](super::Error::InvalidOption)); the error's `option` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum OptionRule {
    /// Not of the form the option takes: not a certificate, a private key, a CRL, PEM, a DNS
    /// name or an IP address; a command line not as documented.
    Form,
    /// Empty where at least one is needed: no worker, no certificate, no trusted root, no CRL,
    /// no chunk, no allowed peer.
    Missing,
    /// Names something that does not exist: a device this process does not see, a buffer a
    /// server does not serve.
    Unknown,
    /// Outside the option's range: negative, zero where that means nothing, too many, or too
    /// large to fit (or to round up to the granularity).
    Range,
    /// Not a multiple of what it must be: a power of two, the alignment, the granularity.
    Alignment,
    /// Contradicts another option or what it is given to: a peer that is the resource's own
    /// device or is listed twice, a handle type the resource, the transport or the message
    /// does not carry.
    Conflict,
    /// The device or the driver (or the TLS library) cannot honour it.
    Unsupported,
}

/// Why a resource refused to grow a buffer
/// ([`Error::GrowRefused`](super::Error::GrowRefused)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum GrowRule {
    /// The buffer is on another device than the resource's.
    Device,
    /// The buffer's location is not the resource's.
    Location,
    /// The buffer's handle type is not the resource's (it cannot change across a grow).
    HandleType,
    /// The buffer was imported: its chunks belong to the exporter.
    Imported,
    /// The new size is smaller than the buffer's: grow never shrinks.
    Shrink,
    /// The new size overflows.
    Overflow,
}

/// Why a buffer cannot be exported ([`Error::NotExportable`](super::Error::NotExportable)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ExportRule {
    /// It was imported: its memory belongs to its exporter (forward the descriptor, or copy
    /// the data).
    Imported,
    /// It was allocated without the handle type the export needs.
    HandleType,
}

/// Which rule a named endpoint's name, directory or socket file broke
/// ([`Error::InvalidEndpoint`](super::Error::InvalidEndpoint)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum EndpointRule {
    /// The path is empty.
    EmptyName,
    /// The name is longer than a Unix socket name can be.
    NameTooLong {
        /// The name's length in bytes.
        len: usize,
        /// The most a socket name holds.
        max: usize,
    },
    /// The directory is a symbolic link.
    DirectorySymlink,
    /// The directory is not a directory.
    NotADirectory,
    /// This process's uid is the overflow uid (or it cannot be read): it cannot tell its own
    /// directory from other users'.
    OverflowUid {
        /// This process's effective uid.
        uid: u32,
    },
    /// The directory is owned by another uid.
    DirectoryOwner {
        /// The directory's owner.
        owner: u32,
        /// This process's effective uid.
        uid: u32,
    },
    /// Group or others may enter or list the directory.
    DirectoryMode {
        /// The directory's mode (the permission bits).
        mode: u32,
    },
    /// The path exists and is not a socket (it is never replaced).
    NotASocket,
}

/// What could not move a value's fds ([`Error::FdsCannotTravel`](super::Error::FdsCannotTravel)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum FdlessTransport {
    /// A serde format other than `vmm_core::wire`'s (whose fds travel out of band).
    OtherSerdeFormat,
    /// A named endpoint's `DATA` value: only docs/protocol.md's messages carry fds there.
    EndpointValue,
}

/// Which way a value failed to cross serde ([`Error::Serde`](super::Error::Serde)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SerdeStep {
    /// Serialising it.
    Encode,
    /// Deserialising it.
    Decode,
}

/// Which rule an environment variable's value broke
/// ([`Error::InvalidEnv`](super::Error::InvalidEnv)).
///
/// Every setting vmm-core reads from the environment has a documented form and range (the
/// README's Environment paragraph lists them): the environment is whoever started the
/// program's to choose, and a typo (`300` for `30`) or a hostile launcher must not start
/// hundreds of processes or spin for an hour. A setting either refuses a value with one of
/// these rules or, where nothing can be refused (a receive deep in a channel), clamps it with
/// one line on stderr; each setting's docs say which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum EnvRule {
    /// Not of the variable's form: not a number (or a list of numbers) where one is needed,
    /// not UTF-8, NaN.
    Syntax,
    /// A number below the least the variable takes: a negative count or ordinal, a timeout
    /// of zero or less.
    TooSmall,
    /// A number above the variable's documented maximum, `max`, counted in the variable's
    /// unit (children, a device ordinal, microseconds).
    TooLarge {
        /// The maximum.
        max: u64,
    },
    /// A list of more than `max` entries.
    TooMany {
        /// The most entries the list may have.
        max: u64,
    },
    /// A value longer than `max` bytes, refused before it is parsed.
    TooLong {
        /// The longest value read, in bytes.
        max: u64,
    },
}

/// Which half of sharing failed ([`Error::Ipc`](super::Error::Ipc)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum IpcOp {
    /// Exporting a buffer's chunks as handles.
    Export,
    /// Importing handles and mapping them.
    Import,
}

impl IpcOp {
    /// `"export"` or `"import"`.
    pub fn name(self) -> &'static str {
        match self {
            IpcOp::Export => "export",
            IpcOp::Import => "import",
        }
    }
}

impl fmt::Display for IpcOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One chunk of a buffer, as an [`IpcStep`] names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Chunk {
    /// Its index, from 0.
    pub index: usize,
    /// How many chunks the buffer has.
    pub count: usize,
    /// Its size in bytes.
    pub size: usize,
}

impl fmt::Display for Chunk {
    /// `chunk 2 of 3 (2097152 bytes)`: counted from 1, as people count.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "chunk {} of {} ({} bytes)",
            self.index + 1,
            self.count,
            self.size
        )
    }
}

/// Where an export or import failed ([`Error::Ipc`](super::Error::Ipc)); everything done
/// before it was undone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum IpcStep {
    /// Making the resource's device current.
    MakeCurrent,
    /// Exporting one chunk's handle.
    Export(Chunk),
    /// Importing one chunk's handle.
    Import(Chunk),
    /// Checking where an imported chunk's memory lives.
    CheckLocation(Chunk),
    /// Reserving the address range for the whole buffer.
    Reserve {
        /// The range's size.
        bytes: usize,
        /// How many chunks it is for.
        chunks: usize,
    },
    /// Mapping one chunk into the range (and setting its access).
    Map(Chunk),
}

impl IpcStep {
    /// The chunk the step was working on, if it was one chunk's.
    pub fn chunk(&self) -> Option<Chunk> {
        match *self {
            IpcStep::Export(c)
            | IpcStep::Import(c)
            | IpcStep::CheckLocation(c)
            | IpcStep::Map(c) => Some(c),
            IpcStep::MakeCurrent | IpcStep::Reserve { .. } => None,
        }
    }
}

impl fmt::Display for IpcStep {
    /// `while mapping chunk 2 of 2 (4194304 bytes)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IpcStep::MakeCurrent => f.write_str("while making the device current"),
            IpcStep::Export(c) => write!(f, "while exporting {c}"),
            IpcStep::Import(c) => write!(f, "while importing {c}"),
            IpcStep::CheckLocation(c) => write!(f, "while checking the location of {c}"),
            IpcStep::Reserve { bytes, chunks } => {
                write!(f, "while reserving {bytes} bytes for {chunks} chunk(s)")
            }
            IpcStep::Map(c) => write!(f, "while mapping {c}"),
        }
    }
}
