//! Failures: a panicking or dying worker fails only its own task and is replaced; no task
//! runs twice; timeouts and cancellation kill the task's worker; dropping the pool kills and
//! reaps every worker; the parent's fds stay as they were throughout; a task that floods its
//! worker's output costs the pool at most the output cap.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rstest::rstest;
use vmm_core::Error;
use vmm_core::process::{Context, Pool, StartMethod, WarmPool, ensure_running};
use vmm_core::shm::HostBuffer;
use vmm_core::testing::settled_open_fds;
use vmm_core::wire::Queue;
use vmm_tests::flood::{
    Flood, LAST_WORDS, MemoryWatch, PANIC, RETURNED, assert_tail_kept, flood_task,
};
use vmm_tests::process_table::{gone_within, state};
use vmm_tests::turns::{exclusive, shared};

use super::arguments::fill_and_count;
use super::{TIMEOUT, my_pid, next_worker, run_task};

fn print_and_return(word: String) -> String {
    println!("task says {word}");
    word
}

fn print_and_panic(word: String) -> String {
    println!("task says {word}");
    panic!("task panicked on {word}");
}

#[vmm_core::all_methods]
#[rstest]
fn a_panicking_task_fails_alone_and_its_worker_is_replaced(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let pool = Pool::new(method, 2).unwrap();
    let before: BTreeSet<u32> = pool.pids().into_iter().collect();
    let ok = pool
        .submit(print_and_return, String::from("first"))
        .unwrap();
    assert_eq!(ok.join(TIMEOUT).unwrap(), "first");
    let failing = pool
        .submit(print_and_panic, String::from("second"))
        .unwrap();
    let others: Vec<_> = (0..4)
        .map(|i| pool.submit(print_and_return, format!("other {i}")).unwrap())
        .collect();
    let Err(Error::Child(failure)) = failing.join(TIMEOUT) else {
        panic!("a panicking task must fail with Error::Child")
    };
    assert_eq!(failure.method, method);
    assert_eq!(
        failure.panic_message.as_deref(),
        Some("task panicked on second")
    );
    assert!(
        failure
            .panic_location
            .as_deref()
            .is_some_and(|l| l.contains(file!())),
        "{failure}"
    );
    assert_eq!(
        failure.status.and_then(|s| s.code()),
        Some(101),
        "{failure}"
    );
    assert!(failure.stdout.contains("task says second"), "{failure}");
    assert!(
        !failure.stdout.contains("first") && !failure.stdout.contains("other"),
        "another task's output was blamed on this one: {failure}"
    );
    assert!(failure.to_string().contains("Pool worker"), "{failure}");
    let dead = failure.pid;
    assert!(before.contains(&dead));
    for (i, task) in others.into_iter().enumerate() {
        assert_eq!(task.join(TIMEOUT).unwrap(), format!("other {i}"));
    }
    let after: BTreeSet<u32> = pool.pids().into_iter().collect();
    assert_eq!(after.len(), 2, "the panicked worker was replaced");
    assert!(!after.contains(&dead));
    assert_eq!(state(dead), None, "the panicked worker was not reaped");
}

fn die_by_signal(_: ()) -> u32 {
    kill(Pid::this(), Signal::SIGKILL).unwrap();
    unreachable!("killed")
}

#[vmm_core::all_methods]
#[rstest]
fn a_worker_that_dies_fails_its_task_with_how_it_died(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let pool = Pool::new(method, 1).unwrap();
    let first = next_worker(&pool);
    let Err(Error::Child(failure)) = pool.submit(die_by_signal, ()).unwrap().join(TIMEOUT) else {
        panic!("a dying worker must fail its task with Error::Child")
    };
    assert_eq!(failure.pid, first);
    assert_eq!(
        failure.status.and_then(|s| s.signal()),
        Some(9),
        "{failure}"
    );
    assert!(failure.panic_message.is_none());
    assert!(
        failure
            .to_string()
            .contains("it ended without reporting how its function ended"),
        "{failure}"
    );
    let next = next_worker(&pool);
    assert_ne!(next, first, "the task ran on the replacement");
    assert_eq!(state(first), None, "the dead worker was not reaped");
}

