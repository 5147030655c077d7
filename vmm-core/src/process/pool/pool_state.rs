//! [`PoolState`]: everything about a pool that changes, behind its lock (the workers' slots, the
//! task table and queue, the waiter that reads the workers, the start failures), owned by this
//! one type. Its fields are private: the other files of `pool/` change them only through the
//! methods here, each of which keeps the table, the queue and the slots in agreement (a task is
//! queued, running on one worker, or done; never two of these, never on two workers).

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::time::Duration;

use super::super::ends::Sealed;
use super::super::protocol::Call;
use super::super::supervisor::Watch;
use super::task_message::TaskMessage;
use super::worker::{Assigned, Dying, Worker, WorkerState};
use crate::error::ProtocolRule;
use crate::{Error, Result};

/// How many workers in a row may die while starting before the pool stops replacing them and
/// fails the tasks that wait.
const START_FAILURES_MAX: usize = 3;

/// The pool's changing state (see the file's doc).
pub(super) struct PoolState {
    /// One per worker position; `None` while a dead worker awaits its replacement.
    slots: Vec<Option<Worker>>,
    /// Workers out of their slots whose exit status is still to come, for a task's error or
    /// the pool's start error (see `worker`).
    dying: Vec<Dying>,
    /// Tasks waiting for an idle worker, in the order they go out.
    queue: VecDeque<TaskMessage>,
    /// Every task not yet joined or cancelled.
    tasks: HashMap<u64, TaskState>,
    next_id: u64,
    /// A waiter is reading the workers (only one at a time sleeps in `poll` on them).
    driving: bool,
    /// The pool was dropped: no task is taken, no worker started.
    closed: bool,
    /// Workers that died before serving, in a row.
    start_failures: usize,
    /// Why the last worker could not be started or died starting.
    start_error: Option<Error>,
    /// Tasks finished so far (a waiter that reads the workers wakes the others when it grows).
    finished: u64,
}

enum TaskState {
    /// Its message is in the queue.
    Queued,
    /// Its message went to the worker in `slot`.
    Running {
        slot: usize,
        /// Its waiter gave up after this long (its worker was killed).
        timed_out: Option<Duration>,
    },
    /// Its worker died (or broke the protocol, or panicked in it); its error waits for the
    /// worker's exit status (a `Dying` worker's).
    Failing,
    Done(Finished),
}

/// A task's end: its result's bytes and fds, or the error; and what it printed.
pub(super) struct Finished {
    pub(super) result: Result<(Vec<u8>, Vec<OwnedFd>)>,
    pub(super) stdout: String,
    pub(super) stderr: String,
}

/// Where a task stands, for its waiter ([`PoolState::take_finished`]).
pub(super) enum Progress {
    /// It ended: here is how (it is now gone from the table).
    Finished(Finished),
    /// Queued or running.
    Pending,
    /// Not in the table (cancelled, or never submitted here).
    Unknown,
}

/// What [`PoolState::expire`] did to a task whose waiter's deadline passed.
pub(super) enum Expired {
    /// It was still queued: it is cancelled and never runs.
    Dequeued,
    /// It was running: its worker is killed, and reading that worker fails the task.
    WorkerKilled,
    /// It had ended already (or is unknown).
    Over,
}

/// What [`PoolState::dispatch_next`] did.
pub(super) enum Dispatch {
    /// Nothing to do: no task queued, or no idle worker.
    Nothing,
    /// The first queued task went to an idle worker.
    Sent,
    /// The worker in this slot is gone (its task socket is closed): the task is back at the
    /// front of the queue, and the worker is to be read and ended.
    WorkerGone(usize),
    /// The task could not be sent (too many fds for one message, say): it failed alone.
    Unsendable,
}

impl PoolState {
    /// A pool of `workers` empty slots, no task.
    pub(super) fn new(workers: usize) -> PoolState {
        PoolState {
            slots: (0..workers).map(|_| None).collect(),
            dying: Vec::new(),
            queue: VecDeque::new(),
            tasks: HashMap::new(),
            next_id: 0,
            driving: false,
            closed: false,
            start_failures: 0,
            start_error: None,
            finished: 0,
        }
    }

    // The workers.

    pub(super) fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// The workers alive now.
    pub(super) fn workers(&self) -> impl Iterator<Item = &Worker> {
        self.slots.iter().flatten()
    }

