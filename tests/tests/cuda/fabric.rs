//! Fabric handles across processes, each scenario generated for both cold start methods by
//! `#[ipc_test]` (a buffer as an argument and through a Queue are `handles`'; two GPUs are
//! `two_gpus`'; a receiver vmm-core did not start is `fabric_tcp`'s): one descriptor to many
//! children, the lifetime rules, the refusals.
//!
//! They skip (one `SKIP` line each) where fabric handles cannot be used (no GPU, no fabric
//! support, or no IMEX channel: the reason says which), and fail there instead under
//! `VMM_REQUIRE_GPU=1`, which the GPU runs set.

use std::time::Duration;

use vmm_core::cuda::{
    Device, FabricDescriptor, FabricHandle, ResourceOptions, VirtualMemoryBuffer,
    VirtualMemoryResource,
};
use vmm_core::error::{Chunk, IpcOp, IpcStep};
use vmm_core::ipc_test;
use vmm_core::process::{Context, Process};
use vmm_core::testing::open_fds;
use vmm_core::wire::Queue;
use vmm_core::{Error, Result};
use vmm_tests::turns::shared;
use vmm_tests::{contents, pattern, where_stuck};

use super::{TIMEOUT, filled_fabric};

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
    let _turn = shared();
    let buf = filled_fabric(2);
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
    let _turn = shared();
    let buf = filled_fabric(2);
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

/// A child started on [`take_after_go`], a fabric buffer of `chunks` chunks sent to it (in
/// flight until the child takes it), and the queue that lets the child go on.
fn send_to_a_child_that_waits(
    ctx: &Context,
    chunks: usize,
) -> (Process, Queue<()>, VirtualMemoryBuffer) {
    let go = Queue::new().unwrap();
    let buffers = Queue::new().unwrap();
    let child = ctx
        .spawn(take_after_go, (go.clone(), buffers.clone()))
        .unwrap();
    let buf = filled_fabric(chunks);
    buffers.put(&buf).unwrap();
    (child, go, buf)
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_fabric())]
fn a_sent_fabric_buffer_outlives_its_senders_handles(ctx: &Context) {
    let _turn = shared();
    let (child, go, buf) = send_to_a_child_that_waits(ctx, 3);
    // The sender lets go of every handle before the child even looks: the sending process
    // keeps the memory until the child has imported it, as an fd in flight would.
    drop(buf);
    std::thread::sleep(Duration::from_millis(50));
    go.put(&()).unwrap();
    child.wait().unwrap();
}

#[ipc_test(skip_unless = vmm_core::testing::cuda_fabric())]
fn wait_imported_returns_once_the_child_has_imported(ctx: &Context) {
    let _turn = shared();
    let (child, go, buf) = send_to_a_child_that_waits(ctx, 1);
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
    let _turn = shared();
    let buf = filled_fabric(1);
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
    let _turn = shared();
    let buf = filled_fabric(1);
    ctx.spawn(refuse_malformed, buf.export_fabric().unwrap())
        .unwrap()
        .wait()
        .unwrap();
}
