//! The POSIX-fd scenarios (those the same for fabric handles are `handles`'), each generated
//! for every start method it names by `#[ipc_test]`: fd accounting, grown and relocated
//! buffers, refusals of malformed and re-exported descriptors, descriptors through a transport
//! of one's own, shared and concurrent imports. They skip (one `SKIP` line each) where no GPU
//! with VMM IPC support is present, and fail there instead under `VMM_REQUIRE_GPU=1`.

use std::os::fd::AsFd;
use std::sync::Barrier;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use vmm_core::cuda::{
    Device, Granularity, HandleType, IpcDescriptor, Location, ResourceOptions, VirtualMemoryBuffer,
    VirtualMemoryResource, importer,
};
use vmm_core::error::ExportRule;
use vmm_core::ipc_test;
use vmm_core::process::ensure_running;
use vmm_core::process::{Context, Process};
use vmm_core::testing::{open_fds, settled_open_fds};
use vmm_core::wire::{Fd, Queue};
use vmm_core::{Error, SharedBuffer};
use vmm_tests::turns::shared;
use vmm_tests::{contents, pattern};

use super::handles::read_back_and_reply;
use super::{TIMEOUT, filled, resource};

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc(), thread_unsafe = "counts the process's open fds")]
fn fd_count_returns_to_baseline(ctx: &Context) {
    let _turn = shared();
    ensure_running().unwrap();
    let buf = filled(2);
    let before = settled_open_fds().unwrap();
    ctx.spawn(read_back_and_reply, (buf.clone(), false))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "passing a buffer to a child leaked fds"
    );
    assert_eq!(contents(&buf), pattern(2, buf.size()));
}

fn read_grown(buf: VirtualMemoryBuffer) {
    let g = buf.chunk_sizes()[0];
    assert_eq!(
        buf.chunk_sizes(),
        vec![g, g],
        "the import keeps the exporter's layout"
    );
    assert_eq!(buf.size(), 2 * g);
    // One copy across the chunk boundary: the chunks are mapped back to back.
    let mut across = vec![0u8; 4096];
    buf.read_at(g - 2048, &mut across).unwrap();
    assert_eq!(across, pattern(1, 2 * g)[g - 2048..g + 2048]);
    assert_eq!(contents(&buf), pattern(1, 2 * g));
}

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn grown_two_chunk_buffer_reads_as_one_range(ctx: &Context) {
    let _turn = shared();
    let buf = filled(2);
    ctx.spawn(read_grown, buf.clone()).unwrap().wait().unwrap();
}

fn refuse_malformed(descriptor: IpcDescriptor) {
    let resource = resource();
    let g = descriptor.chunk_sizes()[0];
    let min = resource.min_granularity();
    let fds: Vec<_> = descriptor.fds().collect();
    let before = open_fds().unwrap();
    // Each case: the layout, and the rule the refusal must name.
    let cases: Vec<(vmm_core::Result<IpcDescriptor>, String)> = vec![
        (
            IpcDescriptor::from_fds(&fds, &[min / 2], HandleType::PosixFd, min / 2),
            format!(
                "chunk 1 of 1 has size {}, not a multiple of the allocation granularity {min}",
                min / 2
            ),
        ),
        (
            IpcDescriptor::from_fds(&fds, &[g], HandleType::PosixFd, g + 1),
            format!(
                "size {} exceeds the {g} bytes that its 1 chunk(s) hold",
                g + 1
            ),
        ),
        (
            IpcDescriptor::from_fds(&fds, &[g, g], HandleType::PosixFd, g),
            "1 fd(s) for 2 chunk(s): a descriptor carries exactly one fd per chunk".to_owned(),
        ),
        (
            IpcDescriptor::from_fds(&fds, &[g], HandleType::None, g),
            "handle type None: only PosixFd descriptors can be imported".to_owned(),
        ),
        (
            IpcDescriptor::from_fds(&fds, &[0], HandleType::PosixFd, 0),
            "chunk 1 of 1 has size 0: chunks are never empty".to_owned(),
        ),
    ];
    for (result, rule) in cases {
        let refused = result.and_then(|bad| resource.import(&bad));
        match refused {
            Err(Error::InvalidDescriptor { message, .. }) => assert_eq!(
                message,
                format!("invalid IpcDescriptor: {rule}"),
                "the refusal names the rule"
            ),
            other => panic!("{rule}: expected InvalidDescriptor, got {other:?}"),
        }
    }
    assert_eq!(
        open_fds().unwrap(),
        before,
        "a refused descriptor left fds behind"
    );
    // The real one still imports.
    let buf = resource.import(&descriptor).unwrap();
    assert_eq!(contents(&buf), pattern(1, g));
}

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn malformed_descriptors_are_refused(ctx: &Context) {
    let _turn = shared();
    let buf = filled(1);
    ctx.spawn(refuse_malformed, buf.export().unwrap())
        .unwrap()
        .wait()
        .unwrap();
}

