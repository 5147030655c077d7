//! `shm::buffers_hold_no_fd()` remembers only a definite answer: a probe that failed because the
//! process was out of fds for a moment must not decide it for the life of the process.
//!
//! The probe's memory is per process, so each case runs in a fresh spawn child.

use std::time::Duration;

use nix::sys::resource::{Resource, getrlimit, setrlimit};
use vmm_core::process::{Context, StartMethod};
use vmm_core::shm;
use vmm_core::wire::Queue;

const WAIT: Duration = Duration::from_secs(30);

/// The answer of a process that probes with fds to spare.
fn probe_plainly(answer: Queue<bool>) {
    answer.put(&shm::buffers_hold_no_fd()).unwrap();
}

/// Probe at the fd limit (the probe cannot make its memfd), then again with the limit restored.
fn probe_at_the_fd_limit_then_again(answers: Queue<(bool, bool)>) {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    let open = vmm_core::testing::open_fds().unwrap() as u64;
    setrlimit(Resource::RLIMIT_NOFILE, open + 16, hard).unwrap();
    // Take every fd number left below the limit.
    let stdin = std::io::stdin();
    let mut fillers = Vec::new();
    while let Ok(fd) = std::os::fd::AsFd::as_fd(&stdin).try_clone_to_owned() {
        fillers.push(fd);
    }
    let starved = shm::buffers_hold_no_fd();
    drop(fillers);
    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
    let later = shm::buffers_hold_no_fd();
    answers.put(&(starved, later)).unwrap();
}

#[test]
fn a_probe_that_ran_out_of_fds_is_not_remembered() {
    let ctx = Context::new(StartMethod::Spawn);
    let plain = Queue::new().unwrap();
    ctx.spawn(probe_plainly, plain.clone())
        .unwrap()
        .join(WAIT)
        .unwrap();
    let truth = plain.get(WAIT).unwrap();

    let answers = Queue::new().unwrap();
    ctx.spawn(probe_at_the_fd_limit_then_again, answers.clone())
        .unwrap()
        .join(WAIT)
        .unwrap();
    let (starved, later) = answers.get(WAIT).unwrap();
    assert!(!starved, "a probe without a free fd cannot have succeeded");
    assert_eq!(
        later, truth,
        "after the fds came back, the probe must answer as a process that never ran out"
    );
    if !truth {
        eprintln!(
            "note: /proc/self/map_files reopens are not allowed here (not root), so this run \
             cannot tell a remembered failure from a real one"
        );
    }
}
