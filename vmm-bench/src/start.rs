//! Child start + join, and a GPU child, next to bare process starts.
//!
//! - child-start: `Context::spawn` of a no-op `fn` + `join`, under spawn and forkserver. Spawn
//!   is next to this bench executable re-run with `VMM_BENCH_BASELINE=noop` (which exits right
//!   after `init()`: the cost of exec'ing a large Rust binary without vmm-core's protocol, the
//!   target baseline) and, for information, `std::process::Command` of `/bin/true` until reaped
//!   (fork+exec of a tiny program, init_cost.c's `noop`), which is forkserver's baseline.
//!   `exec-self-role-refused`: `exec-self-noop` with a role variable that the pre-`main` hook
//!   checks through and refuses at its peer check (see [`crate::role_check`]): the checks' cost.
//!   `spawn`, `exec-self-noop` and `exec-self-role-refused` run interleaved, as do `forkserver`
//!   and `fork-exec-true`: each process is reaped before the next starts. `warm`: the same from
//!   a warm pool that is full and ready when the clock starts (`WarmPool::global().fill()`
//!   untimed before each), next to spawn; not interleaved (taking a warm child starts its
//!   replacement in the background, beside whatever runs next).
//! - gpu-child: a child that initialises CUDA by importing a descriptor, drops it and exits,
//!   and join, next to this executable re-run with `VMM_BENCH_BASELINE=cuda-init` (`cuInit` +
//!   primary context, then exit: init_cost.c's `cuda` child). `warm`: the same child taken
//!   from a warm pool (CUDA initialised while it waited), next to `spawn` (40x below it is the
//!   target) and the 5 ms target; `warm-acked` times the same with an ack from the child's
//!   function, split into `warm-returned` (start until the function returned: the start
//!   message, the import, the ack) and `warm-exit` (from then until `join` returned: the
//!   report, the exit with a live CUDA context, the reap), the latter next to
//!   `cuda-exit-process`: a bare process that initialised CUDA, timed from its cue to exit
//!   until it is reaped (the kernel's teardown of a CUDA context). `warm-exit-alone`: the
//!   same exit, from the parent's go until `join` returned, once the pool's replacement for
//!   the child taken has finished its own CUDA init (which `warm-exit` runs beside). The cold starts and
//!   `cuda-init-process` run interleaved; the warm figures do not (as in child-start).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use criterion::Criterion;
use vmm_core::cuda::{
    Device, HandleType, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
};
use vmm_core::process::{Context, StartMethod, WarmPool, ensure_running};
use vmm_core::wire::Queue;

use crate::report::{Target, row};
use crate::role_check::ForeignSocket;
use crate::{BASELINE_VAR, CHILD_WAIT, Group, Kind, Settings, key, record};

/// The no-op child-start group.
pub const GROUP: &str = "child-start";
/// The GPU child group.
pub const GPU_GROUP: &str = "gpu-child";

fn noop(_: ()) {}

fn gpu_work(descriptor: IpcDescriptor) {
    let buffer = VirtualMemoryBuffer::import(&descriptor).expect("gpu child: import");
    drop(buffer);
}

fn gpu_work_acked((descriptor, ack): (IpcDescriptor, Queue<u8>)) {
    gpu_work(descriptor);
    ack.put(&1).expect("gpu child: ack");
}

/// As [`gpu_work_acked`], then wait for the parent's go before returning: the parent lets the
/// pool's replacement finish its CUDA init first, so that the exit it times runs alone.
fn gpu_work_acked_held((descriptor, ack, go): (IpcDescriptor, Queue<u8>, Queue<u8>)) {
    gpu_work_acked((descriptor, ack));
    go.get(CHILD_WAIT).expect("gpu child: go");
}

/// Warm-up and measurement for warm figures, whose untimed refill (a fresh process; on a GPU,
/// its CUDA init) is far longer than what they time.
fn warm_times() -> (Duration, Duration) {
    if Settings::from_env().quick {
        (Duration::from_millis(20), Duration::from_millis(100))
    } else {
        (Duration::from_millis(50), Duration::from_millis(400))
    }
}

/// The methods whose children start cold.
const COLD: [StartMethod; 2] = [StartMethod::Spawn, StartMethod::Forkserver];

