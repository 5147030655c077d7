//! `warm` as a downstream crate uses it: `#[ipc_test(methods = [.., warm])]` and
//! `StartMethod::Warm`, on host buffers everywhere and, where there is a GPU, with CUDA
//! initialised in the waiting child before its function runs (skipped elsewhere; a failure
//! under `VMM_REQUIRE_GPU=1`).

use std::time::Duration;

use cudarc::driver::sys;
use vmm_core::ipc_test;
use vmm_core::process::{Context, StartMethod, WarmPool, ensure_running};
use vmm_core::shm::HostBuffer;
use vmm_core::testing::settled_open_fds;
use vmm_core::wire::Queue;
use vmm_tests::pattern;

const TIMEOUT: Duration = Duration::from_secs(60);
const LEN: usize = 1 << 20;

fn read_back_and_reply(buf: HostBuffer) {
    assert_eq!(buf.to_vec(), pattern(1, buf.size()));
    buf.write_at(0, &pattern(2, buf.size())).unwrap();
}

#[ipc_test(methods = [spawn, forkserver, warm])]
fn host_buffer_as_argument(ctx: &Context) {
    let buf = HostBuffer::new(LEN).unwrap();
    buf.write_at(0, &pattern(1, LEN)).unwrap();
    ctx.spawn(read_back_and_reply, buf.clone())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(buf.to_vec(), pattern(2, LEN));
}

#[ipc_test(methods = [warm], thread_unsafe = "counts the process's open fds")]
fn a_thread_unsafe_warm_test_starts_with_the_pool_full(ctx: &Context) {
    assert_eq!(ctx.method(), StartMethod::Warm);
    // The runner filled the pool before the body: the waiting children are there, and the fd
    // baseline taken now includes them.
    let waiting = WarmPool::global().pids();
    assert_eq!(
        waiting.len(),
        WarmPool::global().options().depth(),
        "the pool was not filled before the body"
    );
    ensure_running().unwrap();
    let buf = HostBuffer::new(LEN).unwrap();
    buf.write_at(0, &pattern(1, LEN)).unwrap();
    let before = settled_open_fds().unwrap();
    let child = ctx.spawn(read_back_and_reply, buf.clone()).unwrap();
    assert!(
        waiting.is_empty() || waiting.contains(&child.pid()),
        "the child was not one that waited"
    );
    child.wait().unwrap();
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "a warm child left fds behind"
    );
    assert_eq!(WarmPool::global().fill().unwrap().len(), waiting.len());
}

/// Whether device 0's primary context is active in this process, asked before this process
/// does anything with CUDA itself (`cuInit` is idempotent; the state query creates nothing).
fn primary_context_active() -> bool {
    // SAFETY: cuInit takes flags (0); libcuda is present (the test's requirement).
    let rc = unsafe { sys::cuInit(0) };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
    let mut device = 0;
    // SAFETY: a live out-pointer.
    let rc = unsafe { sys::cuDeviceGet(&mut device, 0) };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
    let (mut flags, mut active) = (0u32, 0i32);
    // SAFETY: live out-pointers and a valid device.
    let rc = unsafe { sys::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active) };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
    active != 0
}

fn report_cuda_state(queue: Queue<bool>) {
    queue.put(&primary_context_active()).unwrap();
}

#[ipc_test(methods = [spawn, warm], skip_unless = vmm_core::testing::cuda_vmm_ipc())]
fn a_warm_child_has_cuda_initialised_before_its_function_runs(ctx: &Context) {
    let queue = Queue::new().unwrap();
    ctx.spawn(report_cuda_state, queue.clone())
        .unwrap()
        .wait()
        .unwrap();
    let active = queue.get(TIMEOUT).unwrap();
    match ctx.method() {
        StartMethod::Warm => assert!(active, "the warm child had no primary context yet"),
        // The control: a spawned child starts cold.
        _ => assert!(!active, "a spawned child already had a primary context"),
    }
}
