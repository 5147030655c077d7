//! The peer protocol's message (version 1): a fixed 64-byte little-endian header, the chunk
//! sizes, a payload; the fds ride in the packet's `SCM_RIGHTS`. `docs/protocol.md` is the
//! specification; this is its one Rust codec, and it knows nothing of CUDA or memfds: the
//! descriptor kinds are checked here only as far as numbers go, and
//! [`peer`](crate::peer) turns them into descriptors.
//!
//! Every number in a header is the peer's choice. [`Frame::decode`] checks each one against the
//! documented maximum and against what the kernel said (the message's length, its fd count)
//! before it allocates anything; fields a kind does not use must be zero.

use crate::{Error, Result};

/// The first four bytes of every message: `VMMI`.
pub(crate) const MAGIC: [u8; 4] = *b"VMMI";

/// The protocol version this crate speaks (and the only one it accepts).
pub const PROTOCOL_VERSION: u16 = 1;

/// The header's length in bytes (version 1).
pub(crate) const HEADER_LEN: usize = 64;

/// The most chunks (and so fds) one descriptor message may carry: the kernel's `SCM_MAX_FD`.
pub const MAX_CHUNKS: usize = super::super::MAX_FDS;

/// The most payload bytes one message may carry (a `DATA` message's bytes, a `REFUSED`
/// message's reason).
pub const MAX_DATA: usize = 16 * 1024;

/// The longest message of docs/protocol.md (without the packet's frame byte): a header, the
/// most chunk sizes and the most payload. A receiver reads at most this plus the frame byte.
pub(crate) const MAX_FRAME: usize = HEADER_LEN + 8 * MAX_CHUNKS + MAX_DATA;

/// Header flag: the device UUID and ordinal fields are set (CUDA descriptors only).
pub(crate) const FLAG_DEVICE: u16 = 1;

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
}

