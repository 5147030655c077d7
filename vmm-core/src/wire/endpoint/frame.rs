//! The peer protocol's message (versions 1 and 2): a fixed 64-byte little-endian header, the
//! chunk sizes, a payload; the fds ride in the packet's `SCM_RIGHTS`. `docs/protocol.md` is the
//! specification; this is its one Rust codec, for packets on a named endpoint and for messages
//! on a byte stream alike. It knows nothing of importing: the descriptor kinds are checked
//! here as far as numbers go (the chunk layout by the descriptors' own rule, shared with
//! [`cuda`](crate::cuda)), and [`peer`](crate::peer) turns them into descriptors.
//!
//! Each message carries the version that defines its kind ([`Kind::version`]): the five kinds
//! of version 1 are encoded exactly as version 1 always encoded them, `CUDA_FABRIC` as version
//! 2. A message whose version is not its kind's, or is neither 1 nor 2, is refused.
//!
//! Every number in a header is the peer's choice. [`Frame::decode`] checks each one against the
//! documented maximum and against what the kernel said (the message's length, its fd count)
//! before it allocates anything; fields a kind does not use must be zero.
//! [`Frame::check_stream_header`] makes the same checks on a header alone, for a reader that
//! must know how much more to read before it reads it.

use std::fmt;

use crate::{Error, Result};

/// The first four bytes of every message: `VMMI`.
pub(crate) const MAGIC: [u8; 4] = *b"VMMI";

/// The newest protocol version this crate speaks. It speaks every version up to it (1 and 2):
/// each message carries its kind's version, so a version 2 peer speaks version 1, byte for
/// byte, to a version 1 peer as long as it sends no `CUDA_FABRIC` message.
pub const PROTOCOL_VERSION: u16 = 2;

/// The versions this crate accepts, for errors.
const VERSIONS_SPOKEN: &str = "versions 1 and 2";

/// The header's length in bytes (versions 1 and 2).
pub(crate) const HEADER_LEN: usize = 64;

/// The most chunks (and so fds) one descriptor message may carry: the kernel's `SCM_MAX_FD`.
/// A `CUDA_FABRIC` message, which carries no fds, has the same bound.
pub const MAX_CHUNKS: usize = super::super::MAX_FDS;

/// The most payload bytes one message may carry (a `DATA` message's bytes, a `REFUSED`
/// message's reason, a `CUDA_FABRIC` message's handles).
pub const MAX_DATA: usize = 16 * 1024;

/// The bytes of one fabric handle in a `CUDA_FABRIC` payload (`CUmemFabricHandle`).
pub(crate) const FABRIC_HANDLE_BYTES: usize = 64;

/// The longest message of docs/protocol.md (without the packet's frame byte): a header, the
/// most chunk sizes and the most payload. A receiver reads at most this plus the frame byte.
pub(crate) const MAX_FRAME: usize = HEADER_LEN + 8 * MAX_CHUNKS + MAX_DATA;

/// Header flag: the device UUID and ordinal fields are set (CUDA descriptors only).
pub(crate) const FLAG_DEVICE: u16 = 1;

/// `CUmemAllocationHandleType` of a POSIX fd, the handle type of `CUDA_VMM`.
const HANDLE_TYPE_POSIX_FD: u32 = 1;
/// `CUmemAllocationHandleType` of a fabric handle, the handle type of `CUDA_FABRIC`.
const HANDLE_TYPE_FABRIC: u32 = 8;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub(crate) enum Kind {
    /// Listener to client: admitted (no fds, no payload).
    Hello = 1,
    /// Listener to client: refused; the payload is the reason (UTF-8).
    Refused = 2,
    /// Application bytes (no fds).
    Data = 3,
    /// A CUDA VMM descriptor: one fd per chunk.
    Cuda = 4,
    /// A host (memfd) descriptor: one fd, or none for an empty buffer.
    Host = 5,
    /// A CUDA VMM descriptor as fabric handles (version 2): one 64-byte handle per chunk in
    /// the payload, no fds.
    Fabric = 6,
}

impl Kind {
    fn from_raw(raw: u16) -> Option<Kind> {
        Some(match raw {
            1 => Kind::Hello,
            2 => Kind::Refused,
            3 => Kind::Data,
            4 => Kind::Cuda,
            5 => Kind::Host,
            6 => Kind::Fabric,
            _ => return None,
        })
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Hello => "HELLO",
            Kind::Refused => "REFUSED",
            Kind::Data => "DATA",
            Kind::Cuda => "CUDA_VMM",
            Kind::Host => "HOST_MEMFD",
            Kind::Fabric => "CUDA_FABRIC",
        }
    }

    /// The protocol version that defines the kind: what a message of this kind carries in its
    /// version field, and the only version it is accepted with.
    pub(crate) fn version(self) -> u16 {
        match self {
            Kind::Hello | Kind::Refused | Kind::Data | Kind::Cuda | Kind::Host => 1,
            Kind::Fabric => 2,
        }
    }

    /// Whether a message of this kind carries fds (one per chunk); the others carry none.
    pub(crate) fn carries_fds(self) -> bool {
        matches!(self, Kind::Cuda | Kind::Host)
    }

    /// Whether the kind belongs to a named endpoint's handshake.
    pub(crate) fn is_handshake(self) -> bool {
        matches!(self, Kind::Hello | Kind::Refused)
    }
}