    pub(super) fn worker_mut(&mut self, slot: usize) -> Option<&mut Worker> {
        self.slots[slot].as_mut()
    }

    /// Take the worker out of `slot` (to end it); the slot awaits a replacement.
    pub(super) fn take_worker(&mut self, slot: usize) -> Option<Worker> {
        self.slots[slot].take()
    }

    /// The slots that await a worker.
    pub(super) fn empty_slots(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&slot| self.slots[slot].is_none())
            .collect()
    }

    /// Put a just-started `worker` in empty `slot`.
    pub(super) fn install(&mut self, slot: usize, worker: Worker) {
        debug_assert!(self.slots[slot].is_none(), "slot {slot} holds a worker");
        self.slots[slot] = Some(worker);
    }

    /// Whether every slot holds a worker that serves (none starting, none missing).
    pub(super) fn all_serving(&self) -> bool {
        self.slots.iter().all(|w| {
            w.as_ref()
                .is_some_and(|w| w.state() != WorkerState::Starting)
        })
    }

    // Starting workers.

    /// Whether another worker may be started: the pool is open, and fewer than
    /// [`START_FAILURES_MAX`] workers in a row died while starting.
    pub(super) fn may_start_worker(&self) -> bool {
        !self.closed && self.start_failures < START_FAILURES_MAX
    }

    /// A worker serves: the run of start failures is over.
    pub(super) fn worker_started(&mut self) {
        self.start_failures = 0;
    }

    /// A worker could not be started, or died starting, with `error`.
    pub(super) fn start_failed(&mut self, error: Error) {
        self.start_failures += 1;
        self.start_error = Some(error);
    }

    /// A worker died while it started: count it; `dying` gives the start error once its status
    /// is known ([`set_start_error`](Self::set_start_error)).
    pub(super) fn died_starting(&mut self, dying: Dying) {
        self.start_failures += 1;
        self.dying.push(dying);
    }

    /// Why the last worker died starting, now that its status is known.
    pub(super) fn set_start_error(&mut self, error: Error) {
        self.start_error = Some(error);
    }

    /// Why the last worker could not start, if one could not (once).
    pub(super) fn take_start_error(&mut self) -> Option<Error> {
        self.start_error.take()
    }

    /// When no worker is alive and starting them failed, nothing can run the queued tasks:
    /// fail them with why (a copy of the last start error each).
    pub(super) fn fail_queued_if_none_can_run(&mut self) {
        // A worker that died starting tells why once its status is known: wait for that.
        let why_pending = self.dying.iter().any(Dying::failed_start);
        if self.closed
            || self.start_failures == 0
            || why_pending
            || self.slots.iter().any(Option::is_some)
        {
            return;
        }
        let why = self.start_error.as_ref().map(clone_error);
        self.fail_queued(|| {
            why.as_ref().map(clone_error).unwrap_or_else(|| {
                Error::Disconnected("a Pool task: no worker could be started".into())
            })
        });
    }

    // The tasks.

    /// Queue a task (its encoded call and fds) and give it its id; `None` once the pool is
    /// closed (the message is dropped).
    pub(super) fn submit(&mut self, call: Sealed<Call>, fds: Vec<OwnedFd>) -> Option<u64> {
        if self.closed {
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.tasks.insert(id, TaskState::Queued);
        self.queue.push_back(TaskMessage::new(id, call, fds));
        Some(id)
    }

    /// Send the first queued task to the first idle worker. The message moves from the queue to
    /// that worker: a task is in one place at a time, so it is never sent to two workers.
    pub(super) fn dispatch_next(&mut self) -> Dispatch {
        if self.queue.is_empty() {
            return Dispatch::Nothing;
        }
        let Some(slot) = self
            .slots
            .iter()
            .position(|w| w.as_ref().is_some_and(|w| w.state() == WorkerState::Idle))
        else {
            return Dispatch::Nothing;
        };
        let task = self.queue.pop_front().expect("not empty");
        let worker = self.slots[slot].as_mut().expect("found above");
        match worker.assign(task) {
            Assigned::Sent(id) => {
                self.tasks.insert(
                    id,
                    TaskState::Running {
                        slot,
                        timed_out: None,
                    },
                );
                Dispatch::Sent
            }
            // The worker is gone: the task never reached it. Put it back; reading the worker
            // ends it.
            Assigned::Unsent(task, Error::Disconnected(_)) => {
                self.queue.push_front(task);
                Dispatch::WorkerGone(slot)
            }
            Assigned::Unsent(task, error) => {
                self.finish(task.id(), Err(error), Default::default());
                Dispatch::Unsendable
            }
        }
    }

    /// Put `task`, which a dead worker never received, back at the front of the queue for the
    /// next worker.
    pub(super) fn requeue(&mut self, task: TaskMessage) {
        debug_assert!(self.awaits_result(task.id()), "requeued a task not running");
        self.tasks.insert(task.id(), TaskState::Queued);
        self.queue.push_front(task);
    }

    /// Task `id`'s worker is `dying`: the task fails once the worker's status is known.
    pub(super) fn fail_later(&mut self, dying: Dying) {
        if let Some(id) = dying.task()
            && let Some(state) = self.tasks.get_mut(&id)
        {
            *state = TaskState::Failing;
        }
        self.dying.push(dying);
    }

    /// What the dying workers wait on, to sleep on it.
    pub(super) fn dying_watches(&self) -> Vec<Watch> {
        self.dying.iter().map(Dying::watch).collect()
    }

    /// Advance every dying worker without waiting; take out those whose end is known now.
    pub(super) fn take_settled(&mut self) -> Vec<Dying> {
        let mut settled = Vec::new();
        let mut i = 0;
        while i < self.dying.len() {
            if self.dying[i].advance() {
                settled.push(self.dying.remove(i));
            } else {
                i += 1;
            }
        }
        settled
    }

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

    /// Fail every queued task with `error()`.
    pub(super) fn fail_queued(&mut self, error: impl Fn() -> Error) {
        let queued: Vec<u64> = self.queue.drain(..).map(|task| task.id()).collect();
        for id in queued {
            self.finish(id, Err(error()), Default::default());
        }
    }

    /// How long task `id`'s waiter waited before it gave up on the running task.
    pub(super) fn timed_out(&self, id: u64) -> Option<Duration> {
        match self.tasks.get(&id) {
            Some(TaskState::Running { timed_out, .. }) => *timed_out,
            _ => None,
        }
    }

    /// Whether running task `id` still waits for its result: not cancelled, its waiter has not
    /// given up (a task that may go to another worker).
    pub(super) fn awaits_result(&self, id: u64) -> bool {
        matches!(
            self.tasks.get(&id),
            Some(TaskState::Running {
                timed_out: None,
                ..
            })
        )
    }

    /// Whether task `id` has ended (or is unknown: cancelled).
    pub(super) fn task_over(&self, id: u64) -> bool {
        matches!(self.tasks.get(&id), Some(TaskState::Done(_)) | None)
    }

    /// Task `id`'s end, taken out of the table, if it ended.
    pub(super) fn take_finished(&mut self, id: u64) -> Progress {
        match self.tasks.get(&id) {
            None => Progress::Unknown,
            Some(TaskState::Done(_)) => match self.tasks.remove(&id) {
                Some(TaskState::Done(finished)) => Progress::Finished(finished),
                _ => unreachable!("just seen done"),
            },
            Some(_) => Progress::Pending,
        }
    }

    /// Task `id`'s waiter gave up after `after`: a queued task is cancelled; a running one is
    /// marked timed out and its worker killed.
    pub(super) fn expire(&mut self, id: u64, after: Duration) -> Expired {
        match self.tasks.get_mut(&id) {
            Some(TaskState::Queued) => {
                self.tasks.remove(&id);
                self.queue.retain(|task| task.id() != id);
                Expired::Dequeued
            }
            Some(TaskState::Running { slot, timed_out }) => {
                *timed_out = Some(after);
                if let Some(worker) = self.slots[*slot].as_ref() {
                    worker.kill();
                }
                Expired::WorkerKilled
            }
            // Its worker is dying already.
            Some(TaskState::Failing | TaskState::Done(_)) | None => Expired::Over,
        }
    }

    /// Forget task `id` (its handle was dropped unjoined): a queued one never runs; a running
    /// one's worker is taken out of its slot and returned, to be ended and replaced.
    pub(super) fn cancel(&mut self, id: u64) -> Option<Worker> {
        match self.tasks.remove(&id) {
            Some(TaskState::Queued) => {
                self.queue.retain(|task| task.id() != id);
                None
            }
            Some(TaskState::Running { slot, .. }) => self.slots[slot].take(),
            // Its worker is dying already: nobody waits for its status now (dropped, it is
            // reaped in the background).
            Some(TaskState::Failing) => {
                self.dying.retain(|dying| dying.task() != Some(id));
                None
            }
            Some(TaskState::Done(_)) | None => None,
        }
    }

    /// How many tasks finished so far.
    pub(super) fn finished_count(&self) -> u64 {
        self.finished
    }

    // The waiter that reads the workers.

    /// Become the waiter that reads the workers, unless another is: whether this one is now.
    pub(super) fn start_driving(&mut self) -> bool {
        !std::mem::replace(&mut self.driving, true)
    }

    /// The waiter that reads the workers steps down.
    pub(super) fn stop_driving(&mut self) {
        self.driving = false;
    }

    /// Whether a waiter reads the workers (and is to be woken when there is news).
    pub(super) fn is_driving(&self) -> bool {
        self.driving
    }

    // Closing.

    /// Close the pool (no task is taken, no worker started from now on) and take every worker
    /// out of its slot, to be ended. Their tasks and the queued ones are the caller's to fail.
    pub(super) fn close(&mut self) -> Vec<Worker> {
        self.closed = true;
        self.slots.iter_mut().filter_map(Option::take).collect()
    }
}

