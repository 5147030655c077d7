//! What `cargo bench -p vmm-bench` measures: vmm-core next to the raw driver calls, a bare
//! socket and a bare fork+exec, in one run, with a summary table at the end. See README.md for
//! each figure and its baseline.
//!
//! The bench main (`benches/vmm.rs`) is: [`vmm_core::process::init`], [`baseline_child_main`],
//! then [`run`] and [`report::finish`]. Children of the bench are the bench executable itself,
//! re-run: vmm-core's children take their role before `main`; the baseline processes (a bare
//! CUDA-init process, a no-op) are told apart by [`BASELINE_VAR`].

#![cfg(target_os = "linux")]

pub mod child_drop;
pub mod compare;
pub mod driver;
pub mod endpoint;
pub mod fabric;
pub mod gpu_memd;
pub mod handoff;
pub mod host;
pub mod memd;
pub mod memd_service;
pub mod pool;
pub mod raw;
pub mod record;
pub mod report;
pub mod role_check;
pub mod start;
pub mod tls;
pub mod units;

use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, SamplingMode};
use vmm_core::cuda::Unavailable;

/// Set in a baseline process the bench starts from its own executable: `cuda-init` runs
/// `cuInit` + primary context and exits, `noop` exits at once, `peer-socket` sends a socket
/// over stdout (see [`role_check`]), `memd-service` plays `vmm-memd` (see [`memd_service`]).
/// Checked by
/// [`baseline_child_main`] right after `init()`.
pub const BASELINE_VAR: &str = "VMM_BENCH_BASELINE";

/// Set to `1` to shrink warm-up and measurement times for a smoke run.
pub const QUICK_VAR: &str = "VMM_BENCH_QUICK";

/// Set to `1` (the GPU runs do) to make a missing GPU an error instead of a skip.
pub const REQUIRE_GPU_VAR: &str = "VMM_REQUIRE_GPU";

/// Warm-up of a figure that spans processes, outside quick runs (see
/// [`Settings::process_times`]).
pub const PROCESS_WARM_UP: Duration = Duration::from_millis(500);

/// Measurement of a figure that spans processes, outside quick runs (see
/// [`Settings::process_times`]).
pub const PROCESS_MEASUREMENT: Duration = Duration::from_secs(5);

/// How long a hand-off child or a join may wait before the bench calls it hung.
pub const CHILD_WAIT: Duration = Duration::from_secs(120);

/// If this process is a baseline process ([`BASELINE_VAR`] set), do its job and exit.
pub fn baseline_child_main() {
    let Ok(role) = std::env::var(BASELINE_VAR) else {
        return;
    };
    let code = match role.as_str() {
        "noop" => 0,
        "cuda-init" => match raw::init_context() {
            Ok(_) => 0,
            Err(e) => {
                eprintln!("vmm-bench baseline cuda-init: {e}");
                3
            }
        },
        // Initialise CUDA, say so (one byte on stdout), wait for stdin's end, then exit: the
        // parent times the exit alone (`gpu-child/cuda-exit-process`).
        "cuda-exit" => match raw::init_context() {
            Ok(_) => {
                use std::io::{Read, Write};
                let said = std::io::stdout()
                    .write_all(b"r")
                    .and_then(|()| std::io::stdout().flush());
                let mut rest = Vec::new();
                let _ = std::io::stdin().read_to_end(&mut rest);
                if said.is_ok() { 0 } else { 4 }
            }
            Err(e) => {
                eprintln!("vmm-bench baseline cuda-exit: {e}");
                3
            }
        },
        role_check::PEER_SOCKET => role_check::peer_socket_main(),
        memd_service::SERVICE_ROLE => memd_service::service_main(),
        other => {
            eprintln!("vmm-bench: unknown {BASELINE_VAR}={other:?}");
            2
        }
    };
    std::process::exit(code);
}

/// Timing settings: the defaults keep the whole run to a few minutes; quick is a smoke run.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// [`QUICK_VAR`] is `1`.
    pub quick: bool,
    /// The command line sets criterion's warm-up or measurement time (`--warm-up-time`,
    /// `--measurement-time`): then no group sets its own.
    pub times_from_args: bool,
}

impl Settings {
    /// From the environment and the command line.
    pub fn from_env() -> Settings {
        Settings {
            quick: std::env::var(QUICK_VAR).is_ok_and(|v| v == "1"),
            times_from_args: std::env::args()
                .any(|a| a.starts_with("--warm-up-time") || a.starts_with("--measurement-time")),
        }
    }

