"""Mutual TLS (standard library ssl) carrying the byte-stream framing over TCP, both ends
authenticated: ``tls_listen``/``TlsListener`` and ``tls_connect``/``TlsConnection``."""

import errno
import select
import socket
import time
from collections import namedtuple

try:
    import ssl
except ImportError:  # a Python built without OpenSSL: everything but TLS works
    ssl = None

from .accepting import _RefusalLog
from .constants import (ACCEPT_BATCH, CONNECT_ATTEMPT, DEFAULT_TIMEOUT, FD_LIMIT_PAUSE,
                        LISTEN_BACKLOG, MAX_HANDSHAKES, RECORD_RECHECK)
from .errors import PeerClosed, PeerRefused, ProtocolError, TlsError, TlsReason, TlsRefused
from .stream import StreamConnection


# A refused client: its address, why in words, and why as a TlsReason (None for a refusal
# that is no certificate's: a handshake past its deadline, a plaintext client).
TlsRefusal = namedtuple("TlsRefusal", "address reason kind", defaults=(None,))

# TLS alerts that mean "your certificate is refused" (OpenSSL's reason names).
_REFUSAL_ALERTS = ("CERTIFICATE", "UNKNOWN_CA", "ACCESS_DENIED")

# OpenSSL's verify codes (X509_V_ERR_*) as the TlsReason of the rule each breaks; any other
# is BAD_CERTIFICATE.
_VERIFY_CODES = {
    2: TlsReason.UNKNOWN_ISSUER,        # UNABLE_TO_GET_ISSUER_CERT
    3: TlsReason.REVOCATION_UNKNOWN,    # UNABLE_TO_GET_CRL
    9: TlsReason.NOT_YET_VALID,         # CERT_NOT_YET_VALID
    10: TlsReason.EXPIRED,              # CERT_HAS_EXPIRED
    12: TlsReason.CRL_EXPIRED,          # CRL_HAS_EXPIRED
    18: TlsReason.UNKNOWN_ISSUER,       # DEPTH_ZERO_SELF_SIGNED_CERT
    19: TlsReason.UNKNOWN_ISSUER,       # SELF_SIGNED_CERT_IN_CHAIN
    20: TlsReason.UNKNOWN_ISSUER,       # UNABLE_TO_GET_ISSUER_CERT_LOCALLY
    21: TlsReason.UNKNOWN_ISSUER,       # UNABLE_TO_VERIFY_LEAF_SIGNATURE
    22: TlsReason.CHAIN_TOO_LONG,       # CERT_CHAIN_TOO_LONG
    23: TlsReason.REVOKED,              # CERT_REVOKED
    26: TlsReason.WRONG_USAGE,          # INVALID_PURPOSE
    32: TlsReason.NOT_AN_ISSUER,        # KEYUSAGE_NO_CERTSIGN
    33: TlsReason.REVOCATION_UNKNOWN,   # UNABLE_TO_GET_CRL_ISSUER
    37: TlsReason.NOT_AN_ISSUER,        # INVALID_NON_CA
    39: TlsReason.WRONG_USAGE,          # KEYUSAGE_NO_DIGITAL_SIGNATURE
    79: TlsReason.NOT_AN_ISSUER,        # INVALID_CA
    92: TlsReason.NOT_AN_ISSUER,        # CA_CERT_MISSING_KEY_USAGE
}


def _tls_failure(e, what):
    """The typed exception for ``e`` (raised by ssl or the socket under it), or None to let
    ``e`` through (timeouts, PeerClosed, this module's own)."""
    if ssl is None or isinstance(e, (PeerClosed, PeerRefused, ProtocolError, TimeoutError)):
        return None
    if isinstance(e, ssl.SSLCertVerificationError):
        return TlsRefused(f"{what}: the peer's certificate was refused: {e.verify_message}",
                          _VERIFY_CODES.get(e.verify_code, TlsReason.BAD_CERTIFICATE))
    if isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionResetError,
                      BrokenPipeError, ConnectionAbortedError)):
        return PeerClosed(f"{what}: the connection was cut ({type(e).__name__}); a TLS "
                          f"server closes a client it refuses this way")
    if isinstance(e, ssl.SSLError):
        reason = e.reason or str(e)
        if "ALERT" in reason and any(w in reason for w in _REFUSAL_ALERTS):
            return TlsRefused(f"{what}: the peer refused this side (TLS alert {reason})",
                              TlsReason.REFUSED_BY_PEER)
        return TlsError(f"{what}: TLS failed ({reason})")
    return None