/// A copy of an error (through its serde form, which keeps the variant).
fn clone_error(error: &Error) -> Error {
    postcard::to_stdvec(error)
        .ok()
        .and_then(|bytes| postcard::from_bytes(&bytes).ok())
        .unwrap_or_else(|| Error::protocol(ProtocolRule::Internal, error.to_string()))
}

#[cfg(test)]
mod tests {
    //! The table's rules, without workers (slots stay empty: no child process is started).

    use super::*;
    use crate::process::protocol::Payload;

    /// A task's call, sealed: what `Pool::submit` queues (its bytes are never sent here).
    fn call(arg: &[u8]) -> Sealed<Call> {
        let call = Call {
            layout: 0,
            entry: 0,
            args: Payload(arg.to_vec()),
        };
        Sealed::new(&call).expect("a call without fds seals")
    }

    fn done_error(state: &mut PoolState, id: u64) -> Error {
        match state.take_finished(id) {
            Progress::Finished(finished) => finished.result.expect_err("a failed task"),
            Progress::Pending => panic!("task {id} is pending"),
            Progress::Unknown => panic!("task {id} is unknown"),
        }
    }

    #[test]
    fn a_closed_pool_refuses_tasks() {
        let mut state = PoolState::new(2);
        assert_eq!(state.submit(call(&[]), Vec::new()), Some(0));
        assert!(state.close().is_empty());
        assert_eq!(state.submit(call(&[]), Vec::new()), None);
        assert!(!state.may_start_worker());
    }

