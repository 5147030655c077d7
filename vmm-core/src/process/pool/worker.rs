//! A pool worker's lifecycle on the parent's side: start one (a child of the pool's method,
//! sent its `Serve`), end one, and replace the dead.
//!
//! Ending a worker never waits under the pool's lock. One whose status nobody needs (idle,
//! cancelled, or the pool dropped) is dropped: killed, and reaped in the background by the
//! supervisor's orphan queue. One whose status its task's error (or the pool's start error)
//! tells is [`Dying`]: its [`Ending`] advances at every drive, the driver sleeps on what it
//! watches, and the error is made once its status is known.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use super::super::context;
use super::super::protocol::{Begin, Serve};
use super::super::status::{ChildError, Observed, Outcome};
use super::super::supervisor::{Child, Ending, Watch};
use super::tasks::{Queued, TaskState, clone_error};
use super::{Inner, Shared};
use crate::wire::{self, Channel};
use crate::{Error, Result};

/// How many workers in a row may die while starting before the pool stops replacing them and
/// fails the tasks that wait.
const START_FAILURES_MAX: usize = 3;

/// What a worker is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WorkerState {
    /// Sent its `Serve`, not yet `Serving`.
    Starting,
    Idle,
    Busy(u64),
}

/// One worker: the child, and the pool's side of its task socket.
pub(super) struct Worker {
    pub(super) child: Child,
    pub(super) state: WorkerState,
    pub(super) tasks_done: u64,
    /// Our end of its task socket: tasks go here, nothing is read (shut for reading, so the
    /// worker cannot fill it).
    pub(super) tasks: Channel,
    /// Its end of the task socket, which we keep so that a task it never received stays
    /// queued there, for us to see, after it is gone.
    pub(super) unread: OwnedFd,
    /// The task it runs, kept (with its fds) until it reports: if it dies before taking it, the
    /// task goes to another worker.
    pub(super) in_flight: Option<Queued>,
}

impl Worker {
    /// The worker's pid, as the public API shows pids.
    pub(super) fn pid(&self) -> u32 {
        self.child.pid().as_raw() as u32
    }
}

/// A worker on its way out whose exit status is part of what it leaves behind.
pub(super) struct Dying {
    worker: Worker,
    ending: Ending,
    then: Then,
}

/// What a dying worker's status is for.
enum Then {
    /// Task `id`'s error: it ran the task (`outcome`: what it reported of it; `output`: what it
    /// printed before that).
    FailTask {
        id: u64,
        outcome: Option<Outcome>,
        output: (String, String),
        violation: Option<String>,
        timed_out: Option<Duration>,
    },
    /// The pool's start error: it died while it started.
    StartFailed { violation: Option<String> },
}

impl Dying {
    /// What to poll, and until when, before advancing it again.
    pub(super) fn watch(&self) -> Watch {
        self.worker.child.ending_watch(&self.ending)
    }

    /// Whether it is failing task `id`.
    pub(super) fn fails(&self, task: u64) -> bool {
        matches!(self.then, Then::FailTask { id, .. } if id == task)
    }

    /// Whether it died while the pool started.
    pub(super) fn failed_start(&self) -> bool {
        matches!(self.then, Then::StartFailed { .. })
    }
}

impl Shared {
    /// Start one worker and send it its `Serve`; it is `Starting` until it says `Serving`.
    pub(super) fn start_worker(&self) -> Result<Worker> {
        let (tasks, unread) = Channel::pair()?;
        nix::sys::socket::shutdown(tasks.as_raw_fd(), nix::sys::socket::Shutdown::Read)
            .map_err(|e| Error::errno("shutdown(SHUT_RD) of a worker's task socket", e))?;
        let unread = unread.into_fd();
        let new_child = context::make(self.method, &[], self.child_args.clone())?;
        let worker = Worker {
            child: new_child.child,
            state: WorkerState::Starting,
            tasks_done: 0,
            tasks,
            unread,
            in_flight: None,
        };
        let serve = Begin::Serve(Serve {
            devices: self.devices.clone(),
        });
        let serve = wire::encode(&serve)?;
        match worker
            .child
            .channel()
            .send(serve.bytes(), &[worker.unread.as_fd()])
        {
            // Disconnected: it died already; reading its channel says how.
            Ok(()) | Err(Error::Disconnected(_)) => Ok(worker),
            Err(error) => {
                // Killed, and reaped in the background.
                drop(worker);
                Err(error)
            }
        }
    }

