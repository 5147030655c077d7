//! Rules 1 to 4 of docs/protocol.md ("Limits and checks on receipt"), on a header's bytes: the
//! magic, the version and the kind's version, the header's length, flags and reserved field,
//! the counts against their maxima and against the fds the kernel delivered, the device and
//! location fields. Nothing here allocates: a header that passes says exactly how long its
//! message is.

use super::{
    FLAG_DEVICE, FrameLocation, HEADER_LEN, Kind, MAGIC, MAX_CHUNKS, MAX_DATA, PROTOCOL_VERSION,
    VERSIONS_SPOKEN,
};
use crate::error::ProtocolRule;
use crate::{Error, Result};

/// `Err(Error::Protocol { rule, message: "peer message: {why}" })`.
pub(super) fn refuse<T>(rule: ProtocolRule, why: String) -> Result<T> {
    Err(Error::protocol(rule, format!("peer message: {why}")))
}

/// What a header's fields say, after rules 1 and 2 and the counts of rule 3 of
/// docs/protocol.md ("Limits and checks on receipt").
pub(super) struct RawHeader {
    pub(super) kind: Kind,
    pub(super) flags: u16,
    pub(super) handle_type: u32,
    pub(super) chunk_count: usize,
    pub(super) payload_len: usize,
    pub(super) size: u64,
    pub(super) uuid: [u8; 16],
    pub(super) ordinal: u32,
    pub(super) location_type: u32,
    pub(super) location_id: i32,
}

/// A header whose fields passed rule 4 too (device fields only with the flag, a known
/// location), with its counts.
pub(super) struct Header {
    pub(super) kind: Kind,
    pub(super) handle_type: u32,
    pub(super) size: u64,
    pub(super) device: Option<(u32, [u8; 16])>,
    pub(super) location: FrameLocation,
    pub(super) chunk_count: usize,
    pub(super) payload_len: usize,
}

/// The refusal of bytes that do not start with the whole magic (a wrong byte of it, or too
/// few bytes to hold it), naming the bytes there are of it.
fn no_magic<T>(bytes: &[u8]) -> Result<T> {
    let len = bytes.len();
    let start = &bytes[..len.min(MAGIC.len())];
    refuse(
        ProtocolRule::Magic,
        format!(
            "it does not start with the magic \"VMMI\" (got {start:02x?}, {len} bytes): not a \
             vmm-ipc peer message"
        ),
    )
}

impl RawHeader {
    /// Rules 1 and 2 on as many of a header's first bytes as there are: the magic (on the
    /// bytes there are of it), then the version (once its 2 bytes are there), then the kind
    /// and its version (once those are). A refusal the bytes already decide is made at once,
    /// so a stream reader refuses an unknown version without waiting for the rest of the
    /// header. `Ok(None)` while the kind is not there yet.
    pub(super) fn check_prefix(bytes: &[u8]) -> Result<Option<Kind>> {
        let len = bytes.len();
        let magic = len.min(MAGIC.len());
        if bytes[..magic] != MAGIC[..magic] {
            return no_magic(bytes);
        }
        if len < 6 {
            return Ok(None);
        }
        let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let version = u16_at(4);
        if !(1..=PROTOCOL_VERSION).contains(&version) {
            return refuse(
                ProtocolRule::Version,
                format!(
                    "protocol version {version} is not supported: this peer speaks \
                 {VERSIONS_SPOKEN}"
                ),
            );
        }
        if len < 8 {
            return Ok(None);
        }
        let raw_kind = u16_at(6);
        let Some(kind) = Kind::from_raw(raw_kind) else {
            return refuse(
                ProtocolRule::UnknownKind,
                format!(
                    "unknown message kind {raw_kind} (version {version} message; {VERSIONS_SPOKEN} \
                 know 1 HELLO, 2 REFUSED, 3 DATA, 4 CUDA_VMM, 5 HOST_MEMFD and, in version 2, \
                 6 CUDA_FABRIC)"
                ),
            );
        };
        if version != kind.version() {
            return refuse(
                ProtocolRule::Version,
                format!(
                    "{} is a version {} kind, but the message is marked version {version}: a \
                 message carries the version that defines its kind",
                    kind.name(),
                    kind.version()
                ),
            );
        }
        Ok(Some(kind))
    }

