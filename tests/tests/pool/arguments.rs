//! Arguments and results: imported for the task, released when it ends; host buffers,
//! GPU buffers and descriptors as a program passes them.

use std::time::Duration;

use rstest::rstest;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use vmm_core::Error;
use vmm_core::SharedBuffer;
use vmm_core::cuda::{
    Device, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
};
use vmm_core::error::DescriptorRule;
use vmm_core::process::{Pool, StartMethod};
use vmm_core::shm::{HostBuffer, HostDescriptor};
use vmm_core::testing::{cuda_vmm_ipc, skip_unless};
use vmm_tests::turns::shared;
use vmm_tests::{contents, pattern};

use super::{TIMEOUT, next_worker, run_task};

/// The buffer scenarios' deadline for a task (a fresh worker's first CUDA import included).
const BUFFER_TIMEOUT: Duration = Duration::from_secs(60);

/// This worker's open fds and memfd mappings (HostBuffers are memfds).
fn counts() -> (usize, usize) {
    let fds = std::fs::read_dir("/proc/self/fd").unwrap().count() - 1;
    let maps = std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|line| line.contains("memfd:"))
        .count();
    (fds, maps)
}

fn report_counts(_: ()) -> (usize, usize) {
    counts()
}

/// Fill the buffer and report the counts while it is held.
pub(crate) fn fill_and_count(args: (HostBuffer, u8)) -> (usize, usize) {
    args.0.fill(args.1).unwrap();
    counts()
}

/// Hold the descriptor (one fd) and the buffer imported from it; report the counts.
fn import_and_count(descriptor: HostDescriptor) -> (usize, usize) {
    let buf = HostBuffer::import(&descriptor).unwrap();
    assert_eq!(buf.to_vec()[0], 0x11);
    counts()
}

/// Give back a descriptor of a fresh buffer: a result that carries an fd.
fn make_buffer(len: usize) -> HostDescriptor {
    let buf = HostBuffer::new(len).unwrap();
    buf.fill(0x77).unwrap();
    buf.export().unwrap()
}

#[vmm_core::all_methods]
#[rstest]
fn arguments_are_imported_for_the_task_and_released_when_it_ends(
    #[all_methods] method: StartMethod,
) {
    let _guard = shared();
    let pool = Pool::new(method, 1).unwrap();
    let baseline = run_task(&pool, report_counts, (), TIMEOUT);
    let buf = HostBuffer::new(1 << 20).unwrap();
    for round in 0..3u8 {
        let during = run_task(&pool, fill_and_count, (buf.clone(), round), TIMEOUT);
        assert_eq!(
            during.1,
            baseline.1 + 1,
            "the buffer was mapped in the worker while the task ran"
        );
        assert!(buf.to_vec().iter().all(|&b| b == round));
        let after = run_task(&pool, report_counts, (), TIMEOUT);
        assert_eq!(
            after, baseline,
            "the task's buffer outlived it in the worker"
        );
    }
    buf.fill(0x11).unwrap();
    let during = run_task(&pool, import_and_count, buf.export().unwrap(), TIMEOUT);
    assert_eq!(during.1, baseline.1 + 1);
    assert!(
        during.0 > baseline.0,
        "the descriptor's fd was held in the task"
    );
    let after = run_task(&pool, report_counts, (), TIMEOUT);
    assert_eq!(after, baseline, "the descriptor's fd outlived the task");
    // By reference: one descriptor sent to several tasks (each gets its own copy of the fd).
    let descriptor = buf.export().unwrap();
    for _ in 0..3 {
        let during = run_task(&pool, import_and_count, &descriptor, TIMEOUT);
        assert_eq!(during.1, baseline.1 + 1);
    }
    drop(descriptor);
    let after = run_task(&pool, report_counts, (), TIMEOUT);
    assert_eq!(
        after, baseline,
        "a descriptor sent by reference outlived its task"
    );
    // A result can carry fds too.
    let descriptor = run_task(&pool, make_buffer, 4096, TIMEOUT);
    let made = HostBuffer::import(&descriptor).unwrap();
    assert!(made.to_vec().iter().all(|&b| b == 0x77));
    let after = run_task(&pool, report_counts, (), TIMEOUT);
    assert_eq!(after, baseline, "the result's buffer outlived the task");
}