#[vmm_core::all_methods]
#[rstest]
fn a_worker_killed_while_idle_is_replaced_before_its_next_task(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let pool = Pool::new(method, 1).unwrap();
    let idle = pool.pids()[0];
    kill(Pid::from_raw(idle as i32), Signal::SIGKILL).unwrap();
    assert!(gone_within(idle, TIMEOUT, true));
    let ran_in = next_worker(&pool);
    assert_ne!(ran_in, idle);
    assert_eq!(pool.pids(), [ran_in]);
    assert!(
        gone_within(idle, Duration::from_secs(5), true) && state(idle).is_none(),
        "the dead idle worker was not reaped"
    );
}

fn count_run(runs: Queue<u32>) -> u32 {
    runs.put(&std::process::id()).unwrap();
    std::process::id()
}

/// A task sent to a worker that dies before taking it off its channel (stopped, then killed:
/// the task sits unread in its channel) never ran, so it runs on the replacement, once, rather
/// than failing. A worker that dies after taking its task fails it instead
/// (`a_worker_that_dies_fails_its_task_with_how_it_died`).
#[vmm_core::all_methods]
#[rstest]
fn a_task_its_worker_died_before_taking_runs_on_the_replacement(
    #[all_methods] method: StartMethod,
) {
    let _guard = shared();
    let pool = Pool::new(method, 1).unwrap();
    let stopped = pool.pids()[0];
    kill(Pid::from_raw(stopped as i32), Signal::SIGSTOP).unwrap();
    let runs = Queue::new().unwrap();
    let task = pool.submit(count_run, runs.clone()).unwrap();
    // The task is in the stopped worker's channel now; it has not taken it.
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        runs.get(Duration::from_millis(10)).is_err(),
        "a stopped worker ran the task"
    );
    kill(Pid::from_raw(stopped as i32), Signal::SIGKILL).unwrap();
    let ran_in = task.join(TIMEOUT).unwrap();
    assert_ne!(ran_in, stopped);
    assert_eq!(runs.get(TIMEOUT).unwrap(), ran_in);
    assert!(
        runs.get(Duration::from_millis(100)).is_err(),
        "the task ran twice"
    );
    assert_eq!(pool.pids(), [ran_in]);
    assert!(
        gone_within(stopped, Duration::from_secs(5), true) && state(stopped).is_none(),
        "the dead worker was not reaped"
    );
}

/// A hostile task: it counts its run in `runs` (through the queue, outside its own memory),
/// then zeroes every writable shared mapping of its own process except its argument's (what a
/// task, or a stray write, can do to anything the worker keeps in shared memory), and kills
/// its own process.
fn wipe_shared_memory_and_die(runs: Queue<u32>) -> u32 {
    runs.put(&std::process::id()).unwrap();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        if !perms.starts_with("rw") || !perms.ends_with('s') {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let start = usize::from_str_radix(start, 16).unwrap();
        let end = usize::from_str_radix(end, 16).unwrap();
        // SAFETY: this is the attack. The range is a writable shared mapping of this process
        // (the kernel says so), and the process kills itself right after, so nothing of it
        // reads the wiped memory as Rust values again.
        unsafe { std::ptr::write_bytes(start as *mut u8, 0, end - start) };
    }
    kill(Pid::this(), Signal::SIGKILL).unwrap();
    unreachable!("SIGKILL returned")
}

/// Another hostile task: it counts its run, shuts down every socket of its process both ways
/// (a task socket that reads as closed must not pass for one whose task is still unread), and
/// kills its own process.
fn shut_every_socket_and_die(runs: Queue<u32>) -> u32 {
    runs.put(&std::process::id()).unwrap();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let is_socket = std::fs::read_link(entry.path())
            .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"));
        if is_socket {
            // SAFETY: shutdown only changes the socket's state; the fd stays open and owned by
            // whoever owns it. This is the attack.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        }
    }
    kill(Pid::this(), Signal::SIGKILL).unwrap();
    unreachable!("SIGKILL returned")
}

