//! Reading a worker's reports: a task's result or failure, a worker that serves, dies or
//! breaks the protocol, and the errors a task fails with.

use std::time::Duration;

use super::super::status::{ChildError, Observed, Outcome};
use super::Shared;
use super::pool_state::PoolState;
use super::worker::{Dying, Settled, Then, Worker, WorkerState};
use crate::Error;

impl Shared {
    /// Take what worker `slot` sent; end it if it died or broke the protocol. Never waits: a
    /// worker whose exit status a task's error needs is ended in the background
    /// ([`settle_dying`](Self::settle_dying)).
    pub(super) fn read_worker(&self, inner: &mut PoolState, slot: usize) {
        let Some(worker) = inner.worker_mut(slot) else {
            return;
        };
        let news = worker.read_reports();
        let pid = worker.pid();
        if news.serving {
            inner.worker_started();
        }
        for (id, outcome, fds) in news.done {
            let output = match inner.worker_mut(slot) {
                Some(worker) => worker.child.output().take(),
                None => Default::default(),
            };
            match outcome {
                Outcome::Returned(bytes) => inner.finish(id, Ok((bytes.0, fds)), output),
                Outcome::Unsendable(error) => inner.finish(id, Err(error), output),
                outcome @ Outcome::NotRun { .. } => {
                    let error = self.not_run_error(pid, inner.timed_out(id), outcome, output);
                    inner.finish(id, Err(error), Default::default());
                }
                Outcome::Panicked { .. } => unreachable!("a panic stops the reading"),
            }
        }
        if let Some((id, outcome)) = news.panicked {
            // It exits next, on its own: fail the task with the panic and how the worker exited.
            let worker = inner.take_worker(slot).expect("read above");
            let output = worker.child.output().take();
            self.fail_task(inner, worker, id, Some(outcome), output, None);
            return;
        }
        let violation = news.violation;
        let Some(worker) = inner.worker_mut(slot) else {
            return;
        };
        if !news.gone && violation.is_none() && !worker.child.poll_exited() {
            return;
        }
        // Dead, or no longer to be trusted: end it and fail what it was doing.
        let worker = inner.take_worker(slot).expect("checked above");
        worker.kill();
        match worker.state() {
            // It kept to the protocol, its task still waits for its result, and it died before
            // taking the task off its channel (killed while idle, say): the task never ran; the
            // next worker gets it. Nothing waits for its status: it is reaped in the background.
            WorkerState::Busy(id)
                if violation.is_none() && inner.awaits_result(id) && worker.never_received(id) =>
            {
                let mut worker = worker;
                let task = worker.take_in_flight().expect("checked by never_received");
                drop(worker);
                inner.requeue(task);
            }
            WorkerState::Busy(id) => {
                self.fail_task(inner, worker, id, None, Default::default(), violation)
            }
            WorkerState::Starting => {
                inner.died_starting(Dying::new(worker, Then::StartFailed { violation }));
                self.settle_dying(inner);
            }
            // Reaped in the background.
            WorkerState::Idle => drop(worker),
        }
    }

    /// End `worker`, which was running task `id`, and fail the task with what is known once
    /// the worker's status is (`outcome`: what it reported; `output`: what it printed before
    /// that; `violation`: how it broke the protocol). Never waits: see [`Dying`].
    fn fail_task(
        &self,
        inner: &mut PoolState,
        worker: Worker,
        id: u64,
        outcome: Option<Outcome>,
        output: (String, String),
        violation: Option<String>,
    ) {
        let timed_out = inner.timed_out(id);
        let then = Then::FailTask {
            id,
            outcome,
            output,
            violation,
            timed_out,
        };
        inner.fail_later(Dying::new(worker, then));
        self.settle_dying(inner);
    }

    /// Advance every dying worker without waiting; for each whose status is known now, fail
    /// its task, or set the pool's start error.
    pub(super) fn settle_dying(&self, inner: &mut PoolState) {
        for dying in inner.take_settled() {
            let Settled {
                pid,
                status,
                status_unknown,
                output: (stdout, stderr),
                tasks_done,
                then,
            } = dying.settled();
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
                                tasks_done + 1
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
                    inner.set_start_error(Error::Child(Box::new(ChildError::new(
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
