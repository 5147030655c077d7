//! Peer protocol version 2 on the host path (it runs everywhere, CI included): `CUDA_FABRIC`
//! descriptors over a named endpoint (abstract names) and over byte streams (a TCP loopback
//! connection, a Unix stream), version 1 and version 2 side by side, and hostile version 2
//! messages refused by rule, with typed errors, nothing leaked and no handle byte shown.
//!
//! No GPU is needed: a fabric descriptor is plain data (`FabricDescriptor::from_handles`),
//! and importing one is `fabric_local`'s (GPU) business. The tests count fds, so they run one
//! at a time (`vmm_tests::turns::exclusive()`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use vmm_core::Error;
use vmm_core::cuda::{FabricDescriptor, FabricHandle};
use vmm_core::error::{OptionRule, ProtocolRule};
use vmm_core::peer::stream::{StreamReader, StreamWriter};
use vmm_core::peer::{
    Descriptor, MAX_CHUNKS, PROTOCOL_VERSION, PeerMessage, Session, decode_message,
    encode_descriptor,
};
use vmm_core::shm::HostBuffer;
use vmm_core::testing::settled_open_fds;
use vmm_core::wire::endpoint::{Listener, Name};
use vmm_core::wire::{CallerAuthenticated, TimedStream};

use vmm_tests::endpoint::{data_packet, raw_client, send_raw};
use vmm_tests::turns::exclusive;

const G: usize = 2 << 20;

fn unique(tag: &str) -> Name {
    vmm_tests::unique_name("peer-v2-test", tag)
}

/// A handle whose bytes are easy to spot in any text: `c0 ff ee` and a chunk number, repeated.
fn handle(chunk: u8) -> FabricHandle {
    FabricHandle::from_bytes(std::array::from_fn(|i| match i % 4 {
        0 => 0xc0,
        1 => 0xff,
        2 => 0xee,
        _ => chunk,
    }))
}

fn descriptor(chunks: usize) -> FabricDescriptor {
    let handles: Vec<FabricHandle> = (0..chunks).map(|i| handle(i as u8)).collect();
    let sizes: Vec<usize> = (0..chunks).map(|i| G * (i + 1)).collect();
    let total: usize = sizes.iter().sum();
    FabricDescriptor::from_handles(&handles, &sizes, total - 3, [0x5a; 16]).unwrap()
}

/// What a received descriptor must say: everything the sent one did. (`from_handles` names
/// no ordinal; the message carries 0, which arrives as the exporter's ordinal 0.)
fn assert_same(received: &FabricDescriptor, sent: &FabricDescriptor) {
    assert_eq!(received.handles(), sent.handles());
    assert_eq!(received.chunk_sizes(), sent.chunk_sizes());
    assert_eq!(received.size(), sent.size());
    assert_eq!(received.owner_uuid(), sent.owner_uuid());
    assert_eq!(
        received.owner_ordinal(),
        Some(sent.owner_ordinal().unwrap_or(0))
    );
    assert_eq!(received.location(), sent.location());
}

/// A version 2 `CUDA_FABRIC` message with these header fields and `payload`, framed.
#[allow(clippy::too_many_arguments)]
fn fabric_packet(
    version: u16,
    kind: u16,
    flags: u16,
    handle_type: u32,
    sizes: &[u64],
    payload_len: u32,
    size: u64,
    payload: &[u8],
) -> Vec<u8> {
    let mut b = vec![0u8];
    b.extend_from_slice(b"VMMI");
    for v in [version, kind, 64, flags] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&handle_type.to_le_bytes());
    b.extend_from_slice(&(sizes.len() as u32).to_le_bytes());
    b.extend_from_slice(&payload_len.to_le_bytes());
    b.extend_from_slice(&size.to_le_bytes());
    b.extend_from_slice(&[0x5a; 16]); // uuid
    b.extend_from_slice(&[0; 16]); // ordinal, location, reserved
    for s in sizes {
        b.extend_from_slice(&s.to_le_bytes());
    }
    b.extend_from_slice(payload);
    b
}

/// A coherent `CUDA_FABRIC` packet of `n` chunks of 2 MiB.
fn good_fabric_packet(n: usize) -> Vec<u8> {
    let sizes = vec![G as u64; n];
    let payload = vec![0xabu8; 64 * n];
    fabric_packet(
        2,
        6,
        1,
        8,
        &sizes,
        payload.len() as u32,
        (G * n) as u64,
        &payload,
    )
}

