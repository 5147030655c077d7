//! Caps on descriptor fds in flight (sent, not read yet by the client), counted by vmm-core's
//! [`FdBudget`](vmm_core::wire::endpoint::FdBudget): at most one reply's on a connection (a
//! reply is sent only once the client has read every earlier one), and at most the budget's
//! per uid and in all. A connection's charge is settled (given back) once its client has read
//! everything sent (`SIOCOUTQ` is zero), which the connection's thread looks at every poll
//! tick.

use std::os::fd::BorrowedFd;

use vmm_core::wire::endpoint::{self, FdWindow};

pub use vmm_core::wire::endpoint::InFlightScope;

/// The shared budget.
#[derive(Debug)]
pub(crate) struct FdBudget(endpoint::FdBudget);

/// One connection's share of the budget; given back on drop.
#[derive(Debug)]
pub(crate) struct Charge<'a>(FdWindow<'a>);

impl FdBudget {
    /// Caps of `per_uid` and `total` fds in flight (`total` at most half this process's soft
    /// `RLIMIT_NOFILE`, past which the kernel refuses an unprivileged sender's fds). A
    /// connection's own cap is its uid's: one reply at a time is what bounds a connection.
    pub(crate) fn new(per_uid: usize, total: usize) -> FdBudget {
        FdBudget(endpoint::FdBudget::new(usize::MAX, per_uid, total))
    }

    /// A connection's (empty) charge.
    pub(crate) fn charge(&self, uid: u32) -> Charge<'_> {
        Charge(self.0.window(uid))
    }
}

impl Charge<'_> {
    /// Give the charge back if the client has read everything sent on `socket`; whether it
    /// has.
    pub(crate) fn settle(&mut self, socket: BorrowedFd<'_>) -> bool {
        self.0.settle(socket)
    }

    /// [`settle`](Self::settle), then whether fds sent on `socket` may still be unread (the
    /// charge is kept while they may).
    pub(crate) fn unread(&mut self, socket: BorrowedFd<'_>) -> bool {
        self.0.unread(socket)
    }

    /// Charge `fds` more, or say which cap it would pass: (scope, in flight now, cap).
    pub(crate) fn reserve(&mut self, fds: usize) -> Result<(), (InFlightScope, usize, usize)> {
        self.0
            .try_reserve(fds)
            .map_err(|over| (over.scope, over.in_flight, over.cap))
    }
}