/// Start + join of a warm child running `f(args)`, timed once the pool is full and ready.
fn warm_start_join<F, A>(f: F, args: A) -> Duration
where
    F: Fn(A) + Copy,
    A: serde::Serialize + serde::de::DeserializeOwned,
{
    WarmPool::global().fill().expect("warm the pool");
    start_join(StartMethod::Warm, f, args)
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

/// The exit alone of a process holding a CUDA context: this executable with
/// `VMM_BENCH_BASELINE=cuda-exit` initialises CUDA and says so (untimed), then the clock runs
/// from closing its stdin (its cue to exit) until it is reaped.
fn cuda_process_exit(exe: &Path) -> Duration {
    use std::io::Read;
    let mut child = Command::new(exe)
        .env(BASELINE_VAR, "cuda-exit")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start baseline");
    let mut ready = [0u8];
    child
        .stdout
        .take()
        .expect("piped stdout")
        .read_exact(&mut ready)
        .expect("baseline initialised CUDA");
    let t = Instant::now();
    drop(child.stdin.take());
    let status = child.wait().expect("reap baseline");
    let elapsed = t.elapsed();
    assert!(status.success(), "baseline process failed: {status}");
    elapsed
}

/// Run `command` (stdin from /dev/null) until reaped, check it succeeded; record the time
/// until `spawn` returned under `started` and from then until reaped under `reaped`; return
/// the whole.
fn run_to_exit_split(command: &mut Command, (started, reaped): (&str, &str)) -> Duration {
    let t = Instant::now();
    let mut child = command
        .stdin(Stdio::null())
        .spawn()
        .expect("start baseline");
    let until_started = t.elapsed();
    let status = child.wait().expect("reap baseline");
    let total = t.elapsed();
    assert!(status.success(), "baseline process failed: {status}");
    record::measure(started, 1, || until_started);
    record::measure(reaped, 1, || total - until_started);
    total
}

/// A spawn child's no-op start + join, split as [`run_to_exit_split`] splits its baseline: the
/// time until `Context::spawn` returned under `started`, from then until `join` returned under
/// `joined`; returns the whole.
fn spawn_join_split((started, joined): (&str, &str)) -> Duration {
    let t = Instant::now();
    let child = Context::new(StartMethod::Spawn)
        .spawn(noop, ())
        .expect("start child");
    let until_started = t.elapsed();
    child.join(CHILD_WAIT).expect("join child");
    let total = t.elapsed();
    record::measure(started, 1, || until_started);
    record::measure(joined, 1, || total - until_started);
    total
}

/// Start + join of a child with `method` running `f(args)`.
fn start_join<F, A>(method: StartMethod, f: F, args: A) -> Duration
where
    F: Fn(A) + Copy,
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
    let noop_exec = key(GROUP, "exec-self-noop");
    // A spawned child must exec this executable: its floor is exec'ing it, not /bin/true.
    row(&key(GROUP, "spawn"), &noop_exec, Target::RatioAtMost(1.1));
    row(&key(GROUP, "spawn"), &base, Target::None);
    // What the pre-main role check costs (see role_check).
    row(
        &key(GROUP, "exec-self-role-refused"),
        &noop_exec,
        Target::None,
    );
    // Where spawn's time goes, next to the same split of exec'ing this executable: until the
    // start call returned (posix_spawn; for spawn also its launcher thread, the channel and the
    // output files), and from then until reaped (the child's whole run, its exit, the reap).
    let split = |figure: &str| {
        (
            key(GROUP, &format!("{figure}-started")),
            key(GROUP, &format!("{figure}-reaped")),
        )
    };
    let (spawn_started, spawn_joined) = split("spawn");
    let (noop_started, noop_reaped) = split("exec-self-noop");
    row(&spawn_started, &noop_started, Target::None);
    row(&spawn_joined, &noop_reaped, Target::None);
    record::note_interleaved(&[&spawn_started, &spawn_joined, &noop_started, &noop_reaped]);
    row(&key(GROUP, "forkserver"), &base, Target::Under(1e6));
    row(&key(GROUP, "warm"), &key(GROUP, "spawn"), Target::None);

    // The server is started once per parent, outside any figure (and before the role check's
    // socket exists, which it must not inherit).
    ensure_running().expect("start the forkserver");
    let exe = this_exe();
    let foreign = ForeignSocket::new(&exe);
    foreign.assert_refused_at_peer_check(&exe);

    let mut group = Group::new(c, GROUP, Kind::Processes);
    // Each process is reaped before the next starts, so these start figures alternate, one
    // iteration each in turn: the machine's drift falls on all of them alike.
    group.bench_interleaved(
        "spawn-vs-exec-self",
        &mut [
            ("spawn", &mut || {
                spawn_join_split((&spawn_started, &spawn_joined))
            }),
            ("exec-self-noop", &mut || {
                run_to_exit_split(
                    Command::new(&exe)
                        .env(BASELINE_VAR, "noop")
                        .stderr(Stdio::null()),
                    (&noop_started, &noop_reaped),
                )
            }),
            ("exec-self-role-refused", &mut || {
                foreign.inherited(|| run_to_exit(&mut foreign.refused_command(&exe)))
            }),
        ],
    );
    drop(foreign);
    let truth = true_program();
    group.bench_pair(
        "forkserver-vs-fork-exec-true",
        ("forkserver", || {
            start_join(StartMethod::Forkserver, noop, ())
        }),
        ("fork-exec-true", || run_to_exit(&mut Command::new(truth))),
    );
    // Not interleaved: taking a warm child makes the pool start its replacement in the
    // background, which would run beside the next baseline iteration.
    // The host path even on a GPU machine: these warm children initialise no CUDA device.
    let options = WarmPool::global().options();
    WarmPool::global().set_options(options.clone().with_devices([]));
    let (warm_up, measure) = warm_times();
    group.times(warm_up, measure);
    group.bench("warm", || warm_start_join(noop, ()));
    WarmPool::global().set_options(options);
    group.finish();
}

