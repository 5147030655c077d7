//! Leases kept alive by the client: a thread renews the connection's leases every third of
//! their TTL while it holds any, as etcd's and Dynamo's clients do for theirs. Without it an
//! engine that attaches its weights and serves for an hour drops out of the service's
//! accounting after one TTL (its mapping stays valid; the service just forgets the reader,
//! and may free a retired generation under it).
//!
//! A process that is stopped (SIGSTOP) stops this thread too, so its leases still end by TTL:
//! the service's defence against a stopped reader holding memory is untouched.
//!
//! The connection carries one exchange at a time (a request, then every message of its
//! reply), so the thread and the client's own calls take turns: each public call of the
//! client holds a [`Turn`] for its whole exchange (nested calls too: a count, not a lock), and
//! the thread renews only between calls, holding the connection meanwhile. A due renewal goes
//! before the next call, so a client making calls back to back cannot starve it.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Who may use the connection now, and what the renewal thread is told.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    state: Mutex<TurnState>,
    changed: Condvar,
}

#[derive(Debug)]
struct TurnState {
    /// Calls of the client in progress (nested ones counted).
    calls: usize,
    /// The renewal thread holds the connection.
    renewing: bool,
    /// The renewal thread is due and waits for the calls in progress to end: a new call
    /// waits behind it, so that a client busy with back-to-back calls cannot starve it.
    wanted: bool,
    /// Renew at all (on by default; [`Client::set_keep_alive`](crate::Client::set_keep_alive)).
    enabled: bool,
    /// The leases' TTL, as the last attach's reply said.
    ttl: Option<Duration>,
    /// A lease was taken since the thread last looked: it renews from now on.
    leased: bool,
    /// The client is going: the thread ends.
    stop: bool,
}

impl Default for TurnState {
    fn default() -> Self {
        TurnState {
            calls: 0,
            renewing: false,
            wanted: false,
            enabled: true,
            ttl: None,
            leased: false,
            stop: false,
        }
    }
}

/// A call's turn on the connection: held for the whole exchange.
#[derive(Debug)]
pub(crate) struct Turn<'t>(&'t Turns);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.calls -= 1;
        if state.calls == 0 {
            self.0.changed.notify_all();
        }
    }
}

/// What the renewal thread is to do next.
pub(crate) enum Next {
    /// Renew now: the connection is the thread's until [`Turns::renewed`].
    Renew,
    /// The client is going.
    Stop,
}

impl Turns {
    fn lock(&self) -> MutexGuard<'_, TurnState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The connection for a call of the client (waits while the thread renews, or is due
    /// to: one small request and its reply). A call inside a call never waits.
    pub(crate) fn call(&self) -> Turn<'_> {
        let mut state = self.lock();
        while state.calls == 0 && (state.renewing || state.wanted) {
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.calls += 1;
        Turn(self)
    }

    /// Whether a call holds its turn (debug checks of the exchange's primitives).
    pub(crate) fn in_call(&self) -> bool {
        let state = self.lock();
        state.calls > 0 || state.renewing
    }

    /// A lease with this TTL was taken: whether the thread is wanted (renewal enabled).
    pub(crate) fn leased(&self, ttl: Duration) -> bool {
        let mut state = self.lock();
        state.ttl = Some(ttl);
        state.leased = true;
        self.changed.notify_all();
        state.enabled
    }

    pub(crate) fn set_enabled(&self, enabled: bool) {
        self.lock().enabled = enabled;
        self.changed.notify_all();
    }

    /// Tell the thread to end.
    pub(crate) fn stop(&self) {
        self.lock().stop = true;
        self.changed.notify_all();
    }

    /// The renewal thread: wait until a third of the TTL has passed since the last renewal
    /// (or the first lease, after `idle`: the last renewal renewed nothing) and no call holds
    /// the connection, then take it.
    pub(crate) fn next(&self, idle: bool) -> Next {
        let mut state = self.lock();
        let mut idle = idle;
        let mut due: Option<Instant> = None;
        loop {
            if state.stop {
                state.wanted = false;
                self.changed.notify_all();
                return Next::Stop;
            }
            if state.leased {
                state.leased = false;
                idle = false;
                due = None;
            }
            let (Some(ttl), true, false) = (state.ttl, state.enabled, idle) else {
                if state.wanted {
                    state.wanted = false;
                    self.changed.notify_all();
                }
                state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
                continue;
            };
            let due = *due.get_or_insert_with(|| Instant::now() + ttl / 3);
            let now = Instant::now();
            if now >= due && state.calls == 0 {
                state.renewing = true;
                state.wanted = false;
                return Next::Renew;
            }
            state.wanted = now >= due;
            state = match now >= due {
                // A call holds the connection: its end wakes us.
                true => self.changed.wait(state).unwrap_or_else(|e| e.into_inner()),
                false => match self.changed.wait_timeout(state, due - now) {
                    Ok((state, _)) => state,
                    Err(e) => e.into_inner().0,
                },
            };
        }
    }

    /// The renewal is done: the connection is the calls' again.
    pub(crate) fn renewed(&self) {
        self.lock().renewing = false;
        self.changed.notify_all();
    }
}
