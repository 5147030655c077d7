//! Which connections the daemon holds, and whom it turns away when it has no slot to give.
//!
//! A connection costs the daemon a thread and an fd, so it holds at most `max` at once. Left
//! at that, one allowed uid that opens `max` connections and says nothing would starve every
//! other (issue 23, item 6i): so no uid holds more than `per_uid` of them (below `max`), and a
//! connection idle for `idle_timeout` is closed by its own thread (see [`Daemon`]). When a
//! newcomer finds no slot (its uid at its cap, or every slot taken), the connection idle the
//! longest, if it has been idle at least `evict_after`, is closed to make room: one of the
//! newcomer's own uid when that uid is at its cap, else one of the uid that holds the most.
//! Only when none qualifies is the newcomer refused, at once and with the reason
//! (`REFUSED` of the protocol, before it is admitted), rather than left waiting in the backlog.
//!
//! [`Daemon`]: crate::Daemon

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vmm_core::peer::Session;

/// One held connection.
#[derive(Debug)]
struct Held {
    uid: u32,
    session: Arc<Session>,
    /// Since when it has waited for a request; `None` while it serves one.
    idle_since: Option<Instant>,
    /// Shut down to make room (or to stop): no longer counted.
    closed: bool,
}

/// The connections a daemon holds (see the module docs).
#[derive(Debug)]
pub struct Slots {
    max: usize,
    per_uid: usize,
    evict_after: Duration,
    held: Mutex<(u64, HashMap<u64, Held>)>,
}

/// A held connection's slot: tell it when the connection waits for a request and when it
/// serves one; dropping it frees the slot.
#[derive(Debug)]
pub struct Slot<'a> {
    slots: &'a Slots,
    id: u64,
}

impl Slots {
    /// At most `max` connections (at least 1), at most `per_uid` of one uid (at least 1, at
    /// most `max`); one idle `evict_after` or longer may be closed for a newcomer.
    pub fn new(max: usize, per_uid: usize, evict_after: Duration) -> Slots {
        let max = max.max(1);
        Slots {
            max,
            per_uid: per_uid.clamp(1, max),
            evict_after,
            held: Mutex::new((0, HashMap::new())),
        }
    }

    fn lock(&self) -> MutexGuard<'_, (u64, HashMap<u64, Held>)> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many connections it holds.
    pub fn len(&self) -> usize {
        self.lock().1.values().filter(|h| !h.closed).count()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a newcomer of `uid` may have a slot: yes if one is free, or once the longest
    /// idle connection that may give way has been closed for it; else why not.
    pub fn admit(&self, uid: u32) -> Result<(), String> {
        let mut guard = self.lock();
        let held = &mut guard.1;
        let mut per_uid: HashMap<u32, usize> = HashMap::new();
        for h in held.values().filter(|h| !h.closed) {
            *per_uid.entry(h.uid).or_default() += 1;
        }
        let mine = per_uid.get(&uid).copied().unwrap_or(0);
        let total: usize = per_uid.values().sum();
        let now = Instant::now();
        let idle_for = |h: &Held| h.idle_since.map(|since| now.duration_since(since));
        let candidates = held
            .iter()
            .filter(|(_, h)| !h.closed && idle_for(h).is_some_and(|idle| idle >= self.evict_after));
        let victim = if mine >= self.per_uid {
            candidates
                .filter(|(_, h)| h.uid == uid)
                .max_by_key(|(_, h)| idle_for(h))
                .map(|(id, _)| *id)
                .ok_or_else(|| {
                    format!(
                        "this uid holds {mine} connections, the most one uid may hold, and \
                         none has been idle for {:?}; try again later",
                        self.evict_after
                    )
                })?
        } else if total >= self.max {
            candidates
                .max_by_key(|(_, h)| (per_uid.get(&h.uid).copied(), idle_for(h)))
                .map(|(id, _)| *id)
                .ok_or_else(|| {
                    format!(
                        "all {} connections are taken and none has been idle for {:?}; try \
                         again later",
                        self.max, self.evict_after
                    )
                })?
        } else {
            return Ok(());
        };
        let h = held.get_mut(&victim).expect("a held connection");
        h.closed = true;
        shut_down(&h.session);
        Ok(())
    }

    /// Hold `session` (of `uid`), admitted by [`admit`](Self::admit).
    pub fn hold(&self, uid: u32, session: Arc<Session>) -> Slot<'_> {
        let mut guard = self.lock();
        guard.0 += 1;
        let id = guard.0;
        guard.1.insert(
            id,
            Held {
                uid,
                session,
                idle_since: None,
                closed: false,
            },
        );
        Slot { slots: self, id }
    }

    /// Shut every held connection down (their threads then end at once): to stop.
    pub fn close_all(&self) {
        for h in self.lock().1.values_mut() {
            h.closed = true;
            shut_down(&h.session);
        }
    }
}

impl Slot<'_> {
    /// The connection waits for its next request: from now on it counts as idle.
    pub fn idle(&self) {
        if let Some(h) = self.slots.lock().1.get_mut(&self.id) {
            h.idle_since = Some(Instant::now());
        }
    }

    /// The connection serves a request: it may not be closed for a newcomer meanwhile.
    pub fn busy(&self) {
        if let Some(h) = self.slots.lock().1.get_mut(&self.id) {
            h.idle_since = None;
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.slots.lock().1.remove(&self.id);
    }
}

/// Shut `session`'s socket down both ways: its thread's wait for a request, and any send
/// blocked on a peer that does not read, return at once.
pub(crate) fn shut_down(session: &Session) {
    // SAFETY: shutdown on an fd `session` keeps open; it touches no memory.
    unsafe {
        libc::shutdown(session.as_fd().as_raw_fd(), libc::SHUT_RDWR);
    }
}
