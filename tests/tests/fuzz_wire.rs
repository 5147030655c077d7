//! Structured fuzzing of everything a peer controls on the wire: raw packets (tags, lengths,
//! spill headers), the fds a packet carries (how many, of which kind), and the serde forms of
//! the fd-backed types (descriptor fields, fd indices), decoded as the types a receiver asks for.
//!
//! For every input: no panic, no abort, and afterwards exactly the fds and mappings this process
//! had before (every received fd closed, every mapping an import made unmapped).
//!
//! A bounded run: `VMM_FUZZ_CASES` inputs (default 20 000, a few seconds), a fixed seed unless `VMM_FUZZ_SEED`
//! is set, so CI is repeatable; the corpus below (inputs that broke earlier versions) runs first.
//! The binary has one test, so nothing else opens or closes fds while it counts.

use std::os::fd::{AsFd, OwnedFd};
use std::time::Instant;

use proptest::prelude::*;
use serde::Serialize;
use vmm_core::cuda::{IpcDescriptor, VirtualMemoryBuffer};
use vmm_core::shm::{HostBuffer, HostDescriptor};
use vmm_core::wire::{Channel, Fd, Queue, decode};
use vmm_tests::fuzz::{FdKind, fd_kind, holdings, make, seeded_runner, send_raw, touch_claimed};

/// Sizes at the edges: empty, small, a page, a granule, the host import cap and one byte over
/// it, huge (sparse, over the cap), the largest.
fn size() -> impl Strategy<Value = u64> {
    let cap = vmm_core::shm::DEFAULT_MAX_IMPORT_SIZE as u64;
    prop_oneof![
        Just(0u64),
        1u64..5000,
        Just(4096),
        Just(2 << 20),
        Just(cap),
        Just(cap + 1),
        Just(1 << 40),
        Just(u64::MAX),
    ]
}

/// The serde forms a receiver decodes, with every field the peer's choice.
#[derive(Debug, Clone, Serialize)]
enum Location {
    Device,
    HostNuma(i32),
}

#[derive(Debug, Clone, Serialize)]
struct DeviceIdentity {
    ordinal: u64,
    uuid: [u8; 16],
}

#[derive(Debug, Clone, Serialize)]
struct IpcWire {
    handle_type: u32,
    size: u64,
    chunk_sizes: Vec<u64>,
    device: Option<DeviceIdentity>,
    location: Location,
    fds: Vec<u32>,
}

#[derive(Debug, Clone, Serialize)]
struct HostWire {
    size: u64,
    fd: Option<u32>,
}

/// What the receiver decodes the payload as.
#[derive(Debug, Clone, Copy)]
enum Target {
    HostDescriptor,
    HostBuffer,
    IpcDescriptor,
    VirtualMemoryBuffer,
    Queue,
    Fds,
    Nested,
}

#[derive(Debug, Clone)]
enum Payload {
    Host(HostWire),
    Ipc(IpcWire),
    Bytes(Vec<u8>),
}

impl Payload {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Payload::Host(w) => postcard::to_stdvec(w).expect("postcard"),
            Payload::Ipc(w) => postcard::to_stdvec(w).expect("postcard"),
            Payload::Bytes(b) => b.clone(),
        }
    }
}

fn index() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..10, Just(u32::MAX)]
}

fn payload() -> impl Strategy<Value = Payload> {
    let host = (size(), proptest::option::of(index()))
        .prop_map(|(size, fd)| Payload::Host(HostWire { size, fd }));
    let ipc = (
        0u32..6,
        size(),
        proptest::collection::vec(size(), 0..5),
        proptest::option::of((0u64..4, any::<[u8; 16]>())),
        prop_oneof![
            Just(Location::Device),
            any::<i32>().prop_map(Location::HostNuma)
        ],
        proptest::collection::vec(index(), 0..5),
    )
        .prop_map(|(handle_type, size, chunk_sizes, device, location, fds)| {
            Payload::Ipc(IpcWire {
                handle_type,
                size,
                chunk_sizes,
                device: device.map(|(ordinal, uuid)| DeviceIdentity { ordinal, uuid }),
                location,
                fds,
            })
        });
    let bytes = proptest::collection::vec(any::<u8>(), 0..64).prop_map(Payload::Bytes);
    prop_oneof![host, ipc, bytes]
}

fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        Just(Target::HostDescriptor),
        Just(Target::HostBuffer),
        Just(Target::IpcDescriptor),
        Just(Target::VirtualMemoryBuffer),
        Just(Target::Queue),
        Just(Target::Fds),
        Just(Target::Nested),
    ]
}

/// One packet as a hostile peer sends it.
#[derive(Debug, Clone)]
enum Packet {
    /// Tag 0 (inline) and a payload decoded as `target`.
    Inline {
        payload: Payload,
        flip: Option<(usize, u8)>,
        fds: Vec<FdKind>,
        target: Target,
    },
    /// Tag 1 (spilled) with a size header and fds (the last one is taken as the payload).
    Spill { size: u64, fds: Vec<FdKind> },
    /// Anything at all.
    Raw { bytes: Vec<u8>, fds: Vec<FdKind> },
}

fn packet() -> impl Strategy<Value = Packet> {
    let fds = || proptest::collection::vec(fd_kind(), 0..6);
    prop_oneof![
        4 => (payload(), proptest::option::of((any::<usize>(), any::<u8>())), fds(), target())
            .prop_map(|(payload, flip, fds, target)| Packet::Inline { payload, flip, fds, target }),
        2 => (size(), fds()).prop_map(|(size, fds)| Packet::Spill { size, fds }),
        1 => (proptest::collection::vec(any::<u8>(), 0..80), fds())
            .prop_map(|(bytes, fds)| Packet::Raw { bytes, fds }),
    ]
}

impl Packet {
    fn wire(&self) -> (Vec<u8>, &[FdKind], Option<Target>) {
        match self {
            Packet::Inline {
                payload,
                flip,
                fds,
                target,
            } => {
                let mut bytes = vec![2u8]; // frame byte 0x02: an inline payload
                bytes.extend(payload.bytes());
                if let Some((at, xor)) = flip {
                    let at = at % bytes.len();
                    if at > 0 {
                        bytes[at] ^= xor;
                    }
                }
                (bytes, fds, Some(*target))
            }
            Packet::Spill { size, fds } => {
                let mut bytes = vec![1u8];
                bytes.extend(size.to_le_bytes());
                (bytes, fds, Some(Target::HostDescriptor))
            }
            Packet::Raw { bytes, fds } => (bytes.clone(), fds, Some(Target::Fds)),
        }
    }
}

fn decode_as(target: Target, bytes: &[u8], fds: Vec<OwnedFd>) {
    // Every outcome is fine but a panic or an import over the cap (`touch_claimed` checks it);
    // values are dropped at once (unmapping any import).
    let _ = match target {
        Target::HostDescriptor => decode::<HostDescriptor>(bytes, fds).map(|d| {
            // A descriptor is only data; importing it is where the cap applies.
            if d.size() > vmm_core::shm::max_import_size() {
                let err = HostBuffer::import(&d).expect_err("imported over the cap");
                assert!(
                    matches!(err, vmm_core::Error::LimitExceeded { .. }),
                    "{err:?}"
                );
            }
        }),
        Target::HostBuffer => decode::<HostBuffer>(bytes, fds).map(|b| touch_claimed(&b)),
        Target::IpcDescriptor => decode::<IpcDescriptor>(bytes, fds).map(drop),
        Target::VirtualMemoryBuffer => decode::<VirtualMemoryBuffer>(bytes, fds).map(drop),
        Target::Queue => decode::<Queue<u8>>(bytes, fds).map(drop),
        Target::Fds => decode::<(Vec<Fd>, String)>(bytes, fds).map(drop),
        Target::Nested => decode::<Option<Vec<HostDescriptor>>>(bytes, fds).map(drop),
    };
}

fn run_one(a: &Channel, b: &Channel, packet: &Packet) -> Result<(), TestCaseError> {
    let before = holdings();
    {
        let (bytes, kinds, target) = packet.wire();
        let fds: Vec<OwnedFd> = kinds.iter().map(make).collect();
        send_raw(a.as_fd(), &bytes, &fds);
        drop(fds);
        if let Ok(Some(message)) = b.try_recv()
            && let Some(target) = target
        {
            decode_as(target, &message.bytes, message.fds);
        }
        // Whatever arrived is consumed; the channel must still carry a real message.
        a.send(b"ok", &[]).expect("send after");
        let after = b.try_recv().expect("recv after").expect("a message");
        prop_assert_eq!(after.bytes, b"ok".to_vec());
    }
    let after = holdings();
    prop_assert_eq!(before, after, "fds or mappings left over (before, after)");
    Ok(())
}

