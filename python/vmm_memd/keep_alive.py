"""Leases kept alive by the client: a daemon thread renews the connection's leases every third
of their TTL while it holds any, as etcd's and Dynamo's clients do for theirs. Without it an
engine that attaches its weights and serves for an hour drops out of the service's accounting
after one TTL (its mapping stays valid; the service just forgets the reader, and may free a
retired generation under it).

A stopped process (SIGSTOP) stops this thread too, so its leases still end by TTL.

The connection carries one exchange at a time (a request, then every message of its reply), so
the thread and the client's calls take turns: each exchange of the client holds a turn for its
whole length (nested ones too: a count, not a lock), and the thread renews only between them,
holding the connection meanwhile. A due renewal goes before the next exchange, so a client
making calls back to back cannot starve it. vmm-memd's Rust client does the same (src/keep_alive.rs).
"""

import contextlib
import os
import threading
import time


class Turns:
    """Who may use the connection now, and what the renewal thread is told."""

    def __init__(self):
        self._cond = threading.Condition()
        self.calls = 0  # exchanges of the client in progress (nested ones counted)
        self.renewing = False  # the renewal thread holds the connection
        # The renewal thread is due and waits for the exchanges in progress to end: a new one
        # waits behind it, so that back-to-back calls cannot starve it.
        self.wanted = False
        self.enabled = True
        self.ttl = None  # seconds, as the last attach's reply said
        self.leased = False  # a lease was taken since the thread last looked
        self.stop = False

    @contextlib.contextmanager
    def call(self):
        """The connection for an exchange of the client (waits while the thread renews: one
        small request and its reply)."""
        with self._cond:
            while self.calls == 0 and (self.renewing or self.wanted):
                self._cond.wait()
            self.calls += 1
        try:
            yield
        finally:
            with self._cond:
                self.calls -= 1
                if self.calls == 0:
                    self._cond.notify_all()

    def lease_taken(self, ttl):
        """A lease with this TTL (seconds) was taken: whether renewal is on."""
        with self._cond:
            self.ttl, self.leased = ttl, True
            self._cond.notify_all()
            return self.enabled

    def set_enabled(self, enabled):
        with self._cond:
            self.enabled = bool(enabled)
            self._cond.notify_all()

    def end(self):
        with self._cond:
            self.stop = True
            self._cond.notify_all()

    def next(self, idle):
        """The renewal thread: wait until a third of the TTL has passed since the last
        renewal (or the next lease, after ``idle``: the last renewal renewed nothing) and no
        exchange holds the connection, then take it: True; False when the client is closing."""
        with self._cond:
            due = None
            while True:
                if self.stop:
                    self.wanted = False
                    self._cond.notify_all()
                    return False
                if self.leased:
                    self.leased, idle, due = False, False, None
                if self.ttl is None or not self.enabled or idle:
                    if self.wanted:
                        self.wanted = False
                        self._cond.notify_all()
                    self._cond.wait()
                    continue
                if due is None:
                    due = time.monotonic() + self.ttl / 3
                now = time.monotonic()
                if now >= due and self.calls == 0:
                    self.renewing, self.wanted = True, False
                    return True
                self.wanted = now >= due
                self._cond.wait(None if now >= due else due - now)

    def renewed(self):
        with self._cond:
            self.renewing = False
            self._cond.notify_all()


class Renewer:
    """The renewal thread of one client: ``renew`` is a ``weakref.WeakMethod`` of one Renew
    exchange (the number of leases renewed), called only while the thread holds the
    connection; the thread keeps no client alive, and ends once its client is gone. A renewal that fails
    (the service gone, a timeout that leaves the connection out of step) turns renewal off:
    the leases then end by TTL, as without it."""

    def __init__(self, turns, renew):
        self.turns, self._renew, self.pid = turns, renew, os.getpid()
        self.thread = threading.Thread(target=self._run, name="vmm-memd-renew", daemon=True)
        self.thread.start()

    def _run(self):
        idle = False
        while self.turns.next(idle):
            try:
                renew = self._renew()  # a weak reference: the client may be gone
                if renew is None:
                    return
                idle = renew() == 0
                del renew
            except Exception:  # noqa: BLE001 (any failure: renewal off, leases end by TTL)
                self.turns.set_enabled(False)
                idle = True
            finally:
                self.turns.renewed()

    def join(self):
        """Wait for the thread to end (after ``turns.end()``); nothing in a forked child,
        which has no such thread."""
        if self.pid == os.getpid() and self.thread is not threading.current_thread():
            self.thread.join()
