//! The task table: tasks queued, running and done, handing them to idle workers, and
//! redelivery (a task whose worker died before taking it goes to another).

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use nix::sys::socket::MsgFlags;

use super::Shared;
use super::worker::{Dying, Worker, WorkerState};
use crate::error::ProtocolRule;
use crate::{Error, Result};

/// How many workers a task is sent to at most: one that dies before taking the task off its
/// channel (killed while idle, say) leaves it to the next, up to this many times.
const DELIVERIES_MAX: u32 = 3;

#[derive(Default)]
pub(super) struct Inner {
    /// One per worker position; `None` while a dead worker awaits its replacement.
    pub(super) slots: Vec<Option<Worker>>,
    /// Workers out of their slots whose exit status is still to come (see `worker`).
    pub(super) dying: Vec<Dying>,
    pub(super) queue: VecDeque<Queued>,
    pub(super) tasks: HashMap<u64, TaskState>,
    pub(super) next_id: u64,
    /// A waiter is reading the workers (only one at a time sleeps in `poll` on them).
    pub(super) driving: bool,
    pub(super) closed: bool,
    /// Workers that died before serving, in a row.
    pub(super) start_failures: usize,
    /// Why the last worker could not be started or died starting.
    pub(super) start_error: Option<Error>,
    /// Tasks finished so far (a waiter that reads the workers wakes the others when it grows).
    pub(super) finished: u64,
}

pub(super) enum TaskState {
    Queued,
    Running {
        slot: usize,
        timed_out: Option<Duration>,
    },
    /// Its worker died (or broke the protocol, or panicked in it); its error waits for the
    /// worker's exit status (a `Dying` worker's).
    Failing,
    Done(Finished),
}

pub(super) struct Queued {
    pub(super) id: u64,
    pub(super) bytes: Vec<u8>,
    pub(super) fds: Vec<OwnedFd>,
    /// How many workers it was sent to that died before taking it.
    pub(super) deliveries: u32,
}

/// A task's end: its result's bytes and fds, or the error; and what it printed.
pub(super) struct Finished {
    pub(super) result: Result<(Vec<u8>, Vec<OwnedFd>)>,
    pub(super) stdout: String,
    pub(super) stderr: String,
}
impl Inner {
    /// Record task `id`'s end (unless it was cancelled meanwhile).
    pub(super) fn finish(
        &mut self,
        id: u64,
        result: Result<(Vec<u8>, Vec<OwnedFd>)>,
        (stdout, stderr): (String, String),
    ) {
        if let Some(state) = self.tasks.get_mut(&id) {
            *state = TaskState::Done(Finished {
                result,
                stdout,
                stderr,
            });
            self.finished += 1;
        }
    }

    pub(super) fn timed_out(&self, id: u64) -> Option<Duration> {
        match self.tasks.get(&id) {
            Some(TaskState::Running { timed_out, .. }) => *timed_out,
            _ => None,
        }
    }
}

impl Shared {
    /// Whether dead `worker`, busy with task `id`, never took it off its channel, and the task
    /// should go to another worker: it still waits for its result (not cancelled, not past its
    /// deadline), the worker kept to the protocol, and fewer than [`DELIVERIES_MAX`] workers
    /// died before taking it.
    pub(super) fn never_taken(
        &self,
        inner: &Inner,
        worker: &Worker,
        id: u64,
        violated: bool,
    ) -> bool {
        !violated
            && task_unread(&worker.unread)
            && matches!(
                inner.tasks.get(&id),
                Some(TaskState::Running {
                    timed_out: None,
                    ..
                })
            )
            && worker
                .in_flight
                .as_ref()
                .is_some_and(|task| task.id == id && task.deliveries < DELIVERIES_MAX)
    }

    /// Hand queued tasks to idle workers.
    pub(super) fn dispatch(&self, inner: &mut Inner) {
        while !inner.queue.is_empty() {
            let Some(slot) = inner
                .slots
                .iter()
                .position(|w| w.as_ref().is_some_and(|w| w.state == WorkerState::Idle))
            else {
                return;
            };
            let mut task = inner.queue.pop_front().expect("not empty");
            let fds: Vec<BorrowedFd<'_>> = task.fds.iter().map(AsFd::as_fd).collect();
            let worker = inner.slots[slot].as_mut().expect("found above");
            match worker.tasks.send(&task.bytes, &fds) {
                Ok(()) => {
                    drop(fds);
                    let id = task.id;
                    task.deliveries += 1;
                    worker.state = WorkerState::Busy(id);
                    worker.in_flight = Some(task);
                    inner.tasks.insert(
                        id,
                        TaskState::Running {
                            slot,
                            timed_out: None,
                        },
                    );
                }
                // The worker is gone: the task never reached it. Put it back; reading the
                // worker ends it.
                Err(Error::Disconnected(_)) => {
                    drop(fds);
                    inner.queue.push_front(task);
                    self.read_worker(inner, slot);
                    if inner.slots[slot].is_some() {
                        // Not seen dead yet: end it now rather than offer it again (killed,
                        // and reaped in the background).
                        drop(inner.slots[slot].take());
                    }
                    self.replace_dead(inner);
                }
                // The task cannot be sent (too many fds for one message, say): it fails alone.
                Err(error) => {
                    drop(fds);
                    inner.finish(task.id, Err(error), Default::default());
                }
            }
        }
    }
}

/// Whether a task still waits in `unread`, a (dead) worker's end of its task socket: the worker
/// never received it. Only a message queued there counts (peeked, not taken), not an
/// end-of-file or a shutdown the worker made; anything but a message says "received", so that a
/// task that may have run is never sent again.
pub(super) fn task_unread(unread: &OwnedFd) -> bool {
    let mut byte = [0u8; 1];
    let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC;
    matches!(
        nix::sys::socket::recv(unread.as_raw_fd(), &mut byte, flags),
        Ok(len) if len > 0
    )
}

/// Whether task `id` has ended (or is unknown: cancelled).
pub(super) fn task_over(inner: &Inner, id: u64) -> bool {
    matches!(inner.tasks.get(&id), Some(TaskState::Done(_)) | None)
}

/// A copy of an error (through its serde form, which keeps the variant).
pub(super) fn clone_error(error: &Error) -> Error {
    postcard::to_stdvec(error)
        .ok()
        .and_then(|bytes| postcard::from_bytes(&bytes).ok())
        .unwrap_or_else(|| Error::protocol(ProtocolRule::Internal, error.to_string()))
}
