//! Fd accounting for tests that prove nothing leaks.

use std::time::{Duration, Instant};

use crate::{Error, Result};

/// The number of open fds of this process: entries of `/proc/self/fd`, not counting the one
/// the listing itself holds open.
pub fn open_fds() -> Result<usize> {
    crate::limits::open_fds().map_err(|e| Error::io("read_dir(/proc/self/fd)", e))
}

/// How many threads the endpoints' background closer has started so far (closers and the
/// watcher that starts one when every closer is stuck), ended ones included: each had a stack
/// mapping, which the C library may keep for reuse after the thread ends, so a test that
/// counts this process's mappings allows two (stack and guard page) per thread started.
pub fn closer_threads_started() -> usize {
    crate::wire::endpoint::closer_threads_started()
}

/// [`open_fds`] once it has stopped changing: after the [warm pool](crate::process::WarmPool)'s
/// replacements in flight have been launched (each adds the fds of the child it replaces), the
/// dropped children's pidfds and channels have been let go (the supervisor's orphan queue has
/// reaped them all and its reaper thread, with its eventfd, has ended; at most ten seconds) and
/// the fds a peer sent that endpoints refused have been closed (on a background thread; at most
/// five seconds are given to a close that blocks), the same count three times in a row, a
/// millisecond apart (other threads may be closing fds), or the last count after one second.
pub fn settled_open_fds() -> Result<usize> {
    crate::process::WarmPool::global().quiesce();
    crate::process::settle_orphans(Duration::from_secs(10));
    let closing = Instant::now() + Duration::from_secs(5);
    while crate::wire::endpoint::closing_fds() > 0 && Instant::now() < closing {
        std::thread::sleep(Duration::from_millis(1));
    }
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut last = open_fds()?;
    let mut same = 1;
    while same < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
        let now = open_fds()?;
        if now == last {
            same += 1;
        } else {
            (last, same) = (now, 1);
        }
    }
    Ok(last)
}