/// The rule every refusal to export imported memory states (after its operation's prefix).
const REEXPORT_RULE: &str = "an imported buffer cannot be exported again (the CUDA driver \
     refuses to re-export imported memory, and host buffers follow the same rule): forward the \
     descriptor you imported it from, or copy the data into a buffer allocated here and export \
     that";

/// The next item of `queue`; if none comes, the test fails with `child`'s own outcome (a child
/// that failed before it put one would otherwise leave the parent waiting, and its panic unseen).
fn next_or_child_error<T: Serialize + DeserializeOwned>(
    queue: &Queue<T>,
    child: Process,
) -> (T, Process) {
    match queue.get(Duration::from_secs(20)) {
        Ok(item) => (item, child),
        Err(e) => panic!("nothing arrived ({e}); the child: {:?}", child.wait()),
    }
}

fn try_reexport(args: (VirtualMemoryBuffer, Queue<VirtualMemoryBuffer>, Queue<u8>)) {
    let (buf, queue, ack) = args;
    match buf.export() {
        Err(
            refused @ Error::NotExportable {
                rule: ExportRule::Imported,
                ..
            },
        ) => {
            assert_eq!(refused.to_string(), format!("export: {REEXPORT_RULE}"))
        }
        other => panic!("re-export must be refused, got {other:?}"),
    }
    // Sending exports on the way, so it is refused the same way (the encode's typed error).
    match queue.put(&buf) {
        Err(
            refused @ Error::NotExportable {
                rule: ExportRule::Imported,
                ..
            },
        ) => assert_eq!(
            refused.to_string(),
            format!("vmm_core::cuda::VirtualMemoryBuffer: {REEXPORT_RULE}")
        ),
        other => panic!("sending an imported buffer must be refused, got {other:?}"),
    }
    // The queue is still usable after the refused put: a buffer of this process goes through.
    let own = resource().allocate(buf.size()).unwrap();
    own.write_at(0, &pattern(7, own.size())).unwrap();
    queue.put(&own).unwrap();
    // Keep `own` until the parent has imported it.
    assert_eq!(ack.get(TIMEOUT).unwrap(), 1);
}

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn imported_buffer_is_not_exported_again(ctx: &Context) {
    let _turn = shared();
    let buf = filled(1);
    let queue = Queue::new().unwrap();
    let ack = Queue::new().unwrap();
    let child = ctx
        .spawn(try_reexport, (buf.clone(), queue.clone(), ack.clone()))
        .unwrap();
    let (theirs, child) = next_or_child_error(&queue, child);
    assert_eq!(contents(&theirs), pattern(7, buf.size()));
    ack.put(&1).unwrap();
    child.wait().unwrap();
    assert!(
        queue.try_get().unwrap().is_none(),
        "nothing was half-sent by the refused put"
    );
}

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc(), thread_unsafe = "counts the process's open fds")]
fn imported_buffer_as_process_argument_is_refused(ctx: &Context) {
    let _turn = shared();
    ensure_running().unwrap();
    let buf = filled(1);
    let alias = VirtualMemoryBuffer::import(&buf.export().unwrap()).unwrap();
    let before = settled_open_fds().unwrap();
    match ctx.spawn(read_back_and_reply, (alias.clone(), false)) {
        Err(
            refused @ Error::NotExportable {
                rule: ExportRule::Imported,
                ..
            },
        ) => assert_eq!(
            refused.to_string(),
            format!("vmm_core::cuda::VirtualMemoryBuffer: {REEXPORT_RULE}")
        ),
        Ok(child) => panic!("an imported buffer went to child {}", child.pid()),
        Err(other) => panic!("expected NotExportable, got {other:?}"),
    }
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "a refused spawn keeps no fd (and started nothing)"
    );
    // The exporter's own buffer goes.
    ctx.spawn(read_back_and_reply, (buf.clone(), false))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(contents(&alias), pattern(2, buf.size()));
}

