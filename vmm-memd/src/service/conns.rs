//! The service's table of live connections: who holds each (its uid), when it last finished a
//! request, whether it is serving one or writes a pending generation, and whether it was
//! evicted. It keeps the connection caps (in all and per uid): a uid at its cap gets a slot
//! by evicting its own longest-idle connection that holds no lease and no pending
//! generation ([`Conns::admit`]); the eviction shuts the reading side of that connection's
//! socket, which wakes its thread, and the thread sees it ([`Conns::begin_request`],
//! [`Conns::evicted`]) and ends.
//!
//! One lock orders admission against requests: a connection starts serving a request only
//! while it is not evicted, and is evicted only while it serves none, so no request of an
//! evicted connection is ever served (its client sees `ServiceGone`), and a connection gains
//! a lease or a pending generation only inside a request. An evicted connection's slot is
//! free at once (its thread may take a tick to end), and is counted once. The eviction is
//! decided before the newcomer's `HELLO` is sent: a newcomer that is gone by then has still
//! cost its uid that idle connection (as the idle timeout would have, later).

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

/// One live connection.
#[derive(Debug)]
struct Entry {
    uid: u32,
    /// When it was accepted or last finished a request.
    last_request: Instant,
    /// Serving a request now.
    in_request: bool,
    /// Writing a pending generation.
    writing: bool,
    /// Evicted: its slot is free; its thread ends at its next wake.
    evicted: bool,
    /// Its socket, open for as long as the entry is in the table (its thread removes the
    /// entry before the socket closes): an eviction shuts its reading side to wake the
    /// thread. `None` in unit tests.
    socket: Option<RawFd>,
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Full {
    /// The service holds `held` connections, its cap.
    Service { held: usize },
    /// This uid holds `held` connections, the cap per uid, and none of them can be evicted
    /// (each serves a request, holds a lease or writes).
    Uid { held: usize },
}

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Full::Service { held } => write!(f, "the service holds {held} connections, its cap"),
            Full::Uid { held } => write!(
                f,
                "this uid holds {held} connections, the cap per uid, each busy (a request, a \
                 lease or a pending generation)"
            ),
        }
    }
}

/// What [`Conns::admit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admitted {
    /// Below the caps.
    Free,
    /// The uid was at its cap: connection `conn` (of that uid) was evicted for it.
    Evicted { conn: u64 },
}

/// A connection's place in [`Conns`]: the connection is counted until this is dropped (its
/// thread ended, or never started), and its socket must stay open until then.
#[derive(Debug)]
pub(crate) struct Slot<'a> {
    conns: &'a Conns,
    conn: u64,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.conns.lock().remove(&self.conn);
    }
}

/// The live connections and the caps on them.
#[derive(Debug)]
pub(crate) struct Conns {
    total: usize,
    per_uid: usize,
    live: Mutex<HashMap<u64, Entry>>,
}

