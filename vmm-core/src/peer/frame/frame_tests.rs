use super::*;
use crate::error::ProtocolRule;

fn cuda(sizes: &[u64], size: u64) -> Frame {
    Frame {
        handle_type: 1,
        size,
        chunk_sizes: sizes.to_vec(),
        ..Frame::empty(Kind::Cuda)
    }
}

/// The message of `bytes`' refusal, which must be by `rule`.
fn refused(bytes: &[u8], fds: usize, rule: ProtocolRule) -> String {
    match Frame::decode(bytes, fds) {
        Err(Error::Protocol { rule: got, message }) => {
            assert_eq!(got, rule, "{message}");
            message
        }
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
    let m = refused(&fabric_v1, 0, ProtocolRule::Version);
    assert!(
        m.contains("CUDA_FABRIC is a version 2 kind, but the message is marked version 1"),
        "{m}"
    );
    let mut hello_v2 = Frame::empty(Kind::Hello).encode().unwrap();
    hello_v2[4] = 2;
    let m = refused(&hello_v2, 0, ProtocolRule::Version);
    assert!(
        m.contains("HELLO is a version 1 kind, but the message is marked version 2"),
        "{m}"
    );
    for kind in [1u8, 2, 3, 4, 5] {
        let mut b = v1_messages()[0].encode().unwrap();
        b[6] = kind;
        b[4] = 2;
        assert!(refused(&b, 0, ProtocolRule::Version).contains("is a version 1 kind"));
    }
    let mut unknown = Frame::empty(Kind::Data).encode().unwrap();
    unknown[4] = 2;
    unknown[6] = 7;
    let m = refused(&unknown, 0, ProtocolRule::UnknownKind);
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
    let cases: Vec<(Vec<u8>, usize, &str, ProtocolRule)> = vec![
        (
            with(&|f| f.handle_type = 1),
            0,
            "handle type 1 is not carried by CUDA_FABRIC",
            ProtocolRule::Descriptor,
        ),
        (
            with(&|f| f.handle_type = 9),
            0,
            "handle type 9 is not carried by CUDA_FABRIC",
            ProtocolRule::Descriptor,
        ),
        (
            with(&|f| f.device = None),
            0,
            "device flag (0x0001) is not set",
            ProtocolRule::Descriptor,
        ),
        (
            with(&|f| {
                f.chunk_sizes.clear();
                f.payload.clear();
                f.size = 0;
            }),
            0,
            "0 chunks: a CUDA_FABRIC message carries at least one",
            ProtocolRule::Counts,
        ),
        (
            with(&|f| f.payload.truncate(100)),
            0,
            "100 payload bytes for 2 chunk(s)",
            ProtocolRule::Counts,
        ),
        (
            with(&|f| f.payload.push(0)),
            0,
            "129 payload bytes for 2 chunk(s)",
            ProtocolRule::Counts,
        ),
        (
            with(&|_| {}),
            2,
            "CUDA_FABRIC message with 2 chunk(s) arrived with 2 fd(s): a CUDA_FABRIC \
             message carries no fds",
            ProtocolRule::Fds,
        ),
        (
            with(&|f| f.chunk_sizes[1] = 0),
            0,
            "invalid CUDA_FABRIC: chunk 2 of 2 has size 0",
            ProtocolRule::Descriptor,
        ),
        (
            with(&|f| f.chunk_sizes = vec![u64::MAX, 2]),
            0,
            "invalid CUDA_FABRIC: chunk 2 of 2: the sum of chunk sizes overflows",
            ProtocolRule::Descriptor,
        ),
        (
            with(&|f| f.size = 2 * g + 1),
            0,
            "exceeds the 4194304 bytes that its 2 chunk(s) hold",
            ProtocolRule::Descriptor,
        ),
        (
            with(&|f| f.location = FrameLocation::HostNuma(-3)),
            0,
            "host NUMA node -3 is negative",
            ProtocolRule::Descriptor,
        ),
    ];
    for (bytes, fds, words, rule) in cases {
        let m = refused(&bytes, fds, rule);
        assert!(m.contains(words), "{words:?} not in {m}");
    }
    // A header that claims the most of everything is refused from its counts.
    let mut claims = fabric(&[g], g).encode().unwrap();
    claims[16..20].copy_from_slice(&253u32.to_le_bytes());
    claims[20..24].copy_from_slice(&16384u32.to_le_bytes());
    let m = refused(&claims, 0, ProtocolRule::Truncated);
    assert!(m.contains("announces 253 chunk size(s)"), "{m}");
    let m = match Frame::check_stream_header(&claims[..64]) {
        Err(Error::Protocol {
            rule: ProtocolRule::Counts,
            message,
        }) => message,
        other => panic!("{other:?}"),
    };
    assert!(m.contains("16384 payload bytes for 253 chunk(s)"), "{m}");
}

#[test]
fn a_stream_header_is_checked_alone_and_refuses_fd_and_handshake_kinds() {
    let stream_refused = |bytes: &[u8], rule: ProtocolRule| match Frame::check_stream_header(bytes)
    {
        Err(Error::Protocol { rule: got, message }) => {
            assert_eq!(got, rule, "{message}");
            message
        }
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
        let m = stream_refused(&frame.encode().unwrap()[..64], ProtocolRule::UnexpectedKind);
        assert!(m.contains(words), "{words:?} not in {m}");
    }
    let m = stream_refused(&data[..30], ProtocolRule::Truncated);
    assert!(
        m.contains("30 bytes: shorter than the 64-byte header"),
        "{m}"
    );
    let m = stream_refused(
        &[b"VMMI".as_slice(), &[3, 0]].concat(),
        ProtocolRule::Version,
    );
    assert!(m.contains("protocol version 3 is not supported"), "{m}");
    let m = stream_refused(b"GET / HT", ProtocolRule::Magic);
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
    let m = refused(&bad, 0, ProtocolRule::Descriptor);
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
    let m = refused(&[], 0, ProtocolRule::Magic);
    assert!(m.contains("magic") && m.contains("0 bytes"), "{m}");
    let m = refused(b"hello world, not ours", 0, ProtocolRule::Magic);
    assert!(m.contains("not a vmm-ipc peer message"), "{m}");
    let m = refused(&good[..5], 0, ProtocolRule::Truncated);
    assert!(m.contains("5 bytes end inside"), "{m}");
    let m = refused(&good[..40], 0, ProtocolRule::Truncated);
    assert!(
        m.contains("40 bytes") && m.contains("partial header"),
        "{m}"
    );
    let mut v3 = good.clone();
    v3[4] = 3;
    let m = refused(&v3, 0, ProtocolRule::Version);
    assert!(
        m.contains("protocol version 3 is not supported: this peer speaks versions 1 and 2"),
        "{m}"
    );
    // A future version is refused even when it is shorter than a v1 header.
    let m = refused(&v3[..10], 0, ProtocolRule::Version);
    assert!(m.contains("protocol version 3"), "{m}");
    let m = refused(
        &[b"VMMI".as_slice(), &[0, 0]].concat(),
        0,
        ProtocolRule::Version,
    );
    assert!(m.contains("protocol version 0 is not supported"), "{m}");
    let mut kind = good.clone();
    kind[6] = 9;
    let m = refused(&kind, 0, ProtocolRule::UnknownKind);
    assert!(m.contains("unknown message kind 9"), "{m}");
    let mut header_len = good.clone();
    header_len[8] = 80;
    let m = refused(&header_len, 0, ProtocolRule::HeaderLength);
    assert!(m.contains("header length 80"), "{m}");
    let mut flags = good.clone();
    flags[11] = 0x80;
    let m = refused(&flags, 0, ProtocolRule::Flags);
    assert!(m.contains("unknown flags 0x8000"), "{m}");
    let mut reserved = good.clone();
    reserved[63] = 1;
    let m = refused(&reserved, 0, ProtocolRule::Reserved);
    assert!(m.contains("reserved"), "{m}");
}

#[test]
fn counts_are_checked_against_limits_length_and_fds_before_allocation() {
    let mut huge = cuda(&[4096], 4096).encode().unwrap();
    huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    let m = refused(&huge, 1, ProtocolRule::TooLarge);
    assert!(
        m.contains("4294967295 chunks") && m.contains("at most 253"),
        "{m}"
    );
    let mut payload = Frame::with_payload(Kind::Data, b"abc").encode().unwrap();
    payload[20..24].copy_from_slice(&1_000_000u32.to_le_bytes());
    let m = refused(&payload, 0, ProtocolRule::TooLarge);
    assert!(m.contains("1000000 payload bytes"), "{m}");
    let two = cuda(&[4096, 4096], 8192).encode().unwrap();
    let m = refused(&two[..two.len() - 8], 2, ProtocolRule::Truncated);
    assert!(
        m.contains("announces 2 chunk size(s)") && m.contains("80 bytes"),
        "{m}"
    );
    let m = refused(&two, 1, ProtocolRule::Fds);
    assert!(
        m.contains("2 chunk(s) arrived with 1 fd(s)") && m.contains("one fd per chunk"),
        "{m}"
    );
    let m = refused(&two, 3, ProtocolRule::Fds);
    assert!(m.contains("arrived with 3 fd(s)"), "{m}");
    let data = Frame::with_payload(Kind::Data, b"abc").encode().unwrap();
    let m = refused(&data, 1, ProtocolRule::Fds);
    assert!(
        m.contains("DATA message with 0 chunk(s) arrived with 1 fd(s)"),
        "{m}"
    );
}

#[test]
fn descriptor_rules_are_import_rules() {
    let m = refused(
        &cuda(&[4096, 0], 1).encode().unwrap(),
        2,
        ProtocolRule::Descriptor,
    );
    assert!(m.contains("chunk 2 of 2 has size 0"), "{m}");
    let m = refused(
        &cuda(&[u64::MAX, u64::MAX], 1).encode().unwrap(),
        2,
        ProtocolRule::Descriptor,
    );
    assert!(m.contains("overflows") || m.contains("usize"), "{m}");
    let m = refused(
        &cuda(&[4096], 4097).encode().unwrap(),
        1,
        ProtocolRule::Descriptor,
    );
    assert!(m.contains("size 4097 exceeds the 4096 bytes"), "{m}");
    let fabric = Frame {
        handle_type: 8,
        ..cuda(&[4096], 4096)
    };
    let m = refused(&fabric.encode().unwrap(), 1, ProtocolRule::Descriptor);
    assert!(m.contains("handle type 8 is not carried"), "{m}");
    let host = |size: u64, chunks: &[u64]| Frame {
        size,
        chunk_sizes: chunks.to_vec(),
        ..Frame::empty(Kind::Host)
    };
    let m = refused(&host(10, &[]).encode().unwrap(), 0, ProtocolRule::Counts);
    assert!(m.contains("size 10 with no fd"), "{m}");
    let m = refused(
        &host(10, &[20]).encode().unwrap(),
        1,
        ProtocolRule::Descriptor,
    );
    assert!(m.contains("size 20 but the buffer's size is 10"), "{m}");
    let m = refused(
        &host(10, &[10, 10]).encode().unwrap(),
        2,
        ProtocolRule::Counts,
    );
    assert!(m.contains("at most 1"), "{m}");
    let host_with_device = Frame {
        device: Some((0, [1; 16])),
        ..host(10, &[10])
    };
    let m = refused(
        &host_with_device.encode().unwrap(),
        1,
        ProtocolRule::Reserved,
    );
    assert!(m.contains("must be zero for a memfd"), "{m}");
}

#[test]
fn unused_fields_must_be_zero() {
    let mut hello = Frame::empty(Kind::Hello).encode().unwrap();
    hello[24] = 1; // size
    let m = refused(&hello, 0, ProtocolRule::Reserved);
    assert!(m.contains("HELLO") && m.contains("zero"), "{m}");
    let mut uuid_no_flag = cuda(&[4096], 4096).encode().unwrap();
    uuid_no_flag[40] = 1;
    let m = refused(&uuid_no_flag, 1, ProtocolRule::Reserved);
    assert!(m.contains("device flag"), "{m}");
    let mut location = cuda(&[4096], 4096).encode().unwrap();
    location[52] = 7;
    let m = refused(&location, 1, ProtocolRule::Descriptor);
    assert!(m.contains("unknown location type 7"), "{m}");
    let negative = Frame {
        location: FrameLocation::HostNuma(-1),
        ..cuda(&[4096], 4096)
    };
    let m = refused(&negative.encode().unwrap(), 1, ProtocolRule::Descriptor);
    assert!(m.contains("host NUMA node -1"), "{m}");
}

#[test]
fn encode_refuses_what_decode_would() {
    let too_many = cuda(&vec![4096; MAX_CHUNKS + 1], 0);
    assert!(matches!(too_many.encode(), Err(Error::TooLarge { .. })));
    let too_long = Frame::with_payload(Kind::Data, &vec![0; MAX_DATA + 1]);
    assert!(matches!(too_long.encode(), Err(Error::TooLarge { .. })));
}