fn importer_holds_no_fd(descriptor: IpcDescriptor) {
    let chunks = descriptor.chunk_sizes().len();
    // The first import initialises CUDA here, which opens the driver's own fds (device nodes):
    // take the baseline after that.
    drop(VirtualMemoryBuffer::import(&descriptor).unwrap());
    let before = open_fds().unwrap();
    let buf = VirtualMemoryBuffer::import(&descriptor).unwrap();
    assert_eq!(
        open_fds().unwrap(),
        before,
        "an import holds no fd of its own"
    );
    drop(descriptor);
    assert_eq!(
        open_fds().unwrap(),
        before - chunks,
        "the descriptor owned exactly one fd per chunk"
    );
    assert_eq!(contents(&buf), pattern(1, buf.size()));
}

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc(), thread_unsafe = "counts the process's open fds")]
fn fds_live_only_in_descriptors(ctx: &Context) {
    let _turn = shared();
    ensure_running().unwrap();
    // Initialise CUDA here first: the driver keeps its own fds (device nodes) for the process's
    // life, and this test may be the first in the binary to touch the GPU.
    drop(filled(1));
    let before = settled_open_fds().unwrap();
    let buf = filled(3);
    assert_eq!(open_fds().unwrap(), before, "a buffer holds no fd");
    let descriptor = buf.export().unwrap();
    assert_eq!(
        open_fds().unwrap(),
        before + 3,
        "a descriptor holds one fd per chunk"
    );
    ctx.spawn(importer_holds_no_fd, descriptor)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "the exporter holds no fd once the descriptor is gone"
    );
}

#[ipc_test(methods = [spawn], skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn same_process_alias_sees_writes_both_ways(_ctx: &Context) {
    let _turn = shared();
    let buf = filled(2);
    let alias = VirtualMemoryBuffer::import(&buf.export().unwrap()).unwrap();
    assert_ne!(
        alias.device_ptr(),
        buf.device_ptr(),
        "an alias lives at a new address"
    );
    assert_eq!(contents(&alias), pattern(1, buf.size()));
    alias.write_at(0, &pattern(3, buf.size())).unwrap();
    assert_eq!(contents(&buf), pattern(3, buf.size()));
    buf.fill(0x5A).unwrap();
    assert!(contents(&alias).iter().all(|&b| b == 0x5A));
    // The alias outlives the original.
    drop(buf);
    assert!(contents(&alias).iter().all(|&b| b == 0x5A));
}

/// Another allocation at the range right after `buf`, so that growing `buf` cannot be in place.
fn occupy_after(buf: &VirtualMemoryBuffer) -> VirtualMemoryBuffer {
    let after = buf.device_ptr() + buf.capacity() as u64;
    VirtualMemoryResource::new(
        buf.device(),
        ResourceOptions::default()
            .granularity(Granularity::Minimum)
            .address_hint(after),
    )
    .unwrap()
    .allocate(1)
    .unwrap()
}

fn write_every_chunk(buf: VirtualMemoryBuffer) {
    let g = buf.chunk_sizes()[0];
    assert_eq!(buf.chunk_sizes(), vec![g; 3]);
    assert_eq!(contents(&buf), pattern(1, 3 * g), "the parent's data");
    for chunk in 0..3 {
        buf.write_at(chunk * g, &pattern(30 + chunk as u8, g))
            .unwrap();
    }
}

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn relocated_buffer_crosses_to_a_child_that_writes_every_chunk(ctx: &Context) {
    let _turn = shared();
    let resource = resource();
    let g = resource.granularity();
    let two = resource
        .grow(&resource.allocate(g).unwrap(), 2 * g)
        .unwrap();
    let blocker = occupy_after(&two);
    let three = resource.grow(&two, 3 * g).unwrap();
    // `two` still holds its range, so an in-place grow is the only way to keep its address.
    assert_ne!(
        three.device_ptr(),
        two.device_ptr(),
        "with the range after it taken (blocker at {:#x}), grow relocates",
        blocker.device_ptr()
    );
    assert_eq!(three.chunk_sizes(), vec![g; 3]);
    three.write_at(0, &pattern(1, 3 * g)).unwrap();
    ctx.spawn(write_every_chunk, three.clone())
        .unwrap()
        .wait()
        .unwrap();
    for chunk in 0..3 {
        let mut seen = vec![0u8; g];
        three.read_at(chunk * g, &mut seen).unwrap();
        assert_eq!(seen, pattern(30 + chunk as u8, g), "chunk {}", chunk + 1);
    }
    // The first two chunks are the same memory at their old address.
    let mut old = vec![0u8; 2 * g];
    two.read_at(0, &mut old).unwrap();
    assert_eq!(old[..g], pattern(30, g));
    assert_eq!(old[g..], pattern(31, g));
}