impl Conns {
    /// At most `total` connections in all and `per_uid` of one uid.
    pub(crate) fn new(total: usize, per_uid: usize) -> Conns {
        Conns {
            total,
            per_uid,
            live: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Entry>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a new connection of `uid` may be served: below both caps; or, with `uid` at
    /// its cap, once its longest-idle connection that serves no request, writes nothing and
    /// holds no lease (`holds_leases(conn)`) is evicted. Refused when the service is full
    /// (it evicts nobody for another uid) or no connection of `uid` can be evicted.
    pub(crate) fn admit(
        &self,
        uid: u32,
        holds_leases: &dyn Fn(u64) -> bool,
    ) -> Result<Admitted, Full> {
        let mut live = self.lock();
        let counted = |live: &HashMap<u64, Entry>| {
            let all = live.values().filter(|e| !e.evicted).count();
            let mine = live.values().filter(|e| !e.evicted && e.uid == uid).count();
            (all, mine)
        };
        let (all, mine) = counted(&live);
        if mine < self.per_uid {
            return match all < self.total {
                true => Ok(Admitted::Free),
                false => Err(Full::Service { held: all }),
            };
        }
        let victim = live
            .iter()
            .filter(|(_, e)| e.uid == uid && !e.evicted && !e.in_request && !e.writing)
            .filter(|(conn, _)| !holds_leases(**conn))
            .min_by_key(|(conn, e)| (e.last_request, **conn))
            .map(|(conn, _)| *conn);
        let Some(conn) = victim else {
            return Err(Full::Uid { held: mine });
        };
        if all > self.total {
            // The cap in all was lowered below what is held: evicting one would not do.
            return Err(Full::Service { held: all });
        }
        if let Some(entry) = live.get_mut(&conn) {
            entry.evicted = true;
            if let Some(socket) = entry.socket {
                // Its thread sleeps in poll on this socket: the shut reading side wakes it
                // (as a request, which `begin_request` refuses: it ends). The client's next
                // send fails, as it would once the connection closed.
                // SAFETY: the socket is open while its entry is here (see `Entry::socket`),
                // and the table's lock is held.
                unsafe { libc::shutdown(socket, libc::SHUT_RD) };
            }
        }
        Ok(Admitted::Evicted { conn })
    }

    /// Count connection `conn` of `uid`, accepted now, on `socket` (which must stay open
    /// until the slot is dropped), for as long as the returned slot lives.
    pub(crate) fn insert(&self, conn: u64, uid: u32, socket: Option<RawFd>) -> Slot<'_> {
        self.lock().insert(
            conn,
            Entry {
                uid,
                last_request: Instant::now(),
                in_request: false,
                writing: false,
                evicted: false,
                socket,
            },
        );
        Slot { conns: self, conn }
    }

    /// Whether connection `conn` was evicted (or is not counted).
    pub(crate) fn evicted(&self, conn: u64) -> bool {
        self.lock().get(&conn).is_none_or(|e| e.evicted)
    }

    /// Start serving a request on `conn`: false (serve nothing, end) if it was evicted.
    pub(crate) fn begin_request(&self, conn: u64) -> bool {
        match self.lock().get_mut(&conn) {
            Some(entry) if !entry.evicted => {
                entry.in_request = true;
                true
            }
            _ => false,
        }
    }

    /// A request on `conn` is answered; the connection writes a pending generation after it
    /// (`writing`) or not.
    pub(crate) fn end_request(&self, conn: u64, writing: bool) {
        if let Some(entry) = self.lock().get_mut(&conn) {
            entry.in_request = false;
            entry.writing = writing;
            entry.last_request = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_LEASES: &dyn Fn(u64) -> bool = &|_| false;

    #[test]
    fn below_the_caps_everyone_is_admitted() {
        let conns = Conns::new(3, 2);
        assert_eq!(conns.admit(1, NO_LEASES), Ok(Admitted::Free));
        let _zero = conns.insert(0, 1, None);
        let _one = conns.insert(1, 2, None);
        let two = conns.insert(2, 3, None);
        // Full in all: nobody is evicted for another uid.
        assert_eq!(conns.admit(4, NO_LEASES), Err(Full::Service { held: 3 }));
        drop(two);
        assert_eq!(conns.admit(4, NO_LEASES), Ok(Admitted::Free));
    }

    #[test]
    fn a_uid_at_its_cap_evicts_its_longest_idle_free_connection() {
        let conns = Conns::new(10, 4);
        let mut slots: Vec<Slot<'_>> = (0..4)
            .map(|conn| {
                let slot = conns.insert(conn, 7, None);
                std::thread::sleep(std::time::Duration::from_millis(2));
                slot
            })
            .collect();
        // 0 holds a lease, 1 writes, 2 serves a request now: 3 is the one to go.
        assert!(conns.begin_request(1));
        conns.end_request(1, true);
        assert!(conns.begin_request(2));
        let leases = |conn| conn == 0;
        assert_eq!(conns.admit(7, &leases), Ok(Admitted::Evicted { conn: 3 }));
        assert!(conns.evicted(3));
        assert!(
            !conns.begin_request(3),
            "an evicted connection serves nothing"
        );
        // Its slot is free: the newcomer is counted (it sends a request at once), and the uid
        // is at its cap again with every connection busy.
        let _four = conns.insert(4, 7, None);
        assert!(conns.begin_request(4));
        assert_eq!(conns.admit(7, &leases), Err(Full::Uid { held: 4 }));
        // The evicted connection's thread ends: nothing more is freed by it.
        drop(slots.pop());
        assert_eq!(conns.admit(7, &leases), Err(Full::Uid { held: 4 }));
        // The newcomer's request ends, then 2's, then 1 commits: the newcomer is the longest
        // idle now.
        conns.end_request(4, false);
        std::thread::sleep(std::time::Duration::from_millis(2));
        conns.end_request(2, false);
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(conns.begin_request(1));
        conns.end_request(1, false);
        assert_eq!(conns.admit(7, &leases), Ok(Admitted::Evicted { conn: 4 }));
        // Another uid is untouched by all this.
        assert_eq!(conns.admit(8, NO_LEASES), Ok(Admitted::Free));
    }
}
