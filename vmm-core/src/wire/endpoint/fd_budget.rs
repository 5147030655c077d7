//! How many descriptor fds a server has sent that its clients have not read yet, capped per
//! connection, per client uid and in all: one implementation for every server (vmm-memd
//! uses it).
//!
//! An fd sent over a Unix socket is "in flight" until the receiver reads its message, and the
//! kernel charges it to the sender's uid: past the sender's `RLIMIT_NOFILE` of them, every send
//! with fds by any process of that uid fails with `ETOOMANYREFS` (unless it has
//! `CAP_SYS_RESOURCE`). A client that asks for descriptors and never reads its replies would
//! drive the server's uid there, for everyone. So a server counts what it sent, in an
//! [`FdWindow`] per connection charged against one [`FdBudget`], and refuses (or waits) when a
//! send would pass a cap ([`InFlightExceeded`]).
//!
//! What is read is learnt from the kernel, not from the client: `SIOCOUTQ` on the server's end
//! of a Unix socket is the memory of its messages the peer has not read yet, so when it is 0
//! everything sent on the connection has been read (or the peer has closed, which drops its
//! queue). Until then, everything sent since it was last 0 counts as in flight (an over-estimate
//! for a client that reads some of its replies, never an under-estimate).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

/// Which cap a send would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum InFlightScope {
    /// The fds in flight on this connection.
    Connection,
    /// The fds in flight to this uid's connections.
    Uid,
    /// The fds in flight to all connections.
    All,
}

/// A send that [`FdWindow::try_reserve`] refused: the cap it would pass, what is in flight in
/// that scope now, and the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlightExceeded {
    /// Which cap.
    pub scope: InFlightScope,
    /// The fds in flight in that scope now (before the refused send).
    pub in_flight: usize,
    /// The cap.
    pub cap: usize,
}

/// The caps, and what is charged against them (shared by every connection of a server).
#[derive(Debug)]
pub struct FdBudget {
    per_connection: usize,
    per_uid: usize,
    total: usize,
    /// Fds in flight in all, and per client uid.
    charged: Mutex<(usize, HashMap<u32, usize>)>,
}

/// One connection's fds in flight, charged to its client's uid; given back when its client has
/// read everything ([`settle`](Self::settle)) or the window is dropped.
#[derive(Debug)]
pub struct FdWindow<'a> {
    budget: &'a FdBudget,
    uid: u32,
    charged: usize,
}

impl FdBudget {
    /// At most `total` fds in flight in all, `per_uid` to one client uid, `per_connection` on
    /// one connection, each at least 1. `total` is clamped to half this process's soft
    /// `RLIMIT_NOFILE` (the kernel's limit on the sender's uid, which the server's other fds
    /// share), `per_uid` to a quarter of `total` ([`uid_share`]: one uid never takes the
    /// room of the others, at any file limit), `per_connection` to `per_uid`; see
    /// [`caps`](Self::caps).
    ///
    /// A send of more fds than the uid's share (a reply with many chunks under a tiny file
    /// limit) can never fit: [`FdWindow::try_reserve`] refuses it with scope
    /// [`InFlightScope::Uid`], as any other send past that cap.
    pub fn new(per_connection: usize, per_uid: usize, total: usize) -> FdBudget {
        let total = total.min(nofile_soft_limit() / 2).max(1);
        let per_uid = per_uid.clamp(1, uid_share(total));
        FdBudget {
            per_connection: per_connection.clamp(1, per_uid),
            per_uid,
            total,
            charged: Mutex::new((0, HashMap::new())),
        }
    }

    /// The caps in force: per connection, per uid, in all.
    pub fn caps(&self) -> (usize, usize, usize) {
        (self.per_connection, self.per_uid, self.total)
    }

    /// The fds in flight now, in all.
    pub fn in_flight(&self) -> usize {
        self.lock().0
    }

    fn lock(&self) -> MutexGuard<'_, (usize, HashMap<u32, usize>)> {
        self.charged.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An empty window for a connection of client `uid`.
    pub fn window(&self, uid: u32) -> FdWindow<'_> {
        FdWindow {
            budget: self,
            uid,
            charged: 0,
        }
    }
}

