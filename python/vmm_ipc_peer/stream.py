"""Byte streams (version 2): DATA and CUDA_FABRIC over a connected stream socket or a pipe,
with one deadline per message."""

import socket
import struct
import time

from .constants import (
    DEFAULT_TIMEOUT, FRAME_INLINE, HEADER, KIND_DATA, KIND_NAMES, MAGIC, MAX_BODY,
    STREAM_KINDS, VERSIONS,
)
from .decoding import _Receives, _decode
from .descriptors import FabricDescriptor, HostDescriptor, VmmDescriptor
from .errors import PeerClosed, ProtocolError
from .framing import _parse_header, encode


def write_message(stream, message, timeout=DEFAULT_TIMEOUT):
    """Write one message on a byte stream: a FabricDescriptor, or bytes as a DATA message, with
    the frame byte first (the same bytes as on an endpoint). ``stream`` is a connected stream
    socket (TCP, a Unix SOCK_STREAM; the whole write is bounded by ``timeout`` seconds, None for
    no limit) or a binary file (a pipe's write end; no deadline). A descriptor that carries
    fds (VmmDescriptor, HostDescriptor) cannot cross a stream: TypeError.

    A fabric handle is a bearer token: write one only on a stream that reaches a peer you would
    give the memory to (TLS, a VPN, an SSH tunnel, a socket only that process can reach)."""
    if isinstance(message, FabricDescriptor):
        data, _ = message.encode()
    elif isinstance(message, (VmmDescriptor, HostDescriptor)):
        raise TypeError(f"a {type(message).__name__} carries fds: it crosses a Unix endpoint, "
                        f"not a byte stream")
    elif isinstance(message, (bytes, bytearray, memoryview)):
        data = encode(KIND_DATA, payload=bytes(message))
    else:
        raise TypeError(f"a stream carries a FabricDescriptor or DATA bytes, not "
                        f"{type(message).__name__}")
    frame = FRAME_INLINE + data
    if hasattr(stream, "sendall"):
        # One deadline for the whole message (a TLS socket's sendall would restart the
        # timeout at each record), however slowly the other end reads.
        previous = stream.gettimeout()
        deadline = None if timeout is None else time.monotonic() + timeout
        view, sent = memoryview(frame), 0
        try:
            while sent < len(frame):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise socket.timeout
                stream.settimeout(left)
                sent += stream.send(view[sent:])
        except socket.timeout:
            raise TimeoutError(f"writing a {len(frame)}-byte message on the stream took longer "
                               f"than {timeout} s") from None
        finally:
            stream.settimeout(previous)
    else:
        stream.write(frame)
        if hasattr(stream, "flush"):
            stream.flush()


