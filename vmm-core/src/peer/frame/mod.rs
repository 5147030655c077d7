//! The peer protocol's message (versions 1 and 2): a fixed 64-byte little-endian header, the
//! chunk sizes, a payload; the fds ride in the packet's `SCM_RIGHTS`. `docs/protocol.md` is the
//! specification; this is its one Rust codec, for packets on a named endpoint and for messages
//! on a byte stream alike.
//!
//! It lives in [`peer`](crate::peer), not in [`wire`](crate::wire): a message's kinds are CUDA
//! and host descriptors, and their rules are the descriptors' own. The handle types are
//! [`HandleType`](crate::cuda::HandleType)'s driver numbers and the chunk layout is checked by the rule every
//! descriptor meets (`cuda::descriptor::validate_chunks`), so the protocol never states a
//! descriptor rule a second time; `wire` moves the packet and knows nothing of what it says.
//!
//! - [`header`]: rules 1 to 4 of docs/protocol.md ("Limits and checks on receipt"), on the
//!   header's bytes alone;
//! - [`kind_rules`]: rule 5, each kind's own rules;
//! - this file: [`Frame`], its encoding, and the order in which a decode applies the rules.
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

mod header;
mod kind_rules;

use std::fmt;

use header::{RawHeader, refuse};

use crate::error::ProtocolRule;
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
pub const MAX_CHUNKS: usize = crate::wire::MAX_FDS;

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

/// [`Error::TooLarge`] unless `count` (of `unit`) is at most `max`: how a sender refuses, before
/// anything is sent, what a receiver would refuse on arrival.
pub(super) fn carries_at_most(what: &str, count: usize, max: usize, unit: &str) -> Result<()> {
    if count <= max {
        return Ok(());
    }
    Err(Error::TooLarge {
        size: count as u64,
        max: max as u64,
        message: format!("{what} carries at most {max} {unit}, this one has {count}"),
    })
}

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
        carries_at_most(
            "a peer message",
            self.chunk_sizes.len(),
            MAX_CHUNKS,
            "chunks",
        )?;
        carries_at_most(
            "a peer message",
            self.payload.len(),
            MAX_DATA,
            "payload bytes",
        )?;
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
            let rule = if len < expected {
                ProtocolRule::Truncated
            } else {
                ProtocolRule::TrailingBytes
            };
            return refuse(
                rule,
                format!(
                    "its header announces {} chunk size(s) and {} payload bytes ({expected} bytes \
                 in all), but the message has {len} bytes",
                    raw.chunk_count, raw.payload_len
                ),
            );
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
        stream_carries(raw.kind)?;
        let body = raw.message_len() - HEADER_LEN;
        let header = raw.resolve()?;
        header.check_kind()?;
        Ok(body)
    }

    /// For a byte stream, as its bytes arrive: refuse at once what the first bytes of a header
    /// already decide (the magic, the version, a kind a stream does not carry), so that a
    /// reader does not wait for the rest of a header it will refuse.
    pub(crate) fn check_stream_prefix(prefix: &[u8]) -> Result<()> {
        match RawHeader::check_prefix(prefix)? {
            Some(kind) => stream_carries(kind),
            None => Ok(()),
        }
    }
}

/// Whether a byte stream carries messages of `kind`: not those with fds, nor the handshake's.
fn stream_carries(kind: Kind) -> Result<()> {
    let name = kind.name();
    if kind.carries_fds() {
        return refuse(
            ProtocolRule::UnexpectedKind,
            format!(
                "{name} on a byte stream: its kind carries fds, which a stream cannot (send it on a \
             named endpoint)"
            ),
        );
    }
    if kind.is_handshake() {
        return refuse(
            ProtocolRule::UnexpectedKind,
            format!(
                "{name} on a byte stream: it belongs to a named endpoint's handshake, and a stream \
             has none"
            ),
        );
    }
    Ok(())
}

#[cfg(test)]
mod frame_tests;