impl FdWindow<'_> {
    /// The fds charged to this connection now.
    pub fn charged(&self) -> usize {
        self.charged
    }

    /// Give the charge back if the client has read everything sent on `socket` (the
    /// connection's server end); whether it has.
    pub fn settle(&mut self, socket: BorrowedFd<'_>) -> bool {
        let read = unread_bytes(socket) == 0;
        if read {
            self.uncharge();
        }
        read
    }

    /// Whether fds sent on `socket` may still be unread (after [`settle`](Self::settle)).
    pub fn unread(&mut self, socket: BorrowedFd<'_>) -> bool {
        self.settle(socket);
        self.charged > 0
    }

    /// Charge `fds` about to be sent, if every cap allows it; else a cap it would pass, and
    /// nothing is charged. The widest is named first (its uid's, then all, then this
    /// connection's): waiting for this connection's client to read would not help the others.
    pub fn try_reserve(&mut self, fds: usize) -> Result<(), InFlightExceeded> {
        let budget = self.budget;
        let mut charged = budget.lock();
        let (total, by_uid) = &mut *charged;
        let uid_now = by_uid.get(&self.uid).copied().unwrap_or(0);
        let over = |scope, in_flight, cap| {
            Err(InFlightExceeded {
                scope,
                in_flight,
                cap,
            })
        };
        if uid_now.saturating_add(fds) > budget.per_uid {
            return over(InFlightScope::Uid, uid_now, budget.per_uid);
        }
        if total.saturating_add(fds) > budget.total {
            return over(InFlightScope::All, *total, budget.total);
        }
        if self.charged.saturating_add(fds) > budget.per_connection {
            return over(
                InFlightScope::Connection,
                self.charged,
                budget.per_connection,
            );
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

impl Drop for FdWindow<'_> {
    fn drop(&mut self) {
        self.uncharge();
    }
}

/// The most fds in flight one uid may have under a cap of `total` in all: a quarter of it
/// (at least 1), so that at least three quarters stay for other uids whatever `total` is
/// (with `total` at least 2, some room always stays).
pub fn uid_share(total: usize) -> usize {
    (total / 4).max(1)
}

/// `SIOCOUTQ`: the bytes (of socket memory) sent on `socket` that its peer has not read yet;
/// taken as unread (1) when it cannot be asked.
fn unread_bytes(socket: BorrowedFd<'_>) -> usize {
    let mut value: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one c_int to the pointer given, a live local.
    let rc = unsafe { libc::ioctl(socket.as_raw_fd(), libc::TIOCOUTQ, &mut value) };
    if rc < 0 { 1 } else { value.max(0) as usize }
}

/// The soft `RLIMIT_NOFILE` (1024 when it cannot be read).
fn nofile_soft_limit() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit to the pointer given, a live local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn caps_are_clamped_and_at_least_one() {
        let budget = FdBudget::new(0, 0, 0);
        assert_eq!(budget.caps(), (1, 1, 1));
        let budget = FdBudget::new(100, 5, 20);
        assert_eq!(budget.caps(), (5, 5, 20));
        let budget = FdBudget::new(1, 1, usize::MAX);
        assert_eq!(budget.caps().2, nofile_soft_limit() / 2);
    }

    #[test]
    fn one_uid_gets_at_most_a_quarter_of_the_total() {
        // Asked for more than a quarter (or for all of it): a quarter.
        assert_eq!(FdBudget::new(100, 10, 20).caps(), (5, 5, 20));
        assert_eq!(FdBudget::new(100, 20, 20).caps(), (5, 5, 20));
        // Below 4 in all, still at least 1 each (room stays for others from 2 on).
        assert_eq!(FdBudget::new(9, 9, 2).caps(), (1, 1, 2));
        for total in 1..=4096 {
            let share = uid_share(total);
            assert!(share >= 1 && share * 4 <= total.max(4), "{total}: {share}");
            assert!(total < 2 || share < total, "{total}: {share}");
        }
        // At this process's soft limit (the usual 1024: 512 in all, 128 per uid), 16
        // connections of one uid each asking for 32 take at most the uid's share, and another
        // uid still fits.
        let budget = FdBudget::new(usize::MAX, usize::MAX, usize::MAX);
        let (_, per_uid, total) = budget.caps();
        assert_eq!(per_uid, uid_share(total));
        let mut mine: Vec<_> = (0..16).map(|_| budget.window(1)).collect();
        let took = mine
            .iter_mut()
            .map(|w| w.try_reserve(32))
            .filter(Result::is_ok)
            .count();
        assert_eq!(took, (per_uid / 32).min(16));
        let mut other = budget.window(2);
        other.try_reserve(32.min(per_uid)).unwrap();
    }

    #[test]
    fn a_send_larger_than_a_uids_share_is_refused_with_scope_uid() {
        let budget = FdBudget::new(usize::MAX, usize::MAX, 64);
        assert_eq!(budget.caps(), (16, 16, 64));
        let refused = budget.window(1).try_reserve(32).unwrap_err();
        assert_eq!(
            refused,
            InFlightExceeded {
                scope: InFlightScope::Uid,
                in_flight: 0,
                cap: 16
            }
        );
        assert_eq!(budget.in_flight(), 0);
    }

    #[test]
    fn each_cap_refuses_in_order_and_nothing_is_charged_by_a_refusal() {
        // A total of 24: 6 per uid (a quarter), 4 per connection.
        let budget = FdBudget::new(4, 6, 24);
        assert_eq!(budget.caps(), (4, 6, 24));
        let mut a = budget.window(1);
        let mut b = budget.window(1);
        let mut others: Vec<_> = (2..5).map(|uid| budget.window(uid)).collect();
        let mut c = budget.window(5);
        a.try_reserve(4).unwrap();
        let refused = a.try_reserve(1).unwrap_err();
        assert_eq!(refused.scope, InFlightScope::Connection);
        assert_eq!((refused.in_flight, refused.cap), (4, 4));
        b.try_reserve(2).unwrap();
        let refused = b.try_reserve(1).unwrap_err();
        assert_eq!(refused.scope, InFlightScope::Uid);
        assert_eq!((refused.in_flight, refused.cap), (6, 6));
        // Three more uids at their share (two connections each): 24 in all.
        let mut seconds = Vec::new();
        for other in &mut others {
            other.try_reserve(4).unwrap();
            let mut second = budget.window(other.uid);
            second.try_reserve(2).unwrap();
            seconds.push(second);
        }
        let refused = c.try_reserve(1).unwrap_err();
        assert_eq!(refused.scope, InFlightScope::All);
        assert_eq!((refused.in_flight, refused.cap), (24, 24));
        assert_eq!(budget.in_flight(), 24);
        assert_eq!(
            a.try_reserve(usize::MAX).unwrap_err().scope,
            InFlightScope::Uid
        );
        drop(a);
        assert_eq!(budget.in_flight(), 20);
        drop((b, c, others));
        assert_eq!(budget.in_flight(), 6);
        drop(seconds);
        assert_eq!(budget.in_flight(), 0);
    }

    #[test]
    fn a_charge_is_given_back_once_the_peer_has_read_everything() {
        let (mut server, mut client) = UnixStream::pair().unwrap();
        let budget = FdBudget::new(2, 2, 8);
        let mut window = budget.window(7);
        window.try_reserve(2).unwrap();
        server.write_all(b"reply").unwrap();
        assert!(!window.settle(server.as_fd()));
        assert!(window.unread(server.as_fd()));
        assert_eq!(budget.in_flight(), 2);
        let mut read = [0u8; 5];
        client.read_exact(&mut read).unwrap();
        assert!(window.settle(server.as_fd()));
        assert_eq!((window.charged(), budget.in_flight()), (0, 0));
        window.try_reserve(2).unwrap();
    }
}
