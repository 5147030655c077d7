//! Fabric handles across processes, each scenario generated for both start methods by
//! `#[ipc_test]`: buffers as process arguments and through Queues, one descriptor to many
//! children, the lifetime rules, the refusals, two GPUs, and a receiver that vmm-core did not
//! start (a plain `std::process::Command`, over TCP on 127.0.0.1, as JSON).
//!
//! They skip (one `SKIP` line each) where fabric handles cannot be used (no GPU, no fabric
//! support, or no IMEX channel: the reason says which), and fail there instead under
//! `VMM_REQUIRE_GPU=1`, which the GPU runs set.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use cudarc::driver::sys;
use serde::{Deserialize, Serialize};
use vmm_core::cuda::{
    Access, Device, FabricDescriptor, FabricHandle, HandleType, Location, ResourceOptions,
    VirtualMemoryBuffer, VirtualMemoryResource, importer, set_importer,
};
use vmm_core::error::{Chunk, DescriptorRule, IpcOp, IpcStep};
use vmm_core::ipc_test;
use vmm_core::process::Context;
use vmm_core::testing::open_fds;
use vmm_core::wire::Queue;
use vmm_core::{Error, Result};
use vmm_tests::{check, contents, filled_in, pattern, text, where_stuck, with_context_of};

const TIMEOUT: Duration = Duration::from_secs(60);

fn fabric_resource(device: usize, options: ResourceOptions) -> VirtualMemoryResource {
    VirtualMemoryResource::new(
        &Device::new(device).unwrap(),
        options.handle_type(HandleType::Fabric),
    )
    .unwrap()
}

/// A Fabric buffer of `chunks` chunks of the granularity, filled with `pattern(1, ..)`.
fn filled(chunks: usize) -> VirtualMemoryBuffer {
    filled_in(&fabric_resource(0, ResourceOptions::default()), chunks)
}

fn read_back_and_reply(buf: VirtualMemoryBuffer) {
    assert!(buf.is_imported());
    assert_eq!(
        buf.handle_type(),
        HandleType::Fabric,
        "arrived by fabric handle"
    );
    assert_eq!(
        contents(&buf),
        pattern(1, buf.size()),
        "child did not see the parent's pattern"
    );
    buf.write_at(0, &pattern(2, buf.size())).unwrap();
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_fabric())]
fn fabric_buffer_as_process_argument(ctx: &Context) {
    let buf = filled(2);
    ctx.spawn(read_back_and_reply, buf.clone())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(contents(&buf), pattern(2, buf.size()));
    // The child has imported: nothing is kept for it any more.
    buf.wait_imported(TIMEOUT).unwrap();
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_fabric())]
fn fabric_buffer_through_queue(ctx: &Context) {
    let queue: Queue<VirtualMemoryBuffer> = Queue::new().unwrap();
    let child = ctx
        .spawn(
            |q: Queue<VirtualMemoryBuffer>| read_back_and_reply(q.get(TIMEOUT).unwrap()),
            queue.clone(),
        )
        .unwrap();
    let buf = filled(1);
    queue.put(&buf).unwrap();
    child.wait().unwrap();
    assert_eq!(contents(&buf), pattern(2, buf.size()));
}

/// Where child `n` of `one_fabric_export_serves_many_children_that_acknowledge` leaves its mark:
/// the last byte of the first chunk, then 1000 bytes on each.
fn mark_at(buf: &VirtualMemoryBuffer, n: usize) -> usize {
    n * 1000 + buf.chunk_sizes()[0] - 1
}