/// "No task runs twice" whatever a task does to its own process: a task that wipes every
/// shared mapping of its worker, or shuts down every socket it has, and then dies ran once,
/// and fails with how its worker died; it is never handed to a replacement.
#[vmm_core::all_methods]
#[rstest]
fn a_hostile_task_that_kills_its_worker_runs_once(
    #[all_methods] method: StartMethod,
    #[values("wipe shared memory", "shut every socket")] attack: &str,
) {
    let _guard = shared();
    let pool = Pool::new(method, 1).unwrap();
    let worker = pool.pids()[0];
    let runs = Queue::new().unwrap();
    let submitted = if attack == "wipe shared memory" {
        pool.submit(wipe_shared_memory_and_die, runs.clone())
    } else {
        pool.submit(shut_every_socket_and_die, runs.clone())
    };
    let joined = submitted.unwrap().join(TIMEOUT);
    let Err(Error::Child(failure)) = &joined else {
        panic!("a task whose worker died must fail, got {joined:?}");
    };
    // (A worker that shut its own channel down may leave its exit status unknown.)
    assert!(
        failure.to_string().contains("SIGKILL") || failure.to_string().contains("status unknown"),
        "{failure}"
    );
    assert_eq!(runs.get(TIMEOUT).unwrap(), worker, "the task never ran");
    assert!(
        runs.get(Duration::from_millis(500)).is_err(),
        "the task ran again after its worker died"
    );
    // The pool serves on.
    assert_ne!(next_worker(&pool), worker);
}

/// A worker SIGKILLed an instant before a submit: the task may reach its channel before the
/// kernel has finished it, but it never takes the task, so the task runs elsewhere.
#[vmm_core::all_methods]
#[rstest]
fn a_task_submitted_just_after_its_worker_was_killed_runs_elsewhere(
    #[all_methods] method: StartMethod,
) {
    let _guard = shared();
    let pool = Pool::new(method, 1).unwrap();
    for _ in 0..5 {
        let idle = pool.pids()[0];
        kill(Pid::from_raw(idle as i32), Signal::SIGKILL).unwrap();
        let ran_in = next_worker(&pool);
        assert_ne!(ran_in, idle);
    }
}

fn hang(started: Queue<u32>) -> u32 {
    started.put(&std::process::id()).unwrap();
    std::thread::sleep(Duration::from_secs(600));
    0
}