def _read_upto(stream, n, deadline):
    """Up to ``n`` bytes: fewer only where the stream ended. TimeoutError past ``deadline``."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if hasattr(stream, "recv_into"):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"reading a message from the stream: {got} of {n} bytes "
                                   f"arrived within the deadline")
            stream.settimeout(left)
            try:
                k = stream.recv_into(view[got:])
            except socket.timeout:
                raise TimeoutError(f"reading a message from the stream: {got} of {n} bytes "
                                   f"arrived within the deadline") from None
        elif hasattr(stream, "readinto"):
            k = stream.readinto(view[got:])
        else:
            chunk = stream.read(n - got)
            k = len(chunk)
            view[got:got + k] = chunk
        if not k:
            break
        got += k
    return bytes(buf[:got])


def read_message(stream, timeout=DEFAULT_TIMEOUT):
    """Read one message from a byte stream (a connected stream socket, or a binary file such as
    a pipe's read end): Data or FabricDescriptor. ``timeout`` bounds the whole read on a socket
    (seconds; None for no limit; a file has no deadline).

    The reader checks the frame byte, the magic and the version, then the rest of the 64-byte
    header (docs/protocol.md's rules 1 and 2 and the counts of rule 3) and that the kind is one
    a stream carries (DATA, CUDA_FABRIC: never fd-carrying kinds or the handshake) before it
    reads or allocates anything more; then it reads exactly the ``8n + p`` bytes the header
    announced (at most ``8 * 253 + 16384``) and checks the message as a packet is checked.
    PeerClosed when the stream ends before a message starts; ProtocolError for anything else,
    after which the stream is unusable (it cannot know where the next message starts): close
    it. StreamConnection does that for you."""
    previous = stream.gettimeout() if hasattr(stream, "gettimeout") else None
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        frame = _read_upto(stream, 1, deadline)
        if not frame:
            raise PeerClosed("the stream ended (between messages)")
        if frame != FRAME_INLINE:
            raise ProtocolError(f"frame byte {frame[0]}: a peer message starts with 0")
        # Magic and version first: a peer that speaks something else is refused without
        # waiting for a header it may never send.
        head = _read_upto(stream, 6, deadline)
        if len(head) < 6 and head[:4] == MAGIC[:len(head)]:
            raise ProtocolError(f"the stream ended inside a message's header ({len(head)} of "
                                f"{HEADER.size} bytes)")
        if head[:4] != MAGIC:
            _parse_header(head)
        (version,) = struct.unpack_from("<H", head, 4)
        if version not in VERSIONS:
            _parse_header(head)
        head += _read_upto(stream, HEADER.size - 6, deadline)
        if len(head) < HEADER.size:
            raise ProtocolError(f"the stream ended inside a message's header ({len(head)} of "
                                f"{HEADER.size} bytes)")
        fields = _parse_header(head)
        kind, count, payload_len = fields[2], fields[6], fields[7]
        if kind not in STREAM_KINDS:
            raise ProtocolError(f"{KIND_NAMES[kind]} on a byte stream: a stream carries only "
                                f"DATA and CUDA_FABRIC (fds and the handshake need a Unix "
                                f"endpoint)")
        body_len = 8 * count + payload_len
        assert body_len <= MAX_BODY  # the header's counts were checked
        body = _read_upto(stream, body_len, deadline) if body_len else b""
        if len(body) < body_len:
            raise ProtocolError(f"the stream ended inside a {KIND_NAMES[kind]} message "
                                f"({len(body)} of the {body_len} bytes after its header)")
        return _decode(head + body, [])
    finally:
        if hasattr(stream, "settimeout"):
            stream.settimeout(previous)


class StreamConnection(_Receives):
    """DATA and CUDA_FABRIC messages over a connected stream socket (TCP, a Unix SOCK_STREAM).
    A stream has no credentials, and TCP (loopback included) lets whoever connects first have
    the bytes: across a network, or wherever another user can connect, use ``tls_listen`` /
    ``tls_connect`` (mutual TLS). A plain socket is the caller's explicit choice for a channel
    it has authenticated itself (a socketpair of its own, an SSH tunnel): it says so with
    ``caller_authenticated=True``, and without it the constructor refuses (ValueError).

    Every send and receive is bounded by ``timeout`` seconds (None: no limit), one deadline
    for the whole message. A receive that fails for any reason (a refused message, a timeout,
    the other end closing), or a send that fails, ends the stream: the socket is shut down and
    every later send or receive raises ProtocolError, since after a bad or partial message
    nobody can know where the next one starts."""

    def __init__(self, sock, timeout=DEFAULT_TIMEOUT, *, caller_authenticated=False):
        if not caller_authenticated:
            raise ValueError("a plain stream authenticates no one: use tls_connect/tls_listen, "
                             "or pass caller_authenticated=True for a channel you have "
                             "authenticated yourself")
        self.sock, self.timeout = sock, timeout
        self.ended = None  # why the stream ended, once it has

    def send_descriptor(self, descriptor):
        self._write(descriptor)

    def send_data(self, data):
        self._write(bytes(data))

    def _write(self, message):
        if self.ended is not None:
            raise ProtocolError(f"this stream has ended ({self.ended}): open a new one")
        try:
            write_message(self.sock, message, self.timeout)
        except OSError as e:  # timeouts included: part of a message may have gone
            self._end(e)
            raise

    def _end(self, e):
        self.ended = f"{type(e).__name__}: {e}"
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def recv(self):
        """The next message: Data or FabricDescriptor."""
        if self.ended is not None:
            raise ProtocolError(f"this stream has ended ({self.ended}): open a new one")
        try:
            return read_message(self.sock, self.timeout)
        except BaseException as e:
            self._end(e)
            raise

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