/// The message of a refusal by `rule`, which must contain `words`.
fn protocol_error<T: std::fmt::Debug>(
    result: vmm_core::Result<T>,
    rule: ProtocolRule,
    words: &str,
) -> String {
    match result {
        Err(Error::Protocol { rule: got, message }) => {
            assert_eq!(got, rule, "{words:?}: {message}");
            assert!(message.contains(words), "{words:?} not in {message}");
            message
        }
        other => panic!("{words:?}: wanted Error::Protocol, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Round trips.

#[test]
fn a_fabric_descriptor_crosses_a_named_endpoint_beside_version_1_messages() {
    let _serial = exclusive();
    let name = unique("round-trip");
    let before = settled_open_fds().unwrap();
    {
        let listener = Listener::bind(&name).unwrap();
        let sent = [descriptor(1), descriptor(3)];
        let host = HostBuffer::new(4096).unwrap();
        host.fill(9).unwrap();
        let host_descriptor = host.export().unwrap();
        std::thread::scope(|scope| {
            let server = scope.spawn(|| {
                let conn = Session::accept(&listener, Some(Duration::from_secs(10))).unwrap();
                for d in &sent {
                    conn.send_descriptor(d).unwrap();
                }
                // Version 1 and version 2 messages on one connection, in any order.
                conn.send_descriptor(&host_descriptor).unwrap();
                conn.send_data(b"that is all").unwrap();
                assert_eq!(conn.recv_data().unwrap(), b"imported");
            });
            let client = Session::connect(&name).unwrap();
            for d in &sent {
                let received = client.recv_descriptor().unwrap();
                assert!(received.fds().is_empty(), "a fabric descriptor has no fds");
                assert_eq!(received.size(), d.size());
                assert_same(&received.into_fabric().unwrap(), d);
            }
            let host = client.recv_descriptor().unwrap();
            let m = protocol_error(
                Descriptor::from(descriptor(1)).into_host(),
                ProtocolRule::UnexpectedKind,
                "expected a HOST_MEMFD descriptor, the peer sent a CUDA_FABRIC one",
            );
            assert!(!m.contains("c0"), "{m}");
            let mapped = HostBuffer::import(&host.into_host().unwrap()).unwrap();
            assert_eq!(mapped.to_vec(), vec![9; 4096]);
            assert!(matches!(
                client.recv_message().unwrap(),
                PeerMessage::Data(d) if d == b"that is all"
            ));
            client.send_data(b"imported").unwrap();
            server.join().unwrap();
        });
    }
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "fds after the round trip"
    );
}

#[test]
fn the_codec_carries_a_fabric_descriptor_of_every_allowed_chunk_count() {
    for chunks in [1, 2, MAX_CHUNKS] {
        let d = descriptor(chunks);
        let (bytes, fds) = encode_descriptor(&d).unwrap();
        assert!(fds.is_empty());
        assert_eq!(bytes.len(), 64 + 72 * chunks);
        assert_eq!(bytes[4..6], 2u16.to_le_bytes(), "CUDA_FABRIC is version 2");
        let PeerMessage::Descriptor(back) = decode_message(&bytes, Vec::new()).unwrap() else {
            panic!("not a descriptor");
        };
        assert_same(&back.into_fabric().unwrap(), &d);
    }
    assert_eq!(PROTOCOL_VERSION, 2);
    // What the protocol cannot carry is refused before anything is sent.
    let empty = FabricDescriptor::from_handles(&[], &[], 0, [1; 16]).unwrap();
    let err = encode_descriptor(&empty).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidOption { option, rule: OptionRule::Missing, .. }
            if option == "chunk_sizes"),
        "{err:?}"
    );
    let err = encode_descriptor(&descriptor(MAX_CHUNKS + 1)).unwrap_err();
    assert!(
        matches!(&err, Error::TooLarge { message, .. } if message.contains("at most 253")),
        "{err:?}"
    );
}

