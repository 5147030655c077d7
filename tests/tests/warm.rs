//! `StartMethod::Warm` on the host path: children started ahead of need, each running one
//! function; a waiting child that died is replaced, never handed out; the pool's fds are stable
//! once it is warm; waiting children die with their parent.
//!
//! Then `warm` as a downstream crate uses it, `#[ipc_test(methods = [.., warm])]`: host buffers
//! everywhere and, where there is a GPU, CUDA initialised in the waiting child before its
//! function runs (skipped elsewhere; a failure under `VMM_REQUIRE_GPU=1`).
//!
//! Every test here uses the one process-wide warm pool, so they take turns (the pool's pids
//! are compared before and after), and each hands its turn back with the pool refilled under
//! the environment's options.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use vmm_core::Error;
use vmm_core::ipc_test;
use vmm_core::process::{
    Context, DEFAULT_DEPTH, StartMethod, WarmOptions, WarmPool, ensure_running,
};
use vmm_core::shm::HostBuffer;
use vmm_core::testing::settled_open_fds;
use vmm_core::wire::Queue;
use vmm_tests::pattern;

use vmm_tests::process_table::{gone_within, state};

const TIMEOUT: Duration = Duration::from_secs(30);
/// A GPU child's deadline (its CUDA initialisation included).
const CUDA_TIMEOUT: Duration = Duration::from_secs(60);
const LEN: usize = 1 << 20;

/// This file's tests run one at a time: they all look at the one warm pool.
struct Turn {
    _alone: std::sync::RwLockWriteGuard<'static, ()>,
}

fn turn() -> Turn {
    Turn {
        _alone: vmm_tests::turns::exclusive(),
    }
}

impl Drop for Turn {
    /// Leave the pool as the `#[ipc_test]` runner leaves it for a `thread_unsafe` body: only
    /// children of the environment's options, none for a context with extra environment, and
    /// full (a failure here is the next test's to report).
    fn drop(&mut self) {
        WarmPool::global().set_options(WarmOptions::from_env().unwrap());
        let _ = WarmPool::global().fill();
    }
}

/// Use `depth` (no CUDA devices: this is the host path) until dropped, then the environment's
/// options again.
struct Depth;

impl Depth {
    fn set(depth: usize) -> Depth {
        WarmPool::global().set_options(WarmOptions::new().with_depth(depth));
        Depth
    }
}

impl Drop for Depth {
    fn drop(&mut self) {
        WarmPool::global().set_options(WarmOptions::from_env().unwrap());
    }
}

/// How many times this process ran `count_runs`: a warm child that ran two functions would say 2.
static RUNS: AtomicUsize = AtomicUsize::new(0);

fn count_runs(queue: Queue<(u32, usize)>) {
    let runs = RUNS.fetch_add(1, Ordering::SeqCst) + 1;
    queue.put(&(std::process::id(), runs)).unwrap();
}

#[test]
fn a_warm_child_was_waiting_runs_one_function_and_is_replaced() {
    let _turn = turn();
    let _depth = Depth::set(2);
    let waiting = WarmPool::global().fill().unwrap();
    assert_eq!(waiting.len(), 2);
    let queue = Queue::new().unwrap();
    let ctx = Context::new(StartMethod::Warm);
    let mut seen = Vec::new();
    for _ in 0..3 {
        let child = ctx.spawn(count_runs, queue.clone()).unwrap();
        let pid = child.pid();
        child.join(TIMEOUT).unwrap();
        let (ran_in, runs) = queue.get(TIMEOUT).unwrap();
        assert_eq!(ran_in, pid, "the function ran in the child handed out");
        assert_eq!(runs, 1, "a warm child runs exactly one function");
        assert_eq!(state(pid), None, "the child was reaped");
        seen.push(pid);
    }
    assert!(
        waiting.contains(&seen[0]),
        "the first child was one that waited: {seen:?} vs {waiting:?}"
    );
    seen.dedup();
    assert_eq!(seen.len(), 3, "every spawn got a fresh process");
    let refilled = WarmPool::global().fill().unwrap();
    assert_eq!(refilled.len(), waiting.len(), "the pool was refilled");
    assert!(refilled.iter().all(|pid| !seen.contains(pid)));
}