#[vmm_core::all_methods]
#[rstest]
fn a_task_past_its_timeout_is_killed_with_its_worker(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let pool = Pool::new(method, 1).unwrap();
    let started = Queue::new().unwrap();
    let hanging = pool.submit(hang, started.clone()).unwrap();
    // A second task waits for the only worker: at its deadline it is cancelled, not run.
    let waiting = pool.submit(my_pid, ()).unwrap();
    let worker = started.get(TIMEOUT).unwrap();
    let t = Instant::now();
    match waiting.join(Duration::from_millis(200)) {
        Err(Error::Timeout { what, .. }) => assert!(what.contains("free worker"), "{what}"),
        other => panic!("a queued task past its deadline is Error::Timeout, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5));
    let t = Instant::now();
    let Err(Error::Child(failure)) = hanging.join(Duration::from_millis(300)) else {
        panic!("a running task past its deadline is Error::Child")
    };
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "join overran its deadline"
    );
    assert_eq!(failure.timed_out, Some(Duration::from_millis(300)));
    assert_eq!(
        failure.status.and_then(|s| s.signal()),
        Some(9),
        "{failure}"
    );
    assert_eq!(failure.pid, worker);
    assert_eq!(state(worker), None, "the killed worker was not reaped");
    // The pool goes on with a replacement.
    assert_ne!(next_worker(&pool), worker);
}

#[vmm_core::all_methods]
#[rstest]
fn dropping_an_unjoined_handle_cancels_its_task(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let pool = Pool::new(method, 1).unwrap();
    let started = Queue::new().unwrap();
    let hanging = pool.submit(hang, started.clone()).unwrap();
    let worker = started.get(TIMEOUT).unwrap();
    drop(hanging);
    // The drop kills the worker without waiting; it is reaped in the background.
    assert!(
        gone_within(worker, Duration::from_secs(5), false),
        "the cancelled task's worker was not reaped: {:?}",
        state(worker)
    );
    assert_ne!(next_worker(&pool), worker);
}

#[vmm_core::all_methods]
#[rstest]
fn dropping_the_pool_kills_and_reaps_every_worker(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let pool = Pool::new(method, 3).unwrap();
    let pids = pool.pids();
    assert_eq!(pids.len(), 3);
    let started = Queue::new().unwrap();
    let hanging = pool.submit(hang, started.clone()).unwrap();
    started.get(TIMEOUT).unwrap();
    let queued: Vec<_> = (0..5).map(|_| pool.submit(my_pid, ()).unwrap()).collect();
    drop(pool);
    // The drop kills the workers without waiting; they are reaped in the background.
    for pid in &pids {
        assert!(
            gone_within(*pid, Duration::from_secs(5), false),
            "worker {pid} survived its pool (or is a zombie): {:?}",
            state(*pid)
        );
    }
    match hanging.join(TIMEOUT) {
        Err(Error::Disconnected(why)) => assert!(why.contains("Pool was dropped"), "{why}"),
        other => panic!("the running task must fail with the pool, got {other:?}"),
    }
    // The queued ones either ran before the drop or fail with it.
    for task in queued {
        match task.join(TIMEOUT) {
            Ok(pid) => assert!(pids.contains(&pid)),
            Err(Error::Disconnected(_)) => {}
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
}

#[vmm_core::all_methods]
#[rstest]
fn the_parents_fds_are_stable_across_tasks_and_replacements(#[all_methods] method: StartMethod) {
    let _guard = exclusive();
    ensure_running().unwrap();
    WarmPool::global().fill().unwrap();
    let pool = Pool::new(method, 2).unwrap();
    let buf = HostBuffer::new(1 << 16).unwrap();
    let before = settled_open_fds().unwrap();
    for round in 0..4u8 {
        run_task(&pool, fill_and_count, (buf.clone(), round), TIMEOUT);
    }
    assert!(
        pool.submit(print_and_panic, String::from("x"))
            .unwrap()
            .join(TIMEOUT)
            .is_err()
    );
    next_worker(&pool);
    assert_eq!(
        settled_open_fds().unwrap(),
        before,
        "the pool's fds changed"
    );
}

/// The pool's side, in a process of its own: a pool of one worker under `method`, then, with
/// this process's address space limited far below the flood (see `vmm_tests::flood`), tasks
/// that flood their worker's output: one that returns (its result arrives, the worker serves
/// on, its output was emptied), one that panics (its failure keeps the tail, with the panic),
/// and an ordinary task after them.
fn run_flooding_tasks_under_a_memory_limit((method, flood): (StartMethod, Flood)) {
    let pool = Pool::new(method, 1).unwrap();
    let watch = MemoryWatch::limit_and_start();
    let worker = next_worker(&pool);
    assert_eq!(
        run_task(&pool, flood_task, (flood, false), TIMEOUT),
        RETURNED
    );
    assert_eq!(
        next_worker(&pool),
        worker,
        "a task that returned ended its worker"
    );
    let result = pool
        .submit(flood_task, (flood, true))
        .unwrap()
        .join(TIMEOUT);
    let Err(Error::Child(failure)) = result else {
        panic!("a task that panicked must fail, got {result:?}")
    };
    assert_eq!(failure.panic_message.as_deref(), Some(PANIC), "{failure}");
    assert_eq!(failure.pid, worker);
    assert_tail_kept("stdout", &failure.stdout, flood, None);
    assert_tail_kept("stderr", &failure.stderr, flood, Some(LAST_WORDS));
    assert_tail_kept("stderr", &failure.stderr, flood, Some(PANIC));
    assert_ne!(
        next_worker(&pool),
        worker,
        "the panicked worker was not replaced"
    );
    watch.assert_peak_stayed_low(&format!("{method}, {flood:?}"));
}

/// A task that truncates its worker's captured stdout and stderr to a terabyte, or writes
/// 4 MiB to each, costs the pool's process at most the output cap per stream: what the pool
/// keeps of a task's output is its tail, with the panic, and a note of what was cut, and the
/// process stays within a memory limit far below the flood (a parent that read it whole
/// aborted on 1 TiB).
#[vmm_core::all_methods]
#[rstest]
fn a_task_that_floods_its_workers_output_costs_the_pool_one_cap(
    #[all_methods] method: StartMethod,
    #[values(Flood::Sparse, Flood::Written)] flood: Flood,
) {
    let _guard = shared();
    // The pool's process is a child of its own, so that its limit binds nothing else; its warm
    // workers initialise no GPU under that limit.
    Context::new(StartMethod::Spawn)
        .with_env("VMM_WARM_DEVICES", "none")
        .spawn(run_flooding_tasks_under_a_memory_limit, (method, flood))
        .unwrap()
        .join(TIMEOUT)
        .unwrap();
}