/// Both ends of a stream (a pair this test made, so it vouches for both ends): write on one,
/// read on the other, in both directions.
fn stream_round_trip<S: Sync + TimedStream>(a: S, b: S)
where
    for<'s> &'s S: Read + Write,
{
    let sent = [descriptor(1), descriptor(4)];
    std::thread::scope(|scope| {
        let writer = scope.spawn(|| {
            let mut out = StreamWriter::new(CallerAuthenticated::new(&a));
            for d in &sent {
                out.write_descriptor(d).unwrap();
            }
            out.write_data(b"done?").unwrap();
            let mut replies = StreamReader::new(CallerAuthenticated::new(&a));
            match replies.read_message().unwrap() {
                PeerMessage::Data(d) => assert_eq!(d, b"imported"),
                other => panic!("{other:?}"),
            }
        });
        let mut reader = StreamReader::new(CallerAuthenticated::new(&b));
        for d in &sent {
            match reader.read_message().unwrap() {
                PeerMessage::Descriptor(received) => {
                    assert_same(&received.into_fabric().unwrap(), d);
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(reader.read_message().unwrap(), PeerMessage::Data(d) if d == b"done?"));
        StreamWriter::new(CallerAuthenticated::new(&b))
            .write_data(b"imported")
            .unwrap();
        writer.join().unwrap();
    });
}

#[test]
fn a_fabric_descriptor_crosses_tcp_loopback_and_a_unix_stream() {
    let _serial = exclusive();
    let before = settled_open_fds().unwrap();
    {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        for s in [&client, &server] {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        }
        stream_round_trip(client, server);
        let (a, b) = UnixStream::pair().unwrap();
        stream_round_trip(a, b);
    }
    assert_eq!(settled_open_fds().unwrap(), before);
}

#[test]
fn stream_bytes_are_endpoint_bytes() {
    let d = descriptor(2);
    let mut stream = Vec::new();
    let mut writer = StreamWriter::untimed(&mut stream);
    writer.write_descriptor(&d).unwrap();
    writer.write_data(b"x").unwrap();
    let (bytes, _) = encode_descriptor(&d).unwrap();
    let data = data_packet(b"x");
    assert_eq!(stream, [&[0u8][..], &bytes, &data].concat());
    // And a version 1 DATA message written to a stream is the version 1 packet.
    assert_eq!(data[5..7], 1u16.to_le_bytes());
}

// ---------------------------------------------------------------------------------------------
// Hostile version 2 messages.

#[test]
fn hostile_version_2_messages_on_an_endpoint_are_refused_by_rule_and_nothing_leaks() {
    let _serial = exclusive();
    let name = unique("hostile");
    let listener = Listener::bind(&name).unwrap();
    let warm = raw_client(&name);
    let conn = Session::accept(&listener, Some(Duration::from_secs(5))).unwrap();
    drop((conn, warm));
    let before = settled_open_fds().unwrap();
    let client = raw_client(&name);
    let conn = Session::accept(&listener, Some(Duration::from_secs(5))).unwrap();
    let sizes = [G as u64, G as u64];
    let handles = vec![0xabu8; 128];
    let fabric = |version, flags, handle_type, sizes: &[u64], payload: &[u8]| {
        fabric_packet(
            version,
            6,
            flags,
            handle_type,
            sizes,
            payload.len() as u32,
            sizes.iter().sum(),
            payload,
        )
    };
    let mut hello_v2 = data_packet(b"");
    hello_v2[5] = 2; // version
    hello_v2[7] = 1; // kind HELLO
    let mut v3 = good_fabric_packet(1);
    v3[5] = 3;
    let cases: Vec<(Vec<u8>, usize, &str, ProtocolRule)> = vec![
        (
            fabric(1, 1, 8, &sizes, &handles),
            0,
            "CUDA_FABRIC is a version 2 kind, but the message is marked version 1",
            ProtocolRule::Version,
        ),
        (
            hello_v2,
            0,
            "HELLO is a version 1 kind, but the message is marked version 2",
            ProtocolRule::Version,
        ),
        (
            v3,
            0,
            "protocol version 3 is not supported: this peer speaks versions 1 and 2",
            ProtocolRule::Version,
        ),
        (
            fabric(2, 1, 1, &sizes, &handles),
            0,
            "handle type 1 is not carried by CUDA_FABRIC",
            ProtocolRule::Descriptor,
        ),
        (
            fabric(2, 1, 8, &sizes, &handles[..127]),
            0,
            "127 payload bytes for 2 chunk(s)",
            ProtocolRule::Counts,
        ),
        (
            fabric(2, 1, 8, &[], &[]),
            0,
            "0 chunks: a CUDA_FABRIC message carries at least one",
            ProtocolRule::Counts,
        ),
        (
            {
                let mut b = fabric(2, 0, 8, &sizes, &handles);
                b[33..49].fill(0); // no owner named, consistently
                b
            },
            0,
            "the device flag (0x0001) is not set",
            ProtocolRule::Descriptor,
        ),
        (
            fabric(2, 1, 8, &sizes, &handles),
            2,
            "arrived with 2 fd(s): a CUDA_FABRIC message carries no fds",
            ProtocolRule::Fds,
        ),
        (
            fabric(2, 1, 8, &[G as u64, 0], &handles),
            0,
            "invalid CUDA_FABRIC: chunk 2 of 2 has size 0",
            ProtocolRule::Descriptor,
        ),
        // A version 1 kind carrying the fabric handle type is still refused as in version 1.
        (
            {
                let mut b = fabric(2, 1, 8, &sizes, &[]);
                b[5] = 1;
                b[7] = 4;
                b
            },
            2,
            "handle type 8 is not carried by CUDA_VMM",
            ProtocolRule::Descriptor,
        ),
    ];
    for (bytes, nfds, words, rule) in &cases {
        let fds: Vec<OwnedFd> = (0..*nfds)
            .map(|_| {
                nix::sys::memfd::memfd_create(c"v2", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
                    .unwrap()
            })
            .collect();
        let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
        send_raw(&client, bytes, &raw);
        drop(fds);
        let m = protocol_error(conn.recv_message(), *rule, words);
        assert!(!m.contains("ab, ab") && !m.contains("171"), "{m}");
    }
    // The connection still carries a real message, fabric and otherwise.
    send_raw(&client, &good_fabric_packet(2), &[]);
    let d = conn.recv_descriptor().unwrap().into_fabric().unwrap();
    assert_eq!((d.chunk_sizes(), d.size()), (&[G, G][..], 2 * G));
    send_raw(&client, &data_packet(b"ok"), &[]);
    assert_eq!(conn.recv_data().unwrap(), b"ok");
    drop((client, conn, d));
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "every received fd closed"
    );
}

/// A reader that counts what it was asked for and gave.
struct Counting<'a> {
    bytes: &'a [u8],
    given: usize,
}

impl Read for Counting<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.bytes.len().min(buf.len());
        buf[..n].copy_from_slice(&self.bytes[..n]);
        self.bytes = &self.bytes[n..];
        self.given += n;
        Ok(n)
    }
}

