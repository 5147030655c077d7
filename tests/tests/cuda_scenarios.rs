//! The CUDA VMM scenarios, each generated for both start methods by `#[ipc_test]`. They skip
//! (one `SKIP` line each) where no GPU with VMM IPC support is present, and fail there instead
//! under `VMM_REQUIRE_GPU=1`, which the GPU runs set.

use std::time::Duration;

use cudarc::driver::sys;
use vmm_core::cuda::{
    Access, Device, HandleType, IpcDescriptor, Location, PeerAccess, ResourceOptions,
    VirtualMemoryBuffer, VirtualMemoryResource, importer, set_importer,
};
use vmm_core::ipc_test;
use vmm_core::process::Context;
use vmm_core::process::ensure_running;
use vmm_core::testing::{open_fds, settled_open_fds};
use vmm_core::wire::Queue;
use vmm_core::{Error, SharedBuffer};
use vmm_tests::pattern;

const TIMEOUT: Duration = Duration::from_secs(60);

fn resource() -> VirtualMemoryResource {
    VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default()).unwrap()
}

fn contents(buf: &VirtualMemoryBuffer) -> Vec<u8> {
    let mut out = vec![0u8; buf.size()];
    buf.read_at(0, &mut out).unwrap();
    out
}

/// A buffer of `chunks` chunks of the granularity, filled with `pattern(1, ..)`.
fn filled(chunks: usize) -> VirtualMemoryBuffer {
    let resource = resource();
    let g = resource.granularity();
    let mut buf = resource.allocate(g).unwrap();
    for n in 2..=chunks {
        buf = resource.grow(&buf, n * g).unwrap();
    }
    assert_eq!(buf.chunk_sizes(), vec![g; chunks]);
    buf.write_at(0, &pattern(1, buf.size())).unwrap();
    buf
}

fn read_back_and_reply(buf: VirtualMemoryBuffer) {
    assert!(buf.is_imported());
    assert_eq!(
        contents(&buf),
        pattern(1, buf.size()),
        "child did not see the parent's pattern"
    );
    buf.write_at(0, &pattern(2, buf.size())).unwrap();
}

#[ipc_test(methods = [spawn, forkserver, warm], skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn buffer_as_process_argument(ctx: &Context) {
    let buf = filled(1);
    ctx.spawn(read_back_and_reply, buf.clone())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(contents(&buf), pattern(2, buf.size()));
}

#[ipc_test(methods = [spawn, forkserver, warm], skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn buffer_through_queue(ctx: &Context) {
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