/// A GPU child (start, CUDA init, import, drop, exit) + join, next to a bare CUDA-init process;
/// and the same child from a warm pool.
pub fn gpu_child(c: &mut Criterion) {
    let base = key(GPU_GROUP, "cuda-init-process");
    for method in COLD {
        row(
            &key(GPU_GROUP, method.name()),
            &base,
            Target::RatioAtMost(1.1),
        );
    }
    let warm = key(GPU_GROUP, "warm");
    row(
        &warm,
        &key(GPU_GROUP, "spawn"),
        Target::RatioAtMost(1.0 / 40.0),
    );
    row(&warm, &base, Target::Under(5e6));
    let acked = key(GPU_GROUP, "warm-acked");
    let (returned, exit) = (key(GPU_GROUP, "warm-returned"), key(GPU_GROUP, "warm-exit"));
    row(&returned, &acked, Target::None);
    row(&exit, &acked, Target::None);
    // What the exit of a warm child costs, next to the exit of a bare process holding a CUDA
    // context (the kernel's teardown of the context: exiting with `_exit` changed nothing).
    row(&exit, &key(GPU_GROUP, "cuda-exit-process"), Target::None);
    // The same exit with nothing beside it: `warm-exit` runs while the pool's replacement for
    // the child taken initialises CUDA in another process (a refill starts at the take), and
    // both contend in the driver; `warm-exit-alone` waits for the replacement to be ready
    // first. The target (at most `cuda-exit-process`) is for this one.
    let alone = key(GPU_GROUP, "warm-exit-alone");
    row(
        &alone,
        &key(GPU_GROUP, "cuda-exit-process"),
        Target::RatioAtMost(1.0),
    );

    let device = Device::new(0).expect("device 0");
    let resource =
        VirtualMemoryResource::new(&device, ResourceOptions::default()).expect("resource");
    let size = (2usize << 20).next_multiple_of(resource.granularity());
    let buffer = resource.allocate(size).expect("allocate");
    let descriptor = buffer.export().expect("export");
    let fds: Vec<_> = descriptor.fds().collect();
    let sizes = descriptor.chunk_sizes().to_vec();
    // A fresh descriptor (dup of the exported fds) per child, untimed.
    let own =
        || IpcDescriptor::from_fds(&fds, &sizes, HandleType::PosixFd, size).expect("descriptor");

    ensure_running().expect("start the forkserver");
    let mut group = Group::new(c, GPU_GROUP, Kind::Processes);
    let exe = this_exe();
    // Each child is reaped before the next starts: the cold starts and their baseline
    // alternate, one iteration each in turn.
    group.bench_interleaved(
        "cold-vs-cuda-init",
        &mut [
            ("spawn", &mut || {
                start_join(StartMethod::Spawn, gpu_work, own())
            }),
            ("forkserver", &mut || {
                start_join(StartMethod::Forkserver, gpu_work, own())
            }),
            ("cuda-init-process", &mut || {
                run_to_exit(Command::new(&exe).env(BASELINE_VAR, "cuda-init"))
            }),
        ],
    );
    group.bench("cuda-exit-process", || cuda_process_exit(&exe));
    let (warm_up, measure) = warm_times();
    group.times(warm_up, measure);
    group.bench("warm", || warm_start_join(gpu_work, own()));
    let ack = Queue::new().expect("queue");
    group.bench("warm-acked", || {
        let args = (own(), ack.clone());
        WarmPool::global().fill().expect("warm the pool");
        let t = Instant::now();
        let child = Context::new(StartMethod::Warm)
            .spawn(gpu_work_acked, args)
            .expect("start child");
        ack.get(CHILD_WAIT).expect("child ack");
        let until_returned = t.elapsed();
        child.join(CHILD_WAIT).expect("join child");
        let total = t.elapsed();
        record::measure(&returned, 1, || until_returned);
        record::measure(&exit, 1, || total - until_returned);
        total
    });
    let go = Queue::new().expect("queue");
    group.bench("warm-exit-alone", || {
        let args = (own(), ack.clone(), go.clone());
        WarmPool::global().fill().expect("warm the pool");
        let child = Context::new(StartMethod::Warm)
            .spawn(gpu_work_acked_held, args)
            .expect("start child");
        ack.get(CHILD_WAIT).expect("child ack");
        // The replacement started at the take: let it finish initialising CUDA.
        WarmPool::global().fill().expect("refill the pool");
        let t = Instant::now();
        go.put(&1).expect("go");
        child.join(CHILD_WAIT).expect("join child");
        t.elapsed()
    });
    group.finish();
    // End the waiting children: they hold a CUDA context each.
    WarmPool::global().set_options(WarmPool::global().options());
}