fn noop(_: ()) {}

#[test]
fn a_waiting_child_that_died_is_replaced_and_never_handed_out() {
    let _turn = turn();
    let _depth = Depth::set(2);
    let waiting = WarmPool::global().fill().unwrap();
    assert_eq!(waiting.len(), 2);
    let victim = waiting[0];
    kill(Pid::from_raw(victim as i32), Signal::SIGKILL).unwrap();
    assert!(
        gone_within(victim, TIMEOUT, true),
        "the killed child did not die"
    );
    let child = Context::new(StartMethod::Warm).spawn(noop, ()).unwrap();
    assert_ne!(child.pid(), victim, "a dead child was handed out");
    assert_eq!(child.pid(), waiting[1], "the live waiting child was used");
    child.join(TIMEOUT).unwrap();
    // A dead waiting child is dropped, and a drop never waits: the supervisor reaps it in the
    // background (on the H200 it was still a zombie when join returned). No zombie may stay.
    assert!(
        gone_within(victim, TIMEOUT, false),
        "the dead waiting child was not reaped: {:?}",
        state(victim)
    );
    let refilled = WarmPool::global().fill().unwrap();
    assert_eq!(refilled.len(), 2);
    assert!(!refilled.contains(&victim) && !refilled.contains(&waiting[1]));
}

#[test]
fn every_waiting_child_dead_still_starts_one() {
    let _turn = turn();
    let _depth = Depth::set(2);
    let waiting = WarmPool::global().fill().unwrap();
    for &pid in &waiting {
        kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    }
    for &pid in &waiting {
        assert!(gone_within(pid, TIMEOUT, true));
    }
    let queue = Queue::new().unwrap();
    let child = Context::new(StartMethod::Warm)
        .spawn(count_runs, queue.clone())
        .unwrap();
    assert!(!waiting.contains(&child.pid()));
    child.join(TIMEOUT).unwrap();
    assert_eq!(queue.get(TIMEOUT).unwrap().1, 1);
    for &pid in &waiting {
        assert_eq!(state(pid), None, "dead waiting child {pid} was not reaped");
    }
}

/// A waiting child SIGKILLed an instant before the take: its pidfd and channel may still be
/// quiet (the kernel has not finished it), but it cannot answer the pool's ping, so it is never
/// handed out. On a GPU machine that instant lasts as long as the CUDA teardown.
#[test]
fn a_waiting_child_killed_just_before_the_take_is_never_handed_out() {
    let _turn = turn();
    let _depth = Depth::set(2);
    let queue = Queue::new().unwrap();
    let ctx = Context::new(StartMethod::Warm);
    for _ in 0..10 {
        let waiting = WarmPool::global().fill().unwrap();
        let victim = waiting[0];
        kill(Pid::from_raw(victim as i32), Signal::SIGKILL).unwrap();
        let child = ctx.spawn(count_runs, queue.clone()).unwrap();
        assert_ne!(child.pid(), victim, "a killed child was handed out");
        let pid = child.pid();
        child.join(TIMEOUT).unwrap();
        assert_eq!(
            queue.get(TIMEOUT).unwrap(),
            (pid, 1),
            "the function ran once, in it"
        );
        assert!(
            gone_within(victim, TIMEOUT, false),
            "the killed child was not reaped"
        );
    }
}

