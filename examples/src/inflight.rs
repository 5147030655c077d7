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
//! The counting is vmm-core's ([`vmm_core::wire::endpoint::FdBudget`], which learns what was
//! read from the kernel's `SIOCOUTQ`, not from the client); this module adds the daemon's
//! policy: its clamps, the wait before a refusal, and the refusal as a typed error. A
//! connection that ends with replies still unread keeps its count (and its socket) until they
//! are read or dropped: the daemon parks it ([`Window::unread`]).

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vmm_core::wire::endpoint::{self, FdWindow, InFlightScope};
use vmm_core::{Error, Result};

/// How long a send that would pass a cap waits for the client to read before it is refused:
/// 1 s.
pub const IN_FLIGHT_WAIT: Duration = Duration::from_secs(1);

/// How often a waiting send looks again: 5 ms.
const POLL: Duration = Duration::from_millis(5);

/// The caps, and what is charged against them.
#[derive(Debug)]
pub struct FdBudget(endpoint::FdBudget);

/// One connection's fds in flight, charged to its client's uid.
#[derive(Debug)]
pub struct Window<'a> {
    window: FdWindow<'a>,
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
        let (_, _, total) = endpoint::FdBudget::new(1, 1, total).caps();
        let per_uid = per_uid.min(total / 2).max(1);
        let per_connection = per_connection.min(per_uid / 4).max(1);
        FdBudget(endpoint::FdBudget::new(per_connection, per_uid, total))
    }

    /// The caps in force: per connection, per uid, in all.
    pub fn caps(&self) -> (usize, usize, usize) {
        self.0.caps()
    }

    /// The fds in flight now, in all.
    pub fn in_flight(&self) -> usize {
        self.0.in_flight()
    }

    /// An empty window for a connection of client `uid`.
    pub fn window(&self, uid: u32) -> Window<'_> {
        Window {
            window: self.0.window(uid),
            refused: false,
        }
    }
}

impl Window<'_> {
    /// Forget what the client has read: when nothing sent on `socket` is unread, nothing is
    /// in flight on it.
    pub fn settle(&mut self, socket: BorrowedFd<'_>) {
        if self.window.settle(socket) {
            self.refused = false;
        }
    }

    /// Whether fds sent on `socket` may still be unread (after [`settle`](Self::settle)).
    pub fn unread(&mut self, socket: BorrowedFd<'_>) -> bool {
        self.settle(socket);
        self.window.charged() > 0
    }

    /// Charge `fds` about to be sent on `socket`: at once if every cap allows it; else wait
    /// (at most [`IN_FLIGHT_WAIT`], and not past `stop`; not at all if a send was refused
    /// since the client last read everything) for the client to read; else
    /// [`Error::LimitExceeded`], naming the cap.
    pub fn reserve(&mut self, socket: BorrowedFd<'_>, fds: usize, stop: &AtomicBool) -> Result<()> {
        let deadline = Instant::now() + IN_FLIGHT_WAIT;
        loop {
            self.settle(socket);
            let over = match self.window.try_reserve(fds) {
                Ok(()) => return Ok(()),
                Err(over) => over,
            };
            if self.refused || Instant::now() >= deadline || stop.load(Ordering::Relaxed) {
                self.refused = true;
                let scope = match over.scope {
                    InFlightScope::Connection => "on this connection",
                    InFlightScope::Uid => "to this uid",
                    InFlightScope::All => "in all",
                };
                return Err(Error::LimitExceeded {
                    what: format!("descriptor fds in flight (sent, not read yet) {scope}").into(),
                    size: (over.in_flight + fds) as u64,
                    cap: over.cap as u64,
                    raise: "read the replies already sent first".into(),
                });
            }
            std::thread::sleep(POLL);
        }
    }
}
