//! Structured fuzzing of the peer protocol (docs/protocol.md, versions 1 and 2) as a hostile
//! but admitted peer sends it: every header field the peer's choice (magic, version, kind,
//! lengths, flags, handle type, chunk count and sizes, size, device, location), a payload (a
//! `CUDA_FABRIC` message's handles), a cut anywhere, the frame byte, and the fds the packet
//! carries (how many, of which kind), received through a named endpoint's
//! `Session::recv_message` and imported when it is a descriptor; then the same bytes, without
//! fds, through a byte stream's `StreamReader` (followed by a good message).
//!
//! For every input: no panic, no abort, and afterwards exactly the fds and mappings this process
//! had before (every received fd closed, every mapping an import made unmapped), and the
//! connection still carries a real message. On the stream: the reader takes at most one
//! message's bytes (`1 + 64 + 8n + p`, within the maxima) for it, and after a refusal it reads
//! nothing more.
//!
//! A bounded run: `VMM_FUZZ_CASES` inputs (default 10 000), a fixed seed unless `VMM_FUZZ_SEED`
//! is set; the corpus runs first. The binary has one test, so nothing else opens or closes fds
//! while it counts.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
use proptest::prelude::*;
use vmm_core::cuda::{FabricDescriptor, FabricHandle, VirtualMemoryBuffer};
use vmm_core::peer::stream::StreamReader;
use vmm_core::peer::{Descriptor, PeerMessage, Session};
use vmm_core::shm::HostBuffer;
use vmm_core::wire::endpoint::{Listener, ListenerOptions, Name};
use vmm_tests::fuzz::{FdKind, fd_kind, holdings, make, seeded_runner, send_raw, touch_claimed};

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        1u64..70_000,
        Just(4096),
        Just(2 << 20),
        Just(1 << 40),
        Just(u64::MAX / 2 + 1),
        Just(u64::MAX),
    ]
}

/// Every field of a v1 header, the peer's choice; mostly plausible, sometimes anything.
#[derive(Debug, Clone)]
struct Header {
    magic: [u8; 4],
    version: u16,
    kind: u16,
    header_len: u16,
    flags: u16,
    handle_type: u32,
    /// `None`: the number of chunk sizes actually written.
    chunk_count: Option<u32>,
    /// `None`: the number of payload bytes actually written.
    payload_len: Option<u32>,
    size: u64,
    uuid: [u8; 16],
    ordinal: u32,
    location_type: u32,
    location_id: i32,
    reserved: u32,
}

fn header() -> impl Strategy<Value = Header> {
    let magic = prop_oneof![9 => Just(*b"VMMI"), 1 => any::<[u8; 4]>()];
    let version = prop_oneof![7 => Just(1u16), 2 => Just(2u16), 1 => any::<u16>()];
    let kind = prop_oneof![9 => 1u16..=6, 1 => any::<u16>()];
    let header_len = prop_oneof![9 => Just(64u16), 1 => any::<u16>()];
    let flags = prop_oneof![4 => Just(0u16), 4 => Just(1u16), 1 => any::<u16>()];
    let handle_type =
        prop_oneof![4 => Just(1u32), 3 => Just(0u32), 1 => Just(8u32), 1 => any::<u32>()];
    let count = prop_oneof![
        6 => Just(None),
        1 => (0u32..6).prop_map(Some),
        1 => Just(Some(u32::MAX)),
        1 => Just(Some(254)),
    ];
    let payload_len = prop_oneof![
        6 => Just(None),
        1 => (0u32..40).prop_map(Some),
        1 => Just(Some(u32::MAX)),
        1 => Just(Some(16 * 1024 + 1)),
    ];
    let uuid = prop_oneof![Just([0u8; 16]), any::<[u8; 16]>()];
    let ordinal = prop_oneof![Just(0u32), any::<u32>()];
    let location = prop_oneof![
        6 => Just((0u32, 0i32)),
        2 => (Just(1u32), prop_oneof![Just(0i32), any::<i32>()]),
        1 => (any::<u32>(), any::<i32>()),
    ];
    let reserved = prop_oneof![9 => Just(0u32), 1 => any::<u32>()];
    (
        (magic, version, kind, header_len, flags, handle_type),
        (
            count,
            payload_len,
            size(),
            uuid,
            ordinal,
            location,
            reserved,
        ),
    )
        .prop_map(
            |(
                (magic, version, kind, header_len, flags, handle_type),
                (
                    chunk_count,
                    payload_len,
                    size,
                    uuid,
                    ordinal,
                    (location_type, location_id),
                    reserved,
                ),
            )| Header {
                magic,
                version,
                kind,
                header_len,
                flags,
                handle_type,
                chunk_count,
                payload_len,
                size,
                uuid,
                ordinal,
                location_type,
                location_id,
                reserved,
            },
        )
}