impl Kind {
    fn from_raw(raw: u16) -> Option<Kind> {
        Some(match raw {
            1 => Kind::Hello,
            2 => Kind::Refused,
            3 => Kind::Data,
            4 => Kind::Cuda,
            5 => Kind::Host,
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
        }
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
/// count is, and it must equal the fds the kernel delivered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Frame {
    pub kind: Kind,
    /// The driver's `CUmemAllocationHandleType` (1, POSIX fd) for CUDA; 0 otherwise.
    pub handle_type: u32,
    pub size: u64,
    /// `(ordinal, uuid)` of the exporting device, when the exporter named it.
    pub device: Option<(u32, [u8; 16])>,
    pub location: FrameLocation,
    pub chunk_sizes: Vec<u64>,
    pub payload: Vec<u8>,
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

    /// The message's bytes (what follows the packet's frame byte).
    ///
    /// Refuses a message that breaks the limits it would be refused for on arrival.
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        if self.chunk_sizes.len() > MAX_CHUNKS {
            return Err(Error::InvalidArgument(format!(
                "a peer message carries at most {MAX_CHUNKS} chunks (one fd each), this one has {}",
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
        out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
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
    /// check out. Errors are [`Error::Protocol`], naming the rule and the numbers.
    pub(crate) fn decode(bytes: &[u8], fd_count: usize) -> Result<Frame> {
        let refuse = |why: String| Err(Error::Protocol(format!("peer message: {why}")));
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
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4"));
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        let version = u16_at(4);
        if version != PROTOCOL_VERSION {
            return refuse(format!(
                "protocol version {version} is not supported: this peer speaks version \
                 {PROTOCOL_VERSION} only"
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
                "unknown message kind {raw_kind} (version {PROTOCOL_VERSION} knows 1 HELLO, 2 \
                 REFUSED, 3 DATA, 4 CUDA_VMM, 5 HOST_MEMFD)"
            ));
        };
        let header_len = u16_at(8);
        if usize::from(header_len) != HEADER_LEN {
            return refuse(format!(
                "header length {header_len}: version {PROTOCOL_VERSION} headers are \
                 {HEADER_LEN} bytes"
            ));
        }
        let flags = u16_at(10);
        if flags & !FLAG_DEVICE != 0 {
            return refuse(format!(
                "unknown flags {flags:#06x} (only 0x0001 is defined)"
            ));
        }
        let handle_type = u32_at(12);
        let chunk_count = u32_at(16) as usize;
        let payload_len = u32_at(20) as usize;
        let size = u64_at(24);
        let uuid: [u8; 16] = bytes[32..48].try_into().expect("16");
        let ordinal = u32_at(48);
        let location_type = u32_at(52);
        let location_id = u32_at(56) as i32;
        let reserved = u32_at(60);
        if reserved != 0 {
            return refuse(format!("reserved header field is {reserved:#x}, not 0"));
        }
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
        let expected = HEADER_LEN + 8 * chunk_count + payload_len;
        if len != expected {
            return refuse(format!(
                "its header announces {chunk_count} chunk size(s) and {payload_len} payload \
                 bytes ({expected} bytes in all), but the message has {len} bytes"
            ));
        }
        if fd_count != chunk_count {
            return refuse(format!(
                "{} message with {chunk_count} chunk(s) arrived with {fd_count} fd(s): a message \
                 carries exactly one fd per chunk",
                kind.name()
            ));
        }
        let device_named = flags & FLAG_DEVICE != 0;
        if !device_named && (ordinal != 0 || uuid != [0; 16]) {
            return refuse(
                "device fields are set but the device flag (0x0001) is not: fields a message \
                 does not use must be zero"
                    .into(),
            );
        }
        let location = match (location_type, location_id) {
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
        let chunk_sizes: Vec<u64> = (0..chunk_count)
            .map(|i| u64_at(HEADER_LEN + 8 * i))
            .collect();
        let payload = bytes[HEADER_LEN + 8 * chunk_count..].to_vec();
        let frame = Frame {
            kind,
            handle_type,
            size,
            device: device_named.then_some((ordinal, uuid)),
            location,
            chunk_sizes,
            payload,
        };
        frame.check_kind()?;
        Ok(frame)
    }

    /// The rules of each kind: which fields it uses (the others must be zero) and how its
    /// numbers relate.
    fn check_kind(&self) -> Result<()> {
        let name = self.kind.name();
        let refuse = |why: String| Err(Error::Protocol(format!("peer message: {name}: {why}")));
        let count = self.chunk_sizes.len();
        let unused_descriptor_fields = |f: &Frame| {
            f.handle_type != 0
                || f.size != 0
                || f.device.is_some()
                || f.location != FrameLocation::Device
                || !f.chunk_sizes.is_empty()
        };
        match self.kind {
            Kind::Hello => {
                if unused_descriptor_fields(self) || !self.payload.is_empty() {
                    return refuse("every field after the header's length must be zero".into());
                }
            }
            Kind::Refused | Kind::Data => {
                if unused_descriptor_fields(self) {
                    return refuse(
                        "carries descriptor fields or fds; only a payload is allowed".into(),
                    );
                }
            }
            Kind::Cuda => {
                if !self.payload.is_empty() {
                    return refuse(format!(
                        "{} payload bytes: a descriptor has none",
                        self.payload.len()
                    ));
                }
                if self.handle_type != 1 {
                    return refuse(format!(
                        "handle type {} is not carried by protocol version {PROTOCOL_VERSION}: \
                         only 1 (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) is",
                        self.handle_type
                    ));
                }
                let mut total = 0u64;
                for (index, &chunk) in self.chunk_sizes.iter().enumerate() {
                    let which = format!("chunk {} of {count}", index + 1);
                    if chunk == 0 {
                        return refuse(format!("{which} has size 0: chunks are never empty"));
                    }
                    if usize::try_from(chunk).is_err() {
                        return refuse(format!(
                            "{which} has size {chunk}, more than this platform's usize"
                        ));
                    }
                    total = match total.checked_add(chunk) {
                        Some(total) if usize::try_from(total).is_ok() => total,
                        _ => return refuse(format!("{which}: the sum of chunk sizes overflows")),
                    };
                }
                if self.size > total {
                    return refuse(format!(
                        "size {} exceeds the {total} bytes that its {count} chunk(s) hold",
                        self.size
                    ));
                }
            }
            Kind::Host => {
                if !self.payload.is_empty() {
                    return refuse(format!(
                        "{} payload bytes: a descriptor has none",
                        self.payload.len()
                    ));
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
                match (count, self.chunk_sizes.first()) {
                    (0, _) if self.size == 0 => {}
                    (0, _) => {
                        return refuse(format!(
                            "size {} with no fd: only an empty buffer has none",
                            self.size
                        ));
                    }
                    (1, Some(&chunk)) if chunk == self.size && chunk != 0 => {}
                    (1, Some(&chunk)) => {
                        return refuse(format!(
                            "its one chunk has size {chunk} but the buffer's size is {}: they \
                             must be equal and non-zero",
                            self.size
                        ));
                    }
                    _ => return refuse(format!("{count} fds: a memfd descriptor has at most 1")),
                }
            }
        }
        Ok(())
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

    #[test]
    fn every_kind_round_trips() {
        let g = 2 << 20;
        let frames = [
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
        ];
        for frame in frames {
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
        let mut v2 = good.clone();
        v2[4] = 2;
        let m = refused(&v2, 0);
        assert!(m.contains("protocol version 2 is not supported"), "{m}");
        // A future version is refused even when it is shorter than a v1 header.
        let m = refused(&v2[..10], 0);
        assert!(m.contains("protocol version 2"), "{m}");
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
