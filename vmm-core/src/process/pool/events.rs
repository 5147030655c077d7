//! The pool's event loop, run by whoever waits: read the workers' reports, replace the dead,
//! hand out queued tasks, and sleep on the workers (one waiter at a time) until something
//! happens or a deadline passes.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, poll};

use super::super::ends::ParentEnd;
use super::super::supervisor::{Watch, poll_timeout};
use super::Shared;
use super::pool_state::{Dispatch, Expired, Finished, PoolState, Progress};
use crate::error::ProtocolRule;
use crate::wire::spin_window;
use crate::{Error, Result};

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wake the waiter that sleeps on the workers, if there is one.
    pub(super) fn wake_driver(&self, inner: &PoolState) {
        if inner.is_driving() {
            let _ = nix::unistd::write(&self.wake, &1u64.to_ne_bytes());
        }
    }

    /// Wait for task `id` to end, at most `timeout` (then cancel it: see `TaskHandle::join`).
    pub(super) fn wait_for(&self, id: u64, timeout: Duration) -> Result<Finished> {
        let deadline = Instant::now().checked_add(timeout);
        let mut inner = self.lock();
        let mut driving = false;
        let mut gave_up = false;
        let mut spun = false;
        let result = loop {
            match inner.take_finished(id) {
                Progress::Finished(finished) => break Ok(finished),
                Progress::Unknown => {
                    break Err(Error::protocol(
                        ProtocolRule::Internal,
                        "a Pool task that this pool does not know",
                    ));
                }
                Progress::Pending => {}
            }
            if !gave_up && deadline.is_some_and(|d| Instant::now() >= d) {
                gave_up = true;
                match inner.expire(id, timeout) {
                    Expired::Dequeued => {
                        break Err(Error::Timeout {
                            what: "a Pool task waiting for a free worker".into(),
                            after: timeout,
                        });
                    }
                    Expired::WorkerKilled => {
                        if !driving {
                            self.wake_driver(&inner);
                        }
                    }
                    Expired::Over => {}
                }
            }
            if !driving {
                driving = inner.start_driving();
            }
            let until = deadline.filter(|_| !gave_up);
            if driving {
                self.drive(&mut inner);
                if inner.task_over(id) {
                    continue;
                }
                // Keep trying for a moment before sleeping: a report that comes within the
                // window costs no wake-up (as a wire receive does; see `VMM_IPC_SPIN_US`).
                if !spun {
                    spun = true;
                    let spin_end = Instant::now() + spin_window();
                    while Instant::now() < spin_end && !inner.task_over(id) {
                        drop(inner);
                        std::hint::spin_loop();
                        inner = self.lock();
                        self.drive(&mut inner);
                    }
                    if inner.task_over(id) {
                        continue;
                    }
                }
                inner = self.sleep_on_workers(inner, until);
            } else {
                let left = until.map(|d| d.saturating_duration_since(Instant::now()));
                inner = match left {
                    Some(left) => {
                        self.changed
                            .wait_timeout(inner, left)
                            .unwrap_or_else(|e| e.into_inner())
                            .0
                    }
                    None => self.changed.wait(inner).unwrap_or_else(|e| e.into_inner()),
                };
            }
        };
        if driving {
            inner.stop_driving();
        }
        drop(inner);
        if driving {
            // Another waiter takes over reading the workers.
            self.changed.notify_all();
        }
        result
    }

    /// Release the lock and sleep until a worker says something, dies, a dying worker may have
    /// ended, the wake fd is written, or `until` passes; then lock again.
    pub(super) fn sleep_on_workers<'a>(
        &'a self,
        inner: MutexGuard<'a, PoolState>,
        until: Option<Instant>,
    ) -> MutexGuard<'a, PoolState> {
        let watched: Vec<(Arc<ParentEnd>, Option<Arc<OwnedFd>>)> = inner
            .workers()
            .map(|w| (Arc::clone(w.child.channel()), w.child.pidfd().cloned()))
            .collect();
        let dying = inner.dying_watches();
        drop(inner);
        let until = dying.iter().filter_map(Watch::until).chain(until).min();
        let mut fds: Vec<PollFd<'_>> = vec![PollFd::new(self.wake.as_fd(), PollFlags::POLLIN)];
        for (channel, pidfd) in &watched {
            fds.push(PollFd::new(channel.as_fd(), PollFlags::POLLIN));
            if let Some(pidfd) = pidfd {
                fds.push(PollFd::new(pidfd.as_fd(), PollFlags::POLLIN));
            }
        }
        for fd in dying.iter().flat_map(Watch::fds) {
            fds.push(PollFd::new(fd, PollFlags::POLLIN));
        }
        match poll(&mut fds, poll_timeout(until)) {
            Ok(_) | Err(Errno::EINTR) => {}
            // Cannot watch: do not spin.
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
        drop(fds);
        let mut drained = [0u8; 8];
        let _ = nix::unistd::read(&self.wake, &mut drained);
        self.lock()
    }

    /// Read every report the workers have sent, note deaths, advance the dying, replace dead
    /// workers and hand queued tasks to idle ones. Never waits for a child.
    pub(super) fn drive(&self, inner: &mut PoolState) {
        let finished = inner.finished_count();
        for slot in 0..inner.slot_count() {
            self.read_worker(inner, slot);
        }
        self.settle_dying(inner);
        self.replace_dead(inner);
        self.dispatch(inner);
        if inner.finished_count() != finished {
            // Waiters whose task just finished look again.
            self.changed.notify_all();
        }
    }

    /// Hand queued tasks to idle workers.
    pub(super) fn dispatch(&self, inner: &mut PoolState) {
        loop {
            match inner.dispatch_next() {
                Dispatch::Nothing => return,
                Dispatch::Sent | Dispatch::Unsendable => {}
                Dispatch::WorkerGone(slot) => {
                    self.read_worker(inner, slot);
                    // Not seen dead yet: end it now rather than offer it again (killed, and
                    // reaped in the background).
                    drop(inner.take_worker(slot));
                    self.replace_dead(inner);
                }
            }
        }
    }

    /// Start workers in empty slots (unless the pool is closed, or workers keep dying as they
    /// start: then fail the tasks that wait, with why).
    pub(super) fn replace_dead(&self, inner: &mut PoolState) {
        for slot in inner.empty_slots() {
            if !inner.may_start_worker() {
                break;
            }
            match self.start_worker() {
                Ok(worker) => inner.install(slot, worker),
                Err(error) => inner.start_failed(error),
            }
        }
        inner.fail_queued_if_none_can_run();
    }
}