/// One packet as a hostile peer sends it.
#[derive(Debug, Clone)]
struct Packet {
    frame_byte: u8,
    header: Header,
    chunk_sizes: Vec<u64>,
    payload: Vec<u8>,
    /// Cut the message to this many bytes (modulo its length + 1).
    cut: Option<usize>,
    fds: Vec<FdKind>,
}

/// A message that follows the rules of its kind (fds matching chunks, fields a kind does not
/// use zero), so the fuzzer reaches the descriptor checks and the imports; `mutate` then breaks
/// one thing, sometimes.
fn coherent() -> impl Strategy<Value = Packet> {
    let data = proptest::collection::vec(any::<u8>(), 0..24).prop_map(|payload| Packet {
        payload,
        ..Packet::of(header_of(3, 0, 0), Vec::new(), Vec::new())
    });
    let host = (
        0u64..70_000,
        prop_oneof![Just(0i64), -8i64..8],
        any::<bool>(),
    )
        .prop_map(|(file, delta, sealed)| {
            let size = file.saturating_add_signed(delta);
            let fd = if sealed {
                FdKind::SizeSealed(file)
            } else {
                FdKind::Unsealed(file)
            };
            let (chunks, fds) = if size == 0 {
                (Vec::new(), Vec::new())
            } else {
                (vec![size], vec![fd])
            };
            Packet::of(header_of(5, 0, size), chunks, fds)
        });
    let cuda = (
        proptest::collection::vec(prop_oneof![Just(2u64 << 20), size()], 0..4),
        any::<u8>(),
        proptest::option::of((any::<u32>(), any::<[u8; 16]>())),
        prop_oneof![Just(None), (0i32..4).prop_map(Some)],
        fd_kind(),
    )
        .prop_map(|(chunks, fraction, device, numa, fd)| {
            let total = chunks.iter().fold(0u64, |a, &c| a.saturating_add(c));
            let size = total / 256 * u64::from(fraction);
            let mut header = header_of(4, 1, size);
            if let Some((ordinal, uuid)) = device {
                header.flags = 1;
                header.ordinal = ordinal;
                header.uuid = uuid;
            }
            if let Some(node) = numa {
                header.location_type = 1;
                header.location_id = node;
            }
            let fds = vec![fd; chunks.len()];
            Packet::of(header, chunks, fds)
        });
    let fabric = (
        proptest::collection::vec(prop_oneof![Just(2u64 << 20), size()], 0..4),
        any::<u8>(),
        any::<(u32, [u8; 16])>(),
        prop_oneof![Just(None), (0i32..4).prop_map(Some)],
        any::<u8>(),
    )
        .prop_map(|(chunks, fraction, (ordinal, uuid), numa, seed)| {
            let total = chunks.iter().fold(0u64, |a, &c| a.saturating_add(c));
            let size = total / 256 * u64::from(fraction);
            let mut header = header_of(6, 8, size);
            header.version = 2;
            header.flags = 1;
            header.ordinal = ordinal;
            header.uuid = uuid;
            if let Some(node) = numa {
                header.location_type = 1;
                header.location_id = node;
            }
            let payload = (0..64 * chunks.len())
                .map(|i| seed.wrapping_add(i as u8))
                .collect();
            Packet {
                payload,
                ..Packet::of(header, chunks, Vec::new())
            }
        });
    (
        prop_oneof![1 => data, 2 => host, 2 => cuda, 2 => fabric],
        mutation(),
    )
        .prop_map(|(mut p, m)| {
            m.apply(&mut p);
            p
        })
}