/// Read one message of `bytes` followed by a good DATA message; the error, and how many bytes
/// the reader took. The good message is never read: any refusal ends the stream.
fn refused_on_a_stream(bytes: &[u8], rule: ProtocolRule, words: &str) -> usize {
    let all = [bytes, &data_packet(b"after")].concat();
    let mut source = Counting {
        bytes: &all,
        given: 0,
    };
    {
        let mut reader = StreamReader::untimed(&mut source);
        protocol_error(reader.read_message(), rule, words);
        protocol_error(
            reader.read_message(),
            ProtocolRule::StreamFailed,
            "nothing more is read from it",
        );
    }
    source.given
}

#[test]
fn hostile_stream_messages_are_refused_from_the_header_and_end_the_stream() {
    // Claims of the most chunks and payload, then the stream ends: refused from the header
    // alone, before the 18 KiB it announced are read or allocated.
    let claim = |n: u32, p: u32| {
        let mut b = good_fabric_packet(1)[..65].to_vec();
        b[17..21].copy_from_slice(&n.to_le_bytes());
        b[21..25].copy_from_slice(&p.to_le_bytes());
        b
    };
    let took = refused_on_a_stream(
        &claim(253, 16384),
        ProtocolRule::Counts,
        "16384 payload bytes for 253 chunk(s)",
    );
    assert_eq!(took, 65, "only the frame byte and the header were read");
    // Counts that agree: the reader reads what they announce (bounded), then finds the end.
    let all = claim(253, 16192);
    let mut reader = StreamReader::untimed(all.as_slice());
    protocol_error(
        reader.read_message(),
        ProtocolRule::Truncated,
        "it ended after 0 of the 18216 bytes of chunk sizes and payload",
    );
    // Over the maxima: refused from the counts.
    let took = refused_on_a_stream(
        &claim(254, 64 * 254),
        ProtocolRule::TooLarge,
        "254 chunks: at most 253",
    );
    assert_eq!(took, 65);
    let took = refused_on_a_stream(
        &claim(1, u32::MAX),
        ProtocolRule::TooLarge,
        "4294967295 payload bytes",
    );
    assert_eq!(took, 65);
    // Kinds a stream does not carry.
    let mut cuda = vmm_tests::endpoint::header(4, 1, 1, 0, 4096);
    cuda.insert(0, 0);
    cuda.extend_from_slice(&4096u64.to_le_bytes());
    let took = refused_on_a_stream(
        &cuda,
        ProtocolRule::UnexpectedKind,
        "CUDA_VMM on a byte stream: its kind carries fds",
    );
    assert_eq!(took, 65);
    let mut host = vmm_tests::endpoint::header(5, 0, 0, 0, 0);
    host.insert(0, 0);
    refused_on_a_stream(
        &host,
        ProtocolRule::UnexpectedKind,
        "HOST_MEMFD on a byte stream",
    );
    let mut hello = vmm_tests::endpoint::header(1, 0, 0, 0, 0);
    hello.insert(0, 0);
    refused_on_a_stream(
        &hello,
        ProtocolRule::UnexpectedKind,
        "HELLO on a byte stream",
    );
    // Framing: another frame byte (vmm-core's spilled-payload framing), garbage, versions.
    let mut spilled = good_fabric_packet(1);
    spilled[0] = 1;
    // Refused on the first read: at most the frame byte and a header's worth are taken, into
    // the reader's fixed 65-byte buffer (one read for both, not one system call each).
    assert!(refused_on_a_stream(&spilled, ProtocolRule::FrameByte, "frame byte 0x01") <= 65);
    refused_on_a_stream(
        b"\0GET / HTTP/1.1\r\n",
        ProtocolRule::Magic,
        "not a vmm-ipc peer message",
    );
    let mut v3 = good_fabric_packet(1);
    v3[5] = 3;
    refused_on_a_stream(
        &v3,
        ProtocolRule::Version,
        "protocol version 3 is not supported",
    );
    let mut fabric_v1 = good_fabric_packet(1);
    fabric_v1[5] = 1;
    refused_on_a_stream(
        &fabric_v1,
        ProtocolRule::Version,
        "CUDA_FABRIC is a version 2 kind",
    );
    // Cut short: inside the header, inside the body.
    let good = good_fabric_packet(2);
    let mut reader = StreamReader::untimed(&good[..40]);
    protocol_error(
        reader.read_message(),
        ProtocolRule::Truncated,
        "39 bytes: shorter than the 64-byte header",
    );
    let mut reader = StreamReader::untimed(&good[..good.len() - 1]);
    protocol_error(
        reader.read_message(),
        ProtocolRule::Truncated,
        "it ended after 143 of the 144 bytes",
    );
    // The body's rules, after the body.
    let bad = fabric_packet(2, 6, 1, 8, &[G as u64], 64, G as u64 + 1, &[0xab; 64]);
    refused_on_a_stream(&bad, ProtocolRule::Descriptor, "exceeds the 2097152 bytes");
    // A clean end between messages is a disconnection, and stays one.
    let mut reader = StreamReader::untimed(&good[..]);
    reader.read_message().unwrap();
    assert!(matches!(reader.read_message(), Err(Error::Disconnected(_))));
    assert!(matches!(reader.read_message(), Err(Error::Disconnected(_))));
}