fn import_from_plain_fds(args: (Vec<Fd>, Vec<usize>, usize)) {
    let (fds, chunk_sizes, size) = args;
    let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
    let descriptor =
        IpcDescriptor::from_fds(&borrowed, &chunk_sizes, HandleType::PosixFd, size).unwrap();
    drop(fds); // the descriptor holds its own duplicates
    assert_eq!(descriptor.device(), None, "fds and sizes name no device");
    // Into this process's importer for device 0 (the exporter's: same CUDA_VISIBLE_DEVICES).
    let buf = VirtualMemoryBuffer::import(&descriptor).unwrap();
    drop(descriptor);
    read_back_and_reply((buf, false));
}

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn descriptor_fds_through_a_transport_of_ones_own(ctx: &Context) {
    let _turn = shared();
    let buf = filled(2);
    let descriptor = buf.export().unwrap();
    let chunk_sizes = descriptor.chunk_sizes().to_vec();
    let size = descriptor.size();
    let fds: Vec<Fd> = descriptor.into_fds().into_iter().map(Fd::from).collect();
    assert_eq!(fds.len(), 2, "one fd per chunk");
    ctx.spawn(import_from_plain_fds, (fds, chunk_sizes, size))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(contents(&buf), pattern(2, buf.size()));
}

fn check_empty(buf: &VirtualMemoryBuffer) {
    assert!(buf.is_imported());
    assert_eq!(
        (buf.size(), buf.device_ptr(), buf.chunk_sizes()),
        (0, 0, vec![])
    );
    buf.fill(1).unwrap();
    buf.write_at(0, &[]).unwrap();
    buf.read_at(0, &mut []).unwrap();
    match buf.read_at(0, &mut [0]) {
        Err(refused @ Error::OutOfBounds { .. }) => assert_eq!(
            refused.to_string(),
            "read_at: 1 bytes at offset 0 are out of bounds of the 0-byte buffer"
        ),
        other => panic!("expected OutOfBounds, got {other:?}"),
    }
}

fn receive_empty(args: (VirtualMemoryBuffer, Queue<VirtualMemoryBuffer>)) {
    let (argument, queue) = args;
    check_empty(&argument);
    check_empty(&queue.get(TIMEOUT).unwrap());
}

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn empty_buffer_as_argument_and_through_queue(ctx: &Context) {
    let _turn = shared();
    let empty = resource().allocate(0).unwrap();
    assert_eq!((empty.size(), empty.device_ptr()), (0, 0));
    let queue = Queue::new().unwrap();
    let child = ctx
        .spawn(receive_empty, (empty.clone(), queue.clone()))
        .unwrap();
    queue.put(&empty).unwrap();
    child.wait().unwrap();
    assert!(queue.try_get().unwrap().is_none());
}

fn write_half(args: (VirtualMemoryBuffer, usize)) {
    let (buf, half) = args;
    let len = buf.size() / 2;
    let mut mine = vec![0u8; len];
    buf.read_at(half * len, &mut mine).unwrap();
    assert_eq!(mine, pattern(1, buf.size())[half * len..][..len]);
    buf.write_at(half * len, &pattern(20 + half as u8, len))
        .unwrap();
}

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn two_children_share_one_buffer(ctx: &Context) {
    let _turn = shared();
    let buf = filled(2);
    let half = buf.size() / 2;
    // Both run at once: each has imported the same memory while the other writes.
    let first = ctx.spawn(write_half, (buf.clone(), 0)).unwrap();
    let second = ctx.spawn(write_half, (buf.clone(), 1)).unwrap();
    first.wait().unwrap();
    second.wait().unwrap();
    let all = contents(&buf);
    assert_eq!(all[..half], pattern(20, half), "the first child's half");
    assert_eq!(all[half..], pattern(21, half), "the second child's half");
}