/// Import the descriptor, check the pattern, write `mark` at byte `at`, acknowledge. Says on
/// stderr how far it got (shown if the test fails).
fn import_mark_and_ack(args: (FabricDescriptor, usize, u8, Queue<usize>)) {
    let (descriptor, at, mark, acks) = args;
    eprintln!("child {}: importing", std::process::id());
    let buf = VirtualMemoryBuffer::import_fabric(&descriptor).unwrap();
    eprintln!("child {}: imported, checking", std::process::id());
    // The parent's pattern, but where a sibling may have left its mark already.
    let mut expected = pattern(1, buf.size());
    let mut seen = contents(&buf);
    for n in 0..3 {
        let sibling = mark_at(&buf, n);
        assert!(
            seen[sibling] == expected[sibling] || seen[sibling] == 0xF0 + n as u8,
            "byte {sibling}: neither the pattern nor child {n}'s mark"
        );
        seen[sibling] = 0;
        expected[sibling] = 0;
    }
    if let Some(i) = (0..seen.len()).find(|&i| seen[i] != expected[i]) {
        panic!(
            "byte {i} of the import is {:#04x}, the parent wrote {:#04x}",
            seen[i], expected[i]
        );
    }
    buf.write_at(at, &[mark]).unwrap();
    eprintln!("child {}: wrote, acknowledging", std::process::id());
    acks.put(&at).unwrap();
    drop(buf);
    eprintln!("child {}: released its import, exiting", std::process::id());
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_fabric(), timeout = 30)]
fn one_fabric_export_serves_many_children_that_acknowledge(ctx: &Context) {
    let buf = filled(2);
    // Exported once; the descriptor is plain data, cloned for each child. Each child imports
    // after the one before has exited (`concurrent_fabric_imports_of_one_export`: at once).
    let descriptor = buf.export_fabric().unwrap();
    let acks: Queue<usize> = Queue::new().unwrap();
    let mut acked = Vec::new();
    for n in 0..3u8 {
        let at = mark_at(&buf, n as usize);
        let child = ctx
            .spawn(
                import_mark_and_ack,
                (descriptor.clone(), at, 0xF0 + n, acks.clone()),
            )
            .unwrap();
        // A descriptor does not keep the memory alive: the exporter keeps `buf` until every
        // child has said it imported.
        match acks.get(Duration::from_secs(10)) {
            Ok(at) => acked.push(at),
            Err(error) => {
                let stuck = where_stuck(child.pid());
                let story = child.join(Duration::ZERO);
                panic!("child {n} did not acknowledge ({error}); {stuck}\n{story:?}");
            }
        }
        eprintln!("parent: child {n} acknowledged; waiting for it to exit");
        child.wait().unwrap();
        eprintln!("parent: child {n} exited");
    }
    acked.sort();
    for (n, at) in acked.into_iter().enumerate() {
        let mut byte = [0u8];
        buf.read_at(at, &mut byte).unwrap();
        assert_eq!(byte[0], 0xF0 + n as u8);
    }
}

/// Three children importing one fabric export at the same moment, each leaving its mark.
#[ipc_test(skip_unless = vmm_core::testing::cuda_fabric(), timeout = 30)]
fn concurrent_fabric_imports_of_one_export(ctx: &Context) {
    let buf = filled(2);
    let descriptor = buf.export_fabric().unwrap();
    let acks: Queue<usize> = Queue::new().unwrap();
    let children: Vec<_> = (0..3u8)
        .map(|n| {
            let at = mark_at(&buf, n as usize);
            ctx.spawn(
                import_mark_and_ack,
                (descriptor.clone(), at, 0xF0 + n, acks.clone()),
            )
            .unwrap()
        })
        .collect();
    for _ in 0..3 {
        if let Err(error) = acks.get(Duration::from_secs(10)) {
            let stuck: Vec<String> = children.iter().map(|c| where_stuck(c.pid())).collect();
            let stories: Vec<_> = children
                .into_iter()
                .map(|c| c.join(Duration::ZERO))
                .collect();
            panic!("a child did not acknowledge ({error}); {stuck:#?}\n{stories:#?}");
        }
    }
    for child in children {
        child.wait().unwrap();
    }
    for n in 0..3u8 {
        let mut byte = [0u8];
        buf.read_at(mark_at(&buf, n as usize), &mut byte).unwrap();
        assert_eq!(byte[0], 0xF0 + n, "child {n}'s mark");
    }
}

