//! The pool's event loop, run by whoever waits: read the workers' reports, replace the dead,
//! hand out queued tasks, and sleep on the workers (one waiter at a time) until something
//! happens or a deadline passes.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, poll};

use super::super::supervisor::{Watch, poll_timeout};
use super::Shared;
use super::tasks::{Finished, Inner, TaskState, task_over};
use super::worker::Dying;
use crate::error::ProtocolRule;
use crate::wire::{Channel, spin_window};
use crate::{Error, Result};

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wake the waiter that sleeps on the workers, if there is one.
    pub(super) fn wake_driver(&self, inner: &Inner) {
        if inner.driving {
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
            match inner.tasks.get(&id) {
                Some(TaskState::Done(_)) => match inner.tasks.remove(&id) {
                    Some(TaskState::Done(finished)) => break Ok(finished),
                    _ => unreachable!("just seen done"),
                },
                None => {
                    break Err(Error::protocol(
                        ProtocolRule::Internal,
                        "a Pool task that this pool does not know",
                    ));
                }
                Some(_) => {}
            }
            if !gave_up && deadline.is_some_and(|d| Instant::now() >= d) {
                gave_up = true;
                match inner.tasks.get_mut(&id) {
                    Some(TaskState::Queued) => {
                        inner.tasks.remove(&id);
                        inner.queue.retain(|q| q.id != id);
                        break Err(Error::Timeout {
                            what: "a Pool task waiting for a free worker".into(),
                            after: timeout,
                        });
                    }
                    Some(TaskState::Running { slot, timed_out }) => {
                        *timed_out = Some(timeout);
                        let slot = *slot;
                        if let Some(worker) = inner.slots[slot].as_ref() {
                            let _ = worker.child.kill();
                        }
                        if !driving {
                            self.wake_driver(&inner);
                        }
                    }
                    _ => {}
                }
            }
            if !inner.driving {
                inner.driving = true;
                driving = true;
            }
            let until = deadline.filter(|_| !gave_up);
            if driving {
                self.drive(&mut inner);
                if task_over(&inner, id) {
                    continue;
                }
                // Keep trying for a moment before sleeping: a report that comes within the
                // window costs no wake-up (as a wire receive does; see `VMM_IPC_SPIN_US`).
                if !spun {
                    spun = true;
                    let spin_end = Instant::now() + spin_window();
                    while Instant::now() < spin_end && !task_over(&inner, id) {
                        drop(inner);
                        std::hint::spin_loop();
                        inner = self.lock();
                        self.drive(&mut inner);
                    }
                    if task_over(&inner, id) {
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
            inner.driving = false;
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
        inner: MutexGuard<'a, Inner>,
        until: Option<Instant>,
    ) -> MutexGuard<'a, Inner> {
        let watched: Vec<(Arc<Channel>, Option<Arc<OwnedFd>>)> = inner
            .slots
            .iter()
            .flatten()
            .map(|w| (Arc::clone(w.child.channel()), w.child.pidfd().cloned()))
            .collect();
        let dying: Vec<Watch> = inner.dying.iter().map(Dying::watch).collect();
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
    pub(super) fn drive(&self, inner: &mut Inner) {
        let finished = inner.finished;
        for slot in 0..inner.slots.len() {
            self.read_worker(inner, slot);
        }
        self.settle_dying(inner);
        self.replace_dead(inner);
        self.dispatch(inner);
        if inner.finished != finished {
            // Waiters whose task just finished look again.
            self.changed.notify_all();
        }
    }
}