    #[test]
    fn tasks_get_distinct_ids_and_wait_without_an_idle_worker() {
        let mut state = PoolState::new(2);
        let a = state.submit(call(&[1]), Vec::new()).unwrap();
        let b = state.submit(call(&[2]), Vec::new()).unwrap();
        assert_ne!(a, b);
        assert!(matches!(state.dispatch_next(), Dispatch::Nothing));
        assert!(matches!(state.take_finished(a), Progress::Pending));
        assert!(!state.task_over(b));
        assert_eq!(state.empty_slots(), [0, 1]);
        assert!(!state.all_serving());
    }

    #[test]
    fn a_finished_task_is_taken_once() {
        let mut state = PoolState::new(1);
        let id = state.submit(call(&[]), Vec::new()).unwrap();
        state.finish(id, Ok((vec![9], Vec::new())), ("out".into(), "err".into()));
        assert_eq!(state.finished_count(), 1);
        assert!(state.task_over(id));
        match state.take_finished(id) {
            Progress::Finished(finished) => {
                assert_eq!(finished.result.unwrap().0, [9]);
                assert_eq!(
                    (finished.stdout.as_str(), finished.stderr.as_str()),
                    ("out", "err")
                );
            }
            _ => panic!("task {id} should have finished"),
        }
        assert!(matches!(state.take_finished(id), Progress::Unknown));
    }