/// A waiting child that is alive but never answers (stopped) is not handed out either: after
/// the ping's limit it is killed and reaped, and the next waiting child runs the function.
#[test]
fn a_waiting_child_that_never_answers_is_killed_not_handed_out() {
    let _turn = turn();
    let _depth = Depth::set(2);
    let waiting = WarmPool::global().fill().unwrap();
    let stopped = waiting[0];
    kill(Pid::from_raw(stopped as i32), Signal::SIGSTOP).unwrap();
    let queue = Queue::new().unwrap();
    let child = Context::new(StartMethod::Warm)
        .spawn(count_runs, queue.clone())
        .unwrap();
    assert_eq!(
        child.pid(),
        waiting[1],
        "the answering child was handed out"
    );
    child.join(TIMEOUT).unwrap();
    assert_eq!(queue.get(TIMEOUT).unwrap(), (waiting[1], 1));
    // Killed when it was found silent, and reaped in the background (a drop never waits).
    assert!(
        gone_within(stopped, TIMEOUT, false),
        "the silent child was not killed and reaped (state {:?})",
        state(stopped)
    );
}

fn fill(buf: HostBuffer) {
    buf.fill(0x5C).unwrap();
}

#[test]
fn fds_are_stable_once_the_pool_is_warm() {
    let _turn = turn();
    let _depth = Depth::set(2);
    WarmPool::global().fill().unwrap();
    let buf = HostBuffer::new(1 << 16).unwrap();
    let before = settled_open_fds().unwrap();
    let ctx = Context::new(StartMethod::Warm);
    for _ in 0..3 {
        ctx.spawn(fill, buf.clone()).unwrap().join(TIMEOUT).unwrap();
    }
    assert!(buf.to_vec().iter().all(|&b| b == 0x5C));
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "taking warm children changed the parent's fds"
    );
    // A waiting child that dies is replaced by one with the same fds' worth.
    let victim = WarmPool::global().pids()[0];
    kill(Pid::from_raw(victim as i32), Signal::SIGKILL).unwrap();
    assert!(gone_within(victim, TIMEOUT, true));
    ctx.spawn(noop, ()).unwrap().join(TIMEOUT).unwrap();
    WarmPool::global().fill().unwrap();
    assert_eq!(settled_open_fds().unwrap(), before);
}

fn panics(message: String) {
    println!("about to panic");
    panic!("{message}");
}

#[test]
fn a_warm_childs_panic_comes_back_with_its_method() {
    let _turn = turn();
    let Err(Error::Child(failure)) = Context::new(StartMethod::Warm)
        .spawn(panics, "warm words".to_owned())
        .unwrap()
        .join(TIMEOUT)
    else {
        panic!("the panic must fail the join")
    };
    assert_eq!(failure.method, StartMethod::Warm);
    assert_eq!(failure.panic_message.as_deref(), Some("warm words"));
    assert!(failure.stdout.contains("about to panic"), "{failure}");
    assert!(
        failure.to_string().contains("start method warm"),
        "{failure}"
    );
}

