//! `Pool`, under every start method: typed results (`results`); arguments imported for the
//! task and released when it ends, host and GPU buffers as a program passes them (`arguments`:
//! fds and mappings counted in the worker between tasks); a panicking or dying worker fails
//! only its own task and is replaced, timeouts and cancellation kill the task's worker,
//! dropping the pool kills and reaps every worker (`failures`). The GPU scenario skips where
//! there is no GPU and fails there under `VMM_REQUIRE_GPU=1`.
//!
//! The tests that count this process's fds take an exclusive turn
//! ([`vmm_tests::turns::exclusive`]); the others share.

use std::borrow::Borrow;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use vmm_core::process::Pool;

mod arguments;
mod failures;
mod results;

const TIMEOUT: Duration = Duration::from_secs(30);

fn my_pid(_: ()) -> u32 {
    std::process::id()
}

/// Run `f(args)` as a task of `pool` and return its result, which must come by `within`.
fn run_task<F, A, R>(pool: &Pool, f: F, args: impl Borrow<A>, within: Duration) -> R
where
    F: Fn(A) -> R + Copy,
    A: Serialize + DeserializeOwned,
    R: Serialize + DeserializeOwned,
{
    pool.submit(f, args).unwrap().join(within).unwrap()
}

/// The pid of the worker that ran the next task of `pool`.
fn next_worker(pool: &Pool) -> u32 {
    run_task(pool, my_pid, (), TIMEOUT)
}
