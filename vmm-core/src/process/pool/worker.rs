//! A pool worker on the parent's side: [`Worker`] (the child, its task socket, what it is doing)
//! and its lifecycle: start one (a child of the pool's method, sent its `Serve`), hand it a
//! task, end one (kill, reap, its last output).

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::sys::socket::MsgFlags;

use super::super::context;
use super::super::ends::TaskSender;
use super::super::protocol::{Order, Serve};
use super::super::status::ExitStatus;
use super::super::supervisor::Child;
use super::Shared;
use super::task_message::TaskMessage;
use crate::{Error, Result};

/// What a worker is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WorkerState {
    /// Sent its `Serve`, not yet `Serving`.
    Starting,
    Idle,
    Busy(u64),
}

/// One worker: the child, and the pool's side of its task socket. Its state changes only
/// through its methods (`serving`, `assign`, `task_reported`, `task_done`).
pub(super) struct Worker {
    pub(super) child: Child,
    state: WorkerState,
    tasks_done: u64,
    /// Our end of its task socket: tasks go here, nothing is read (shut for reading, so the
    /// worker cannot fill it).
    tasks: TaskSender,
    /// Its end of the task socket, which we keep so that a task it never received stays
    /// queued there, for us to see, after it is gone.
    unread: OwnedFd,
    /// The task it runs, kept (with its fds) until it reports: if it dies before taking it, the
    /// task goes to another worker.
    in_flight: Option<TaskMessage>,
}

impl Worker {
    /// The worker's pid, as the public API shows pids.
    pub(super) fn pid(&self) -> u32 {
        self.child.pid().as_raw() as u32
    }

    pub(super) fn state(&self) -> WorkerState {
        self.state
    }

    /// How many tasks it ran to their report.
    pub(super) fn tasks_done(&self) -> u64 {
        self.tasks_done
    }

    /// The task it runs, if it is busy.
    pub(super) fn busy_with(&self) -> Option<u64> {
        match self.state {
            WorkerState::Busy(id) => Some(id),
            _ => None,
        }
    }

    /// Kill it (it is reaped when ended); a worker already gone is no error.
    pub(super) fn kill(&self) {
        let _ = self.child.kill();
    }

    /// It said `Serving`: it takes tasks from now on.
    pub(super) fn serving(&mut self) {
        debug_assert_eq!(self.state, WorkerState::Starting);
        self.state = WorkerState::Idle;
    }

    /// Send `task` to this idle worker, which is then busy with it and keeps it until it
    /// reports; where it could not be sent, the task comes back with why.
    pub(super) fn assign(&mut self, mut task: TaskMessage) -> Assigned {
        debug_assert_eq!(self.state, WorkerState::Idle);
        let (call, fds) = task.contents();
        let sent = self.tasks.send_sealed(call, &fds, None);
        drop(fds);
        match sent {
            Ok(()) => {
                let id = task.id();
                task.sent();
                self.state = WorkerState::Busy(id);
                self.in_flight = Some(task);
                Assigned::Sent(id)
            }
            Err(error) => Assigned::Unsent(task, error),
        }
    }

    /// It reported on its task: the task was taken, and never goes to another worker.
    pub(super) fn task_reported(&mut self) {
        self.in_flight = None;
    }

    /// It finished its task and serves on.
    pub(super) fn task_done(&mut self) {
        self.state = WorkerState::Idle;
        self.tasks_done += 1;
    }

    /// Whether this (dead) worker, busy with task `id`, never took it off its task socket, and
    /// the task may go to another worker (fewer than the cap of workers had it).
    pub(super) fn never_received(&self, id: u64) -> bool {
        task_unread(&self.unread)
            && self
                .in_flight
                .as_ref()
                .is_some_and(|task| task.id() == id && task.may_redeliver())
    }

    /// Take the task it was sent and never received, for another worker.
    pub(super) fn take_in_flight(&mut self) -> Option<TaskMessage> {
        self.in_flight.take()
    }
}

/// What [`Worker::assign`] did with a task.
pub(super) enum Assigned {
    /// The worker has task `.0` now.
    Sent(u64),
    /// It could not be sent: here it is back, with why.
    Unsent(TaskMessage, Error),
}

/// Whether a task still waits in `unread`, a (dead) worker's end of its task socket: the worker
/// never received it. Only a message queued there counts (peeked, not taken), not an
/// end-of-file or a shutdown the worker made; anything but a message says "received", so that a
/// task that may have run is never sent again.
fn task_unread(unread: &OwnedFd) -> bool {
    let mut byte = [0u8; 1];
    let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC;
    matches!(
        nix::sys::socket::recv(unread.as_raw_fd(), &mut byte, flags),
        Ok(len) if len > 0
    )
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
}