    /// Warm-up and measurement of a [`Kind::Processes`] group, `None` where the run's own
    /// apply (a quick run, or times given on the command line). Long enough that two runs of
    /// one build agree on each median within 15%: a process start (about 2 ms) gets a few
    /// thousand iterations, a hand-off (tens of microseconds) hundreds of thousands, and a
    /// slow drift of the machine's load is averaged over seconds, not caught in one burst.
    pub fn process_times(&self) -> Option<(Duration, Duration)> {
        (!self.quick && !self.times_from_args).then_some((PROCESS_WARM_UP, PROCESS_MEASUREMENT))
    }

    /// A `Criterion` with this run's times, then the command line's criterion options (which
    /// win: `cargo bench -p vmm-bench -- --quick`, `--measurement-time 5`, a name filter, ...).
    pub fn criterion(&self) -> Criterion {
        let (warm_up, measure) = if self.quick {
            (Duration::from_millis(50), Duration::from_millis(200))
        } else {
            (Duration::from_millis(300), Duration::from_millis(1500))
        };
        Criterion::default()
            .warm_up_time(warm_up)
            .measurement_time(measure)
            .sample_size(20)
            // Plots stay on: criterion's HTML report (gnuplot where installed, else plotters)
            // lands in `$CARGO_TARGET_DIR/criterion/report/index.html`.
            .configure_from_args()
    }
}

/// Whether a group's iterations are in-process operations or span processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Microseconds each: 20 samples, criterion's automatic sampling.
    InProcess,
    /// A process start or a round trip to a child: 10 samples, flat sampling, and the longer
    /// times of [`Settings::process_times`].
    Processes,
}

/// A criterion group that records each figure's per-iteration times under `group/id`.
#[allow(missing_debug_implementations)] // BenchmarkGroup is not Debug
pub struct Group<'a> {
    inner: BenchmarkGroup<'a, WallTime>,
    name: &'static str,
}

impl<'a> Group<'a> {
    /// Open group `name`.
    pub fn new(c: &'a mut Criterion, name: &'static str, kind: Kind) -> Group<'a> {
        let mut inner = c.benchmark_group(name);
        if kind == Kind::Processes {
            inner.sample_size(10).sampling_mode(SamplingMode::Flat);
            if let Some((warm_up, measure)) = Settings::from_env().process_times() {
                inner.warm_up_time(warm_up).measurement_time(measure);
            }
        }
        Group { inner, name }
    }

    /// The record key of figure `id` in this group.
    pub fn key(&self, id: &str) -> String {
        key(self.name, id)
    }

    /// Bench `id`: `op` runs one iteration and returns the time of the part it measures.
    pub fn bench(&mut self, id: &str, mut op: impl FnMut() -> Duration) {
        let key = self.key(id);
        self.inner.bench_function(id, |b| {
            b.iter_custom(|iters| record::measure(&key, iters, &mut op))
        });
    }

    /// Bench a figure and its baseline interleaved (see [`record::measure_pair`]), as one
    /// criterion benchmark `id`; `a` and `b` are (figure id, operation) pairs.
    pub fn bench_pair(
        &mut self,
        id: &str,
        a: (&str, impl FnMut() -> Duration),
        b: (&str, impl FnMut() -> Duration),
    ) {
        self.bench_pair_prepared(id, || {}, a, b);
    }

    /// [`bench_pair`](Self::bench_pair), with `prepare` run before each of criterion's
    /// batches (those of its warm-up included), outside every clock: the figure's own and
    /// the wall clock criterion plans the figure's iterations from. For lazy setup far longer
    /// than an iteration (publishing tens of GiB, restarting a service): inside an operation
    /// it would end criterion's warm-up after one iteration and have the figure planned
    /// from that one (criterion's minimum of 10 iterations, and a warning).
    pub fn bench_pair_prepared(
        &mut self,
        id: &str,
        mut prepare: impl FnMut(),
        (id_a, mut op_a): (&str, impl FnMut() -> Duration),
        (id_b, mut op_b): (&str, impl FnMut() -> Duration),
    ) {
        let (key_a, key_b) = (self.key(id_a), self.key(id_b));
        self.inner.bench_function(id, |b| {
            prepare();
            b.iter_custom(|iters| {
                record::measure_pair((&key_a, &mut op_a), (&key_b, &mut op_b), iters)
            })
        });
    }

    /// Bench a figure and its baselines interleaved (see [`record::measure_interleaved`]), as
    /// one criterion benchmark `id`; `ops` are (figure id, operation) pairs.
    pub fn bench_interleaved(
        &mut self,
        id: &str,
        ops: &mut [(&str, &mut dyn FnMut() -> Duration)],
    ) {
        let keys: Vec<String> = ops.iter().map(|(figure, _)| self.key(figure)).collect();
        self.inner.bench_function(id, |b| {
            b.iter_custom(|iters| {
                let mut set: Vec<record::Interleaved<'_>> = keys
                    .iter()
                    .zip(ops.iter_mut())
                    .map(|(key, (_, op))| (key.as_str(), &mut **op as &mut dyn FnMut() -> Duration))
                    .collect();
                record::measure_interleaved(&mut set, iters)
            })
        });
    }

    /// Warm-up and measurement times for the figures benched from here on in this group: for
    /// figures whose untimed setup (a warm pool's refill) takes far longer than what they time,
    /// which would otherwise run for minutes. Command-line times do not override these.
    pub fn times(&mut self, warm_up: Duration, measure: Duration) {
        self.inner.warm_up_time(warm_up).measurement_time(measure);
    }

    /// Close the group.
    pub fn finish(self) {
        self.inner.finish();
    }
}