/// Wait for the go-ahead, then take the buffer from the queue (imported on arrival).
fn take_after_go(args: (Queue<()>, Queue<VirtualMemoryBuffer>)) {
    let (go, buffers) = args;
    go.get(TIMEOUT).unwrap();
    let buf = buffers.get(TIMEOUT).unwrap();
    assert_eq!(contents(&buf), pattern(1, buf.size()));
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_fabric())]
fn a_sent_fabric_buffer_outlives_its_senders_handles(ctx: &Context) {
    let go = Queue::new().unwrap();
    let buffers = Queue::new().unwrap();
    let child = ctx
        .spawn(take_after_go, (go.clone(), buffers.clone()))
        .unwrap();
    let buf = filled(3);
    buffers.put(&buf).unwrap();
    // The sender lets go of every handle before the child even looks: the sending process
    // keeps the memory until the child has imported it, as an fd in flight would.
    drop(buf);
    std::thread::sleep(Duration::from_millis(50));
    go.put(&()).unwrap();
    child.wait().unwrap();
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_fabric())]
fn wait_imported_returns_once_the_child_has_imported(ctx: &Context) {
    let go = Queue::new().unwrap();
    let buffers = Queue::new().unwrap();
    let child = ctx
        .spawn(take_after_go, (go.clone(), buffers.clone()))
        .unwrap();
    let buf = filled(1);
    buffers.put(&buf).unwrap();
    assert_eq!(buf.pending_imports(), 1);
    let err = buf.wait_imported(Duration::from_millis(100)).unwrap_err();
    assert!(
        matches!(&err, Error::Timeout { what, .. } if what.starts_with("1 receiver(s)")),
        "the child has not taken it yet: {err:?}"
    );
    go.put(&()).unwrap();
    buf.wait_imported(TIMEOUT).unwrap();
    assert_eq!(buf.pending_imports(), 0);
    child.wait().unwrap();
}

fn import_of_released_memory_fails(descriptor: FabricDescriptor) {
    let err = VirtualMemoryBuffer::import_fabric(&descriptor).unwrap_err();
    eprintln!("import after the exporter released: {err}");
    match err {
        Error::Ipc { op, step, .. } => {
            assert_eq!(op, IpcOp::Import);
            assert!(
                matches!(
                    step,
                    IpcStep::Import(Chunk {
                        index: 0,
                        count: 1,
                        ..
                    })
                ),
                "{step}"
            );
        }
        other => panic!("expected Error::Ipc while importing, got {other:?}"),
    }
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_fabric())]
fn a_fabric_descriptor_does_not_keep_memory_alive(ctx: &Context) {
    let buf = filled(1);
    let descriptor = buf.export_fabric().unwrap();
    // Unlike a buffer sent as a value, a descriptor is plain data: once the exporter has
    // released the memory, its handles name nothing.
    drop(buf);
    ctx.spawn(import_of_released_memory_fails, descriptor)
        .unwrap()
        .wait()
        .unwrap();
}

