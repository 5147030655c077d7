//! A pool worker on the parent's side: [`Worker`] (the child, its task socket, what it is doing)
//! and its lifecycle: start one (a child of the pool's method, sent its `Serve`), hand it a
//! task, read its reports, end one.
//!
//! Ending a worker never waits under the pool's lock. One whose status nobody needs (idle,
//! cancelled, or the pool dropped) is dropped: killed, and reaped in the background by the
//! supervisor's orphan queue. One whose status its task's error (or the pool's start error)
//! tells is [`Dying`]: its [`Ending`] advances at every drive, the driver sleeps on what it
//! watches, and the error is made once its status is known.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::socket::MsgFlags;

use super::super::context;
use super::super::ends::TaskSender;
use super::super::protocol::{Order, Outcome, Report, Serve};
use super::super::status::ExitStatus;
use super::super::supervisor::{Child, Ending, Flow, Packet, Read, Watch};
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
/// through its methods (`assign`, `read_reports`).
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

/// What one read of a worker's channel found (see [`Worker::read_reports`]).
#[derive(Default)]
pub(super) struct News {
    /// It said `Serving`.
    pub(super) serving: bool,
    /// Tasks it finished and serves on after: each task, how it ended, its report's fds.
    pub(super) done: Vec<(u64, Outcome, Vec<OwnedFd>)>,
    /// Its task panicked (it exits next): the task and the outcome.
    pub(super) panicked: Option<(u64, Outcome)>,
    /// How it broke the protocol, if it did.
    pub(super) violation: Option<String>,
    /// Its channel hung up, or the forkserver reported its exit.
    pub(super) gone: bool,
}

impl Worker {
    /// Read what it reported since the last read, without waiting (the supervisor's one report
    /// loop), and keep its state in step: serving, busy with a task, idle again.
    pub(super) fn read_reports(&mut self) -> News {
        let mut news = News::default();
        let Worker {
            child,
            state,
            tasks_done,
            in_flight,
            ..
        } = self;
        let read = child.read_reports(None, |packet| {
            let (report, fds) = match packet {
                Packet::Report(report, fds) => (report, fds),
                Packet::NotAReport(why) => {
                    news.violation = Some(why);
                    return Flow::Stop;
                }
            };
            match (report, *state) {
                // A warm child's own `Ready`, from before it became a worker.
                (Report::Ready, WorkerState::Starting) => {}
                (Report::Serving, WorkerState::Starting) => {
                    *state = WorkerState::Idle;
                    news.serving = true;
                }
                (Report::Finished(outcome), WorkerState::Busy(id)) => {
                    // The task was taken: it never goes to another worker.
                    *in_flight = None;
                    if let Outcome::Panicked { .. } = outcome {
                        // It exits next, on its own.
                        news.panicked = Some((id, outcome));
                        return Flow::Stop;
                    }
                    *state = WorkerState::Idle;
                    *tasks_done += 1;
                    news.done.push((id, outcome, fds));
                }
                (report, state) => {
                    news.violation =
                        Some(format!("a report out of turn ({report:?} while {state:?})"));
                    return Flow::Stop;
                }
            }
            Flow::Continue
        });
        match read {
            Read::HungUp | Read::Exited => news.gone = true,
            Read::Broken(error) => {
                news.violation = Some(format!("reading its channel failed: {error}"));
            }
            Read::Drained | Read::Stopped => {}
        }
        news
    }
}

/// A worker on its way out whose exit status is part of what it leaves behind.
pub(super) struct Dying {
    worker: Worker,
    ending: Ending,
    then: Then,
}

/// What a dying worker's status is for.
pub(super) enum Then {
    /// Task `id`'s error: it ran the task (`outcome`: what it reported of it; `output`: what it
    /// printed before that; `violation`: how it broke the protocol; `timed_out`: how long the
    /// task's waiter waited before it gave up).
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

/// A dying worker whose end is known: what its error is made of.
pub(super) struct Settled {
    pub(super) pid: u32,
    pub(super) status: Option<ExitStatus>,
    pub(super) status_unknown: Option<String>,
    /// What it printed last.
    pub(super) output: (String, String),
    pub(super) tasks_done: u64,
    pub(super) then: Then,
}

impl Dying {
    /// Start ending `worker` (without waiting) for `then`. A worker that reported its task's
    /// end (a panic) is let exit by itself, for its true exit status.
    pub(super) fn new(mut worker: Worker, then: Then) -> Dying {
        let let_exit = matches!(
            then,
            Then::FailTask {
                outcome: Some(_),
                ..
            }
        );
        let ending = worker.child.start_ending(let_exit);
        Dying {
            worker,
            ending,
            then,
        }
    }

    /// What to poll, and until when, before advancing it again.
    pub(super) fn watch(&self) -> Watch {
        self.worker.child.ending_watch(&self.ending)
    }

    /// The task whose error awaits its status, if one does.
    pub(super) fn task(&self) -> Option<u64> {
        match self.then {
            Then::FailTask { id, .. } => Some(id),
            Then::StartFailed { .. } => None,
        }
    }

    /// Whether it died while the pool started.
    pub(super) fn failed_start(&self) -> bool {
        matches!(self.then, Then::StartFailed { .. })
    }

    /// Take the steps of its end that need no waiting: whether its end is known now.
    pub(super) fn advance(&mut self) -> bool {
        self.worker.child.advance_ending(&mut self.ending)
    }

    /// What its end left behind (once [`advance`](Self::advance) said it is known).
    pub(super) fn settled(self) -> Settled {
        let Dying { worker, then, .. } = self;
        Settled {
            pid: worker.pid(),
            status: worker.child.status(),
            status_unknown: worker.child.lost().map(str::to_owned),
            output: worker.child.output().take(),
            tasks_done: worker.tasks_done,
            then,
        }
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
                // Killed, and reaped in the background.
                drop(worker);
                Err(error)
            }
        }
    }
}