/// `group/id`, the key a figure's times and report row use.
pub fn key(group: &str, id: &str) -> String {
    format!("{group}/{id}")
}

/// Whether GPU groups can run: vmm-core's own check (libcuda, a device, VMM and POSIX-fd
/// support on device 0). With [`REQUIRE_GPU_VAR`]`=1` a missing GPU ends the process with
/// exit status 1 and the reason.
pub fn gpu_or_exit() -> Result<(), Unavailable> {
    let status = vmm_core::cuda::availability();
    if let Err(reason) = &status
        && std::env::var(REQUIRE_GPU_VAR).is_ok_and(|v| v == "1")
    {
        eprintln!("vmm-bench: {REQUIRE_GPU_VAR}=1 but the GPU benches cannot run: {reason}");
        std::process::exit(1);
    }
    status
}

/// One `SKIP <group>: <reason>` line on stderr.
pub fn skip(group: &str, reason: &str) {
    eprintln!("SKIP {group}: {reason}");
}

/// Whether this is a measuring run (`--bench` without `--test`/`--list`/`--profile-time`),
/// the only kind that writes the JSON report.
pub fn is_measuring_run() -> bool {
    let args: Vec<String> = std::env::args().collect();
    args.iter().any(|a| a == "--bench")
        && !args
            .iter()
            .any(|a| a == "--test" || a == "--list" || a.starts_with("--profile-time"))
}

/// Every group, host groups first; when `gpu` is `Err`, one SKIP line per GPU group up front.
/// The fabric groups run last, where fabric handles can be used; elsewhere (a GPU without
/// fabric support or without an IMEX channel) each prints one SKIP line and the report says
/// why (see [`exit_if_fabric_required`]).
pub fn run(c: &mut Criterion, gpu: &Result<(), Unavailable>) {
    let fabric_groups = [fabric::GROUP, fabric::HANDOFF_GROUP];
    if let Err(reason) = gpu {
        for group in [
            driver::GROUP,
            handoff::GROUP,
            pool::GROUP,
            endpoint::GPU_GROUP,
            start::GPU_GROUP,
            gpu_memd::GROUP,
        ]
        .into_iter()
        .chain(fabric_groups)
        {
            skip(group, &reason.to_string());
        }
    }
    host::driver(c);
    host::handoff(c);
    pool::host_pool(c);
    endpoint::host(c);
    start::child_start(c);
    child_drop::host_drop(c);
    tls::host_tls(c);
    memd::host_memd(c);
    if gpu.is_ok() {
        let cuda = raw::RawCuda::init().unwrap_or_else(|e| {
            panic!("vmm-core sees a usable GPU but the raw baseline cannot start: {e}")
        });
        driver::gpu_driver(c, &cuda);
        handoff::gpu_handoff(c, &cuda);
        pool::gpu_pool(c, &cuda);
        endpoint::gpu(c);
        start::gpu_child(c);
        match fabric::availability() {
            Ok(()) => {
                fabric::gpu_fabric(c, &cuda);
                fabric::gpu_fabric_handoff(c);
            }
            Err(reason) => {
                let reason = reason.to_string();
                for group in fabric_groups {
                    skip(group, &reason);
                }
                report::fabric_skipped(reason);
            }
        }
        // Last: it holds up to 98 GiB of the GPU while it runs (all freed at its end).
        gpu_memd::gpu_memd(c, &cuda);
    }
}

/// After the report: with [`REQUIRE_GPU_VAR`]`=1`, a GPU run whose fabric groups were skipped
/// (no fabric support, no IMEX channel) ends the process with exit status 1 and the reason.
/// Every other figure has run and is in the report by then.
pub fn exit_if_fabric_required() {
    if let Some(reason) = report::fabric_skip_reason()
        && std::env::var(REQUIRE_GPU_VAR).is_ok_and(|v| v == "1")
    {
        eprintln!(
            "vmm-bench: {REQUIRE_GPU_VAR}=1 but the fabric benches ({}, {}) could not run: \
             {reason}",
            fabric::GROUP,
            fabric::HANDOFF_GROUP
        );
        std::process::exit(1);
    }
}