const THREADS: usize = 8;

fn import_from_many_threads(descriptor: IpcDescriptor) {
    let size = descriptor.size();
    let start = Barrier::new(THREADS);
    // The first imports also initialise CUDA and this process's importer, all at once.
    let buffers: Vec<VirtualMemoryBuffer> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..THREADS)
            .map(|_| {
                scope.spawn(|| {
                    start.wait();
                    let buf = VirtualMemoryBuffer::import(&descriptor).unwrap();
                    assert_eq!(contents(&buf), pattern(1, size));
                    buf
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let mut addresses: Vec<u64> = buffers.iter().map(|b| b.device_ptr()).collect();
    addresses.sort_unstable();
    addresses.dedup();
    assert_eq!(
        addresses.len(),
        THREADS,
        "each import is a mapping of its own"
    );
    // All of them are the one memory.
    buffers[THREADS - 1].write_at(0, &pattern(9, size)).unwrap();
    for buf in &buffers {
        assert_eq!(contents(buf), pattern(9, size));
    }
}

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn concurrent_imports_from_several_threads(ctx: &Context) {
    let _turn = shared();
    let buf = filled(2);
    ctx.spawn(import_from_many_threads, buf.export().unwrap())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(contents(&buf), pattern(9, buf.size()));
}

/// The sizes of the seven buffers, for granularity `g`: one byte, whole and partial chunks, two
/// chunks by a grow, and an empty one.
fn seven_sizes(g: usize) -> [usize; 7] {
    [1, g, g + 1, 2 * g, 0, 3 * g / 2, 4097]
}

fn check_seven(buffers: Vec<VirtualMemoryBuffer>) {
    let g = importer(&Device::new(0).unwrap(), Location::Device)
        .unwrap()
        .granularity();
    let sizes: Vec<usize> = buffers.iter().map(VirtualMemoryBuffer::size).collect();
    assert_eq!(
        sizes,
        seven_sizes(g),
        "the buffers arrive whole and in order"
    );
    assert_eq!(
        buffers[3].chunk_sizes(),
        vec![g, g],
        "the grown one keeps its chunks"
    );
    for (index, buf) in buffers.iter().enumerate() {
        assert_eq!(
            contents(buf),
            pattern(40 + index as u8, buf.size()),
            "buffer {index}"
        );
        buf.write_at(0, &pattern(50 + index as u8, buf.size()))
            .unwrap();
    }
}

#[ipc_test(methods = all, skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn seven_buffers_as_one_argument(ctx: &Context) {
    let _turn = shared();
    let resource = resource();
    let g = resource.granularity();
    let buffers: Vec<VirtualMemoryBuffer> = seven_sizes(g)
        .into_iter()
        .enumerate()
        .map(|(index, size)| {
            let buf = if index == 3 {
                resource.grow(&resource.allocate(g).unwrap(), size).unwrap()
            } else {
                resource.allocate(size).unwrap()
            };
            buf.write_at(0, &pattern(40 + index as u8, size)).unwrap();
            buf
        })
        .collect();
    ctx.spawn(check_seven, buffers.clone())
        .unwrap()
        .wait()
        .unwrap();
    for (index, buf) in buffers.iter().enumerate() {
        assert_eq!(
            contents(buf),
            pattern(50 + index as u8, buf.size()),
            "buffer {index}"
        );
    }
}

/// The shared trait lets one body serve both backends.
fn roundtrip_through_trait<B: SharedBuffer>(buf: &B) {
    let copy = B::import(&buf.export().unwrap()).unwrap();
    copy.write_at(0, b"trait").unwrap();
    let mut out = [0u8; 5];
    buf.read_at(0, &mut out).unwrap();
    assert_eq!(&out, b"trait");
}

#[ipc_test(methods = [spawn], skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn both_backends_share_one_shape(_ctx: &Context) {
    let _turn = shared();
    roundtrip_through_trait(&filled(1));
    roundtrip_through_trait(&vmm_core::shm::HostBuffer::new(4096).unwrap());
}
