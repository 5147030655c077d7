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
from .constants import DEFAULT_TIMEOUT, FD_LIMIT_PAUSE, MAX_HANDSHAKES
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
    """One client's handshake in progress on a TlsListener."""

    __slots__ = ("sock", "peer", "deadline", "events")

    def __init__(self, sock, peer, deadline):
        self.sock, self.peer, self.deadline = sock, peer, deadline
        self.events = select.POLLIN


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
    ``max_handshakes`` at once (default 64; further connections wait in the backlog), so
    clients that connect and say nothing delay no one until they fill every slot, and then by
    at most ``handshake_timeout``. A handshake in progress when ``accept`` returns or times out
    stays in progress, and goes on at the next ``accept``."""

    def __init__(self, address, config, backlog=128, log=True, max_handshakes=MAX_HANDSHAKES):
        host, port = _host_port(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.config, self.max_handshakes = config, max(1, int(max_handshakes))
        self.sock = socket.create_server((host, port), family=family, backlog=backlog)
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()[:2]
        self._init_log(f"TLS listener {self.address[0]}:{self.address[1]}", log)
        self._pending = {}  # fd: _Handshake

    def accept(self, timeout=None):
        """The next client whose certificate passed every check: a TlsConnection.
        TimeoutError after ``timeout`` seconds (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.sock.fileno() == -1:
                raise OSError(errno.EBADF, f"{self.label} is closed")
            now = time.monotonic()
            for fd, h in list(self._pending.items()):
                if h.deadline <= now:
                    self._refuse(fd, "the TLS handshake did not finish within its deadline")
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"accepting a connection on {self.label}")
            poller = select.poll()
            if len(self._pending) < self.max_handshakes:
                poller.register(self.sock.fileno(), select.POLLIN)
            for fd, h in self._pending.items():
                poller.register(fd, h.events)
            wake = [h.deadline for h in self._pending.values()]
            if deadline is not None:
                wake.append(deadline)
            wait = -1 if not wake else max(1, int((min(wake) - now) * 1000) + 1)
            for fd, _ in poller.poll(wait):
                if fd == self.sock.fileno():
                    self._take_new()
                elif fd in self._pending:
                    conn = self._step(fd)
                    if conn is not None:
                        return conn

    def _take_new(self):
        """Accept what the backlog holds, up to the free handshake slots, and start each
        handshake."""
        while len(self._pending) < self.max_handshakes:
            try:
                raw, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(FD_LIMIT_PAUSE)  # the connection stays queued: try again
                    return
                raise
            raw.settimeout(0)
            try:
                sock = self.config.server_context.wrap_socket(
                    raw, server_side=True, do_handshake_on_connect=False,
                    suppress_ragged_eofs=False)
            except (OSError, ValueError) as e:
                raw.close()
                self._note(peer, f"TLS client {peer[0]}:{peer[1]}: {e}")
                continue
            self._pending[sock.fileno()] = _Handshake(
                sock, peer, time.monotonic() + self.config.handshake_timeout)

    def _step(self, fd):
        """Advance one handshake: its connection once done and checked, else None."""
        h = self._pending[fd]
        what = f"TLS client {h.peer[0]}:{h.peer[1]}"
        try:
            h.sock.do_handshake()
        except ssl.SSLWantReadError:
            h.events = select.POLLIN
            return None
        except ssl.SSLWantWriteError:
            h.events = select.POLLOUT
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
        h = self._pending.pop(fd)
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
        for h in self._pending.values():
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


def tls_listen(address, config, backlog=128, log=True, max_handshakes=None):
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
    ``config.handshake_timeout``). TlsRefused, TlsError, PeerClosed or TimeoutError. (In TLS
    1.3 a server that refuses this client's certificate says so after this returns: as a
    TlsRefused, or PeerClosed, on the first receive.)"""
    timeout = config.handshake_timeout if timeout is None else timeout
    deadline = time.monotonic() + timeout
    host, port = _host_port(address)
    what = f"TLS server {host}:{port}"
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        raise TimeoutError(f"{what}: connecting took longer than {timeout} s") from None
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