/// Where a CUDA descriptor's memory lives, as the header says it (the protocol's own numbers:
/// 0 device, 1 host NUMA node).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameLocation {
    Device,
    HostNuma(i32),
}

/// One message, decoded (or to be encoded). `fd_count` is not a field: the header's chunk
/// count is, and it must equal the fds the kernel delivered for a kind that carries fds.
///
/// Its `Debug` shows the payload's length, never its bytes (a `CUDA_FABRIC` payload is bearer
/// tokens).
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Frame {
    pub kind: Kind,
    /// The driver's `CUmemAllocationHandleType`: 1 (POSIX fd) for `CUDA_VMM`, 8 (fabric) for
    /// `CUDA_FABRIC`; 0 otherwise.
    pub handle_type: u32,
    pub size: u64,
    /// `(ordinal, uuid)` of the exporting device, when the exporter named it.
    pub device: Option<(u32, [u8; 16])>,
    pub location: FrameLocation,
    pub chunk_sizes: Vec<u64>,
    pub payload: Vec<u8>,
}

impl fmt::Debug for Frame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Frame")
            .field("kind", &self.kind)
            .field("handle_type", &self.handle_type)
            .field("size", &self.size)
            .field("device", &self.device.map(|(ordinal, _)| ordinal))
            .field("location", &self.location)
            .field("chunk_sizes", &self.chunk_sizes)
            .field("payload", &format_args!("<{} bytes>", self.payload.len()))
            .finish()
    }
}

/// `Err(Error::Protocol("peer message: {why}"))`.
fn refuse<T>(why: String) -> Result<T> {
    Err(Error::Protocol(format!("peer message: {why}")))
}

/// What a header's fields say, after rules 1 and 2 and the counts of rule 3 of
/// docs/protocol.md ("Limits and checks on receipt").
struct RawHeader {
    kind: Kind,
    flags: u16,
    handle_type: u32,
    chunk_count: usize,
    payload_len: usize,
    size: u64,
    uuid: [u8; 16],
    ordinal: u32,
    location_type: u32,
    location_id: i32,
}

/// A header whose fields passed rule 4 too (device fields only with the flag, a known
/// location), with its counts.
struct Header {
    kind: Kind,
    handle_type: u32,
    size: u64,
    device: Option<(u32, [u8; 16])>,
    location: FrameLocation,
    chunk_count: usize,
    payload_len: usize,
}

impl RawHeader {
    /// Rules 1, 2 and the counts of rule 3, on the first bytes of a message (`bytes` may be a
    /// whole message, or fewer bytes than a header: then the magic and the version are
    /// checked first, so an unknown version is named even in a short message).
    fn parse(bytes: &[u8]) -> Result<RawHeader> {
        let len = bytes.len();
        if len < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
            let start = &bytes[..len.min(MAGIC.len())];
            return refuse(format!(
                "it does not start with the magic \"VMMI\" (got {start:02x?}, {len} bytes): not \
                 a vmm-ipc peer message"
            ));
        }
        if len < 6 {
            return refuse(format!(
                "{len} bytes end inside the header's version field (the header has {HEADER_LEN})"
            ));
        }
        let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let u64_at = |at: usize| u64::from(u32_at(at)) | u64::from(u32_at(at + 4)) << 32;
        let version = u16_at(4);
        if !(1..=PROTOCOL_VERSION).contains(&version) {
            return refuse(format!(
                "protocol version {version} is not supported: this peer speaks \
                 {VERSIONS_SPOKEN}"
            ));
        }
        if len < HEADER_LEN {
            return refuse(format!(
                "{len} bytes: shorter than the {HEADER_LEN}-byte header (a partial header)"
            ));
        }
        let raw_kind = u16_at(6);
        let Some(kind) = Kind::from_raw(raw_kind) else {
            return refuse(format!(
                "unknown message kind {raw_kind} (version {version} message; {VERSIONS_SPOKEN} \
                 know 1 HELLO, 2 REFUSED, 3 DATA, 4 CUDA_VMM, 5 HOST_MEMFD and, in version 2, \
                 6 CUDA_FABRIC)"
            ));
        };
        if version != kind.version() {
            return refuse(format!(
                "{} is a version {} kind, but the message is marked version {version}: a \
                 message carries the version that defines its kind",
                kind.name(),
                kind.version()
            ));
        }
        let header_len = u16_at(8);
        if usize::from(header_len) != HEADER_LEN {
            return refuse(format!(
                "header length {header_len}: version {version} headers are {HEADER_LEN} bytes"
            ));
        }
        let flags = u16_at(10);
        if flags & !FLAG_DEVICE != 0 {
            return refuse(format!(
                "unknown flags {flags:#06x} (only 0x0001 is defined)"
            ));
        }
        let reserved = u32_at(60);
        if reserved != 0 {
            return refuse(format!("reserved header field is {reserved:#x}, not 0"));
        }
        let chunk_count = u32_at(16) as usize;
        let payload_len = u32_at(20) as usize;
        if chunk_count > MAX_CHUNKS {
            return refuse(format!(
                "{chunk_count} chunks: at most {MAX_CHUNKS} (one fd each) may travel in one message"
            ));
        }
        if payload_len > MAX_DATA {
            return refuse(format!(
                "{payload_len} payload bytes: at most {MAX_DATA} may travel in one message"
            ));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&bytes[32..48]);
        Ok(RawHeader {
            kind,
            flags,
            handle_type: u32_at(12),
            chunk_count,
            payload_len,
            size: u64_at(24),
            uuid,
            ordinal: u32_at(48),
            location_type: u32_at(52),
            location_id: u32_at(56) as i32,
        })
    }

    /// The message's length: header, chunk sizes, payload (bounded by [`MAX_FRAME`]).
    fn message_len(&self) -> usize {
        HEADER_LEN + 8 * self.chunk_count + self.payload_len
    }

    /// The second half of rule 3: the kernel delivered exactly the fds the kind carries (one
    /// per chunk for `CUDA_VMM` and `HOST_MEMFD`, none for the others).
    fn check_fds(&self, fd_count: usize) -> Result<()> {
        let (expected, rule) = if self.kind.carries_fds() {
            (
                self.chunk_count,
                "a message carries exactly one fd per chunk".to_owned(),
            )
        } else {
            (0, format!("a {} message carries no fds", self.kind.name()))
        };
        if fd_count != expected {
            return refuse(format!(
                "{} message with {} chunk(s) arrived with {fd_count} fd(s): {rule}",
                self.kind.name(),
                self.chunk_count
            ));
        }
        Ok(())
    }

    /// Rule 4: device fields only with the flag; a known location.
    fn resolve(self) -> Result<Header> {
        let device_named = self.flags & FLAG_DEVICE != 0;
        if !device_named && (self.ordinal != 0 || self.uuid != [0; 16]) {
            return refuse(
                "device fields are set but the device flag (0x0001) is not: fields a message \
                 does not use must be zero"
                    .into(),
            );
        }
        let location = match (self.location_type, self.location_id) {
            (0, 0) => FrameLocation::Device,
            (0, id) => {
                return refuse(format!(
                    "location type 0 (device) with location id {id}: the id must be 0"
                ));
            }
            (1, node) if node >= 0 => FrameLocation::HostNuma(node),
            (1, node) => return refuse(format!("host NUMA node {node} is negative")),
            (other, _) => {
                return refuse(format!(
                    "unknown location type {other} (0 device, 1 host NUMA node)"
                ));
            }
        };
        Ok(Header {
            kind: self.kind,
            handle_type: self.handle_type,
            size: self.size,
            device: device_named.then_some((self.ordinal, self.uuid)),
            location,
            chunk_count: self.chunk_count,
            payload_len: self.payload_len,
        })
    }
}

