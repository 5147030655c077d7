//! Where a `Pool` task's time goes, from the kernel's own counters: a diagnostic for the
//! `pool/task-with-descriptor` figure (issue 25), not a benchmark.
//!
//! A pool of one warm worker runs `TASKS` tasks of one descriptor each (a 2 MiB CUDA buffer's,
//! or with `--host` a memfd's), after `WARM_UP` untimed ones, and prints:
//! - the tasks' latency (submit to join): p10, median, p90;
//! - per task, for every thread of the worker and of this process (named by `comm`): voluntary
//!   and involuntary context switches (`/proc/PID/task/TID/status`), and time on CPU and time
//!   waiting to run (`/proc/PID/task/TID/schedstat`, ns).
//!
//! It uses only the public API, so it builds against older commits for an A/B of the counters
//! across builds (f475110's `submit` takes a fn pointer and has no `WarmPool::global()`: there,
//! `run` takes `fn(D)` and `--end-waiting` goes).
//!
//! With `--end-waiting`, the warm pool's waiting children (the pool's worker came from the warm
//! pool, which refills in the background: processes that initialise and hold CUDA contexts on
//! the same GPU) are ended before the timed tasks, so the tasks run as the raw-socket baseline
//! does, with no sibling process on the device. Run: `cargo run --release -p vmm-bench --example pool_probe --
//! [--host] [--method spawn|forkserver|warm] [--tasks N]`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use vmm_core::cuda::{
    Device, IpcDescriptor, ResourceOptions, VirtualMemoryBuffer, VirtualMemoryResource,
};
use vmm_core::process::{Pool, StartMethod, WarmPool};
use vmm_core::shm::{HostBuffer, HostDescriptor};

const WARM_UP: usize = 200;

fn import_gpu(descriptor: IpcDescriptor) {
    drop(VirtualMemoryBuffer::import(&descriptor).expect("pool task: import"));
}

fn import_host(descriptor: HostDescriptor) {
    drop(HostBuffer::import(&descriptor).expect("pool task: import"));
}

/// One thread's counters: voluntary and involuntary switches, ns on CPU, ns waiting to run.
#[derive(Clone, Copy, Default)]
struct Counters([u64; 4]);

/// Every thread of `pid` (`self` for this process), by `comm` and tid.
fn threads(pid: &str) -> BTreeMap<(String, u32), Counters> {
    let mut out = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.flatten() {
        let dir = task.path();
        let tid: u32 = task.file_name().to_string_lossy().parse().unwrap_or(0);
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        let sched = std::fs::read_to_string(dir.join("schedstat")).unwrap_or_default();
        let mut sched = sched
            .split_whitespace()
            .map(|v| v.parse::<u64>().unwrap_or(0));
        let counters = Counters([
            field("voluntary_ctxt_switches:"),
            field("nonvoluntary_ctxt_switches:"),
            sched.next().unwrap_or(0),
            sched.next().unwrap_or(0),
        ]);
        out.insert((comm.trim().to_owned(), tid), counters);
    }
    out
}

fn print_delta(
    who: &str,
    before: &BTreeMap<(String, u32), Counters>,
    after: &BTreeMap<(String, u32), Counters>,
    tasks: usize,
) {
    println!(
        "{who}: per task, by thread (voluntary switches, involuntary switches, us on CPU, us waiting to run)"
    );
    for (key, end) in after {
        let start = before.get(key).copied().unwrap_or_default();
        let d: Vec<f64> = (0..4)
            .map(|i| end.0[i].saturating_sub(start.0[i]) as f64 / tasks as f64)
            .collect();
        if d.iter().all(|&v| v == 0.0) {
            continue;
        }
        println!(
            "  {:<16} tid {:>7}: {:>6.2} vol {:>6.2} invol {:>8.2} us cpu {:>8.2} us wait",
            key.0,
            key.1,
            d[0],
            d[1],
            d[2] / 1e3,
            d[3] / 1e3
        );
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn run<F, D>(pool: &Pool, task: F, arg: &D, tasks: usize)
where
    F: Fn(D) + Copy,
    D: serde::Serialize + serde::de::DeserializeOwned,
{
    for _ in 0..WARM_UP {
        pool.submit(task, arg)
            .expect("submit")
            .join(Duration::from_secs(30))
            .expect("join");
    }
    let worker = pool.pids()[0].to_string();
    let (worker_before, own_before) = (threads(&worker), threads("self"));
    let mut times = Vec::with_capacity(tasks);
    for _ in 0..tasks {
        let t = Instant::now();
        pool.submit(task, arg)
            .expect("submit")
            .join(Duration::from_secs(30))
            .expect("join");
        times.push(t.elapsed());
    }
    let (worker_after, own_after) = (threads(&worker), threads("self"));
    times.sort();
    println!(
        "latency over {tasks} tasks: p10 {:?}, median {:?}, p90 {:?}",
        percentile(&times, 0.1),
        percentile(&times, 0.5),
        percentile(&times, 0.9)
    );
    print_delta("worker", &worker_before, &worker_after, tasks);
    print_delta("parent", &own_before, &own_after, tasks);
}

fn main() {
    vmm_core::process::init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let host = args.iter().any(|a| a == "--host");
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let method = match value("--method").as_deref() {
        Some("spawn") => StartMethod::Spawn,
        Some("forkserver") => StartMethod::Forkserver,
        _ => StartMethod::Warm,
    };
    let tasks: usize = value("--tasks")
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    println!(
        "pool_probe: {} descriptor, {method:?}, 1 worker",
        if host { "host" } else { "GPU" }
    );
    let pool = Pool::new(method, 1).expect("start the pool");
    if args.iter().any(|a| a == "--end-waiting") {
        let warm = WarmPool::global();
        // Let the refill finish, then end every waiting child (it refills on its next use).
        let _ = warm.fill();
        warm.set_options(warm.options());
    }
    println!(
        "waiting warm children beside the pool: {:?}",
        WarmPool::global().pids()
    );
    if host {
        let buffer = HostBuffer::new(2 << 20).expect("host buffer");
        run(&pool, import_host, &buffer.export().expect("export"), tasks);
    } else {
        let device = Device::new(0).expect("device 0");
        let resource =
            VirtualMemoryResource::new(&device, ResourceOptions::default()).expect("resource");
        let size = (2usize << 20).next_multiple_of(resource.granularity());
        let buffer = resource.allocate(size).expect("allocate");
        run(&pool, import_gpu, &buffer.export().expect("export"), tasks);
    }
}
