//! Reading a worker's reports: a task's result or failure, a worker that serves, dies or
//! breaks the protocol, and the errors a task fails with.

use std::time::Duration;

use super::super::protocol::Report;
use super::super::status::{ChildError, Observed, Outcome};
use super::super::supervisor::{Incoming, Reaper};
use super::Shared;
use super::pool_state::PoolState;
use super::worker::{Worker, WorkerState};
use crate::Error;

impl Shared {
    /// Take what worker `slot` sent; end it if it died or broke the protocol.
    pub(super) fn read_worker(&self, inner: &mut PoolState, slot: usize) {
        let mut gone = false;
        let mut violation = None;
        loop {
            let Some(worker) = inner.worker_mut(slot) else {
                return;
            };
            let (report, fds) = match worker.child.next_report() {
                Incoming::Report(report, fds) => (report, fds),
                Incoming::Empty => break,
                Incoming::HungUp => {
                    gone = true;
                    break;
                }
                Incoming::NotAReport(why) => {
                    violation = Some(why);
                    break;
                }
                Incoming::Broken(error) => {
                    violation = Some(format!("reading its channel failed: {error}"));
                    break;
                }
            };
            match (report, worker.state()) {
                // A warm child's own `Ready`, from before it became a worker.
                (Report::Ready, WorkerState::Starting) => {}
                (Report::Serving, WorkerState::Starting) => {
                    worker.serving();
                    inner.worker_started();
                }
                (Report::Finished(outcome), WorkerState::Busy(id)) => {
                    worker.task_reported();
                    let output = worker.child.output().take();
                    match outcome {
                        Outcome::Returned(bytes) => {
                            worker.task_done();
                            inner.finish(id, Ok((bytes.0, fds)), output);
                        }
                        Outcome::Unsendable(error) => {
                            worker.task_done();
                            inner.finish(id, Err(error), output);
                        }
                        outcome @ Outcome::NotRun { .. } => {
                            worker.task_done();
                            let pid = worker.pid();
                            let error =
                                self.not_run_error(pid, inner.timed_out(id), outcome, output);
                            inner.finish(id, Err(error), Default::default());
                        }
                        outcome @ Outcome::Panicked { .. } => {
                            // It exits next, on its own: fail the task with the panic and how
                            // the worker exited.
                            let worker = inner.take_worker(slot).expect("read above");
                            let error = self.failed_task(inner, worker, id, Some(outcome), output);
                            inner.finish(id, Err(error), Default::default());
                            return;
                        }
                    }
                }
                (Report::Exited(status), _) if worker.child.reaper() == Reaper::Forkserver => {
                    worker.child.set_reaped(status);
                    gone = true;
                    break;
                }
                (report, state) => {
                    violation = Some(format!("a report out of turn ({report:?} while {state:?})"));
                    break;
                }
            }
        }
        let Some(worker) = inner.worker_mut(slot) else {
            return;
        };
        if !gone && violation.is_none() && !worker.child.poll_exited() {
            return;
        }
        // Dead, or no longer to be trusted: end it and fail what it was doing.
        let worker = inner.take_worker(slot).expect("checked above");
        let _ = worker.child.kill();
        match worker.state() {
            // It kept to the protocol, its task still waits for its result, and it died before
            // taking the task off its channel (killed while idle, say): the task never ran; the
            // next worker gets it.
            WorkerState::Busy(id)
                if violation.is_none() && inner.awaits_result(id) && worker.never_received(id) =>
            {
                let mut worker = worker;
                let task = worker.take_in_flight().expect("checked by never_received");
                self.end_worker(worker, false);
                inner.requeue(task);
            }
            WorkerState::Busy(id) => {
                let mut error = self.failed_task(inner, worker, id, None, Default::default());
                if let (Some(violation), Error::Child(child)) = (&violation, &mut error) {
                    child.protocol_violation = Some(violation.clone());
                }
                inner.finish(id, Err(error), Default::default());
            }
            WorkerState::Starting => {
                let pid = worker.pid();
                let ended = self.end_worker(worker, false);
                inner.start_failed(Error::Child(Box::new(ChildError::new(
                    (self.method, pid),
                    (ended.status, false),
                    None,
                    None,
                    Observed {
                        protocol_violation: violation,
                        status_unknown: ended.status_unknown,
                        notes: vec!["a Pool worker, which died while it started".to_owned()],
                        ..Observed::default()
                    },
                    ended.output,
                ))));
            }
            WorkerState::Idle => {
                self.end_worker(worker, false);
            }
        }
    }

    /// End `worker`, which was running task `id`, and make the task's error from what is known
    /// (`outcome`: what it reported; `output`: what it printed before that). A worker that
    /// reported (a panic) is let exit by itself, for its true exit status.
    fn failed_task(
        &self,
        inner: &PoolState,
        worker: Worker,
        id: u64,
        outcome: Option<Outcome>,
        (stdout, stderr): (String, String),
    ) -> Error {
        let pid = worker.pid();
        let done = worker.tasks_done();
        let ended = self.end_worker(worker, outcome.is_some());
        let timed_out = inner.timed_out(id);
        Error::Child(Box::new(ChildError::new(
            (self.method, pid),
            (ended.status, true),
            outcome,
            timed_out,
            Observed {
                status_unknown: ended.status_unknown,
                notes: vec![format!(
                    "a Pool worker, running its task {} (it has been replaced)",
                    done + 1
                )],
                ..Observed::default()
            },
            (stdout + &ended.output.0, stderr + &ended.output.1),
        )))
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