impl Header {
    /// Rule 5, as far as the header decides it: which fields the kind uses (the others must be
    /// zero) and how its counts relate. The chunk sizes' rules are [`Frame::check_chunks`].
    fn check_kind(&self) -> Result<()> {
        let name = self.kind.name();
        let refuse = |why: String| refuse(format!("{name}: {why}"));
        let (count, payload) = (self.chunk_count, self.payload_len);
        let descriptor_fields = self.handle_type != 0
            || self.size != 0
            || self.device.is_some()
            || self.location != FrameLocation::Device
            || count != 0;
        match self.kind {
            Kind::Hello => {
                if descriptor_fields || payload != 0 {
                    return refuse("every field after the header's length must be zero".into());
                }
            }
            Kind::Refused | Kind::Data => {
                if descriptor_fields {
                    return refuse(
                        "carries descriptor fields or chunks; only a payload is allowed".into(),
                    );
                }
            }
            Kind::Cuda => {
                if payload != 0 {
                    return refuse(format!("{payload} payload bytes: a descriptor has none"));
                }
                if self.handle_type != HANDLE_TYPE_POSIX_FD {
                    return refuse(format!(
                        "handle type {} is not carried by CUDA_VMM: only 1 \
                         (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) is{}",
                        self.handle_type,
                        if self.handle_type == HANDLE_TYPE_FABRIC {
                            "; fabric handles (8) travel as CUDA_FABRIC (kind 6, version 2)"
                        } else {
                            ""
                        }
                    ));
                }
            }
            Kind::Fabric => {
                if self.handle_type != HANDLE_TYPE_FABRIC {
                    return refuse(format!(
                        "handle type {} is not carried by CUDA_FABRIC: only 8 \
                         (CU_MEM_HANDLE_TYPE_FABRIC) is",
                        self.handle_type
                    ));
                }
                if self.device.is_none() {
                    return refuse(
                        "the device flag (0x0001) is not set: a CUDA_FABRIC message names the \
                         device that owns the memory"
                            .into(),
                    );
                }
                if count == 0 {
                    return refuse("0 chunks: a CUDA_FABRIC message carries at least one".into());
                }
                if payload != FABRIC_HANDLE_BYTES * count {
                    return refuse(format!(
                        "{payload} payload bytes for {count} chunk(s): the payload is exactly \
                         one {FABRIC_HANDLE_BYTES}-byte fabric handle per chunk ({} bytes)",
                        FABRIC_HANDLE_BYTES * count
                    ));
                }
            }
            Kind::Host => {
                if payload != 0 {
                    return refuse(format!("{payload} payload bytes: a descriptor has none"));
                }
                if self.handle_type != 0
                    || self.device.is_some()
                    || self.location != FrameLocation::Device
                {
                    return refuse(
                        "handle type, device and location must be zero for a memfd".into(),
                    );
                }
                if usize::try_from(self.size).is_err() {
                    return refuse(format!(
                        "size {} is more than this platform's usize",
                        self.size
                    ));
                }
                match count {
                    0 if self.size != 0 => {
                        return refuse(format!(
                            "size {} with no fd: only an empty buffer has none",
                            self.size
                        ));
                    }
                    0 | 1 => {}
                    _ => return refuse(format!("{count} fds: a memfd descriptor has at most 1")),
                }
            }
        }
        Ok(())
    }
}

