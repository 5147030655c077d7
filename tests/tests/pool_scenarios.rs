//! `Pool` as a program uses it: warm workers that run many tasks, buffers in and results out.
//! Host buffers run everywhere; the CUDA scenario (one GPU) skips where there is none and fails
//! there under `VMM_REQUIRE_GPU=1`.

use std::time::Duration;

use rstest::rstest;
use vmm_core::cuda::{
    Device, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
};
use vmm_core::process::{Pool, StartMethod};
use vmm_core::shm::HostBuffer;
use vmm_core::testing::{cuda_vmm_ipc, skip_unless};
use vmm_core::{Error, SharedBuffer};
use vmm_tests::{contents, pattern};

const TIMEOUT: Duration = Duration::from_secs(60);

/// This worker's open fds.
fn open_fds() -> usize {
    vmm_core::testing::open_fds().unwrap()
}

fn count_fds(_: ()) -> usize {
    open_fds()
}

/// Check the parent's pattern, answer with the next one, report the fds held meanwhile.
fn reply<B: SharedBuffer>(buf: B, seed: u8) -> usize {
    let mut seen = vec![0u8; buf.size()];
    buf.read_at(0, &mut seen).unwrap();
    assert_eq!(
        seen,
        pattern(seed, buf.size()),
        "the task saw the parent's data"
    );
    buf.write_at(0, &pattern(seed + 1, buf.size())).unwrap();
    open_fds()
}

fn reply_host(args: (HostBuffer, u8)) -> usize {
    reply(args.0, args.1)
}

fn reply_gpu(args: (VirtualMemoryBuffer, u8)) -> usize {
    assert!(args.0.is_imported());
    reply(args.0, args.1)
}

fn import_and_reply(args: (IpcDescriptor, u8)) -> usize {
    let buf = VirtualMemoryBuffer::import(&args.0).unwrap();
    drop(args.0);
    reply(buf, args.1)
}

fn panics(_: ()) -> usize {
    panic!("a task that fails on purpose")
}

#[rstest]
fn host_buffers_through_a_pool(
    #[values(StartMethod::Spawn, StartMethod::Forkserver, StartMethod::Warm)] method: StartMethod,
) {
    let pool = Pool::new(method, 2).unwrap();
    let baseline = pool.submit(count_fds, ()).unwrap().join(TIMEOUT).unwrap();
    let buffers: Vec<_> = (0..4).map(|_| HostBuffer::new(1 << 20).unwrap()).collect();
    for (seed, buf) in buffers.iter().enumerate() {
        buf.write_at(0, &pattern(seed as u8, buf.size())).unwrap();
    }
    let tasks: Vec<_> = buffers
        .iter()
        .enumerate()
        .map(|(seed, buf)| pool.submit(reply_host, (buf.clone(), seed as u8)).unwrap())
        .collect();
    for task in tasks {
        task.join(TIMEOUT).unwrap();
    }
    for (seed, buf) in buffers.iter().enumerate() {
        assert_eq!(buf.to_vec(), pattern(seed as u8 + 1, buf.size()));
    }
    // Two workers: ask each (one at a time would do; both prove nothing stayed anywhere).
    let after: Vec<_> = (0..2)
        .map(|_| pool.submit(count_fds, ()).unwrap())
        .map(|task| task.join(TIMEOUT).unwrap())
        .collect();
    assert!(
        after.iter().all(|&n| n == baseline),
        "a task's buffer outlived it in its worker: {after:?} vs {baseline}"
    );
}

fn filled(resource: &VirtualMemoryResource, seed: u8) -> VirtualMemoryBuffer {
    let buf = resource.allocate(resource.granularity()).unwrap();
    buf.write_at(0, &pattern(seed, buf.size())).unwrap();
    buf
}

#[rstest]
fn gpu_buffers_through_a_pool_are_released_after_each_task(
    #[values(StartMethod::Spawn, StartMethod::Forkserver, StartMethod::Warm)] method: StartMethod,
) {
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    let resource =
        VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default()).unwrap();
    let pool = Pool::new(method, 1).unwrap();
    // The worker's first import opens what the driver keeps for the process's life: take the
    // baseline after one.
    let first = filled(&resource, 1);
    pool.submit(reply_gpu, (first.clone(), 1))
        .unwrap()
        .join(TIMEOUT)
        .unwrap();
    assert_eq!(contents(&first), pattern(2, first.size()));
    let baseline = pool.submit(count_fds, ()).unwrap().join(TIMEOUT).unwrap();
    for seed in 10..14u8 {
        // A buffer (exported on the way, imported for the task) and a descriptor (its fd held
        // by the task, which imports it itself).
        let buf = filled(&resource, seed);
        let during = pool
            .submit(reply_gpu, (buf.clone(), seed))
            .unwrap()
            .join(TIMEOUT)
            .unwrap();
        assert!(during >= baseline);
        assert_eq!(contents(&buf), pattern(seed + 1, buf.size()));
        let buf = filled(&resource, seed + 100);
        pool.submit(import_and_reply, (buf.export().unwrap(), seed + 100))
            .unwrap()
            .join(TIMEOUT)
            .unwrap();
        assert_eq!(contents(&buf), pattern(seed + 101, buf.size()));
        let after = pool.submit(count_fds, ()).unwrap().join(TIMEOUT).unwrap();
        assert_eq!(after, baseline, "a task's buffer or descriptor outlived it");
    }
    // A failing task fails alone; the replacement worker serves GPU buffers too.
    let worker = pool.pids()[0];
    assert!(matches!(
        pool.submit(panics, ()).unwrap().join(TIMEOUT),
        Err(Error::Child(_))
    ));
    let buf = filled(&resource, 50);
    pool.submit(reply_gpu, (buf.clone(), 50))
        .unwrap()
        .join(TIMEOUT)
        .unwrap();
    assert_eq!(contents(&buf), pattern(51, buf.size()));
    assert_ne!(pool.pids()[0], worker);
}