/// One thing a peer might break in an otherwise coherent message.
#[derive(Debug, Clone)]
enum Mutation {
    None,
    ExtraFd(FdKind),
    DropFd,
    Cut(usize),
    Version(u16),
    Kind(u16),
    HandleType(u32),
    Size(u64),
    ChunkCount(u32),
    Flags(u16),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        8 => Just(Mutation::None),
        1 => fd_kind().prop_map(Mutation::ExtraFd),
        1 => Just(Mutation::DropFd),
        1 => any::<usize>().prop_map(Mutation::Cut),
        1 => prop_oneof![1u16..=3, any::<u16>()].prop_map(Mutation::Version),
        1 => (0u16..8).prop_map(Mutation::Kind),
        1 => any::<u32>().prop_map(Mutation::HandleType),
        1 => size().prop_map(Mutation::Size),
        1 => (0u32..300).prop_map(Mutation::ChunkCount),
        1 => any::<u16>().prop_map(Mutation::Flags),
    ]
}

impl Mutation {
    fn apply(&self, p: &mut Packet) {
        match self {
            Mutation::None => {}
            Mutation::ExtraFd(kind) => p.fds.push(kind.clone()),
            Mutation::DropFd => {
                p.fds.pop();
            }
            Mutation::Cut(at) => p.cut = Some(*at),
            Mutation::Version(v) => p.header.version = *v,
            Mutation::Kind(k) => p.header.kind = *k,
            Mutation::HandleType(h) => p.header.handle_type = *h,
            Mutation::Size(s) => p.header.size = *s,
            Mutation::ChunkCount(c) => p.header.chunk_count = Some(*c),
            Mutation::Flags(f) => p.header.flags = *f,
        }
    }
}

impl Packet {
    fn of(header: Header, chunk_sizes: Vec<u64>, fds: Vec<FdKind>) -> Packet {
        Packet {
            frame_byte: 0,
            header,
            chunk_sizes,
            payload: Vec::new(),
            cut: None,
            fds,
        }
    }
}

fn packet() -> impl Strategy<Value = Packet> {
    prop_oneof![3 => coherent(), 1 => chaotic()]
}

/// Anything at all in every field.
fn chaotic() -> impl Strategy<Value = Packet> {
    (
        prop_oneof![19 => Just(0u8), 1 => any::<u8>()],
        header(),
        proptest::collection::vec(size(), 0..5),
        proptest::collection::vec(any::<u8>(), 0..24),
        proptest::option::weighted(0.15, any::<usize>()),
        proptest::collection::vec(fd_kind(), 0..5),
    )
        .prop_map(
            |(frame_byte, header, chunk_sizes, payload, cut, fds)| Packet {
                frame_byte,
                header,
                chunk_sizes,
                payload,
                cut,
                fds,
            },
        )
}

impl Packet {
    fn bytes(&self) -> Vec<u8> {
        let h = &self.header;
        let mut b = vec![self.frame_byte];
        b.extend_from_slice(&h.magic);
        b.extend_from_slice(&h.version.to_le_bytes());
        b.extend_from_slice(&h.kind.to_le_bytes());
        b.extend_from_slice(&h.header_len.to_le_bytes());
        b.extend_from_slice(&h.flags.to_le_bytes());
        b.extend_from_slice(&h.handle_type.to_le_bytes());
        let count = h.chunk_count.unwrap_or(self.chunk_sizes.len() as u32);
        b.extend_from_slice(&count.to_le_bytes());
        let payload_len = h.payload_len.unwrap_or(self.payload.len() as u32);
        b.extend_from_slice(&payload_len.to_le_bytes());
        b.extend_from_slice(&h.size.to_le_bytes());
        b.extend_from_slice(&h.uuid);
        b.extend_from_slice(&h.ordinal.to_le_bytes());
        b.extend_from_slice(&h.location_type.to_le_bytes());
        b.extend_from_slice(&h.location_id.to_le_bytes());
        b.extend_from_slice(&h.reserved.to_le_bytes());
        for size in &self.chunk_sizes {
            b.extend_from_slice(&size.to_le_bytes());
        }
        b.extend_from_slice(&self.payload);
        if let Some(cut) = self.cut {
            b.truncate(cut % (b.len() + 1));
        }
        b
    }
}

/// How the inputs ended: refused, DATA, host descriptor (imported), CUDA descriptor, fabric
/// descriptor; then on a stream: refused, accepted.
static OUTCOMES: [AtomicUsize; 8] = [const { AtomicUsize::new(0) }; 8];

