//! Typed results, from several threads, in the order they finish.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use rstest::rstest;
use vmm_core::Error;
use vmm_core::process::{Pool, StartMethod};
use vmm_tests::turns::shared;

use super::{TIMEOUT, run_task};

fn square(n: u64) -> (u32, u64) {
    (std::process::id(), n * n)
}

#[vmm_core::all_methods]
#[rstest]
fn tasks_return_typed_results_from_the_workers(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let pool = Pool::new(method, 2).unwrap();
    assert_eq!(pool.method(), method);
    let workers: BTreeSet<u32> = pool.pids().into_iter().collect();
    assert_eq!(workers.len(), 2);
    let tasks: Vec<_> = (0..8u64).map(|n| pool.submit(square, n).unwrap()).collect();
    let mut ran_in = BTreeSet::new();
    for (n, task) in tasks.into_iter().enumerate() {
        let (pid, squared) = task.join(TIMEOUT).unwrap();
        assert_eq!(squared, (n * n) as u64);
        ran_in.insert(pid);
    }
    assert!(
        ran_in.is_subset(&workers),
        "tasks ran outside the workers: {ran_in:?} vs {workers:?}"
    );
    assert!(!ran_in.contains(&std::process::id()));
    // The workers were reused: no task needed a new process.
    assert_eq!(pool.pids().into_iter().collect::<BTreeSet<_>>(), workers);
}

#[vmm_core::all_methods]
#[rstest]
fn tasks_joined_from_several_threads_all_get_their_own_results(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let pool = Pool::new(method, 2).unwrap();
    std::thread::scope(|scope| {
        let threads: Vec<_> = (0..6u64)
            .map(|t| {
                let pool = &pool;
                scope.spawn(move || {
                    // Submitted together, joined in reverse: results arrive for other threads'
                    // tasks while each thread waits for its own.
                    let tasks: Vec<_> = (0..5u64)
                        .map(|i| (t * 100 + i, pool.submit(square, t * 100 + i).unwrap()))
                        .collect();
                    for (n, task) in tasks.into_iter().rev() {
                        assert_eq!(task.join(TIMEOUT).unwrap().1, n * n);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
    });
}

fn sleep_ms(ms: u64) -> u64 {
    std::thread::sleep(Duration::from_millis(ms));
    ms
}

#[vmm_core::all_methods]
#[rstest]
fn a_quick_task_is_not_held_up_by_a_slow_one_joined_first(#[all_methods] method: StartMethod) {
    let _guard = shared();
    let pool = Pool::new(method, 2).unwrap();
    let slow = pool.submit(sleep_ms, 2000).unwrap();
    std::thread::scope(|scope| {
        // This thread waits first, so it is the one reading the workers.
        let slow = scope.spawn(move || slow.join(TIMEOUT).unwrap());
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        assert_eq!(run_task(&pool, sleep_ms, 1, TIMEOUT), 1);
        assert!(
            t.elapsed() < Duration::from_millis(1000),
            "the quick task waited for the slow one: {:?}",
            t.elapsed()
        );
        assert_eq!(slow.join().unwrap(), 2000);
    });
}

#[test]
fn a_pool_needs_a_worker_and_a_function_of_this_executable() {
    let _guard = shared();
    assert!(matches!(
        Pool::new(StartMethod::Spawn, 0),
        Err(Error::InvalidOption { option, .. }) if option == "workers"
    ));
}
