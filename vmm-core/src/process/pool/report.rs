//! Reading a worker's reports: a task's result or failure, a worker that serves, dies or
//! breaks the protocol, and the errors a task fails with.

use std::os::fd::OwnedFd;
use std::time::Duration;

use super::super::protocol::{Report, TaskOutcome};
use super::super::status::{ChildError, Observed, Outcome};
use super::super::supervisor::{Flow, Packet, Read};
use super::Shared;
use super::tasks::{Inner, TaskState};
use super::worker::WorkerState;
use crate::Error;

/// A task's end, as its worker reported it (applied once the worker's reports are read).
struct TaskDone {
    id: u64,
    outcome: TaskOutcome,
    /// The fds its report carried (a result's).
    fds: Vec<OwnedFd>,
}

impl Shared {
    /// Take what worker `slot` sent; end it if it died or broke the protocol. Never waits: a
    /// worker whose exit status a task's error needs is ended in the background
    /// (`Shared::settle_dying`).
    pub(super) fn read_worker(&self, inner: &mut Inner, slot: usize) {
        let Some(worker) = inner.slots[slot].as_mut() else {
            return;
        };
        let mut violation = None;
        let mut serving = false;
        let mut done = Vec::new();
        let mut panicked = None;
        let state = &mut worker.state;
        let (in_flight, tasks_done) = (&mut worker.in_flight, &mut worker.tasks_done);
        let read = worker.child.read_reports(None, |packet| {
            let (report, fds) = match packet {
                Packet::Report(report, fds) => (report, fds),
                Packet::NotAReport(why) => {
                    violation = Some(why);
                    return Flow::Stop;
                }
            };
            match (report, *state) {
                // A warm child's own `Ready`, from before it became a worker.
                (Report::Ready, WorkerState::Starting) => {}
                (Report::Serving, WorkerState::Starting) => {
                    *state = WorkerState::Idle;
                    serving = true;
                }
                (Report::TaskDone(outcome), WorkerState::Busy(id)) => {
                    *in_flight = None;
                    if let TaskOutcome::Panicked { message, location } = outcome {
                        // It exits next, on its own: fail the task with the panic and how the
                        // worker exited.
                        panicked = Some((id, Outcome::Panicked { message, location }));
                        return Flow::Stop;
                    }
                    *state = WorkerState::Idle;
                    *tasks_done += 1;
                    done.push(TaskDone { id, outcome, fds });
                }
                (report, state) => {
                    violation = Some(format!("a report out of turn ({report:?} while {state:?})"));
                    return Flow::Stop;
                }
            }
            Flow::Continue
        });
        let gone = match read {
            Read::HungUp | Read::Exited => true,
            Read::Broken(error) => {
                violation = Some(format!("reading its channel failed: {error}"));
                false
            }
            Read::Drained | Read::Stopped => false,
        };
        if serving {
            inner.start_failures = 0;
        }
        for TaskDone { id, outcome, fds } in done {
            let worker = inner.slots[slot].as_ref().expect("read above");
            let output = worker.child.output().take();
            match outcome {
                TaskOutcome::Returned(bytes) => inner.finish(id, Ok((bytes.0, fds)), output),
                TaskOutcome::Unsendable(error) => inner.finish(id, Err(error), output),
                TaskOutcome::NotRun { stage, error } => {
                    let pid = worker.pid();
                    let outcome = Outcome::NotRun { stage, error };
                    let error = self.not_run_error(pid, inner.timed_out(id), outcome, output);
                    inner.finish(id, Err(error), Default::default());
                }
                TaskOutcome::Panicked { .. } => unreachable!("a panic stops the reading"),
            }
        }
        if let Some((id, outcome)) = panicked {
            let worker = inner.slots[slot].take().expect("read above");
            let output = worker.child.output().take();
            self.fail_task(inner, worker, id, Some(outcome), output, None);
            return;
        }
        let Some(worker) = inner.slots[slot].as_mut() else {
            return;
        };
        if !gone && violation.is_none() && !worker.child.poll_exited() {
            return;
        }
        // Dead, or no longer to be trusted: end it and fail what it was doing.
        let worker = inner.slots[slot].take().expect("checked above");
        let _ = worker.child.kill();
        match worker.state {
            WorkerState::Busy(id) if self.never_taken(inner, &worker, id, violation.is_some()) => {
                // It died before taking the task off its channel (killed while idle, say): the
                // task never ran; the next worker gets it. Nothing waits for its status: it is
                // reaped in the background.
                let mut worker = worker;
                let task = worker.in_flight.take().expect("checked by never_taken");
                drop(worker);
                inner.tasks.insert(id, TaskState::Queued);
                inner.queue.push_front(task);
            }
            WorkerState::Busy(id) => {
                self.fail_task(inner, worker, id, None, Default::default(), violation)
            }
            WorkerState::Starting => self.start_failed(inner, worker, violation),
            // Reaped in the background.
            WorkerState::Idle => drop(worker),
        }
    }

    /// The error of a task that could not run on a worker that lives on (its argument could
    /// not be received, say).
    fn not_run_error(
        &self,
        pid: u32,
        timed_out: Option<Duration>,
        outcome: Outcome,
        output: (String, String),
    ) -> Error {
        Error::Child(Box::new(ChildError::new(
            (self.method, pid),
            (None, true),
            Some(outcome),
            timed_out,
            Observed {
                notes: vec!["a Pool worker (it serves on)".to_owned()],
                ..Observed::default()
            },
            output,
        )))
    }
}
