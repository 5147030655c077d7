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