/// An argument that is refused on arrival, as an import that fails would be.
struct Refused;

impl Serialize for Refused {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_unit()
    }
}

impl<'de> Deserialize<'de> for Refused {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        <()>::deserialize(deserializer)?;
        Err(vmm_core::wire::deserialize_error::<D>(
            Error::InvalidDescriptor {
                rule: DescriptorRule::Fds,
                message: "refused on arrival".into(),
            },
        ))
    }
}

fn never_runs(_: Refused) -> u32 {
    unreachable!("the argument is refused before the function runs")
}

#[vmm_core::all_methods]
#[rstest]
fn an_argument_the_worker_cannot_receive_fails_the_task_not_the_worker(
    #[all_methods] method: StartMethod,
) {
    let _guard = shared();
    let pool = Pool::new(method, 1).unwrap();
    let worker = pool.pids()[0];
    let Err(Error::Child(failure)) = pool.submit(never_runs, Refused).unwrap().join(TIMEOUT) else {
        panic!("an argument that cannot be received fails the task")
    };
    assert!(
        matches!(failure.not_run.as_deref(), Some(Error::InvalidDescriptor { rule: DescriptorRule::Fds, message: m })
            if m == "refused on arrival"),
        "{failure}"
    );
    assert_eq!(next_worker(&pool), worker);
}

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

#[vmm_core::all_methods]
#[rstest]
fn host_buffers_through_a_pool(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let pool = Pool::new(method, 2).unwrap();
    let baseline = run_task(&pool, count_fds, (), BUFFER_TIMEOUT);
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
        task.join(BUFFER_TIMEOUT).unwrap();
    }
    for (seed, buf) in buffers.iter().enumerate() {
        assert_eq!(buf.to_vec(), pattern(seed as u8 + 1, buf.size()));
    }
    // Two workers: ask each (one at a time would do; both prove nothing stayed anywhere).
    let after: Vec<_> = (0..2)
        .map(|_| pool.submit(count_fds, ()).unwrap())
        .map(|task| task.join(BUFFER_TIMEOUT).unwrap())
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

#[vmm_core::all_methods]
#[rstest]
fn gpu_buffers_through_a_pool_are_released_after_each_task(#[all_methods] method: StartMethod) {
    let _guard = shared();
    if !skip_unless(cuda_vmm_ipc()) {
        return;
    }
    let resource =
        VirtualMemoryResource::new(&Device::new(0).unwrap(), ResourceOptions::default()).unwrap();
    let pool = Pool::new(method, 1).unwrap();
    // The worker's first import opens what the driver keeps for the process's life: take the
    // baseline after one.
    let first = filled(&resource, 1);
    run_task(&pool, reply_gpu, (first.clone(), 1), BUFFER_TIMEOUT);
    assert_eq!(contents(&first), pattern(2, first.size()));
    let baseline = run_task(&pool, count_fds, (), BUFFER_TIMEOUT);
    for seed in 10..14u8 {
        // A buffer (exported on the way, imported for the task) and a descriptor (its fd held
        // by the task, which imports it itself).
        let buf = filled(&resource, seed);
        let during = run_task(&pool, reply_gpu, (buf.clone(), seed), BUFFER_TIMEOUT);
        assert!(during >= baseline);
        assert_eq!(contents(&buf), pattern(seed + 1, buf.size()));
        let buf = filled(&resource, seed + 100);
        run_task(
            &pool,
            import_and_reply,
            (buf.export().unwrap(), seed + 100),
            BUFFER_TIMEOUT,
        );
        assert_eq!(contents(&buf), pattern(seed + 101, buf.size()));
        let after = run_task(&pool, count_fds, (), BUFFER_TIMEOUT);
        assert_eq!(after, baseline, "a task's buffer or descriptor outlived it");
    }
    // A failing task fails alone; the replacement worker serves GPU buffers too.
    let worker = pool.pids()[0];
    assert!(matches!(
        pool.submit(panics, ()).unwrap().join(BUFFER_TIMEOUT),
        Err(Error::Child(_))
    ));
    let buf = filled(&resource, 50);
    run_task(&pool, reply_gpu, (buf.clone(), 50), BUFFER_TIMEOUT);
    assert_eq!(contents(&buf), pattern(51, buf.size()));
    assert_ne!(pool.pids()[0], worker);
}
