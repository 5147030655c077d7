"""What both listeners share: a bounded log of refusals, and an accept that waits out the
fd limit instead of failing."""

import collections
import errno
import socket
import sys
import time

from .constants import FD_LIMIT_PAUSE, LOG_BURST, LOG_INTERVAL, REFUSALS_KEPT


class _RefusalLog:
    """Refusals remembered (the last ``REFUSALS_KEPT``, in ``refused``), counted (``refusals``)
    and logged to stderr at most ``LOG_BURST`` lines per ``LOG_INTERVAL`` seconds, then one
    line counting the rest."""

    def _init_log(self, label, log):
        self.label, self.log = label, log
        self.refused = collections.deque(maxlen=REFUSALS_KEPT)
        self.refusals = 0
        self._log_since, self._log_written, self._log_unwritten = time.monotonic(), 0, 0

    def _note_refusal(self, entry, line):
        self.refused.append(entry)
        self.refusals += 1
        if not self.log:
            return
        now = time.monotonic()
        if now - self._log_since >= LOG_INTERVAL:
            self._log_count()
            self._log_since, self._log_written = now, 0
        if self._log_written < LOG_BURST:
            self._log_written += 1
            print(f"vmm_ipc_peer {self.label}: {line}", file=sys.stderr, flush=True)
        else:
            self._log_unwritten += 1

    def _log_count(self):
        if self._log_unwritten:
            print(f"vmm_ipc_peer {self.label}: {self._log_unwritten} more refused "
                  f"connection(s) not logged (at most {LOG_BURST} lines per {LOG_INTERVAL:g} s)",
                  file=sys.stderr, flush=True)
            self._log_unwritten = 0


def _accept_retrying(sock, deadline, what):
    """``sock.accept()`` by ``deadline`` (None: no limit). At the process's or the system's fd
    limit (``EMFILE``, ``ENFILE``; or out of kernel memory) the connection stays queued: wait
    ``FD_LIMIT_PAUSE`` seconds and try again, as the Rust listener's server does, instead of
    failing."""
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(f"accepting a connection on {what}")
        sock.settimeout(left)
        try:
            return sock.accept()
        except socket.timeout:
            raise TimeoutError(f"accepting a connection on {what}") from None
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            pause = FD_LIMIT_PAUSE if left is None else min(FD_LIMIT_PAUSE, left)
            time.sleep(max(pause, 0))