fn refuse_malformed(descriptor: FabricDescriptor) {
    let resource =
        VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default()).unwrap();
    let g = descriptor.chunk_sizes()[0];
    let min = resource.min_granularity();
    let handle = descriptor.handles()[0];
    let uuid = *descriptor.owner_uuid();
    // Warm up: the first import initialises CUDA here, which opens the driver's own fds.
    drop(resource.import_fabric(&descriptor).unwrap());
    let before = open_fds().unwrap();

    let from = |handles: &[FabricHandle], sizes: &[usize], size: usize, uuid: [u8; 16]| {
        FabricDescriptor::from_handles(handles, sizes, size, uuid)
    };
    // Each case: the descriptor (or its refusal), and the rule the refusal must name.
    let cases: Vec<(Result<FabricDescriptor>, String)> = vec![
        (
            from(&[handle], &[min / 2], min / 2, uuid),
            format!(
                "chunk 1 of 1 has size {}, not a multiple of the allocation granularity {min}",
                min / 2
            ),
        ),
        (
            from(&[handle], &[g], g + 1, uuid),
            format!(
                "size {} exceeds the {g} bytes that its 1 chunk(s) hold",
                g + 1
            ),
        ),
        (
            from(&[handle], &[g, g], g, uuid),
            "1 handle(s) for 2 chunk(s): a descriptor carries exactly one fabric handle per \
             chunk"
                .to_owned(),
        ),
    ];
    for (result, rule) in cases {
        match result.and_then(|bad| resource.import_fabric(&bad)) {
            Err(Error::InvalidDescriptor { message, .. }) => assert_eq!(
                message,
                format!("invalid FabricDescriptor: {rule}"),
                "the refusal names the rule"
            ),
            other => panic!("{rule}: expected InvalidDescriptor, got {other:?}"),
        }
    }
    // A forged handle reaches the driver, which refuses it; the real first chunk, imported
    // already, is released again.
    let forged = FabricHandle::from_bytes(std::array::from_fn(|i| (i as u8) ^ 0x5A));
    match resource.import_fabric(&from(&[handle, forged], &[g, g], 2 * g, uuid).unwrap()) {
        Err(Error::Ipc { op, step, source }) => {
            eprintln!("forged fabric handle refused {step}: {source}");
            assert_eq!(op, IpcOp::Import);
            let chunk = Chunk {
                index: 1,
                count: 2,
                size: g,
            };
            assert_eq!(step, IpcStep::Import(chunk));
            assert_eq!(
                step.to_string(),
                format!("while importing chunk 2 of 2 ({g} bytes)")
            );
        }
        other => panic!("a forged handle must be refused, got {other:?}"),
    }
    assert_eq!(
        open_fds().unwrap(),
        before,
        "a refused descriptor left fds behind"
    );
    // The real one still imports.
    let buf = resource.import_fabric(&descriptor).unwrap();
    assert_eq!(contents(&buf), pattern(1, g));
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_fabric())]
fn malformed_fabric_descriptors_are_refused(ctx: &Context) {
    let buf = filled(1);
    ctx.spawn(refuse_malformed, buf.export_fabric().unwrap())
        .unwrap()
        .wait()
        .unwrap();
}