/// A writer that takes `room` bytes, then fails.
struct Full {
    room: usize,
}

impl Write for Full {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.room == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::WouldBlock));
        }
        let n = buf.len().min(self.room);
        self.room -= n;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_write_that_fails_part_way_ends_the_stream() {
    let mut writer = StreamWriter::untimed(Full { room: 100 });
    // Refused before a byte is written: the stream is still good.
    let empty = FabricDescriptor::from_handles(&[], &[], 0, [1; 16]).unwrap();
    assert!(matches!(
        writer.write_descriptor(&empty),
        Err(Error::InvalidOption {
            rule: OptionRule::Missing,
            ..
        })
    ));
    assert!(matches!(
        writer.write_data(&vec![0; 16385]),
        Err(Error::TooLarge { .. })
    ));
    writer.write_data(b"fits").unwrap();
    let err = writer.write_descriptor(&descriptor(1)).unwrap_err();
    assert!(
        matches!(&err, Error::Os { op, .. } if op.contains("CUDA_FABRIC")),
        "{err:?}"
    );
    protocol_error(
        writer.write_data(b"x"),
        ProtocolRule::StreamFailed,
        "can carry no more",
    );
}

// ---------------------------------------------------------------------------------------------
// Bearer tokens.

#[test]
fn no_handle_byte_appears_in_debug_or_errors() {
    let d = descriptor(2);
    let (bytes, _) = encode_descriptor(&d).unwrap();
    let received = decode_message(&bytes, Vec::new()).unwrap();
    let mut shown = vec![
        format!("{received:?}"),
        format!("{received:#?}"),
        format!("{d:?}"),
        format!("{:?}", d.handles()),
    ];
    // Errors about a fabric message: the wrong kind, a refused one, a cut one.
    let PeerMessage::Descriptor(received) = received else {
        panic!()
    };
    shown.push(format!("{:?}", Descriptor::from(d.clone()).into_cuda()));
    shown.push(received.into_host().unwrap_err().to_string());
    let mut cut = bytes.clone();
    cut[24] ^= 0xff; // size beyond the chunks
    shown.push(format!("{:?}", decode_message(&cut, Vec::new())));
    let framed = [&[0u8][..], &bytes].concat();
    shown.push(format!(
        "{:?}",
        StreamReader::untimed(&framed[..framed.len() - 5]).read_message()
    ));
    let mut reader = StreamReader::untimed(&framed[..]);
    shown.push(format!("{:?}", reader.read_message()));
    shown.push(format!("{reader:?}"));
    for text in &shown {
        for pattern in ["c0ffee", "c0, ff", "192, 255", "0xc0", "C0FFEE", "c0 ff"] {
            assert!(!text.contains(pattern), "{pattern:?} in {text}");
        }
    }
    assert!(shown[0].contains("redacted"), "{}", shown[0]);
}

