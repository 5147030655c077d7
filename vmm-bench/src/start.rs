//! Child start + join, and a GPU child, next to bare process starts.
//!
//! - child-start: `Context::spawn` of a no-op `fn` + `join`, under spawn and forkserver, next to
//!   `std::process::Command` of `/bin/true` until reaped (the target baseline: fork+exec of a
//!   tiny program, init_cost.c's `noop`) and, for information, of this bench executable with
//!   `VMM_BENCH_BASELINE=noop` (which exits right after `init()`: the cost of exec'ing a large
//!   Rust binary, without vmm-core's protocol).
//! - gpu-child: a child that initialises CUDA by importing a descriptor, drops it and exits,
//!   and join, next to this executable re-run with `VMM_BENCH_BASELINE=cuda-init` (`cuInit` +
//!   primary context, then exit: init_cost.c's `cuda` child).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use criterion::Criterion;
use vmm_core::cuda::{
    Device, HandleType, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
};
use vmm_core::process::{Context, StartMethod, ensure_running};

use crate::report::{Target, row};
use crate::{BASELINE_VAR, CHILD_WAIT, Group, Kind, key};

/// The no-op child-start group.
pub const GROUP: &str = "child-start";
/// The GPU child group.
pub const GPU_GROUP: &str = "gpu-child";

fn noop(_: ()) {}

fn gpu_work(descriptor: IpcDescriptor) {
    let buffer = VirtualMemoryBuffer::import(&descriptor).expect("gpu child: import");
    drop(buffer);
}

/// `/bin/true` (or `/usr/bin/true`).
fn true_program() -> &'static Path {
    ["/bin/true", "/usr/bin/true"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists())
        .expect("no /bin/true or /usr/bin/true for the fork+exec baseline")
}

fn this_exe() -> PathBuf {
    std::env::current_exe().expect("current_exe")
}

/// Run `command` to completion (stdin from /dev/null), check it succeeded, return the time.
fn run_to_exit(command: &mut Command) -> Duration {
    let t = Instant::now();
    let status = command
        .stdin(Stdio::null())
        .status()
        .expect("start baseline");
    let elapsed = t.elapsed();
    assert!(status.success(), "baseline process failed: {status}");
    elapsed
}

/// Start + join of a child with `method` running `f(args)`.
fn start_join<A>(method: StartMethod, f: fn(A), args: A) -> Duration
where
    A: serde::Serialize + serde::de::DeserializeOwned,
{
    let t = Instant::now();
    Context::new(method)
        .spawn(f, args)
        .expect("start child")
        .join(CHILD_WAIT)
        .expect("join child");
    t.elapsed()
}

/// No-op child start + join.
pub fn child_start(c: &mut Criterion) {
    let base = key(GROUP, "fork-exec-true");
    row(&key(GROUP, "spawn"), &base, Target::RatioAtMost(1.5));
    row(&key(GROUP, "forkserver"), &base, Target::Under(1e6));
    row(
        &key(GROUP, "spawn"),
        &key(GROUP, "exec-self-noop"),
        Target::None,
    );

    let mut group = Group::new(c, GROUP, Kind::Processes);
    group.bench("spawn", || start_join(StartMethod::Spawn, noop, ()));
    // The server is started once per parent, outside any figure.
    ensure_running().expect("start the forkserver");
    group.bench("forkserver", || {
        start_join(StartMethod::Forkserver, noop, ())
    });
    let truth = true_program();
    group.bench("fork-exec-true", || run_to_exit(&mut Command::new(truth)));
    let exe = this_exe();
    group.bench("exec-self-noop", || {
        run_to_exit(Command::new(&exe).env(BASELINE_VAR, "noop"))
    });
    group.finish();
}

/// A GPU child (start, CUDA init, import, drop, exit) + join, next to a bare CUDA-init process.
pub fn gpu_child(c: &mut Criterion) {
    let base = key(GPU_GROUP, "cuda-init-process");
    for method in StartMethod::ALL {
        row(
            &key(GPU_GROUP, method.name()),
            &base,
            Target::RatioAtMost(1.1),
        );
    }
    let device = Device::new(0).expect("device 0");
    let resource =
        VirtualMemoryResource::new(&device, ResourceOptions::default()).expect("resource");
    let size = (2usize << 20).next_multiple_of(resource.granularity());
    let buffer = resource.allocate(size).expect("allocate");
    let descriptor = buffer.export().expect("export");
    let fds: Vec<_> = descriptor.fds().collect();
    let sizes = descriptor.chunk_sizes().to_vec();

    ensure_running().expect("start the forkserver");
    let mut group = Group::new(c, GPU_GROUP, Kind::Processes);
    for method in StartMethod::ALL {
        group.bench(method.name(), || {
            // A fresh descriptor (dup of the exported fds) per child, untimed.
            let own = IpcDescriptor::from_fds(&fds, &sizes, HandleType::PosixFd, size)
                .expect("descriptor");
            start_join(method, gpu_work, own)
        });
    }
    let exe = this_exe();
    group.bench("cuda-init-process", || {
        run_to_exit(Command::new(&exe).env(BASELINE_VAR, "cuda-init"))
    });
    group.finish();
}