    #[test]
    fn a_cancelled_task_never_runs_and_its_end_is_not_recorded() {
        let mut state = PoolState::new(1);
        let cancelled = state.submit(call(&[]), Vec::new()).unwrap();
        let kept = state.submit(call(&[]), Vec::new()).unwrap();
        assert!(state.cancel(cancelled).is_none());
        assert!(matches!(state.take_finished(cancelled), Progress::Unknown));
        // Gone from the queue too: failing the queue fails only the other.
        state.fail_queued(|| Error::Disconnected("the test".into()));
        assert_eq!(state.finished_count(), 1);
        assert!(matches!(
            done_error(&mut state, kept),
            Error::Disconnected(_)
        ));
        state.finish(cancelled, Ok((Vec::new(), Vec::new())), Default::default());
        assert_eq!(state.finished_count(), 1);
        assert!(matches!(state.take_finished(cancelled), Progress::Unknown));
    }

    #[test]
    fn a_queued_task_past_its_deadline_is_dequeued() {
        let mut state = PoolState::new(1);
        let id = state.submit(call(&[]), Vec::new()).unwrap();
        assert!(matches!(
            state.expire(id, Duration::from_secs(1)),
            Expired::Dequeued
        ));
        assert!(matches!(state.take_finished(id), Progress::Unknown));
        assert!(matches!(
            state.expire(id, Duration::from_secs(1)),
            Expired::Over
        ));
        assert!(matches!(state.dispatch_next(), Dispatch::Nothing));
    }

    #[test]
    fn a_requeued_task_is_queued_again_first() {
        let mut state = PoolState::new(1);
        let first = state.submit(call(&[]), Vec::new()).unwrap();
        let second = state.submit(call(&[]), Vec::new()).unwrap();
        // As a dead worker's unreceived task comes back: out of the queue to a worker (as
        // `dispatch_next` does), then requeued.
        let taken = state.queue.pop_front().unwrap();
        assert_eq!(taken.id(), first);
        state.tasks.insert(
            first,
            TaskState::Running {
                slot: 0,
                timed_out: None,
            },
        );
        assert!(state.awaits_result(first));
        state.requeue(taken);
        assert!(!state.awaits_result(first));
        assert!(!state.task_over(first));
        let order: Vec<u64> = state.queue.iter().map(TaskMessage::id).collect();
        assert_eq!(order, [first, second]);
    }

    #[test]
    fn a_running_task_whose_waiter_gave_up_is_not_sent_again() {
        let mut state = PoolState::new(1);
        let id = state.submit(call(&[]), Vec::new()).unwrap();
        state.queue.pop_front().unwrap();
        state.tasks.insert(
            id,
            TaskState::Running {
                slot: 0,
                timed_out: None,
            },
        );
        let after = Duration::from_millis(5);
        assert!(matches!(state.expire(id, after), Expired::WorkerKilled));
        assert_eq!(state.timed_out(id), Some(after));
        assert!(!state.awaits_result(id));
        assert!(!state.task_over(id));
    }

    #[test]
    fn workers_that_keep_dying_as_they_start_fail_the_queue_with_why() {
        let mut state = PoolState::new(2);
        let id = state.submit(call(&[]), Vec::new()).unwrap();
        // No failure yet: the queue waits for workers to be started.
        state.fail_queued_if_none_can_run();
        assert!(!state.task_over(id));
        for _ in 0..START_FAILURES_MAX {
            assert!(state.may_start_worker());
            state.start_failed(Error::Timeout {
                what: "a worker's start".into(),
                after: Duration::from_secs(3),
            });
        }
        assert!(!state.may_start_worker());
        state.fail_queued_if_none_can_run();
        // The task fails with a copy of the start error, variant and all.
        assert!(matches!(
            done_error(&mut state, id),
            Error::Timeout { after, .. } if after == Duration::from_secs(3)
        ));
        // The start error itself is still there for `Pool::new`, once.
        assert!(matches!(
            state.take_start_error(),
            Some(Error::Timeout { .. })
        ));
        assert!(state.take_start_error().is_none());
        state.worker_started();
        assert!(state.may_start_worker());
    }

    #[test]
    fn one_waiter_reads_the_workers_at_a_time() {
        let mut state = PoolState::new(1);
        assert!(!state.is_driving());
        assert!(state.start_driving());
        assert!(!state.start_driving());
        assert!(state.is_driving());
        state.stop_driving();
        assert!(state.start_driving());
    }
}