/// The bytes of one `CUDA_FABRIC` message on a stream (frame byte first).
fn framed_message(chunks: usize) -> Vec<u8> {
    let mut framed = Vec::new();
    StreamWriter::untimed(&mut framed)
        .write_descriptor(&descriptor(chunks))
        .unwrap();
    framed
}

#[test]
fn a_message_trickled_a_byte_at_a_time_ends_by_the_message_deadline() {
    // One byte every 50 ms: each read alone would finish well within 300 ms, so a deadline per
    // read would wait for the whole message (about 8 s); the message's deadline ends it.
    let framed = framed_message(1);
    assert!(framed.len() > 100);
    let (near, far) = UnixStream::pair().unwrap();
    let trickle = std::thread::spawn(move || {
        for byte in framed {
            if (&near).write_all(&[byte]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let err = StreamReader::new(CallerAuthenticated::new(&far))
        .with_timeout(Some(Duration::from_millis(300)))
        .read_message()
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    drop(far);
    trickle.join().unwrap();
}

#[test]
fn a_writer_to_a_peer_that_stops_reading_ends_by_the_message_deadline() {
    let (near, far) = UnixStream::pair().unwrap();
    let mut writer = StreamWriter::new(CallerAuthenticated::new(&near))
        .with_timeout(Some(Duration::from_millis(200)));
    // Fill the socket: the peer never reads.
    let err = loop {
        if let Err(e) = writer.write_data(&[7; 16 * 1024]) {
            break e;
        }
    };
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    drop(far);
}

#[rstest::rstest]
#[case::unknown_version(b"\x00VMMI\x09\x00".to_vec(), ProtocolRule::Version, "protocol version 9")]
#[case::wrong_magic(b"\x00VMMX".to_vec(), ProtocolRule::Magic, "magic")]
#[case::kind_with_fds(
    b"\x00VMMI\x01\x00\x04\x00".to_vec(),
    ProtocolRule::UnexpectedKind,
    "carries fds"
)]
#[case::unknown_kind(
    b"\x00VMMI\x01\x00\x63\x00".to_vec(),
    ProtocolRule::UnknownKind,
    "unknown message kind 99"
)]
fn the_stream_reader_refuses_as_soon_as_the_bytes_decide(
    #[case] first: Vec<u8>,
    #[case] rule: ProtocolRule,
    #[case] words: &str,
) {
    // The peer sends only the deciding bytes and keeps the stream open: a reader that waited
    // for the whole header would wait for its deadline (a timeout, not this refusal).
    let (near, far) = UnixStream::pair().unwrap();
    (&near).write_all(&first).unwrap();
    let err = StreamReader::new(CallerAuthenticated::new(&far))
        .with_timeout(Some(Duration::from_secs(5)))
        .read_message()
        .unwrap_err();
    assert!(
        matches!(&err, Error::Protocol { rule: got, message } if *got == rule && message.contains(words)),
        "{err:?}"
    );
    drop(near);
}
