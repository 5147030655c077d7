//! A pool worker's lifecycle on the parent's side: start one (a child of the pool's method,
//! sent its `Serve`), end one (kill, reap, its last output), and replace the dead.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use super::super::context;
use super::super::ends::TaskSender;
use super::super::protocol::{Order, Serve};
use super::super::status::ExitStatus;
use super::super::supervisor::Child;
use super::tasks::{Queued, clone_error};
use super::{Inner, Shared};
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
    pub(super) tasks: TaskSender,
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

/// What ending a worker found out.
pub(super) struct Ended {
    pub(super) status: Option<ExitStatus>,
    pub(super) status_unknown: Option<String>,
    pub(super) output: (String, String),
}

impl Shared {
    /// Start one worker and send it its `Serve`; it is `Starting` until it says `Serving`.
    pub(super) fn start_worker(&self) -> Result<Worker> {
        let (tasks, unread) = TaskSender::pair()?;
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
        let serve = Order::Serve(Serve {
            devices: self.devices.clone(),
        });
        match worker
            .child
            .channel()
            .send_with(&serve, &[worker.unread.as_fd()], None)
        {
            // Disconnected: it died already; reading its channel says how.
            Ok(()) | Err(Error::Disconnected(_)) => Ok(worker),
            Err(error) => {
                self.end_worker(worker, false);
                Err(error)
            }
        }
    }

    /// Kill (if still needed) and reap `worker` (see [`Child::end`]), and take what it
    /// printed last. With `let_exit` (it said it is exiting), it is given time to exit by
    /// itself, so that its own exit status is what is reported.
    pub(super) fn end_worker(&self, mut worker: Worker, let_exit: bool) -> Ended {
        worker.child.end(let_exit);
        Ended {
            status: worker.child.status(),
            status_unknown: worker.child.lost().map(str::to_owned),
            output: worker.child.output().take(),
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
        if none_alive && inner.start_failures > 0 {
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