def _host_port(address):
    """(host, port) from a tuple or ``HOST:PORT`` (``[v6]:PORT``)."""
    if isinstance(address, (tuple, list)):
        return str(address[0]), int(address[1])
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r}: HOST:PORT")
    return host.strip("[]"), int(port)


def _handshake(sock, deadline, what):
    """Run ``sock``'s TLS handshake to its end by ``deadline`` (one deadline for the whole
    handshake, however the peer dribbles it), non-blocking under poll."""
    sock.settimeout(0)
    poller = select.poll()
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            events = select.POLLIN
        except ssl.SSLWantWriteError:
            events = select.POLLOUT
        except (OSError, ValueError) as e:
            failure = _tls_failure(e, what)
            if failure is None:
                raise
            raise failure from None
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: the TLS handshake did not finish within its deadline")
        poller.register(sock.fileno(), events)
        poller.poll(max(1, int(left * 1000)))
        poller.unregister(sock.fileno())


class TlsConnection(StreamConnection):
    """A mutually authenticated TLS stream carrying the byte-stream framing (DATA and
    CUDA_FABRIC): ``send_descriptor``, ``send_data``, ``recv``, ``recv_descriptor``,
    ``recv_data``, ``close``, ``with``. ``peer_names`` are the DNS names of the other side's
    certificate, ``peer_spki_sha256`` its pin (hex), ``address`` its address. Each message
    has one deadline (``timeout``); failures are typed: TimeoutError, PeerClosed (the stream
    ended or was cut), TlsRefused (the other side refused this one), TlsError (a record that
    did not authenticate), ProtocolError (a bad message); any of them ends the stream."""

    def __init__(self, sock, peer_names, peer_spki_sha256, address, timeout=DEFAULT_TIMEOUT):
        # Its peer passed the TLS checks before this object exists.
        super().__init__(sock, timeout, caller_authenticated=True)
        self.peer_names, self.peer_spki_sha256 = peer_names, peer_spki_sha256
        self.address = address

    def _typed(self, call, *args):
        try:
            return call(*args)
        except BaseException as e:
            failure = _tls_failure(e, f"TLS connection with {self.address[0]}:{self.address[1]}")
            if failure is None:
                raise
            self._end(failure)
            raise failure from None

    def _write(self, message):
        self._typed(super()._write, message)

    def recv(self):
        return self._typed(super().recv)

    def close(self):
        """Send close_notify where the socket takes it at once (never waiting for the
        peer's), then close."""
        if self.sock.fileno() != -1:
            try:
                self.sock.settimeout(0)
                self.sock.unwrap()
            except (OSError, ValueError):
                pass
        self.sock.close()

    def __repr__(self):
        return f"TlsConnection(address={self.address}, peer_names={self.peer_names})"


class _Handshake:
    """One client's handshake in progress on a TlsListener: ``sock`` is the accepted socket
    until its first TLS record has come whole (a connection that says nothing, or half a
    ClientHello, costs no TLS state), then the TLS socket over it; ``answered`` once the
    listener has sent its first flight (which takes a whole, valid ClientHello). ``waiting``:
    part of its first record is there and the rest is not (it is looked at again every
    ``RECORD_RECHECK``, and polled for its end only: its bytes would wake every poll)."""

    __slots__ = ("sock", "peer", "deadline", "events", "accepted", "wrapped", "answered",
                 "waiting")

    def __init__(self, sock, peer, now, deadline):
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.events = select.POLLIN
        self.accepted = now
        self.wrapped = self.answered = self.waiting = False


#: The largest TLS record (2^14 bytes of plaintext, with room for its expansion) plus its
#: header: the most of a first record worth peeking at.
_MAX_RECORD = 5 + 2**14 + 2048