#[ipc_test(methods = [spawn, forkserver, warm], skip_unless = vmm_core::testing::cuda_vmm_ipc(), thread_unsafe = "counts the process's open fds")]
fn fd_count_returns_to_baseline(ctx: &Context) {
    ensure_running().unwrap();
    let buf = filled(2);
    let before = settled_open_fds().unwrap();
    ctx.spawn(read_back_and_reply, buf.clone())
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

#[ipc_test(methods = [spawn, forkserver, warm], skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn grown_two_chunk_buffer_reads_as_one_range(ctx: &Context) {
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
    ];
    for (result, rule) in cases {
        let refused = result.and_then(|bad| resource.import(&bad));
        match refused {
            Err(Error::InvalidArgument(message)) => assert_eq!(
                message,
                format!("invalid IpcDescriptor: {rule}"),
                "the refusal names the rule"
            ),
            other => panic!("{rule}: expected InvalidArgument, got {other:?}"),
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

#[ipc_test(methods = [spawn, forkserver, warm], skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn malformed_descriptors_are_refused(ctx: &Context) {
    let buf = filled(1);
    ctx.spawn(refuse_malformed, buf.export().unwrap())
        .unwrap()
        .wait()
        .unwrap();
}

fn try_reexport(args: (VirtualMemoryBuffer, Queue<VirtualMemoryBuffer>)) {
    let (buf, queue) = args;
    let Err(Error::InvalidArgument(message)) = buf.export() else {
        panic!("re-export must be refused")
    };
    assert!(
        message.starts_with("export: an imported buffer cannot be exported again")
            && message.contains("forward the descriptor"),
        "{message}"
    );
    // Sending exports on the way, so it is refused the same way (the encode's typed error).
    match queue.put(&buf) {
        Err(Error::InvalidArgument(message)) => assert!(
            message.contains("an imported buffer cannot be exported again")
                && message.contains("forward the descriptor"),
            "{message}"
        ),
        other => panic!("sending an imported buffer must be refused, got {other:?}"),
    }
}

#[ipc_test(methods = [spawn, forkserver, warm], skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn imported_buffer_is_not_exported_again(ctx: &Context) {
    let buf = filled(1);
    let queue = Queue::new().unwrap();
    ctx.spawn(try_reexport, (buf, queue.clone()))
        .unwrap()
        .wait()
        .unwrap();
    assert!(queue.try_get().unwrap().is_none(), "nothing was half-sent");
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

#[ipc_test(methods = [spawn, forkserver, warm], skip_unless = vmm_core::testing::cuda_vmm_ipc(), thread_unsafe = "counts the process's open fds")]
fn fds_live_only_in_descriptors(ctx: &Context) {
    ensure_running().unwrap();
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

/// Panics unless `rc` is success, naming the driver call.
#[track_caller]
fn check(call: &str, rc: sys::CUresult) {
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "{call}");
}

/// Run `f` with `device`'s primary context current on this thread, waiting for its work, then
/// restore the thread's previous context. The buffer API always makes the buffer's own device
/// current, so a peer's access through a mapping is driven with the driver directly.
fn with_context_of(device: &Device, f: impl FnOnce()) {
    let mut raw = 0;
    // SAFETY: a live out-pointer; libcuda is loaded and initialised (vmm-core made `device`).
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut raw, device.ordinal() as i32)
    });
    let mut ctx = std::ptr::null_mut();
    // SAFETY: a live out-pointer and a valid device; released below.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, raw)
    });
    let mut previous = std::ptr::null_mut();
    // SAFETY: a live out-pointer.
    check("cuCtxGetCurrent", unsafe {
        sys::cuCtxGetCurrent(&mut previous)
    });
    // SAFETY: `ctx` is retained (alive) until the release below.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) });
    f();
    // SAFETY: acts on the current context, `ctx`.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() });
    // SAFETY: `previous` was current on this thread a moment ago (or null) and nothing here
    // destroyed it.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(previous) });
    // SAFETY: releases the retain above; this thread no longer has `ctx` current and nothing
    // here uses it again (vmm-core keeps its own retain where it uses a primary context).
    check("cuDevicePrimaryCtxRelease", unsafe {
        sys::cuDevicePrimaryCtxRelease_v2(raw)
    });
}

fn import_on_the_other_device(args: (IpcDescriptor, String)) {
    let (descriptor, exporter_uuid) = args;
    // CUDA_VISIBLE_DEVICES=1,0 here: this process's device 0 is the exporter's device 1, and
    // the exporter's device 0 (where the memory lives) is device 1.
    let peer = Device::new(0).unwrap();
    assert_ne!(
        peer.uuid_string(),
        exporter_uuid,
        "device order was not swapped"
    );
    let home = Device::by_uuid(&descriptor.device().unwrap().uuid).unwrap();
    assert_eq!(home.uuid_string(), exporter_uuid);
    assert_eq!(home.ordinal(), 1);

    // Until one is registered, arriving buffers go to a default resource: no peer access.
    assert!(
        importer(&home, Location::Device)
            .unwrap()
            .options()
            .peers
            .is_empty()
    );
    // Register an importer that maps arriving buffers for the peer too.
    set_importer(
        &VirtualMemoryResource::new(
            &home,
            ResourceOptions::default().peer(peer.ordinal(), Access::ReadWrite),
        )
        .unwrap(),
    );
    assert_eq!(
        importer(&home, Location::Device).unwrap().options().peers,
        [PeerAccess {
            device: peer.ordinal(),
            access: Access::ReadWrite
        }]
    );
    let buf = VirtualMemoryBuffer::import(&descriptor).unwrap();
    assert_eq!(buf.device(), &home, "imported on the exporter's device");
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

#[ipc_test(methods = [spawn, forkserver, warm], skip_unless = vmm_core::testing::cuda_devices(2))]
fn two_gpus_import_from_the_other_device_with_peer_access(ctx: &Context) {
    let device = Device::new(0).unwrap();
    let resource = VirtualMemoryResource::new(
        &device,
        ResourceOptions::default().peer(1, Access::ReadWrite),
    )
    .unwrap();
    let buf = resource.allocate(resource.granularity()).unwrap();
    buf.write_at(0, &pattern(1, buf.size())).unwrap();
    let child_ctx = ctx.clone().with_env("CUDA_VISIBLE_DEVICES", "1,0");
    child_ctx
        .spawn(
            import_on_the_other_device,
            (buf.export().unwrap(), device.uuid_string()),
        )
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(contents(&buf), pattern(4, buf.size()));
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
    roundtrip_through_trait(&filled(1));
    roundtrip_through_trait(&vmm_core::shm::HostBuffer::new(4096).unwrap());
}