fn fabric_import_on_the_other_device(args: (FabricDescriptor, FabricDescriptor, String)) {
    let (descriptor, other_device, exporter_uuid) = args;
    // CUDA_VISIBLE_DEVICES=1,0 here: this process's device 0 is the exporter's device 1, and
    // the exporter's device 0 (where the memory lives) is device 1.
    let peer = Device::new(0).unwrap();
    assert_ne!(
        peer.uuid_string(),
        exporter_uuid,
        "device order was not swapped"
    );
    let home = Device::by_uuid(descriptor.owner_uuid()).unwrap();
    assert_eq!((home.uuid_string(), home.ordinal()), (exporter_uuid, 1));

    // Another device's memory: memory of the exporter's device 1 (this process's device 0)
    // imported for this process's device 1, over the fabric; the buffer names its owner.
    let on_home = VirtualMemoryResource::new(&home, ResourceOptions::default()).unwrap();
    let across = on_home.import_fabric(&other_device).unwrap();
    assert_eq!(across.device(), &home);
    assert_eq!(across.owner_uuid(), *peer.uuid());
    assert_eq!(contents(&across), pattern(5, across.size()));
    drop(across);
    // Found by UUID, it imports on its own device.
    let other = VirtualMemoryBuffer::import_fabric(&other_device).unwrap();
    assert_eq!(other.device(), &peer);
    assert_eq!(contents(&other), pattern(5, other.size()));

    // Arriving buffers for `home` are mapped for the peer too.
    set_importer(
        &VirtualMemoryResource::new(
            &home,
            ResourceOptions::default().peer(peer.ordinal(), Access::ReadWrite),
        )
        .unwrap(),
    );
    assert_eq!(
        importer(&home, Location::Device)
            .unwrap()
            .options()
            .peers
            .len(),
        1
    );
    let buf = VirtualMemoryBuffer::import_fabric(&descriptor).unwrap();
    assert_eq!(buf.device(), &home, "imported on the owner's device");
    assert_eq!(contents(&buf), pattern(1, buf.size()));

    // The peer device reads and writes through the mapping, with its own context current.
    let (ptr, size) = (buf.device_ptr(), buf.size());
    let mut seen = vec![0u8; size];
    let written = pattern(4, size);
    with_context_of(&peer, || {
        // SAFETY: `ptr..ptr + size` is `buf`'s mapping, alive for the call and mapped with
        // read-write access for `peer`; `seen` is writable for `size` bytes.
        check("cuMemcpyDtoH (peer)", unsafe {
            sys::cuMemcpyDtoH_v2(seen.as_mut_ptr().cast(), ptr, size)
        });
        // SAFETY: as above; `written` is readable for `size` bytes, and `with_context_of`
        // synchronises before `buf` can go.
        check("cuMemcpyHtoD (peer)", unsafe {
            sys::cuMemcpyHtoD_v2(ptr, written.as_ptr().cast(), size)
        });
    });
    assert_eq!(seen, pattern(1, size), "the peer read the exporter's data");
    assert_eq!(
        contents(&buf),
        written,
        "the peer's write reached the memory"
    );
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_devices(2).and_then(|()| vmm_core::testing::cuda_fabric()))]
fn two_gpus_fabric_import_on_the_owners_device_with_peer_access(ctx: &Context) {
    let resource = fabric_resource(0, ResourceOptions::default().peer(1, Access::ReadWrite));
    let buf = resource.allocate(resource.granularity()).unwrap();
    buf.write_at(0, &pattern(1, buf.size())).unwrap();
    let on_one = fabric_resource(1, ResourceOptions::default());
    let other = on_one.allocate(on_one.granularity()).unwrap();
    other.write_at(0, &pattern(5, other.size())).unwrap();
    let exporter_uuid = buf.device().uuid_string();
    ctx.clone()
        .with_env("CUDA_VISIBLE_DEVICES", "1,0")
        .spawn(
            fabric_import_on_the_other_device,
            (
                buf.export_fabric().unwrap(),
                other.export_fabric().unwrap(),
                exporter_uuid,
            ),
        )
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(contents(&buf), pattern(4, buf.size()));
}

// ---- Memory whose owner the importer cannot see ------------------------------------------

/// The exporter of a remote-owner hand-off, seeing only its own GPU: fill a fabric buffer
/// with `pattern(7, ..)`, send its descriptor, and once the importer says it wrote its mark,
/// send back the first bytes it finds.
fn export_and_report_mark(args: (Queue<FabricDescriptor>, Queue<()>, Queue<Vec<u8>>)) {
    let (descriptors, marked, seen) = args;
    assert_eq!(
        Device::count().unwrap(),
        1,
        "the exporter sees more than its GPU"
    );
    let resource = fabric_resource(0, ResourceOptions::default());
    let buf = resource.allocate(resource.granularity()).unwrap();
    buf.write_at(0, &pattern(7, buf.size())).unwrap();
    descriptors.put(&buf.export_fabric().unwrap()).unwrap();
    marked.get(TIMEOUT).unwrap();
    seen.put(&contents(&buf)[..16].to_vec()).unwrap();
}