/// Receive whatever the packet became, import a descriptor, drop everything.
fn consume(conn: &Session) {
    let outcome = conn.recv_message();
    let index = match &outcome {
        Err(_) => 0,
        Ok(PeerMessage::Data(_)) => 1,
        Ok(PeerMessage::Descriptor(Descriptor::Host(_))) => 2,
        Ok(PeerMessage::Descriptor(Descriptor::Cuda(_))) => 4,
        Ok(PeerMessage::Descriptor(Descriptor::Fabric(_))) => 5,
    };
    OUTCOMES[index].fetch_add(1, Ordering::Relaxed);
    match outcome {
        Ok(PeerMessage::Descriptor(Descriptor::Host(d))) => {
            if let Ok(buf) = HostBuffer::import(&d) {
                OUTCOMES[3].fetch_add(1, Ordering::Relaxed);
                touch_claimed(&buf);
            }
        }
        Ok(PeerMessage::Descriptor(Descriptor::Cuda(d))) => {
            let _ = VirtualMemoryBuffer::import(&d);
        }
        Ok(PeerMessage::Descriptor(Descriptor::Fabric(d))) => {
            let _ = VirtualMemoryBuffer::import_fabric(&d);
        }
        Ok(PeerMessage::Data(_)) | Err(_) => {}
    }
}

/// A valid DATA message carrying `ok`, framed.
fn ok_message() -> Vec<u8> {
    let mut b = vec![0u8];
    b.extend_from_slice(b"VMMI");
    for v in [1u16, 3, 64, 0] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&0u32.to_le_bytes()); // handle type
    b.extend_from_slice(&0u32.to_le_bytes()); // chunk count
    b.extend_from_slice(&2u32.to_le_bytes()); // payload length
    b.extend_from_slice(&[0; 40]); // size .. reserved
    b.extend_from_slice(b"ok");
    b
}

/// A reader over bytes that counts how many it gave.
struct Counting<'a> {
    bytes: &'a [u8],
    given: usize,
}

impl std::io::Read for Counting<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.bytes.len().min(buf.len());
        buf[..n].copy_from_slice(&self.bytes[..n]);
        self.bytes = &self.bytes[n..];
        self.given += n;
        Ok(n)
    }
}

/// The packet's bytes on a byte stream, a good DATA message after them: the reader takes at
/// most one message's bytes for the first read, and a refusal ends the stream.
fn stream_one(packet: &Packet) -> Result<(), TestCaseError> {
    const MAX_MESSAGE: usize = 1 + 64 + 8 * 253 + 16 * 1024;
    let bytes = [packet.bytes(), ok_message()].concat();
    let mut source = Counting {
        bytes: &bytes,
        given: 0,
    };
    let (first, second) = {
        let mut reader = StreamReader::untimed(&mut source);
        (reader.read_message(), reader.read_message())
    };
    prop_assert!(source.given <= bytes.len());
    match first {
        Err(_) => {
            OUTCOMES[6].fetch_add(1, Ordering::Relaxed);
            prop_assert!(second.is_err(), "read on after a refusal: {:?}", second);
            prop_assert!(source.given <= MAX_MESSAGE);
        }
        Ok(message) => {
            OUTCOMES[7].fetch_add(1, Ordering::Relaxed);
            let fdless = matches!(
                message,
                PeerMessage::Data(_) | PeerMessage::Descriptor(Descriptor::Fabric(_))
            );
            prop_assert!(fdless, "a stream gave {:?}", message);
            prop_assert!(source.given <= 2 * MAX_MESSAGE);
        }
    }
    Ok(())
}

