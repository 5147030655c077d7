//! How many descriptors' fds the daemon has sent that their clients have not read yet.
//!
//! An fd sent over a Unix socket is "in flight" until the receiver reads its message, and the
//! kernel charges it to the sender's uid: past the sender's `RLIMIT_NOFILE` of them, every
//! send with fds by any process of that uid fails with `ETOOMANYREFS` (unless it has
//! `CAP_SYS_RESOURCE`). A client that asks for descriptors and never reads its replies would
//! drive the daemon's uid there, for everyone (issue 23, item 6b). So the daemon counts what
//! it sent and caps it per connection, per client uid and in all; a send that would pass a
//! cap waits (at most [`IN_FLIGHT_WAIT`]) for the client to read, then is refused with a
//! typed answer (`error: busy: ...`, which [`crate::client`] turns into
//! [`Error::LimitExceeded`]), and other clients go on being served.
//!
//! What is read is learnt from the kernel, not from the client: `SIOCOUTQ` on the daemon's
//! end of a Unix socket is the memory of its messages the peer has not read yet, so when it
//! is 0 everything sent on the connection has been read (or the peer has closed, which drops
//! its queue). Until then, everything sent since it was last 0 counts as in flight (an over-
//! estimate for a client that reads some of its replies, never an under-estimate). A
//! connection that ends with replies still unread keeps its count (and its socket) until
//! they are read or dropped: the daemon parks it ([`Window::unread`]).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_core::{Error, Result};

/// How long a send that would pass a cap waits for the client to read before it is refused:
/// 1 s.
pub const IN_FLIGHT_WAIT: Duration = Duration::from_secs(1);

/// How often a waiting send looks again: 5 ms.
const POLL: Duration = Duration::from_millis(5);

/// The caps, and what is charged against them.
#[derive(Debug)]
pub struct FdBudget {
    per_connection: usize,
    per_uid: usize,
    total: usize,
    charged: Mutex<(usize, HashMap<u32, usize>)>,
}

/// One connection's fds in flight, charged to its client's uid.
#[derive(Debug)]
pub struct Window<'a> {
    budget: &'a FdBudget,
    uid: u32,
    charged: usize,
    /// A send was refused since the client last read everything: later ones are refused at
    /// once (a client that sent many requests waits once, not once per request).
    refused: bool,
}

impl FdBudget {
    /// At most `total` fds in flight in all, `per_uid` to one client uid, `per_connection`
    /// on one connection. Clamped so that each leaves room beside it: `total` at most half
    /// the process's soft `RLIMIT_NOFILE` (the kernel's own limit on the daemon's uid, which
    /// the daemon's other fds share), `per_uid` at most half of `total` (no uid takes it
    /// all), `per_connection` at most a quarter of `per_uid` (one connection that does not
    /// read leaves its uid's other clients served); each at least 1.
    pub fn new(per_connection: usize, per_uid: usize, total: usize) -> FdBudget {
        let nofile = nofile_soft_limit();
        let total = total.min(nofile / 2).max(1);
        let per_uid = per_uid.min(total / 2).max(1);
        let per_connection = per_connection.min(per_uid / 4).max(1);
        FdBudget {
            per_connection,
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
    pub fn window(&self, uid: u32) -> Window<'_> {
        Window {
            budget: self,
            uid,
            charged: 0,
            refused: false,
        }
    }
}

impl Window<'_> {
    /// Forget what the client has read: when nothing sent on `socket` is unread, nothing is
    /// in flight on it.
    pub fn settle(&mut self, socket: BorrowedFd<'_>) {
        if self.charged > 0 && unread_bytes(socket) == 0 {
            self.uncharge();
            self.refused = false;
        }
    }

    /// Whether fds sent on `socket` may still be unread (after [`settle`](Self::settle)).
    pub fn unread(&mut self, socket: BorrowedFd<'_>) -> bool {
        self.settle(socket);
        self.charged > 0
    }

    /// Charge `fds` about to be sent on `socket`: at once if every cap allows it; else wait
    /// (at most [`IN_FLIGHT_WAIT`], and not past `stop`; not at all if a send was refused
    /// since the client last read everything) for the client to read; else
    /// [`Error::LimitExceeded`], naming the cap.
    pub fn reserve(&mut self, socket: BorrowedFd<'_>, fds: usize, stop: &AtomicBool) -> Result<()> {
        let deadline = Instant::now() + IN_FLIGHT_WAIT;
        loop {
            self.settle(socket);
            let refusal = {
                let mut charged = self.budget.lock();
                let (total, by_uid) = &mut *charged;
                let uid_now = by_uid.get(&self.uid).copied().unwrap_or(0);
                let (per_connection, per_uid, all) = (
                    self.budget.per_connection,
                    self.budget.per_uid,
                    self.budget.total,
                );
                if self.charged + fds > per_connection {
                    Some(("on this connection", self.charged, per_connection))
                } else if uid_now + fds > per_uid {
                    Some(("to this uid", uid_now, per_uid))
                } else if *total + fds > all {
                    Some(("in all", *total, all))
                } else {
                    *total += fds;
                    *by_uid.entry(self.uid).or_default() += fds;
                    self.charged += fds;
                    None
                }
            };
            let Some((scope, now, cap)) = refusal else {
                return Ok(());
            };
            if self.refused || Instant::now() >= deadline || stop.load(Ordering::Relaxed) {
                self.refused = true;
                return Err(Error::LimitExceeded {
                    what: format!("descriptor fds in flight (sent, not read yet) {scope}").into(),
                    size: (now + fds) as u64,
                    cap: cap as u64,
                    raise: "read the replies already sent first".into(),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    fn uncharge(&mut self) {
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

impl Drop for Window<'_> {
    fn drop(&mut self) {
        self.uncharge();
    }
}

/// `SIOCOUTQ`: the bytes (of socket memory) sent on `socket` that its peer has not read yet;
/// taken as unread (1) when it cannot be asked.
fn unread_bytes(socket: BorrowedFd<'_>) -> usize {
    let mut value: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one c_int to the pointer given, a live local.
    let rc = unsafe { libc::ioctl(socket.as_raw_fd(), libc::TIOCOUTQ, &mut value) };
    if rc < 0 { 1 } else { value.max(0) as usize }
}

/// The soft `RLIMIT_NOFILE`.
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