/// The importer, seeing only the other GPU: the owner is not among its devices, and the
/// memory is mapped for its own device over the fabric.
fn import_remote_and_mark(args: (FabricDescriptor, Queue<()>)) {
    let (descriptor, marked) = args;
    assert_eq!(
        Device::count().unwrap(),
        1,
        "the importer sees more than its GPU"
    );
    assert!(
        Device::by_uuid(descriptor.owner_uuid()).is_err(),
        "the importer sees the owner's GPU"
    );
    let buf = VirtualMemoryBuffer::import_fabric(&descriptor).unwrap();
    assert_eq!(buf.owner_uuid(), *descriptor.owner_uuid());
    assert_ne!(buf.device().uuid(), descriptor.owner_uuid());
    assert_eq!(contents(&buf), pattern(7, buf.size()), "the owner's data");
    buf.write_at(0, &[0xA5; 16]).unwrap();
    drop(buf);
    marked.put(&()).unwrap();
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_devices(2).and_then(|()| vmm_core::testing::cuda_fabric()))]
fn two_gpus_fabric_import_of_memory_whose_owner_the_importer_cannot_see(ctx: &Context) {
    let (descriptors, marked, seen) = (
        Queue::new().unwrap(),
        Queue::new().unwrap(),
        Queue::new().unwrap(),
    );
    let exporter = ctx
        .clone()
        .with_env("CUDA_VISIBLE_DEVICES", "0")
        .spawn(
            export_and_report_mark,
            (descriptors.clone(), marked.clone(), seen.clone()),
        )
        .unwrap();
    let descriptor = descriptors.get(TIMEOUT).unwrap();
    ctx.clone()
        .with_env("CUDA_VISIBLE_DEVICES", "1")
        .spawn(import_remote_and_mark, (descriptor, marked.clone()))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        seen.get(TIMEOUT).unwrap(),
        [0xA5; 16],
        "the importer's mark"
    );
    exporter.wait().unwrap();
}

/// The exporter of a POSIX-fd descriptor in the same setup: it keeps its buffer until told.
fn export_posix_and_wait(args: (Queue<vmm_core::cuda::IpcDescriptor>, Queue<()>)) {
    let (descriptors, done) = args;
    let resource =
        VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default()).unwrap();
    let buf = resource.allocate(resource.granularity()).unwrap();
    descriptors.put(&buf.export().unwrap()).unwrap();
    done.get(TIMEOUT).unwrap();
}

/// A POSIX-fd descriptor of a GPU this process cannot see: refused before any driver call,
/// with an error that says why, and its fd closed with it.
fn import_posix_of_a_hidden_gpu(descriptor: vmm_core::cuda::IpcDescriptor) {
    let here = Device::new(0).unwrap();
    let resource = VirtualMemoryResource::new(&here, ResourceOptions::default()).unwrap();
    let before = open_fds().unwrap();
    match VirtualMemoryBuffer::import(&descriptor) {
        Err(error) => assert!(
            error
                .to_string()
                .contains("no CUDA device in this process has UUID"),
            "{error}"
        ),
        Ok(_) => panic!("a POSIX-fd descriptor of a hidden GPU was imported"),
    }
    match resource.import(&descriptor) {
        Err(Error::InvalidDescriptor {
            rule: DescriptorRule::Location,
            message: m,
        }) => assert!(
            m.contains("live on the exporter's device") && m.contains(&here.uuid_string()),
            "{m}"
        ),
        other => panic!("expected the device refusal, got {other:?}"),
    }
    assert_eq!(
        open_fds().unwrap(),
        before,
        "a refusal opened or closed fds"
    );
    drop(descriptor);
    assert_eq!(
        open_fds().unwrap(),
        before - 1,
        "the descriptor's fd stayed open"
    );
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_devices(2))]
fn two_gpus_posix_fd_descriptor_of_a_gpu_the_importer_cannot_see_is_refused(ctx: &Context) {
    let (descriptors, done) = (Queue::new().unwrap(), Queue::new().unwrap());
    let exporter = ctx
        .clone()
        .with_env("CUDA_VISIBLE_DEVICES", "0")
        .spawn(export_posix_and_wait, (descriptors.clone(), done.clone()))
        .unwrap();
    let descriptor = descriptors.get(TIMEOUT).unwrap();
    let importer = ctx
        .clone()
        .with_env("CUDA_VISIBLE_DEVICES", "1")
        .spawn(import_posix_of_a_hidden_gpu, descriptor)
        .unwrap()
        .wait();
    done.put(&()).unwrap();
    importer.unwrap();
    exporter.wait().unwrap();
}