def _first_record(sock):
    """How much of the connection's first TLS record is there: ``None`` nothing yet, ``False``
    a part, ``True`` all of it (or its first byte is no TLS handshake record: the TLS state
    then refuses it with its reason); a string, why the connection ended before a whole
    record (no TLS state is made for it). A legitimate client's ClientHello comes whole, at
    once; a half one from a staller never does."""
    try:
        head = sock.recv(_MAX_RECORD, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as e:
        return f"the connection failed before its first TLS record ({e.strerror or e})"
    if len(head) == 0:
        return "the connection ended before its first TLS record"
    if head[0] != 0x16:
        return True
    if len(head) < 5:
        return False
    return len(head) >= 5 + int.from_bytes(head[3:5], "big")


def _evictees(pending, n):
    """The fds of the ``n`` handshakes that end to make room for new connections, in the
    order of this rule: of those the listener has not answered (when none is left, of all),
    the oldest of the address that holds the most. A flood from one address ends its own
    connections first; one from a legitimate client's address (a local process) ends
    connections that said nothing before the client's, which the listener answered as soon
    as its ClientHello came. (Several at once: a flood's connections come by the thousand.)"""
    held = {}
    for h in pending.values():
        key = (h.answered, h.peer[0])
        held[key] = held.get(key, 0) + 1
    ranked = sorted(pending.items(), key=lambda c: (
        c[1].answered, -held[(c[1].answered, c[1].peer[0])], c[1].accepted))
    return [fd for fd, _ in ranked[:n]]


class TlsListener(_RefusalLog):
    """A TCP listener that admits only mutually authenticated TLS clients (``tls_listen``).

    ``accept`` returns a client only after its whole handshake (within ``handshake_timeout``)
    and the check of its names or pin: nothing is written to a client before its check has
    passed (in TLS 1.3 the client's handshake ends before the server has checked the client
    certificate, so the client learns of a refusal as an alert or a closed connection on its
    first read). A refused client (a bad chain, names, pin, no certificate, a plaintext client,
    a handshake past its deadline) is closed, counted in ``refusals``, remembered in
    ``refused`` (the last ``REFUSALS_KEPT``, as TlsRefusal(address, reason, kind)) and logged
    at a bounded rate; ``accept`` goes on to the next connection.

    Handshakes run side by side, non-blocking, inside ``accept`` (no threads): at most
    ``max_handshakes`` at once (default 64), each by its deadline. A flood of clients that
    connect and stall starves no one: the listener never stops accepting, and with every slot
    taken a new connection ends a pending handshake, chosen by progress: first one the listener
    has not answered (its client has not sent a whole ClientHello, which a legitimate client
    sends at once), of those the oldest of the address that holds the most; an answered one
    only when all are. Each turn of its loop drives the handshakes that can move before it
    accepts at most ``ACCEPT_BATCH`` new connections, and a new connection whose first bytes
    are there is driven at once. A handshake in progress when ``accept`` returns or times out
    stays in progress, and goes on at the next ``accept``."""

    def __init__(self, address, config, backlog=LISTEN_BACKLOG, log=True,
                 max_handshakes=MAX_HANDSHAKES):
        host, port = _host_port(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.config, self.max_handshakes = config, max(1, int(max_handshakes))
        self.sock = socket.create_server((host, port), family=family, backlog=backlog)
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()[:2]
        self._init_log(f"TLS listener {self.address[0]}:{self.address[1]}", log)
        self._pending = {}  # fd: _Handshake
        self._recheck_at = None  # when to look again at handshakes waiting for their record

    def accept(self, timeout=None):
        """The next client whose certificate passed every check: a TlsConnection.
        TimeoutError after ``timeout`` seconds (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.sock.fileno() == -1:
                raise OSError(errno.EBADF, f"{self.label} is closed")
            now = time.monotonic()
            # In the order accepted, which is the order of their deadlines (one timeout).
            while self._pending:
                fd, h = next(iter(self._pending.items()))
                if h.deadline > now:
                    break
                self._refuse(fd, "the TLS handshake did not finish within its deadline")
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"accepting a connection on {self.label}")
            if self._recheck_at is not None and now >= self._recheck_at:
                conn = self._recheck()
                if conn is not None:
                    return conn
            poller = select.poll()
            # Always: a listener that stopped accepting at its cap would leave the next
            # client in the kernel's queue behind the stallers.
            poller.register(self.sock.fileno(), select.POLLIN)
            for fd, h in self._pending.items():
                # One waiting for the rest of its record is polled for its end only (its
                # bytes, there already, would wake every poll).
                poller.register(fd, select.POLLRDHUP if h.waiting else h.events)
            wake = [next(iter(self._pending.values())).deadline] if self._pending else []
            if deadline is not None:
                wake.append(deadline)
            if self._recheck_at is not None:
                wake.append(self._recheck_at)
            wait = -1 if not wake else max(1, int((min(wake) - now) * 1000) + 1)
            listener_ready = False
            # The handshakes that can move first, then the new connections: a flood of new
            # ones never keeps a client's ClientHello or last flight waiting.
            events = poller.poll(wait)
            if self.sock.fileno() == -1:
                raise OSError(errno.EBADF, f"{self.label} is closed")
            for fd, _ in events:
                if fd == self.sock.fileno():
                    listener_ready = True
                elif fd in self._pending and self._pending[fd].waiting:
                    # Polled for its end only: it ended inside its first record.
                    self._refuse(fd, "the connection ended inside its first TLS record")
                elif fd in self._pending:
                    conn = self._step(fd)
                    if conn is not None:
                        return conn
            if listener_ready:
                conn = self._take_new()
                if conn is not None:
                    return conn

    def _take_new(self):
        """Accept at most ``ACCEPT_BATCH`` connections the backlog holds, ending a pending
        handshake for each past ``max_handshakes`` (``_evictee``), and drive at once each
        whose first bytes are there: a connection once done and checked, else None."""
        for _ in range(ACCEPT_BATCH):
            try:
                raw, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return None
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(FD_LIMIT_PAUSE)  # the connection stays queued: try again
                    return None
                raise
            raw.settimeout(0)
            if len(self._pending) >= self.max_handshakes:
                room = len(self._pending) - self.max_handshakes + 1
                for fd in _evictees(self._pending, max(room, self.max_handshakes // 8)):
                    self._refuse(fd, "its TLS handshake was ended to make room for a newer "
                                 "connection (max_handshakes)")
            now = time.monotonic()
            self._pending[raw.fileno()] = _Handshake(
                raw, peer, now, now + self.config.handshake_timeout)
            conn = self._step(raw.fileno())
            if conn is not None:
                return conn
        return None

    def _recheck(self):
        """Look again at the handshakes waiting for the rest of their first record: drive
        those whose record is whole now; a connection once done and checked, else None."""
        self._recheck_at = None
        for fd in [fd for fd, h in self._pending.items() if h.waiting]:
            if fd not in self._pending:  # ended meanwhile
                continue
            conn = self._step(fd)
            if conn is not None:
                return conn
        return None

    def _step(self, fd):
        """Advance one handshake: its connection once done and checked, else None."""
        h = self._pending[fd]
        if not h.wrapped:
            # It gets its TLS state once its first record is whole (or it ended).
            record = _first_record(h.sock)
            if record is None:  # nothing yet: its first bytes wake the poll
                return None
            if isinstance(record, str):
                self._refuse(fd, record)
                return None
            if not record:
                h.waiting = True
                if self._recheck_at is None:
                    self._recheck_at = time.monotonic() + RECORD_RECHECK
                return None
            h.waiting = False
        what = f"TLS client {h.peer[0]}:{h.peer[1]}"
        if not h.wrapped:
            try:
                h.sock = self.config.server_context.wrap_socket(
                    h.sock, server_side=True, do_handshake_on_connect=False,
                    suppress_ragged_eofs=False)
            except (OSError, ValueError) as e:
                self._refuse(fd, f"{what}: {e}")
                return None
            h.wrapped = True
        try:
            h.sock.do_handshake()
        except ssl.SSLWantReadError:
            h.events = select.POLLIN
            h.answered = h.answered or h.sock.cipher() is not None
            return None
        except ssl.SSLWantWriteError:
            h.events = select.POLLOUT
            h.answered = h.answered or h.sock.cipher() is not None
            return None
        except (OSError, ValueError) as e:
            failure = _tls_failure(e, what) or e
            self._refuse(fd, str(failure) or type(failure).__name__,
                         getattr(failure, "kind", None))
            return None
        try:
            names, pin = self.config.check_peer(h.sock, what)
        except TlsRefused as e:
            self._refuse(fd, str(e), e.kind)
            return None
        del self._pending[fd]
        h.sock.settimeout(self.config.timeout)
        return TlsConnection(h.sock, names, pin, h.peer, self.config.timeout)

    def _refuse(self, fd, reason, kind=None):
        h = self._pending.pop(fd, None)
        if h is None:  # closed meanwhile by close() in another thread
            return
        h.sock.close()
        if not reason.startswith("TLS client"):
            reason = f"TLS client {h.peer[0]}:{h.peer[1]}: {reason}"
        self._note(h.peer, reason, kind)

    def _note(self, peer, reason, kind=None):
        self._note_refusal(TlsRefusal(peer, reason, kind), f"refused: {reason}")

    def close(self):
        """Stop listening and drop the handshakes in progress (an ``accept`` blocked in
        another thread wakes with OSError)."""
        self._log_count()
        for h in list(self._pending.values()):  # an accept in another thread may change it
            h.sock.close()
        self._pending.clear()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def tls_listen(address, config, backlog=LISTEN_BACKLOG, log=True, max_handshakes=None):
    """Listen for mutual-TLS clients on ``address`` (``(host, port)`` or ``HOST:PORT``; port 0
    picks one: see ``.address``) with ``config`` (a TlsConfig): a TlsListener (handshakes in
    progress at once: ``max_handshakes``, default ``MAX_HANDSHAKES``)."""
    return TlsListener(address, config, backlog, log,
                       MAX_HANDSHAKES if max_handshakes is None else max_handshakes)


def tls_connect(address, config, server_name=None, timeout=None):
    """Connect to a mutual-TLS listener at ``address``, present ``config``'s certificate,
    verify the server's chain and its names or pin, and return a TlsConnection; nothing is
    sent or read before that but the handshake. The SNI is ``server_name`` or the first
    allowed name. ``timeout`` bounds the TCP connect and the whole handshake (default
    ``config.handshake_timeout``); a connect attempt without an answer is made again, each
    attempt waiting ``CONNECT_ATTEMPT`` longer (a flooded listener's kernel drops SYNs). TlsRefused, TlsError, PeerClosed or TimeoutError. (In TLS
    1.3 a server that refuses this client's certificate says so after this returns: as a
    TlsRefused, or PeerClosed, on the first receive.)"""
    timeout = config.handshake_timeout if timeout is None else timeout
    deadline = time.monotonic() + timeout
    host, port = _host_port(address)
    what = f"TLS server {host}:{port}"
    raw, attempt = None, 0.0
    while raw is None:
        # An attempt that gets no answer is made again, each waiting CONNECT_ATTEMPT longer
        # (the kernel would wait 1 s, then 2 s... before its next SYN): a listener whose
        # kernel queue a flood keeps full drops SYNs, and one that comes back soon finds room.
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: connecting took longer than {timeout} s")
        attempt += CONNECT_ATTEMPT
        try:
            raw = socket.create_connection((host, port), timeout=min(attempt, left))
        except socket.timeout:
            continue
    sock = None
    try:
        sni = server_name or (config.allow_names[0] if config.allow_names else None)
        sock = config.client_context.wrap_socket(raw, server_side=False, server_hostname=sni,
                                                 do_handshake_on_connect=False,
                                                 suppress_ragged_eofs=False)
        _handshake(sock, deadline, what)
        names, pin = config.check_peer(sock, what)
        sock.settimeout(config.timeout)
        return TlsConnection(sock, names, pin, (host, port), config.timeout)
    except BaseException:
        (sock or raw).close()
        raise