fn run_one(client: &OwnedFd, conn: &Session, packet: &Packet) -> Result<(), TestCaseError> {
    let before = holdings();
    let closers_before = vmm_core::testing::closer_threads_started();
    stream_one(packet)?;
    {
        let fds: Vec<OwnedFd> = packet.fds.iter().map(make).collect();
        send_raw(client.as_fd(), &packet.bytes(), &fds);
        drop(fds);
        consume(conn);
        send_raw(client.as_fd(), &ok_message(), &[]);
        prop_assert_eq!(conn.recv_data().expect("the connection still works"), b"ok");
    }
    // The fds of a refused message close on the endpoint's background closer (a hostile fd's
    // close may block): wait for it, within a bound. The closer pool may have started threads
    // meanwhile (bounded): a closer, kept for the process's life, or a watcher, which ends once
    // nothing waits but whose stack the C library keeps mapped for the next thread. Each
    // thread started may leave its stack and guard page, and nothing else may remain.
    let deadline = Instant::now() + Duration::from_secs(10);
    let settled = |(fds, maps): (usize, usize)| {
        let new_closers =
            vmm_core::testing::closer_threads_started().saturating_sub(closers_before);
        fds == before.0 && maps <= before.1 + 2 * new_closers
    };
    let mut after = holdings();
    while !settled(after) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(200));
        after = holdings();
    }
    prop_assert!(
        settled(after),
        "fds or mappings left over: (fds, maps) {:?} before, {:?} after, {} closer thread(s) \
         started meanwhile",
        before,
        after,
        vmm_core::testing::closer_threads_started().saturating_sub(closers_before)
    );
    Ok(())
}

fn header_of(kind: u16, handle_type: u32, size: u64) -> Header {
    Header {
        magic: *b"VMMI",
        version: 1,
        kind,
        header_len: 64,
        flags: 0,
        handle_type,
        chunk_count: None,
        payload_len: None,
        size,
        uuid: [0; 16],
        ordinal: 0,
        location_type: 0,
        location_id: 0,
        reserved: 0,
    }
}

/// Inputs worth running every time.
fn corpus() -> Vec<Packet> {
    let packet = |header, chunk_sizes: Vec<u64>, fds| Packet {
        frame_byte: 0,
        header,
        chunk_sizes,
        payload: Vec::new(),
        cut: None,
        fds,
    };
    vec![
        // A host descriptor claiming more than its sealed memfd holds.
        packet(
            header_of(5, 0, 1 << 20),
            vec![1 << 20],
            vec![FdKind::SizeSealed(4096)],
        ),
        // A host descriptor of a sparse 1 TiB memfd: refused or mapped lazily, never read.
        packet(
            header_of(5, 0, 1 << 40),
            vec![1 << 40],
            vec![FdKind::SizeSealed(1 << 40)],
        ),
        // Chunk sizes that overflow when summed.
        packet(
            header_of(4, 1, 1),
            vec![u64::MAX, u64::MAX],
            vec![FdKind::DevNull, FdKind::Pipe],
        ),
        // A header announcing four billion chunks, with two fds.
        Packet {
            header: Header {
                chunk_count: Some(u32::MAX),
                ..header_of(4, 1, 4096)
            },
            ..packet(header_of(4, 1, 4096), vec![4096], vec![FdKind::Pipe; 2])
        },
        // A CUDA descriptor made of memfds (the driver refuses them where there is one).
        packet(
            header_of(4, 1, 2 << 20),
            vec![2 << 20],
            vec![FdKind::SizeSealed(2 << 20)],
        ),
        // Version 2: a coherent CUDA_FABRIC message of the most chunks (forged handles).
        fabric_packet(vec![2 << 20; 253], Vec::new()),
        // ... with fds attached.
        fabric_packet(
            vec![2 << 20; 2],
            vec![FdKind::Pipe, FdKind::SizeSealed(4096)],
        ),
        // ... marked version 1.
        Packet {
            header: Header {
                version: 1,
                ..fabric_packet(vec![4096], Vec::new()).header
            },
            ..fabric_packet(vec![4096], Vec::new())
        },
        // ... claiming the most chunks and payload, with one chunk's worth.
        Packet {
            header: Header {
                chunk_count: Some(253),
                payload_len: Some(16384),
                ..fabric_packet(vec![4096], Vec::new()).header
            },
            ..fabric_packet(vec![4096], Vec::new())
        },
        // ... with one chunk and no handle, and with no chunk at all.
        Packet {
            payload: Vec::new(),
            ..fabric_packet(vec![4096], Vec::new())
        },
        fabric_packet(Vec::new(), Vec::new()),
        // HELLO marked version 2; a version 3 message.
        Packet {
            header: Header {
                version: 2,
                ..header_of(1, 0, 0)
            },
            ..packet(header_of(1, 0, 0), Vec::new(), Vec::new())
        },
        Packet {
            header: Header {
                version: 3,
                ..header_of(3, 0, 0)
            },
            ..packet(header_of(3, 0, 0), Vec::new(), Vec::new())
        },
    ]
}

