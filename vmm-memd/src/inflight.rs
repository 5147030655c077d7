//! Caps on descriptor fds in flight (sent, not read yet by the client): at most one reply's on
//! a connection, at most [`FdBudget`]'s per uid and in all. A connection's charge is settled
//! (given back) once its client has read everything sent (`TIOCOUTQ` is zero), which the
//! connection's thread looks at every poll tick.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

/// Which cap a reply's descriptors would pass, named in
/// [`Refusal::FdsInFlight`](crate::Refusal::FdsInFlight).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum InFlightScope {
    /// This connection's earlier reply is not read yet (one reply's fds at a time).
    Connection,
    /// The fds in flight to this uid's connections.
    Uid,
    /// The fds in flight to all connections.
    All,
}

/// The shared budget.
#[derive(Debug)]
pub(crate) struct FdBudget {
    per_uid: usize,
    total: usize,
    charged: Mutex<(usize, HashMap<u32, usize>)>,
}

/// One connection's share of the budget; given back on drop.
#[derive(Debug)]
pub(crate) struct Charge<'a> {
    budget: &'a FdBudget,
    uid: u32,
    charged: usize,
}

impl FdBudget {
    /// Caps of `per_uid` and `total` fds in flight (`total` at most half this process's soft
    /// `RLIMIT_NOFILE`, past which the kernel refuses an unprivileged sender's fds).
    pub(crate) fn new(per_uid: usize, total: usize) -> FdBudget {
        let total = total.min(nofile_soft_limit() / 2).max(1);
        FdBudget {
            per_uid: per_uid.clamp(1, total),
            total,
            charged: Mutex::new((0, HashMap::new())),
        }
    }

    fn lock(&self) -> MutexGuard<'_, (usize, HashMap<u32, usize>)> {
        self.charged.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A connection's (empty) charge.
    pub(crate) fn charge(&self, uid: u32) -> Charge<'_> {
        Charge {
            budget: self,
            uid,
            charged: 0,
        }
    }
}

impl Charge<'_> {
    /// Give the charge back if the client has read everything sent on `socket`; whether it
    /// has.
    pub(crate) fn settle(&mut self, socket: BorrowedFd<'_>) -> bool {
        let read = unread_bytes(socket) == 0;
        if read {
            self.uncharge();
        }
        read
    }

    /// Charge `fds` more, or say which cap it would pass: (scope, in flight now, cap).
    pub(crate) fn reserve(&mut self, fds: usize) -> Result<(), (InFlightScope, usize, usize)> {
        let budget = self.budget;
        let mut charged = budget.lock();
        let (total, by_uid) = &mut *charged;
        let mine = by_uid.get(&self.uid).copied().unwrap_or(0);
        if mine + fds > budget.per_uid {
            return Err((InFlightScope::Uid, mine, budget.per_uid));
        }
        if *total + fds > budget.total {
            return Err((InFlightScope::All, *total, budget.total));
        }
        *total += fds;
        *by_uid.entry(self.uid).or_default() += fds;
        self.charged += fds;
        Ok(())
    }

    fn uncharge(&mut self) {
        if self.charged == 0 {
            return;
        }
        let mut charged = self.budget.lock();
        let (total, by_uid) = &mut *charged;
        *total -= self.charged;
        if let Some(n) = by_uid.get_mut(&self.uid) {
            *n -= self.charged;
            if *n == 0 {
                by_uid.remove(&self.uid);
            }
        }
        self.charged = 0;
    }
}

impl Drop for Charge<'_> {
    fn drop(&mut self) {
        self.uncharge();
    }
}

/// Bytes sent on `socket` and not read yet by its peer (`TIOCOUTQ`; unknown counts as 1).
pub(crate) fn unread_bytes(socket: BorrowedFd<'_>) -> usize {
    let mut value: libc::c_int = 0;
    // SAFETY: TIOCOUTQ writes one int, a live local.
    let rc = unsafe { libc::ioctl(socket.as_raw_fd(), libc::TIOCOUTQ, &mut value) };
    if rc < 0 { 1 } else { value.max(0) as usize }
}

fn nofile_soft_limit() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills a live local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
}