    /// Rules 1, 2 and the counts of rule 3, on the first bytes of a message (`bytes` may be a
    /// whole message, or fewer bytes than a header: then the magic, the version and the kind
    /// are checked first ([`check_prefix`](Self::check_prefix)), so an unknown version is
    /// named even in a short message).
    pub(super) fn parse(bytes: &[u8]) -> Result<RawHeader> {
        let len = bytes.len();
        let kind = RawHeader::check_prefix(bytes)?;
        if len < MAGIC.len() {
            return no_magic(bytes);
        }
        if len < 6 {
            return refuse(
                ProtocolRule::Truncated,
                format!(
                    "{len} bytes end inside the header's version field (the header has {HEADER_LEN})"
                ),
            );
        }
        let (Some(kind), true) = (kind, len >= HEADER_LEN) else {
            return refuse(
                ProtocolRule::Truncated,
                format!(
                    "{len} bytes: shorter than the {HEADER_LEN}-byte header (a partial header)"
                ),
            );
        };
        let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let u64_at = |at: usize| u64::from(u32_at(at)) | u64::from(u32_at(at + 4)) << 32;
        let version = u16_at(4);
        let header_len = u16_at(8);
        if usize::from(header_len) != HEADER_LEN {
            return refuse(
                ProtocolRule::HeaderLength,
                format!(
                    "header length {header_len}: version {version} headers are {HEADER_LEN} bytes"
                ),
            );
        }
        let flags = u16_at(10);
        if flags & !FLAG_DEVICE != 0 {
            return refuse(
                ProtocolRule::Flags,
                format!("unknown flags {flags:#06x} (only 0x0001 is defined)"),
            );
        }
        let reserved = u32_at(60);
        if reserved != 0 {
            return refuse(
                ProtocolRule::Reserved,
                format!("reserved header field is {reserved:#x}, not 0"),
            );
        }
        let chunk_count = u32_at(16) as usize;
        let payload_len = u32_at(20) as usize;
        if chunk_count > MAX_CHUNKS {
            return refuse(
                ProtocolRule::TooLarge,
                format!(
                    "{chunk_count} chunks: at most {MAX_CHUNKS} (one fd each) may travel in one message"
                ),
            );
        }
        if payload_len > MAX_DATA {
            return refuse(
                ProtocolRule::TooLarge,
                format!(
                    "{payload_len} payload bytes: at most {MAX_DATA} may travel in one message"
                ),
            );
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

    /// The message's length: header, chunk sizes, payload (bounded by [`MAX_FRAME`](super::MAX_FRAME)).
    pub(super) fn message_len(&self) -> usize {
        HEADER_LEN + 8 * self.chunk_count + self.payload_len
    }

    /// The second half of rule 3: the kernel delivered exactly the fds the kind carries (one
    /// per chunk for `CUDA_VMM` and `HOST_MEMFD`, none for the others).
    pub(super) fn check_fds(&self, fd_count: usize) -> Result<()> {
        let (expected, rule) = if self.kind.carries_fds() {
            (
                self.chunk_count,
                "a message carries exactly one fd per chunk".to_owned(),
            )
        } else {
            (0, format!("a {} message carries no fds", self.kind.name()))
        };
        if fd_count != expected {
            return refuse(
                ProtocolRule::Fds,
                format!(
                    "{} message with {} chunk(s) arrived with {fd_count} fd(s): {rule}",
                    self.kind.name(),
                    self.chunk_count
                ),
            );
        }
        Ok(())
    }

    /// Rule 4: device fields only with the flag; a known location.
    pub(super) fn resolve(self) -> Result<Header> {
        let device_named = self.flags & FLAG_DEVICE != 0;
        if !device_named && (self.ordinal != 0 || self.uuid != [0; 16]) {
            return refuse(
                ProtocolRule::Reserved,
                "device fields are set but the device flag (0x0001) is not: fields a message \
                 does not use must be zero"
                    .into(),
            );
        }
        let location = match (self.location_type, self.location_id) {
            (0, 0) => FrameLocation::Device,
            (0, id) => {
                return refuse(
                    ProtocolRule::Reserved,
                    format!("location type 0 (device) with location id {id}: the id must be 0"),
                );
            }
            (1, node) if node >= 0 => FrameLocation::HostNuma(node),
            (1, node) => {
                return refuse(
                    ProtocolRule::Descriptor,
                    format!("host NUMA node {node} is negative"),
                );
            }
            (other, _) => {
                return refuse(
                    ProtocolRule::Descriptor,
                    format!("unknown location type {other} (0 device, 1 host NUMA node)"),
                );
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
