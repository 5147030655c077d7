//! A `Pool` task that carries a descriptor, next to the raw-socket hand-off child.
//!
//! - `pool/task-with-descriptor`: a `Pool` of one warm worker (started, and its first import
//!   made, outside the clock); one iteration is `submit(import_and_drop, &descriptor)` +
//!   `join` of one descriptor exported once: the argument's encoding (its fd duplicated into
//!   the task, as `sendmsg` duplicates the raw child's), the send, the worker's import +
//!   reserve + map + set access + drop, its report (a `()` result) and the decode.
//! - `pool/raw-socket`: raw_vmm.c's child (see `handoff`): `sendmsg` of the fd and size over a
//!   bare socketpair, the raw calls, a 1-byte ack.
//!
//! `host-pool/*` are the memfd twins (no target): the same with a `HostDescriptor` and `mmap`,
//! where no driver time hides what the pool itself costs.

use std::os::fd::OwnedFd;
use std::time::Instant;

use criterion::Criterion;
use vmm_core::cuda::{
    Device, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
};
use vmm_core::process::{Pool, StartMethod, WarmPool};
use vmm_core::shm::{HostBuffer, HostDescriptor};

use crate::handoff::{RawWork, bench_raw};
use crate::raw::{self, RawCuda};
use crate::report::{Target, row};
use crate::{CHILD_WAIT, Group, Kind, key};

/// The GPU pool group.
pub const GROUP: &str = "pool";
/// The host (memfd) twin.
pub const HOST_GROUP: &str = "host-pool";

fn import_gpu(descriptor: IpcDescriptor) {
    drop(VirtualMemoryBuffer::import(&descriptor).expect("pool task: import"));
}

fn import_host(descriptor: HostDescriptor) {
    drop(HostBuffer::import(&descriptor).expect("pool task: import"));
}

/// A warm pool of one worker that has made one import already (untimed), with no waiting warm
/// child beside it.
fn warm_pool_of_one<F, D>(task: F, first: &D) -> Pool
where
    F: Fn(D) + Copy,
    D: serde::Serialize + serde::de::DeserializeOwned,
{
    let pool = Pool::new(StartMethod::Warm, 1).expect("start the pool");
    pool.submit(task, first)
        .expect("submit")
        .join(CHILD_WAIT)
        .expect("first task");
    // The worker came from the warm pool, which refills in the background: processes that
    // initialise CUDA and hold a context on the same GPU beside the timed tasks, which the
    // raw-socket baseline never has beside it. End them (once the refill is done) so that the
    // figure and its baseline run alike: one child on the device (issue 25).
    let warm = WarmPool::global();
    let _ = warm.fill();
    warm.set_options(warm.options());
    pool
}

/// Bench the pool figure (its pool started lazily, so a filtered-out figure starts nothing)
/// and the raw-socket child on `fd`.
fn bench_pool<F, D>(
    group: &mut Group<'_>,
    task: F,
    descriptor: &D,
    (work, fd, size): (RawWork, &OwnedFd, usize),
) where
    F: Fn(D) + Copy,
    D: serde::Serialize + serde::de::DeserializeOwned,
{
    let mut pool: Option<Pool> = None;
    group.bench("task-with-descriptor", || {
        let pool = pool.get_or_insert_with(|| warm_pool_of_one(task, descriptor));
        let t = Instant::now();
        pool.submit(task, descriptor)
            .expect("submit")
            .join(CHILD_WAIT)
            .expect("join");
        t.elapsed()
    });
    drop(pool);
    // The warm pool's waiting children (the worker came from it) would sit beside the baseline:
    // end them (the pool refills on its next use).
    WarmPool::global().set_options(WarmPool::global().options());
    bench_raw(group, "raw-socket", work, fd, size, |child| {
        child.send(fd, size)
    });
}

/// One 2 MiB-granularity chunk's descriptor as a pool task's argument, next to raw_vmm.c's
/// cross-process loop.
pub fn gpu_pool(c: &mut Criterion, cuda: &RawCuda) {
    row(
        &key(GROUP, "task-with-descriptor"),
        &key(GROUP, "raw-socket"),
        Target::RatioAtMost(1.2),
    );
    let device = Device::new(0).expect("device 0");
    let resource =
        VirtualMemoryResource::new(&device, ResourceOptions::default()).expect("resource");
    let size = (2usize << 20).next_multiple_of(resource.granularity());
    let buffer = resource.allocate(size).expect("allocate");
    let descriptor = buffer.export().expect("export");

    cuda.make_current();
    let handle = cuda.create(size);
    let fd = cuda.export(handle);

    let mut group = Group::new(c, GROUP, Kind::Processes);
    bench_pool(
        &mut group,
        import_gpu,
        &descriptor,
        (RawWork::Gpu, &fd, size),
    );
    group.finish();
    drop(fd);
    cuda.make_current();
    cuda.release(handle);
}

/// The memfd twin: a `HostDescriptor` as the task's argument, next to the bare-socket child.
pub fn host_pool(c: &mut Criterion) {
    row(
        &key(HOST_GROUP, "task-with-descriptor"),
        &key(HOST_GROUP, "raw-socket"),
        Target::None,
    );
    let size = 2 << 20;
    let buffer = HostBuffer::new(size).expect("host buffer");
    let descriptor = buffer.export().expect("export");
    let fd = raw::sealed_memfd(size);
    let mut group = Group::new(c, HOST_GROUP, Kind::Processes);
    bench_pool(
        &mut group,
        import_host,
        &descriptor,
        (RawWork::Host, &fd, size),
    );
    group.finish();
}