/// A coherent CUDA_FABRIC message (version 2) with `chunks`, one 64-byte handle each, the
/// owner named, carrying `fds` (which it must not).
fn fabric_packet(chunks: Vec<u64>, fds: Vec<FdKind>) -> Packet {
    let size = chunks.iter().sum();
    let header = Header {
        version: 2,
        flags: 1,
        uuid: [0x5a; 16],
        ..header_of(6, 8, size)
    };
    Packet {
        frame_byte: 0,
        payload: vec![0xab; 64 * chunks.len()],
        header,
        chunk_sizes: chunks,
        cut: None,
        fds,
    }
}

#[test]
fn hostile_peer_messages_never_panic_or_leak() {
    // One malloc arena for every thread: a thread's first allocation would otherwise map a
    // new arena (two mappings) at a time set by the scheduler, which this test would count as
    // a leak (a local CI run under load saw 4 more mappings, 0 more fds, no new thread).
    // SAFETY: mallopt only sets an allocator parameter; no allocation is in flight in a
    // call, and glibc serialises it with the allocator.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    let cases: u32 = std::env::var("VMM_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let seed: u64 = std::env::var("VMM_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x9ee7_f022);
    let name = Name::abstract_name(format!("vmm-fuzz-peer-{}", std::process::id()));
    let listener = Listener::bind_with(
        &name,
        ListenerOptions::default().timeout(Some(Duration::from_secs(10))),
    )
    .expect("bind");
    let client = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    let Name::Abstract(bytes) = &name else {
        unreachable!()
    };
    connect(client.as_raw_fd(), &UnixAddr::new_abstract(bytes).unwrap()).expect("connect");
    let conn = Session::accept(&listener, Some(Duration::from_secs(10))).expect("accept");
    // The client's HELLO waits unread in its socket; nothing else is ever sent to it.
    // Warm what opens lazily for the life of the process before counting.
    let _ = vmm_core::shm::buffers_hold_no_fd();
    let _ = vmm_core::cuda::Device::new(0)
        .and_then(|device| vmm_core::cuda::importer(&device, vmm_core::cuda::Location::Device));
    // The driver opens the IMEX channel on the first fabric import, refused or not (a forged
    // handle is refused by the driver: this one's owner is no device here, so it is imported
    // for device 0), and keeps it open for the life of the process.
    let _ = FabricDescriptor::from_handles(
        &[FabricHandle::from_bytes([0x5A; 64])],
        &[2 << 20],
        2 << 20,
        [0x5A; 16],
    )
    .and_then(|forged| VirtualMemoryBuffer::import_fabric(&forged));
    send_raw(client.as_fd(), &ok_message(), &[]);
    assert_eq!(conn.recv_data().unwrap(), b"ok");
    // A refused message's fd starts the endpoint's background closer (its thread's stack and
    // arena are mappings of the life of the process).
    let (fds_before, _) = holdings();
    let warm = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
    send_raw(client.as_fd(), &ok_message(), std::slice::from_ref(&warm));
    drop(warm);
    assert!(conn.recv_data().is_err());
    let deadline = Instant::now() + Duration::from_secs(10);
    while holdings().0 != fds_before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let started = Instant::now();
    for (i, packet) in corpus().iter().enumerate() {
        run_one(&client, &conn, packet)
            .unwrap_or_else(|e| panic!("corpus input {i} ({packet:?}): {e}"));
    }
    let mut runner = seeded_runner(cases, seed);
    let result = runner.run(&packet(), |packet| run_one(&client, &conn, &packet));
    let n = |i: usize| OUTCOMES[i].load(Ordering::Relaxed);
    eprintln!(
        "fuzz_peer: {} corpus inputs and {cases} generated inputs (seed {seed:#x}) in {:.1?} \
         ({} refused, {} DATA, {} host descriptors of which {} imported, {} CUDA \
         descriptors, {} fabric descriptors; on a stream {} refused, {} accepted): {}",
        corpus().len(),
        started.elapsed(),
        n(0),
        n(1),
        n(2),
        n(3),
        n(4),
        n(5),
        n(6),
        n(7),
        match &result {
            Ok(()) => "0 findings".to_owned(),
            Err(e) => format!("finding: {e}"),
        }
    );
    result.unwrap();
}