impl Frame {
    /// A message of `kind` with every field zero.
    pub(crate) fn empty(kind: Kind) -> Frame {
        Frame {
            kind,
            handle_type: 0,
            size: 0,
            device: None,
            location: FrameLocation::Device,
            chunk_sizes: Vec::new(),
            payload: Vec::new(),
        }
    }

    /// A message carrying `payload` (`DATA`, `REFUSED`).
    pub(crate) fn with_payload(kind: Kind, payload: &[u8]) -> Frame {
        Frame {
            payload: payload.to_vec(),
            ..Frame::empty(kind)
        }
    }

    /// The message's bytes (what follows the packet's frame byte), with its kind's version.
    ///
    /// Refuses a message that breaks the limits it would be refused for on arrival.
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        if self.chunk_sizes.len() > MAX_CHUNKS {
            return Err(Error::InvalidArgument(format!(
                "a peer message carries at most {MAX_CHUNKS} chunks, this one has {}",
                self.chunk_sizes.len()
            )));
        }
        if self.payload.len() > MAX_DATA {
            return Err(Error::InvalidArgument(format!(
                "a peer message carries at most {MAX_DATA} payload bytes, this one has {}",
                self.payload.len()
            )));
        }
        let mut out = Vec::with_capacity(self.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.kind.version().to_le_bytes());
        out.extend_from_slice(&(self.kind as u16).to_le_bytes());
        out.extend_from_slice(&(HEADER_LEN as u16).to_le_bytes());
        let flags = if self.device.is_some() {
            FLAG_DEVICE
        } else {
            0
        };
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&self.handle_type.to_le_bytes());
        out.extend_from_slice(&(self.chunk_sizes.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        let (ordinal, uuid) = self.device.unwrap_or((0, [0; 16]));
        out.extend_from_slice(&uuid);
        out.extend_from_slice(&ordinal.to_le_bytes());
        let (location_type, location_id) = match self.location {
            FrameLocation::Device => (0u32, 0i32),
            FrameLocation::HostNuma(node) => (1, node),
        };
        out.extend_from_slice(&location_type.to_le_bytes());
        out.extend_from_slice(&location_id.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes()); // reserved
        debug_assert_eq!(out.len(), HEADER_LEN);
        for size in &self.chunk_sizes {
            out.extend_from_slice(&size.to_le_bytes());
        }
        out.extend_from_slice(&self.payload);
        Ok(out)
    }

    fn len(&self) -> usize {
        HEADER_LEN + 8 * self.chunk_sizes.len() + self.payload.len()
    }

    /// Decode a message of `bytes` that arrived with `fd_count` fds. Every rule of
    /// `docs/protocol.md` is checked here, in its order; nothing is allocated before the counts
    /// check out. Errors are [`Error::Protocol`], naming the rule and the numbers (never a
    /// payload byte).
    pub(crate) fn decode(bytes: &[u8], fd_count: usize) -> Result<Frame> {
        let raw = RawHeader::parse(bytes)?;
        let (len, expected) = (bytes.len(), raw.message_len());
        if len != expected {
            return refuse(format!(
                "its header announces {} chunk size(s) and {} payload bytes ({expected} bytes \
                 in all), but the message has {len} bytes",
                raw.chunk_count, raw.payload_len
            ));
        }
        raw.check_fds(fd_count)?;
        let header = raw.resolve()?;
        header.check_kind()?;
        let sizes = &bytes[HEADER_LEN..HEADER_LEN + 8 * header.chunk_count];
        let chunk_sizes: Vec<u64> = sizes
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .collect();
        let frame = Frame {
            kind: header.kind,
            handle_type: header.handle_type,
            size: header.size,
            device: header.device,
            location: header.location,
            chunk_sizes,
            payload: bytes[HEADER_LEN + 8 * header.chunk_count..].to_vec(),
        };
        frame.check_chunks()?;
        Ok(frame)
    }

    /// For a byte stream (docs/protocol.md, "Byte streams"): check `header`, the bytes that
    /// followed the frame byte (64 of them, or fewer where the stream ended), by every rule
    /// the header alone decides, and refuse the kinds a stream does not carry (those with fds,
    /// and the handshake's); return how many more bytes the message has (at most
    /// `8 * MAX_CHUNKS + MAX_DATA`). The caller reads exactly those, then [`decode`]s the
    /// whole message with no fds.
    ///
    /// [`decode`]: Frame::decode
    pub(crate) fn check_stream_header(header: &[u8]) -> Result<usize> {
        let raw = RawHeader::parse(header)?;
        let name = raw.kind.name();
        if raw.kind.carries_fds() {
            return refuse(format!(
                "{name} on a byte stream: its kind carries fds, which a stream cannot (send it \
                 on a named endpoint)"
            ));
        }
        if raw.kind.is_handshake() {
            return refuse(format!(
                "{name} on a byte stream: it belongs to a named endpoint's handshake, and a \
                 stream has none"
            ));
        }
        let body = raw.message_len() - HEADER_LEN;
        let header = raw.resolve()?;
        header.check_kind()?;
        Ok(body)
    }

    /// Rule 5, the chunk sizes: a CUDA descriptor's layout by the descriptors' own rule
    /// (non-empty chunks whose sum fits this platform, `size` within it), a memfd's one chunk
    /// equal to its size.
    fn check_chunks(&self) -> Result<()> {
        let name = self.kind.name();
        match self.kind {
            Kind::Hello | Kind::Refused | Kind::Data => Ok(()),
            Kind::Cuda | Kind::Fabric => {
                let count = self.chunk_sizes.len();
                let mut sizes = Vec::new();
                if sizes.try_reserve_exact(count).is_err() {
                    return refuse(format!("{name}: no memory for {count} chunk sizes"));
                }
                for (index, &chunk) in self.chunk_sizes.iter().enumerate() {
                    match usize::try_from(chunk) {
                        Ok(chunk) => sizes.push(chunk),
                        Err(_) => {
                            return refuse(format!(
                                "{name}: chunk {} of {count} has size {chunk}, more than this \
                                 platform's usize",
                                index + 1
                            ));
                        }
                    }
                }
                let Ok(size) = usize::try_from(self.size) else {
                    return refuse(format!(
                        "{name}: size {} is more than this platform's usize",
                        self.size
                    ));
                };
                match crate::cuda::validate_chunks(name, &sizes, size, 1) {
                    Ok(_) => Ok(()),
                    // "invalid CUDA_VMM: chunk 2 of 3 has size 0: ...": the rule, by name.
                    Err(Error::InvalidDescriptor { message, .. }) => refuse(message),
                    Err(other) => Err(other),
                }
            }
            Kind::Host => match self.chunk_sizes.first() {
                None => Ok(()),
                Some(&chunk) if chunk == self.size && chunk != 0 => Ok(()),
                Some(&chunk) => refuse(format!(
                    "{name}: its one chunk has size {chunk} but the buffer's size is {}: they \
                     must be equal and non-zero",
                    self.size
                )),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda(sizes: &[u64], size: u64) -> Frame {
        Frame {
            handle_type: 1,
            size,
            chunk_sizes: sizes.to_vec(),
            ..Frame::empty(Kind::Cuda)
        }
    }

    fn refused(bytes: &[u8], fds: usize) -> String {
        match Frame::decode(bytes, fds) {
            Err(Error::Protocol(m)) => m,
            other => panic!("wanted Error::Protocol, got {other:?}"),
        }
    }

    fn fabric(sizes: &[u64], size: u64) -> Frame {
        Frame {
            handle_type: 8,
            size,
            device: Some((1, [0x42; 16])),
            chunk_sizes: sizes.to_vec(),
            payload: (0..64 * sizes.len())
                .map(|i| (i % 251) as u8 ^ 0x5c)
                .collect(),
            ..Frame::empty(Kind::Fabric)
        }
    }

    /// What the version 1 codec (before version 2 existed, at 23f2e89) wrote for these
    /// messages, byte for byte: version 1 kinds must keep exactly these bytes, and decode
    /// from them to the same messages, so a version 1 peer sees no change.
    const V1_GOLDEN: [&str; 8] = [
        "564d4d49010001004000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000",
        "564d4d490100020040000000000000000000000014000000000000000000000000000000000000000000000000000000000000000000000000000000000000007569642037206973206e6f7420616c6c6f776564",
        "564d4d49010003004000000000000000000000000b000000000000000000000000000000000000000000000000000000000000000000000000000000000000006765742077656967687473",
        "564d4d49010003004000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000",
        "564d4d490100040040000000010000000200000000000000fbff5f0000000000000000000000000000000000000000000000000000000000000000000000000000002000000000000000400000000000",
        "564d4d4901000400400001000100000001000000000000000000200000000000a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5030000000100000001000000000000000000200000000000",
        "564d4d490100050040000000000000000100000000000000001000000000000000000000000000000000000000000000000000000000000000000000000000000010000000000000",
        "564d4d49010005004000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000",
    ];

    fn v1_messages() -> [Frame; 8] {
        let g = 2 << 20;
        [
            Frame::empty(Kind::Hello),
            Frame::with_payload(Kind::Refused, b"uid 7 is not allowed"),
            Frame::with_payload(Kind::Data, b"get weights"),
            Frame::with_payload(Kind::Data, &[]),
            cuda(&[g, 2 * g], 3 * g - 5),
            Frame {
                device: Some((3, [0xa5; 16])),
                location: FrameLocation::HostNuma(1),
                ..cuda(&[g], g)
            },
            Frame {
                size: 4096,
                chunk_sizes: vec![4096],
                ..Frame::empty(Kind::Host)
            },
            Frame::empty(Kind::Host),
        ]
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn unhex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn version_1_messages_are_byte_for_byte_what_version_1_wrote() {
        for (frame, golden) in v1_messages().into_iter().zip(V1_GOLDEN) {
            let bytes = frame.encode().unwrap();
            assert_eq!(hex(&bytes), golden, "{frame:?}");
            assert_eq!(bytes[4..6], [1, 0], "a version 1 kind is sent as version 1");
            let fds = if frame.kind.carries_fds() {
                frame.chunk_sizes.len()
            } else {
                0
            };
            assert_eq!(Frame::decode(&unhex(golden), fds).unwrap(), frame);
        }
    }

    #[test]
    fn fabric_messages_round_trip_as_version_2() {
        let g = 2 << 20;
        for frame in [
            fabric(&[g], g),
            fabric(&[g, 4 * g, g], 5 * g + 1),
            Frame {
                location: FrameLocation::HostNuma(2),
                ..fabric(&vec![g; MAX_CHUNKS], 1)
            },
        ] {
            let bytes = frame.encode().unwrap();
            assert_eq!(bytes.len(), 64 + 72 * frame.chunk_sizes.len());
            assert_eq!(bytes[4..6], [2, 0], "version 2");
            assert_eq!(bytes[6..8], [6, 0], "kind CUDA_FABRIC");
            assert_eq!(bytes[10..12], [1, 0], "device flag");
            assert_eq!(bytes[12..16], [8, 0, 0, 0], "handle type fabric");
            assert_eq!(bytes[32..48], [0x42; 16]);
            assert_eq!(Frame::decode(&bytes, 0).unwrap(), frame);
            assert_eq!(
                Frame::check_stream_header(&bytes[..64]).unwrap(),
                bytes.len() - 64
            );
        }
    }

    #[test]
    fn a_version_must_be_its_kinds() {
        let mut fabric_v1 = fabric(&[4096], 4096).encode().unwrap();
        fabric_v1[4] = 1;
        let m = refused(&fabric_v1, 0);
        assert!(
            m.contains("CUDA_FABRIC is a version 2 kind, but the message is marked version 1"),
            "{m}"
        );
        let mut hello_v2 = Frame::empty(Kind::Hello).encode().unwrap();
        hello_v2[4] = 2;
        let m = refused(&hello_v2, 0);
        assert!(
            m.contains("HELLO is a version 1 kind, but the message is marked version 2"),
            "{m}"
        );
        for kind in [1u8, 2, 3, 4, 5] {
            let mut b = v1_messages()[0].encode().unwrap();
            b[6] = kind;
            b[4] = 2;
            assert!(refused(&b, 0).contains("is a version 1 kind"));
        }
        let mut unknown = Frame::empty(Kind::Data).encode().unwrap();
        unknown[4] = 2;
        unknown[6] = 7;
        let m = refused(&unknown, 0);
        assert!(m.contains("unknown message kind 7"), "{m}");
    }

    #[test]
    fn fabric_rules_are_checked_before_anything_is_allocated() {
        let g = 2 << 20;
        let with = |f: &dyn Fn(&mut Frame)| {
            let mut frame = fabric(&[g, g], 2 * g);
            f(&mut frame);
            frame.encode().unwrap()
        };
        let cases: Vec<(Vec<u8>, usize, &str)> = vec![
            (
                with(&|f| f.handle_type = 1),
                0,
                "handle type 1 is not carried by CUDA_FABRIC",
            ),
            (
                with(&|f| f.handle_type = 9),
                0,
                "handle type 9 is not carried by CUDA_FABRIC",
            ),
            (
                with(&|f| f.device = None),
                0,
                "device flag (0x0001) is not set",
            ),
            (
                with(&|f| {
                    f.chunk_sizes.clear();
                    f.payload.clear();
                    f.size = 0;
                }),
                0,
                "0 chunks: a CUDA_FABRIC message carries at least one",
            ),
            (
                with(&|f| f.payload.truncate(100)),
                0,
                "100 payload bytes for 2 chunk(s)",
            ),
            (
                with(&|f| f.payload.push(0)),
                0,
                "129 payload bytes for 2 chunk(s)",
            ),
            (
                with(&|_| {}),
                2,
                "CUDA_FABRIC message with 2 chunk(s) arrived with 2 fd(s): a CUDA_FABRIC \
                 message carries no fds",
            ),
            (
                with(&|f| f.chunk_sizes[1] = 0),
                0,
                "invalid CUDA_FABRIC: chunk 2 of 2 has size 0",
            ),
            (
                with(&|f| f.chunk_sizes = vec![u64::MAX, 2]),
                0,
                "invalid CUDA_FABRIC: chunk 2 of 2: the sum of chunk sizes overflows",
            ),
            (
                with(&|f| f.size = 2 * g + 1),
                0,
                "exceeds the 4194304 bytes that its 2 chunk(s) hold",
            ),
            (
                with(&|f| f.location = FrameLocation::HostNuma(-3)),
                0,
                "host NUMA node -3 is negative",
            ),
        ];
        for (bytes, fds, words) in cases {
            let m = refused(&bytes, fds);
            assert!(m.contains(words), "{words:?} not in {m}");
        }
        // A header that claims the most of everything is refused from its counts.
        let mut claims = fabric(&[g], g).encode().unwrap();
        claims[16..20].copy_from_slice(&253u32.to_le_bytes());
        claims[20..24].copy_from_slice(&16384u32.to_le_bytes());
        let m = refused(&claims, 0);
        assert!(m.contains("announces 253 chunk size(s)"), "{m}");
        let m = match Frame::check_stream_header(&claims[..64]) {
            Err(Error::Protocol(m)) => m,
            other => panic!("{other:?}"),
        };
        assert!(m.contains("16384 payload bytes for 253 chunk(s)"), "{m}");
    }

    #[test]
    fn a_stream_header_is_checked_alone_and_refuses_fd_and_handshake_kinds() {
        let stream_refused = |bytes: &[u8]| match Frame::check_stream_header(bytes) {
            Err(Error::Protocol(m)) => m,
            other => panic!("wanted Error::Protocol, got {other:?}"),
        };
        let data = Frame::with_payload(Kind::Data, b"hello").encode().unwrap();
        assert_eq!(Frame::check_stream_header(&data[..64]).unwrap(), 5);
        for (frame, words) in [
            (
                cuda(&[4096], 4096),
                "CUDA_VMM on a byte stream: its kind carries fds",
            ),
            (
                Frame {
                    size: 4096,
                    chunk_sizes: vec![4096],
                    ..Frame::empty(Kind::Host)
                },
                "HOST_MEMFD on a byte stream: its kind carries fds",
            ),
            (Frame::empty(Kind::Host), "HOST_MEMFD on a byte stream"),
            (Frame::empty(Kind::Hello), "HELLO on a byte stream"),
            (
                Frame::with_payload(Kind::Refused, b"no"),
                "REFUSED on a byte stream",
            ),
        ] {
            let m = stream_refused(&frame.encode().unwrap()[..64]);
            assert!(m.contains(words), "{words:?} not in {m}");
        }
        let m = stream_refused(&data[..30]);
        assert!(
            m.contains("30 bytes: shorter than the 64-byte header"),
            "{m}"
        );
        let m = stream_refused(&[b"VMMI".as_slice(), &[3, 0]].concat());
        assert!(m.contains("protocol version 3 is not supported"), "{m}");
        let m = stream_refused(b"GET / HT");
        assert!(m.contains("not a vmm-ipc peer message"), "{m}");
    }

    #[test]
    fn debug_and_errors_show_no_payload_byte() {
        let frame = Frame {
            payload: vec![0xd7; 128],
            ..fabric(&[4096, 4096], 8192)
        };
        let shown = format!("{frame:?} {frame:#?}");
        assert!(shown.contains("<128 bytes>"), "{shown}");
        for needle in ["d7", "215", "0xd7", "D7"] {
            assert!(!shown.contains(needle), "{needle} in {shown}");
        }
        let mut bad = frame.encode().unwrap();
        bad[24] = 0xff; // size beyond the chunks
        bad[25] = 0xff;
        let m = refused(&bad, 0);
        assert!(!m.contains("d7") && !m.contains("215"), "{m}");
    }

    #[test]
    fn every_kind_round_trips() {
        for frame in v1_messages() {
            let bytes = frame.encode().unwrap();
            assert_eq!(bytes.len(), frame.len());
            assert_eq!(&bytes[..4], b"VMMI");
            let back = Frame::decode(&bytes, frame.chunk_sizes.len()).unwrap();
            assert_eq!(back, frame);
        }
    }

    /// The layout docs/protocol.md gives, byte by byte (what the Python peer packs with
    /// `struct.Struct("<4sHHHHIIIQ16sIIiI")`).
    #[test]
    fn the_header_layout_is_the_documented_one() {
        let frame = Frame {
            device: Some((2, [0x11; 16])),
            location: FrameLocation::HostNuma(3),
            ..cuda(&[0x20_0000], 0x1f_ffff)
        };
        let b = frame.encode().unwrap();
        assert_eq!(b.len(), 72);
        assert_eq!(&b[0..4], b"VMMI");
        assert_eq!(b[4..6], [1, 0]); // version
        assert_eq!(b[6..8], [4, 0]); // kind CUDA_VMM
        assert_eq!(b[8..10], [64, 0]); // header length
        assert_eq!(b[10..12], [1, 0]); // flags: device named
        assert_eq!(b[12..16], [1, 0, 0, 0]); // handle type
        assert_eq!(b[16..20], [1, 0, 0, 0]); // chunk count
        assert_eq!(b[20..24], [0, 0, 0, 0]); // payload length
        assert_eq!(b[24..32], 0x1f_ffffu64.to_le_bytes()); // size
        assert_eq!(b[32..48], [0x11; 16]); // uuid
        assert_eq!(b[48..52], [2, 0, 0, 0]); // ordinal
        assert_eq!(b[52..56], [1, 0, 0, 0]); // location type
        assert_eq!(b[56..60], [3, 0, 0, 0]); // location id
        assert_eq!(b[60..64], [0, 0, 0, 0]); // reserved
        assert_eq!(b[64..72], 0x20_0000u64.to_le_bytes()); // chunk 1
    }

    #[test]
    fn short_foreign_and_future_messages_are_refused_by_rule() {
        let good = Frame::with_payload(Kind::Data, b"x").encode().unwrap();
        let m = refused(&[], 0);
        assert!(m.contains("magic") && m.contains("0 bytes"), "{m}");
        let m = refused(b"hello world, not ours", 0);
        assert!(m.contains("not a vmm-ipc peer message"), "{m}");
        let m = refused(&good[..5], 0);
        assert!(m.contains("5 bytes end inside"), "{m}");
        let m = refused(&good[..40], 0);
        assert!(
            m.contains("40 bytes") && m.contains("partial header"),
            "{m}"
        );
        let mut v3 = good.clone();
        v3[4] = 3;
        let m = refused(&v3, 0);
        assert!(
            m.contains("protocol version 3 is not supported: this peer speaks versions 1 and 2"),
            "{m}"
        );
        // A future version is refused even when it is shorter than a v1 header.
        let m = refused(&v3[..10], 0);
        assert!(m.contains("protocol version 3"), "{m}");
        let m = refused(&[b"VMMI".as_slice(), &[0, 0]].concat(), 0);
        assert!(m.contains("protocol version 0 is not supported"), "{m}");
        let mut kind = good.clone();
        kind[6] = 9;
        let m = refused(&kind, 0);
        assert!(m.contains("unknown message kind 9"), "{m}");
        let mut header_len = good.clone();
        header_len[8] = 80;
        let m = refused(&header_len, 0);
        assert!(m.contains("header length 80"), "{m}");
        let mut flags = good.clone();
        flags[11] = 0x80;
        let m = refused(&flags, 0);
        assert!(m.contains("unknown flags 0x8000"), "{m}");
        let mut reserved = good.clone();
        reserved[63] = 1;
        let m = refused(&reserved, 0);
        assert!(m.contains("reserved"), "{m}");
    }

    #[test]
    fn counts_are_checked_against_limits_length_and_fds_before_allocation() {
        let mut huge = cuda(&[4096], 4096).encode().unwrap();
        huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        let m = refused(&huge, 1);
        assert!(
            m.contains("4294967295 chunks") && m.contains("at most 253"),
            "{m}"
        );
        let mut payload = Frame::with_payload(Kind::Data, b"abc").encode().unwrap();
        payload[20..24].copy_from_slice(&1_000_000u32.to_le_bytes());
        let m = refused(&payload, 0);
        assert!(m.contains("1000000 payload bytes"), "{m}");
        let two = cuda(&[4096, 4096], 8192).encode().unwrap();
        let m = refused(&two[..two.len() - 8], 2);
        assert!(
            m.contains("announces 2 chunk size(s)") && m.contains("80 bytes"),
            "{m}"
        );
        let m = refused(&two, 1);
        assert!(
            m.contains("2 chunk(s) arrived with 1 fd(s)") && m.contains("one fd per chunk"),
            "{m}"
        );
        let m = refused(&two, 3);
        assert!(m.contains("arrived with 3 fd(s)"), "{m}");
        let data = Frame::with_payload(Kind::Data, b"abc").encode().unwrap();
        let m = refused(&data, 1);
        assert!(
            m.contains("DATA message with 0 chunk(s) arrived with 1 fd(s)"),
            "{m}"
        );
    }

    #[test]
    fn descriptor_rules_are_import_rules() {
        let m = refused(&cuda(&[4096, 0], 1).encode().unwrap(), 2);
        assert!(m.contains("chunk 2 of 2 has size 0"), "{m}");
        let m = refused(&cuda(&[u64::MAX, u64::MAX], 1).encode().unwrap(), 2);
        assert!(m.contains("overflows") || m.contains("usize"), "{m}");
        let m = refused(&cuda(&[4096], 4097).encode().unwrap(), 1);
        assert!(m.contains("size 4097 exceeds the 4096 bytes"), "{m}");
        let fabric = Frame {
            handle_type: 8,
            ..cuda(&[4096], 4096)
        };
        let m = refused(&fabric.encode().unwrap(), 1);
        assert!(m.contains("handle type 8 is not carried"), "{m}");
        let host = |size: u64, chunks: &[u64]| Frame {
            size,
            chunk_sizes: chunks.to_vec(),
            ..Frame::empty(Kind::Host)
        };
        let m = refused(&host(10, &[]).encode().unwrap(), 0);
        assert!(m.contains("size 10 with no fd"), "{m}");
        let m = refused(&host(10, &[20]).encode().unwrap(), 1);
        assert!(m.contains("size 20 but the buffer's size is 10"), "{m}");
        let m = refused(&host(10, &[10, 10]).encode().unwrap(), 2);
        assert!(m.contains("at most 1"), "{m}");
        let host_with_device = Frame {
            device: Some((0, [1; 16])),
            ..host(10, &[10])
        };
        let m = refused(&host_with_device.encode().unwrap(), 1);
        assert!(m.contains("must be zero for a memfd"), "{m}");
    }

    #[test]
    fn unused_fields_must_be_zero() {
        let mut hello = Frame::empty(Kind::Hello).encode().unwrap();
        hello[24] = 1; // size
        let m = refused(&hello, 0);
        assert!(m.contains("HELLO") && m.contains("zero"), "{m}");
        let mut uuid_no_flag = cuda(&[4096], 4096).encode().unwrap();
        uuid_no_flag[40] = 1;
        let m = refused(&uuid_no_flag, 1);
        assert!(m.contains("device flag"), "{m}");
        let mut location = cuda(&[4096], 4096).encode().unwrap();
        location[52] = 7;
        let m = refused(&location, 1);
        assert!(m.contains("unknown location type 7"), "{m}");
        let negative = Frame {
            location: FrameLocation::HostNuma(-1),
            ..cuda(&[4096], 4096)
        };
        let m = refused(&negative.encode().unwrap(), 1);
        assert!(m.contains("host NUMA node -1"), "{m}");
    }

    #[test]
    fn encode_refuses_what_decode_would() {
        let too_many = cuda(&vec![4096; MAX_CHUNKS + 1], 0);
        assert!(matches!(too_many.encode(), Err(Error::InvalidArgument(_))));
        let too_long = Frame::with_payload(Kind::Data, &vec![0; MAX_DATA + 1]);
        assert!(matches!(too_long.encode(), Err(Error::InvalidArgument(_))));
    }
}