// ---- A receiver vmm-core did not start: TCP on 127.0.0.1, JSON ---------------------------

/// Set in the receiver process: the sender's address.
const TCP_RECEIVER_VAR: &str = "VMM_TEST_FABRIC_TCP_ADDR";

/// What the sender writes, as one JSON line.
#[derive(Serialize, Deserialize)]
struct Offer {
    descriptor: FabricDescriptor,
    seed: u8,
}

/// What the receiver writes back, as one JSON line.
#[derive(Serialize, Deserialize, Debug)]
struct Reply {
    imported: bool,
    pattern_matched: bool,
    error: Option<String>,
}

/// The receiver: this test binary re-run with `--ignored --exact fabric_tcp_receiver` and
/// [`TCP_RECEIVER_VAR`] set, by a plain `std::process::Command`, not by vmm-core. Without the
/// variable (a run of all ignored tests) it does nothing.
#[test]
#[ignore = "the receiver half of tcp_receiver_that_vmm_core_did_not_start"]
fn fabric_tcp_receiver() {
    let Ok(addr) = std::env::var(TCP_RECEIVER_VAR) else {
        return;
    };
    let stream = TcpStream::connect(&addr).unwrap();
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).unwrap();
    let offer: Offer = serde_json::from_str(&line).unwrap();
    let reply = match VirtualMemoryBuffer::import_fabric(&offer.descriptor) {
        Ok(buf) => {
            let matched = contents(&buf) == pattern(offer.seed, buf.size());
            buf.write_at(0, &pattern(offer.seed + 1, buf.size()))
                .unwrap();
            Reply {
                imported: true,
                pattern_matched: matched,
                error: None,
            }
        }
        Err(e) => Reply {
            imported: false,
            pattern_matched: false,
            error: Some(e.to_string()),
        },
    };
    let mut out = serde_json::to_string(&reply).unwrap();
    out.push('\n');
    (&stream).write_all(out.as_bytes()).unwrap();
}

/// The receiver's connection, or a failure with its output if it exits (or takes longer than
/// [`TIMEOUT`]) without connecting.
fn accept_from(
    listener: &TcpListener,
    mut receiver: std::process::Child,
) -> (TcpStream, std::process::Child) {
    listener.set_nonblocking(true).unwrap();
    let started = std::time::Instant::now();
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).unwrap();
                return (stream, receiver);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("accept: {e}"),
        }
        let exited = receiver.try_wait().unwrap().is_some();
        if exited || started.elapsed() > TIMEOUT {
            let _ = receiver.kill();
            let output = receiver.wait_with_output().unwrap();
            panic!(
                "the receiver never connected ({}):\n{}",
                if exited { "it exited" } else { "timed out" },
                text(&output)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[ipc_test(methods = [spawn], skip_unless = vmm_core::testing::cuda_fabric())]
fn tcp_receiver_that_vmm_core_did_not_start(_ctx: &Context) {
    let buf = filled(2);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let receiver = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "fabric_tcp_receiver", "--nocapture"])
        .env(TCP_RECEIVER_VAR, &addr)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (stream, receiver) = accept_from(&listener, receiver);
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    let offer = Offer {
        descriptor: buf.export_fabric().unwrap(),
        seed: 1,
    };
    let mut line = serde_json::to_string(&offer).unwrap();
    line.push('\n');
    (&stream).write_all(line.as_bytes()).unwrap();
    let mut reply = String::new();
    let read = BufReader::new(&stream).read_line(&mut reply);
    let output = receiver.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "the receiver failed:\n{}",
        text(&output)
    );
    read.unwrap();
    let reply: Reply = serde_json::from_str(&reply)
        .unwrap_or_else(|e| panic!("reply {reply:?}: {e}\n{}", text(&output)));
    assert!(
        reply.imported && reply.pattern_matched,
        "{reply:?}\n{}",
        text(&output)
    );
    // The exporter kept `buf` until the reply: the receiver's write is in the memory.
    assert_eq!(contents(&buf), pattern(2, buf.size()));
}