    /// End `worker`, which was running task `id`, and fail the task with what is known once
    /// the worker's status is (`outcome`: what it reported; `output`: what it printed before
    /// that; `violation`: how it broke the protocol). A worker that reported (a panic) is let
    /// exit by itself, for its true exit status. Never waits: see [`Dying`].
    pub(super) fn fail_task(
        &self,
        inner: &mut Inner,
        mut worker: Worker,
        id: u64,
        outcome: Option<Outcome>,
        output: (String, String),
        violation: Option<String>,
    ) {
        let timed_out = inner.timed_out(id);
        if let Some(state) = inner.tasks.get_mut(&id) {
            *state = TaskState::Failing;
        }
        let ending = worker.child.start_ending(outcome.is_some());
        inner.dying.push(Dying {
            worker,
            ending,
            then: Then::FailTask {
                id,
                outcome,
                output,
                violation,
                timed_out,
            },
        });
        self.settle_dying(inner);
    }

    /// `worker` died while it started: count it, and make the pool's start error once its
    /// status is known. Never waits: see [`Dying`].
    pub(super) fn start_failed(
        &self,
        inner: &mut Inner,
        mut worker: Worker,
        violation: Option<String>,
    ) {
        inner.start_failures += 1;
        let ending = worker.child.start_ending(false);
        inner.dying.push(Dying {
            worker,
            ending,
            then: Then::StartFailed { violation },
        });
        self.settle_dying(inner);
    }

    /// Advance every dying worker without waiting; for each whose status is known now, fail
    /// its task, or set the pool's start error.
    pub(super) fn settle_dying(&self, inner: &mut Inner) {
        let mut i = 0;
        while i < inner.dying.len() {
            let dying = &mut inner.dying[i];
            if !dying.worker.child.advance_ending(&mut dying.ending) {
                i += 1;
                continue;
            }
            let Dying { worker, then, .. } = inner.dying.remove(i);
            let pid = worker.pid();
            let status = worker.child.status();
            let status_unknown = worker.child.lost().map(str::to_owned);
            let (stdout, stderr) = worker.child.output().take();
            match then {
                Then::FailTask {
                    id,
                    outcome,
                    output,
                    violation,
                    timed_out,
                } => {
                    let mut error = ChildError::new(
                        (self.method, pid),
                        (status, true),
                        outcome,
                        timed_out,
                        Observed {
                            status_unknown,
                            notes: vec![format!(
                                "a Pool worker, running its task {} (it has been replaced)",
                                worker.tasks_done + 1
                            )],
                            ..Observed::default()
                        },
                        (output.0 + &stdout, output.1 + &stderr),
                    );
                    if violation.is_some() {
                        error.protocol_violation = violation;
                    }
                    inner.finish(id, Err(Error::Child(Box::new(error))), Default::default());
                }
                Then::StartFailed { violation } => {
                    inner.start_error = Some(Error::Child(Box::new(ChildError::new(
                        (self.method, pid),
                        (status, false),
                        None,
                        None,
                        Observed {
                            protocol_violation: violation,
                            status_unknown,
                            notes: vec!["a Pool worker, which died while it started".to_owned()],
                            ..Observed::default()
                        },
                        (stdout, stderr),
                    ))));
                }
            }
        }
    }

    /// Start workers in empty slots (unless the pool is closed, or workers keep dying as they
    /// start: then fail the tasks that wait, with why).
    pub(super) fn replace_dead(&self, inner: &mut Inner) {
        if inner.closed {
            return;
        }
        for slot in 0..inner.slots.len() {
            if inner.slots[slot].is_some() {
                continue;
            }
            if inner.start_failures >= START_FAILURES_MAX {
                break;
            }
            match self.start_worker() {
                Ok(worker) => inner.slots[slot] = Some(worker),
                Err(error) => {
                    inner.start_failures += 1;
                    inner.start_error = Some(error);
                }
            }
        }
        let none_alive = inner.slots.iter().all(Option::is_none);
        // A worker that died starting tells why once its status is known: wait for that.
        let why_pending = inner.dying.iter().any(Dying::failed_start);
        if none_alive && inner.start_failures > 0 && !why_pending {
            // Nothing can run the queued tasks: fail them with why.
            let why = inner.start_error.as_ref().map(clone_error);
            let queued: Vec<u64> = inner.queue.drain(..).map(|q| q.id).collect();
            for id in queued {
                let error = why.as_ref().map(clone_error).unwrap_or_else(|| {
                    Error::Disconnected("a Pool task: no worker could be started".into())
                });
                inner.finish(id, Err(error), Default::default());
            }
        }
    }
}
