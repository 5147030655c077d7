//! [`TaskMessage`]: a submitted task as it goes to a worker (its encoded call and the fds sent
//! with it), kept until a worker reports on it, and the cap on how many workers it goes to.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use super::super::ends::Sealed;
use super::super::protocol::Call;

/// How many workers a task is sent to at most: one that dies before taking the task off its
/// channel (killed while idle, say) leaves it to the next, up to this many times.
pub(super) const DELIVERIES_MAX: u32 = 3;

/// A task's message: kept (with its fds) while it waits in the queue and while a worker has it
/// unanswered, so that it can go to another worker if that one never received it.
pub(super) struct TaskMessage {
    id: u64,
    call: Sealed<Call>,
    fds: Vec<OwnedFd>,
    /// How many workers it was sent to.
    deliveries: u32,
}

impl TaskMessage {
    /// Task `id`'s encoded call, and the fds of its argument, not yet sent anywhere.
    pub(super) fn new(id: u64, call: Sealed<Call>, fds: Vec<OwnedFd>) -> TaskMessage {
        TaskMessage {
            id,
            call,
            fds,
            deliveries: 0,
        }
    }

    pub(super) fn id(&self) -> u64 {
        self.id
    }

    /// What goes on the worker's task socket: the call, and the fds out of band.
    pub(super) fn contents(&self) -> (&Sealed<Call>, Vec<BorrowedFd<'_>>) {
        (&self.call, self.fds.iter().map(AsFd::as_fd).collect())
    }

    /// Count one more worker that it was sent to.
    pub(super) fn sent(&mut self) {
        self.deliveries += 1;
    }

    /// Whether, should the worker it was last sent to die before taking it, it may go to
    /// another: fewer than [`DELIVERIES_MAX`] workers had it.
    pub(super) fn may_redeliver(&self) -> bool {
        self.deliveries < DELIVERIES_MAX
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::protocol::Payload;

    #[test]
    fn a_task_goes_to_at_most_three_workers() {
        let call = Call {
            layout: 0,
            entry: 0,
            args: Payload(vec![1, 2, 3]),
        };
        let mut message = TaskMessage::new(7, Sealed::new(&call).expect("seals"), Vec::new());
        assert_eq!(message.id(), 7);
        assert!(message.contents().1.is_empty());
        let mut sends = 0;
        loop {
            message.sent();
            sends += 1;
            if !message.may_redeliver() {
                break;
            }
        }
        assert_eq!(sends, DELIVERIES_MAX);
        assert_eq!(DELIVERIES_MAX, 3);
    }
}