fn hang(_: ()) {
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn a_hanging_warm_child_is_killed_at_its_timeout_and_reaped() {
    let _turn = turn();
    let child = Context::new(StartMethod::Warm).spawn(hang, ()).unwrap();
    let pid = child.pid();
    let started = Instant::now();
    let Err(Error::Child(failure)) = child.join(Duration::from_millis(300)) else {
        panic!("must time out")
    };
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(failure.timed_out, Some(Duration::from_millis(300)));
    assert_eq!(failure.status.and_then(|s| s.signal()), Some(9));
    assert_eq!(state(pid), None, "the killed child was not reaped");
    // Dropped unjoined: killed and reaped too.
    let child = Context::new(StartMethod::Warm).spawn(hang, ()).unwrap();
    let pid = child.pid();
    child.kill().unwrap();
    drop(child);
    // The drop never waits: the child is reaped in the background.
    assert!(
        gone_within(pid, Duration::from_secs(5), false),
        "the dropped child was not reaped: {:?}",
        state(pid)
    );
}

fn report_env(queue: Queue<Option<String>>) {
    queue.put(&std::env::var("VMM_WARM_TEST_ENV").ok()).unwrap();
}

#[test]
fn a_context_with_env_gets_children_started_with_it() {
    let _turn = turn();
    let queue = Queue::new().unwrap();
    let ctx = Context::new(StartMethod::Warm);
    for value in ["one", "two"] {
        ctx.clone()
            .with_env("VMM_WARM_TEST_ENV", value)
            .spawn(report_env, queue.clone())
            .unwrap()
            .join(TIMEOUT)
            .unwrap();
        assert_eq!(queue.get(TIMEOUT).unwrap().as_deref(), Some(value));
    }
    ctx.spawn(report_env, queue.clone())
        .unwrap()
        .join(TIMEOUT)
        .unwrap();
    assert_eq!(queue.get(TIMEOUT).unwrap(), None);
}

#[test]
fn options_set_the_depth() {
    let _turn = turn();
    WarmPool::global().set_options(WarmOptions::new().with_depth(3).with_devices([]));
    assert_eq!(WarmPool::global().fill().unwrap().len(), 3);
    assert_eq!(WarmPool::global().options().devices(), &[] as &[usize]);
    WarmPool::global().set_options(WarmOptions::new().with_depth(0));
    assert!(WarmPool::global().fill().unwrap().is_empty());
    assert!(
        WarmPool::global().pids().is_empty(),
        "children of the old options were ended"
    );
    // With no pool, a warm child is started on demand.
    Context::new(StartMethod::Warm)
        .spawn(noop, ())
        .unwrap()
        .join(TIMEOUT)
        .unwrap();
    assert!(WarmPool::global().pids().is_empty());
    WarmPool::global().set_options(WarmOptions::from_env().unwrap());
    assert_eq!(
        WarmPool::global().options().depth(),
        std::env::var("VMM_WARM_DEPTH")
            .ok()
            .and_then(|d| d.parse().ok())
            .unwrap_or(DEFAULT_DEPTH)
    );
}

#[test]
fn an_owned_pool_fills_apart_from_the_global_one_and_its_children_end_with_it() {
    let _turn = turn();
    let pool = WarmPool::new(WarmOptions::new().with_depth(2).with_devices([]));
    let pids = pool.fill().unwrap();
    assert_eq!(pids.len(), 2);
    assert_eq!(pool.pids().len(), 2);
    assert!(
        pids.iter()
            .all(|pid| !WarmPool::global().pids().contains(pid)),
        "the global pool holds none of them"
    );
    drop(pool);
    for pid in pids {
        assert!(
            gone_within(pid, TIMEOUT, false),
            "waiting child {pid} outlived its pool (or was not reaped)"
        );
    }
}

fn start_pool_and_hang(queue: Queue<Vec<u32>>) {
    let pids = WarmPool::global().fill().unwrap();
    queue.put(&pids).unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn waiting_children_die_with_their_parent() {
    let _turn = turn();
    let queue = Queue::new().unwrap();
    let middle = Context::new(StartMethod::Spawn)
        .spawn(start_pool_and_hang, queue.clone())
        .unwrap();
    let pids = queue.get(TIMEOUT).unwrap();
    assert!(!pids.is_empty());
    for &pid in &pids {
        assert!(state(pid).is_some_and(|s| s != 'Z'), "{pid} is not waiting");
    }
    middle.kill().unwrap();
    drop(middle);
    for &pid in &pids {
        // Their parent is gone, so they were killed; init reaps them.
        assert!(
            gone_within(pid, Duration::from_secs(10), true),
            "waiting child {pid} outlived its parent"
        );
    }
}

fn read_back_and_reply(buf: HostBuffer) {
    assert_eq!(buf.to_vec(), pattern(1, buf.size()));
    buf.write_at(0, &pattern(2, buf.size())).unwrap();
}

#[ipc_test(methods = all)]
fn host_buffer_as_argument(ctx: &Context) {
    let _turn = turn();
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
    let _turn = turn();
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
    let _turn = turn();
    let queue = Queue::new().unwrap();
    ctx.spawn(report_cuda_state, queue.clone())
        .unwrap()
        .wait()
        .unwrap();
    let active = queue.get(CUDA_TIMEOUT).unwrap();
    match ctx.method() {
        StartMethod::Warm => assert!(active, "the warm child had no primary context yet"),
        // The control: a spawned child starts cold.
        _ => assert!(!active, "a spawned child already had a primary context"),
    }
}