/// Inputs that broke earlier versions: they run first, every time.
fn corpus() -> Vec<Packet> {
    vec![
        // A host buffer of a sparse, sealed 1 TiB memfd: imported (no cap) before issue 16.
        Packet::Inline {
            payload: Payload::Host(HostWire {
                size: 1 << 40,
                fd: Some(0),
            }),
            flip: None,
            fds: vec![FdKind::SizeSealed(1 << 40)],
            target: Target::HostBuffer,
        },
        // One byte over the import cap, and exactly at it (imports, mapped lazily).
        Packet::Inline {
            payload: Payload::Host(HostWire {
                size: vmm_core::shm::DEFAULT_MAX_IMPORT_SIZE as u64 + 1,
                fd: Some(0),
            }),
            flip: None,
            fds: vec![FdKind::SizeSealed(1 << 40)],
            target: Target::HostDescriptor,
        },
        Packet::Inline {
            payload: Payload::Host(HostWire {
                size: vmm_core::shm::DEFAULT_MAX_IMPORT_SIZE as u64,
                fd: Some(0),
            }),
            flip: None,
            fds: vec![FdKind::SizeSealed(
                vmm_core::shm::DEFAULT_MAX_IMPORT_SIZE as u64,
            )],
            target: Target::HostBuffer,
        },
        // A 1 TiB spill header backed by a sparse, sealed memfd: aborted the receiver.
        Packet::Spill {
            size: 1 << 40,
            fds: vec![FdKind::Sealed(1 << 40)],
        },
        // An empty packet from a live peer: was reported as a hang-up.
        Packet::Raw {
            bytes: vec![],
            fds: vec![],
        },
        // An empty packet carrying fds.
        Packet::Raw {
            bytes: vec![],
            fds: vec![FdKind::Pipe],
        },
        // A host descriptor claiming more than its (sealed) memfd holds.
        Packet::Inline {
            payload: Payload::Host(HostWire {
                size: 1 << 20,
                fd: Some(0),
            }),
            flip: None,
            fds: vec![FdKind::SizeSealed(4096)],
            target: Target::HostBuffer,
        },
        // An fd index the message does not carry.
        Packet::Inline {
            payload: Payload::Host(HostWire {
                size: 16,
                fd: Some(u32::MAX),
            }),
            flip: None,
            fds: vec![FdKind::Sealed(16)],
            target: Target::HostDescriptor,
        },
        // An IPC descriptor whose chunk sizes overflow when summed.
        Packet::Inline {
            payload: Payload::Ipc(IpcWire {
                handle_type: 1,
                size: 1,
                chunk_sizes: vec![u64::MAX, u64::MAX],
                device: None,
                location: Location::Device,
                fds: vec![0, 1],
            }),
            flip: None,
            fds: vec![FdKind::Sealed(16), FdKind::DevNull],
            target: Target::VirtualMemoryBuffer,
        },
    ]
}

#[test]
fn hostile_packets_and_fds_never_panic_or_leak() {
    let cases: u32 = std::env::var("VMM_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let seed: u64 = std::env::var("VMM_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_f022);
    let (a, b) = Channel::pair().expect("pair");
    // Warm every lazily opened thing before counting: per-thread buffers, the shm probe, and
    // (where there is a GPU) CUDA itself, whose first use opens driver fds and maps memory
    // for the life of the process; arriving buffers are imported through this importer.
    let _ = vmm_core::shm::buffers_hold_no_fd();
    let _ = vmm_core::cuda::Device::new(0)
        .and_then(|device| vmm_core::cuda::importer(&device, vmm_core::cuda::Location::Device));
    a.send(b"warm", &[]).unwrap();
    b.recv(None).unwrap();
    let started = Instant::now();
    for (i, packet) in corpus().iter().enumerate() {
        run_one(&a, &b, packet).unwrap_or_else(|e| panic!("corpus input {i} ({packet:?}): {e}"));
    }
    let mut runner = seeded_runner(cases, seed);
    let result = runner.run(&packet(), |packet| run_one(&a, &b, &packet));
    let elapsed = started.elapsed();
    eprintln!(
        "fuzz_wire: {} corpus inputs and {cases} generated inputs (seed {seed:#x}) in {:.1?}: {}",
        corpus().len(),
        elapsed,
        match &result {
            Ok(()) => "0 findings".to_owned(),
            Err(e) => format!("finding: {e}"),
        }
    );
    result.unwrap();
}
