"""vmm-ipc peer protocol (versions 1 and 2): a reference peer in standard-library Python (3.9+,
Linux).

It speaks the protocol of ``docs/protocol.md`` on a named endpoint (a Unix ``SOCK_SEQPACKET``
socket by path, or by abstract name ``@name``): the same endpoints Rust's
``vmm_core::wire::endpoint`` listens and connects on. One message is a 64-byte little-endian
header, the chunk sizes, a payload, and one fd per chunk in ``SCM_RIGHTS``. Each message carries
the version of its kind: the five kinds of version 1 go out byte for byte as version 1, so this
peer speaks version 1 to a version 1 peer as long as it sends no fabric descriptor.

Version 2 adds ``CUDA_FABRIC`` (``FabricDescriptor``: one 64-byte fabric handle per chunk, no
fds) and byte streams: ``write_message``/``read_message`` (or ``StreamConnection``) carry DATA
and CUDA_FABRIC messages over a connected stream socket (TCP), with the same bytes.

    with peer.connect("@weights") as conn:
        desc = conn.recv_descriptor()              # may be a FabricDescriptor
    sock = socket.create_connection(("10.0.0.2", 7000))   # authenticated by you (VPN...)
    peer.write_message(sock, fabric_descriptor)
    reply = peer.read_message(sock)                # Data or FabricDescriptor

A plain stream, loopback included, authenticates no one. Mutual TLS (TLS 1.3, the standard
library's ``ssl``) carries the same framing with both ends authenticated, by a CA and a
certificate name (DNS subjectAltName) or a pin of the peer's key:

    config = peer.TlsConfig("exporter.pem", "exporter.key", "ca.pem",
                            allow_names=["importer.example"], crl="ca.crl")
    with peer.tls_listen(("0.0.0.0", 7000), config) as listener:
        with listener.accept(timeout=60) as conn:  # only after the client's checks passed
            conn.send_descriptor(fabric_descriptor)
            conn.recv_data()
    config = peer.TlsConfig("importer.pem", "importer.key", "ca.pem",
                            allow_names=["exporter.example"])
    with peer.tls_connect(("10.0.0.2", 7000), config) as conn:
        desc = conn.recv_descriptor()

``TlsListener.accept`` writes nothing to a client before the client's chain and name (or pin)
have passed; refused clients (no certificate, another CA, expired or not yet valid, without
the clientAuth usage, revoked, another name or key, plaintext, a handshake past
``handshake_timeout``) are closed, counted and logged, and ``accept`` goes on. Failures are
typed: TlsRefused (a PeerRefused), TlsError (a ProtocolError: a record that did not
authenticate), PeerClosed (a cut stream), TimeoutError (every handshake and message has one
deadline for the whole of it).

A fabric handle is a bearer token: whoever holds its 64 bytes and an IMEX channel of the same
domain can map the memory. Send one only to a peer you would give the memory to; this module's
``repr`` and errors never show handle bytes (only how many there are). A handle does not keep
the memory alive: the exporter keeps its allocation until the importers say they have imported.

    import vmm_ipc_peer as peer

    with peer.connect("@weights") as conn:          # checks the listener's uid (SO_PEERCRED)
        conn.send_data(b"get weights")
        desc = conn.recv_descriptor()              # VmmDescriptor or HostDescriptor; owns fds

Feeding a received ``VmmDescriptor`` to CUDA:

- cuda.core (1.3+): ``VirtualMemoryIPCBufferDescriptor.from_fds(desc.fds, desc.chunk_sizes,
  size=desc.size)`` duplicates the fds (close ``desc`` afterwards), then
  ``Buffer.from_ipc_descriptor(resource, descriptor)`` imports into a ``VirtualMemoryResource``
  of the exporter's device (find it by ``desc.device_uuid``).
- cuda.bindings: for each fd, ``err, handle = driver.cuMemImportFromShareableHandle(fd,
  driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)`` (the fd is
  passed as its value; the driver does not take it over, so close it afterwards); then one
  ``cuMemAddressReserve(sum(chunk_sizes), ...)``, a ``cuMemMap`` per chunk back to back, and
  ``cuMemSetAccess``. ``python/vmm_ipc_cuda.py`` does exactly that.

Sending one: ``VmmDescriptor(fds, chunk_sizes, size, device_uuid=...)`` from the fds of
``cuMemExportToShareableHandle`` (one per chunk, in address order) or from a cuda.core 1.3
descriptor (``VmmDescriptor.from_cuda_core(d)``), then ``conn.send_descriptor(desc)``.

Security: ``connect`` checks the listener's kernel credentials (``SO_PEERCRED``) against the
uids and gids it expects (default: this process's uid) before it sends or reads anything, and
``Listener.accept`` admits only allowed peers (default: this process's uid); nothing a peer
says about itself is trusted. The overflow uid (``/proc/sys/kernel/overflowuid``: how a uid
with no mapping in this user namespace reads; read once, at import) is admitted only when named
in ``expect_uids`` or ``allow_uids``, never through the default. Every message is checked
against the documented limits and the fd count the kernel reports.

Hostile fds: every fd of a refused message or a refused client is disposed of without holding
up the listener: a socket is defused and closed at once (``SO_LINGER`` 0: a TCP close resets
instead of waiting for a reader that never comes; a Unix socket is first drained, non-blocking,
of the fds queued in it, at most ``_DEFUSE_DEPTH`` deep and ``_DEFUSE_BUDGET`` reads and fds,
taking a message only when all its fds fit in the fds this process has left, since the kernel
closes those it cannot install in the receiving thread), and only other files (and Unix
sockets whose drain stopped at a bound) go to background closer threads (at most 8), since
closing one (a FUSE file whose server never answers FLUSH) may block: such files can still jam
those threads, and then wait open in their queue (the residual). An admitted peer's message
that arrives when this process is at its fd limit has the fds that did not fit closed by the
kernel on the receiving thread (the other residual). A refused client is drained before it is closed
(so it reads the reason, and so no fd it queued is released on the listener's thread),
refusals are logged at most ``LOG_BURST`` lines per ``LOG_INTERVAL`` seconds, and the listener
remembers the last ``REFUSALS_KEPT``.

Availability: ``Listener.accept`` at the fd limit (``EMFILE``, ``ENFILE``) waits
``FD_LIMIT_PAUSE`` (0.05 s) and tries again, within its timeout, instead of failing. Admitted
connections are counted while open: at most ``MAX_PER_UID`` (16) per uid and
``MAX_CONNECTIONS`` (64) in all, a full listener giving the longest-idle connection of the uid
that holds most to a uid that holds fewer (max-min fair), and one idle (no message either way)
for ``IDLE_TIMEOUT`` (60 s) is shut down by the next ``accept``; each is a Listener argument.
"""

import array
import collections
import errno
import fcntl
import hashlib
import mmap
import os
import queue
import resource
import select
import socket
import stat
import struct
import sys
import threading
import time
import weakref
from collections import namedtuple

try:
    import ssl
except ImportError:  # a Python built without OpenSSL: everything but TLS works
    ssl = None

__all__ = [
    "VERSION", "VERSIONS", "MAX_CHUNKS", "MAX_DATA", "FABRIC_HANDLE_LEN", "ProtocolError",
    "PeerRefused", "PeerClosed", "Credentials", "HostDescriptor", "VmmDescriptor",
    "FabricDescriptor", "Connection", "Listener", "connect", "StreamConnection", "write_message",
    "read_message", "encode", "decode", "sealed_memfd", "pattern", "TlsConfig", "TlsRefused",
    "TlsError", "TlsRefusal", "TlsListener", "TlsConnection", "tls_listen", "tls_connect",
    "spki_of", "spki_sha256_of", "MAX_HANDSHAKES", "MAX_CONNECTIONS", "MAX_PER_UID", "IDLE_TIMEOUT",
]

MAGIC = b"VMMI"
VERSIONS = (1, 2)  # the versions this peer speaks
VERSION = max(VERSIONS)
#: magic, version, kind, header length, flags, handle type, chunk count, payload length, size,
#: device UUID, device ordinal, location type, location id, reserved.
HEADER = struct.Struct("<4sHHHHIIIQ16sIIiI")
assert HEADER.size == 64
KIND_HELLO, KIND_REFUSED, KIND_DATA, KIND_CUDA_VMM, KIND_HOST_MEMFD, KIND_CUDA_FABRIC = range(1, 7)
KIND_NAMES = {1: "HELLO", 2: "REFUSED", 3: "DATA", 4: "CUDA_VMM", 5: "HOST_MEMFD",
              6: "CUDA_FABRIC"}
#: The version that defines each kind: a message of the kind carries exactly it.
KIND_VERSIONS = {1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 2}
#: The kinds a byte stream carries (no fds, no handshake).
STREAM_KINDS = (KIND_DATA, KIND_CUDA_FABRIC)
FLAG_DEVICE = 0x0001
HANDLE_TYPE_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
HANDLE_TYPE_FABRIC = 8  # CU_MEM_HANDLE_TYPE_FABRIC
FABRIC_HANDLE_LEN = 64  # sizeof(CUmemFabricHandle)
LOCATION_DEVICE, LOCATION_HOST_NUMA = 0, 1
MAX_CHUNKS = 253  # the kernel's SCM_MAX_FD
MAX_DATA = 16 * 1024
MAX_MESSAGE = HEADER.size + 8 * MAX_CHUNKS + MAX_DATA
MAX_BODY = 8 * MAX_CHUNKS + MAX_DATA  # what a stream reader reads after a header, at most
FRAME_INLINE = b"\x00"  # every packet's first byte
DEFAULT_TIMEOUT = 10.0
# The most a host import maps unless the caller asks for more (vmm-core's default too): a
# sender's size is its own choice, and a sparse memfd costs it nothing.
DEFAULT_MAX_IMPORT_SIZE = 64 << 30
TMPFS_MAGIC = 0x01021994
_USIZE_MAX = 2**64 - 1
REFUSALS_KEPT = 64  # how many refused peers a Listener remembers (the most recent)
LOG_BURST, LOG_INTERVAL = 10, 10.0  # refusal log lines per interval (seconds), then a count
_DRAIN_MAX = 1024  # packets and fds drained from a refused client before its connection closes
# A Listener's admission (see Listener): open admitted connections in all and per uid, and
# how long one may stay idle (seconds).
MAX_CONNECTIONS, MAX_PER_UID, IDLE_TIMEOUT = 64, 16, 60.0
FD_LIMIT_PAUSE = 0.05  # seconds accept waits at the fd limit before it tries again
MAX_HANDSHAKES = 64  # TLS handshakes a TlsListener runs at once


class ProtocolError(Exception):
    """A message broke the protocol (its fds, if any, are already closed)."""


class PeerRefused(Exception):
    """The other side is not trusted: a listener that is not whom ``connect`` expects (a
    squatter), or a listener that refused this process."""


class PeerClosed(ConnectionError):
    """The other end closed the connection."""


Credentials = namedtuple("Credentials", "pid uid gid")


def peer_credentials(sock):
    """The kernel's credentials for the peer of a connected Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    return Credentials(*struct.unpack("iII", raw))


def _read_overflow_ids():
    try:
        with open("/proc/sys/kernel/overflowuid") as u, open("/proc/sys/kernel/overflowgid") as g:
            return int(u.read()), int(g.read())
    except (OSError, ValueError):
        return None


# Read once, at import: a listener near its fd limit cannot open them again (and then had to
# treat every uid as possibly the overflow uid, refusing its own).
_OVERFLOW_IDS = _read_overflow_ids()


def overflow_ids():
    """The kernel's overflow uid and gid (``/proc/sys/kernel/overflowuid``, ``overflowgid``):
    what an id with no mapping in this user namespace reads as. Read once (at import; tried
    again only while it could not be read) and cached. None when they cannot be read (then
    every uid is treated as possibly the overflow uid: fail closed)."""
    global _OVERFLOW_IDS
    if _OVERFLOW_IDS is None:
        _OVERFLOW_IDS = _read_overflow_ids()
    return _OVERFLOW_IDS


def _maybe_overflow_uid(uid):
    ids = overflow_ids()
    return ids is None or ids[0] == uid


def _overflow_note(creds):
    ids = overflow_ids()
    if ids is None:
        return (" (the overflow uid cannot be read from /proc/sys/kernel/overflowuid, so a uid is "
                "admitted only when named)")
    if creds.uid == ids[0]:
        return (f" (uid {ids[0]} is the overflow uid: the process's uid has no mapping in this user "
                f"namespace, and it stands for every such user; admitted only when named)")
    return ""


def _admits(uids, gids, creds, implicit=None):
    """Whether ``creds`` is admitted by ``uids`` or ``gids``. ``implicit`` is the uid a default
    put in (this process's own): it never admits the overflow uid."""
    by_uid = creds.uid in uids and (creds.uid != implicit or not _maybe_overflow_uid(creds.uid))
    return by_uid or creds.gid in gids


class _Closer:
    """Background threads that close the fds a peer sent that nobody wants and that
    ``_close_all`` could not defuse: files that are not sockets (closing the last reference to
    a FUSE file runs code its sender chose, FLUSH, and may block past every timeout), and Unix
    sockets too deeply nested or too full to drain within the budget. Sockets are never queued
    here otherwise: they are defused and closed at once. One thread normally; when each has
    been inside one close for more than ``STUCK`` seconds, another (at most ``MAX``), so one
    hostile fd does not keep later refused fds open.

    The residual: a sender that can make closes block forever (a FUSE file whose server never
    answers FLUSH) can still jam all ``MAX`` threads, after which such fds queue here, open,
    until their closes return."""

    STUCK, MAX = 0.1, 8
    _lock = threading.Lock()
    _closers = []  # [queue, busy_since or None] per thread

    @classmethod
    def close(cls, fds):
        fds = list(fds)
        if not fds:
            return
        with cls._lock:
            now = time.monotonic()
            free = [c for c in cls._closers if c[1] is None or now - c[1] <= cls.STUCK]
            if free:
                closer = free[0]
            elif len(cls._closers) < cls.MAX:
                closer = [queue.SimpleQueue(), None]
                try:
                    threading.Thread(target=cls._run, args=(closer,), name="vmm-ipc-closer",
                                     daemon=True).start()
                except RuntimeError:
                    if not cls._closers:
                        for fd in fds:
                            _close_quietly(fd)
                        return
                    closer = cls._closers[-1]
                else:
                    cls._closers.append(closer)
            else:
                closer = cls._closers[-1]
            closer[0].put(fds)

    @staticmethod
    def _run(closer):
        while True:
            for fd in closer[0].get():
                closer[1] = time.monotonic()
                _close_quietly(fd)
                closer[1] = None


def _close_quietly(fd):
    try:
        os.close(fd)
    except OSError:
        pass


def pattern(seed, length):
    """The test pattern both languages use: byte i is (seed + i % 251) mod 256."""
    period = bytes((seed + i) & 0xFF for i in range(251))
    return (period * (length // 251 + 1))[:length]


_LINGER_ABORT = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close resets, never waits
SO_TIMESTAMP = getattr(socket, "SO_TIMESTAMP", 29)  # asm-generic's SO_TIMESTAMP_OLD
SO_PEEK_OFF = getattr(socket, "SO_PEEK_OFF", 42)
_DEFUSE_DEPTH = 4  # Unix sockets inside Unix sockets drained, at most this deep
_DEFUSE_BUDGET = 1024  # reads and fds one disposal spends draining Unix sockets, at most
_DRAIN_RESERVE = 8  # fds a drain leaves free besides the room of the message it takes


def _close_all(fds):
    """Dispose of fds a peer sent that are refused or unwanted, without letting any of them
    hold up this thread or the listener: every socket is defused and closed at once (SO_LINGER
    on with 0 s makes a TCP close abortive and non-blocking; a Unix socket is first drained,
    non-blocking, of the fds queued in it, which are disposed of the same way, at most
    ``_DEFUSE_DEPTH`` deep and ``_DEFUSE_BUDGET`` reads and fds in all); the rest (files that
    are not sockets, Unix sockets left undrained) go to the background closer."""
    rest, budget = [], [_DEFUSE_BUDGET]
    for fd in fds:
        _dispose(fd, 0, budget, rest)
    _Closer.close(rest)


def _dispose(fd, depth, budget, rest, copy=False):
    """Defuse and close ``fd`` if it is a socket, else add it to ``rest``. A ``copy`` (of a
    reference still queued elsewhere, as a peek installs) is defused as far as it goes and
    closed here whatever it is: its close is never the last."""
    try:
        sock = socket.socket(fileno=fd)  # getsockopt only: touches no file of the sender's
    except OSError:
        if copy:
            _close_quietly(fd)
        else:
            rest.append(fd)  # not a socket
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ABORT)
        defused = True
    except OSError:
        defused = False
    if sock.family == socket.AF_UNIX:
        defused = _drain_unix(sock, depth, budget, rest)
    if defused or copy:
        sock.close()
    else:
        rest.append(sock.detach())


def _drain_unix(sock, depth, budget, rest):
    """Take every fd queued in the Unix socket ``sock`` (connections waiting on a listening
    one, messages of a connected or datagram one) and dispose of them at ``depth + 1``, so
    that closing ``sock`` releases no hostile file on this thread. True when it is known to be
    empty; False when the depth or the budget ran out first (close it on the closer).

    After ``SHUT_RD`` an empty queue reads as end of file, as does an empty packet; with
    ``SO_TIMESTAMP`` every packet carries a timestamp and the end does not, which tells them
    apart. A message is taken only when all its fds fit in the room this process has left
    (less ``_DRAIN_RESERVE``), as a peek first tells."""
    if depth >= _DEFUSE_DEPTH:
        return False
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        listening = 0
    if listening:
        try:
            sock.setblocking(False)
        except OSError:
            return False
        while budget[0] > 0:
            budget[0] -= 1
            try:
                fd, _ = sock._accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            _dispose(fd, depth + 1, budget, rest)
        return False
    try:
        sock.shutdown(socket.SHUT_RD)  # nothing more can be queued
    except OSError:
        pass
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMP, 1)
        stamped = True
    except OSError:
        stamped = False
    try:  # a peek offset its sender set would make the peek below see another message
        sock.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, -1)
    except OSError:
        pass
    stream = sock.type == socket.SOCK_STREAM
    flags = socket.MSG_DONTWAIT | getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    while budget[0] > 0:
        budget[0] -= 1
        # Fds the kernel cannot install in a receive it drops in the receiving thread: the
        # very close this avoids. So first peek (a peek installs copies, and drops only
        # copies) with the room there is; take the message only when all its fds fit, else
        # defuse what the peek showed and leave the socket to the closer.
        room = min(_fd_room() - _DRAIN_RESERVE, MAX_CHUNKS)
        if room < 1:
            return False
        space = socket.CMSG_SPACE(room * 4) + socket.CMSG_SPACE(16)
        try:
            msg, ancdata, got, _ = sock.recvmsg(65536, space, flags | socket.MSG_PEEK)
            fds, stamp = _cmsg_fds(ancdata)
            if got & socket.MSG_CTRUNC:
                for fd in fds:
                    budget[0] -= 1
                    _dispose(fd, depth + 1, budget, rest, copy=True)
                return False
            for fd in fds:
                os.close(fd)  # a copy: the queued reference stays
            peeked, fds = bool(msg or fds or stamp), []
            if peeked:
                msg, ancdata, got, _ = sock.recvmsg(65536, space, flags)
                fds, stamp = _cmsg_fds(ancdata)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as e:
            return e.errno in (errno.ENOTCONN, errno.EINVAL)
        for fd in fds:
            budget[0] -= 1
            _dispose(fd, depth + 1, budget, rest)
        if got & socket.MSG_CTRUNC:
            return False
        if not msg and not fds and (stream or (stamped and not stamp)):
            return True  # the end: nothing is queued
    return False


def _cmsg_fds(ancdata):
    """The fds of a receive's SCM_RIGHTS, and whether it carried a timestamp."""
    fds, stamp = array.array("i"), False
    for level, kind, cmsg in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cmsg[:len(cmsg) - len(cmsg) % fds.itemsize])
        elif level == socket.SOL_SOCKET and kind == SO_TIMESTAMP:
            stamp = True
    return list(fds), stamp


def _fd_room():
    """How many more fds this process may open, about (0 when it cannot tell: listing its
    fds takes one)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft - used


def _filesystem_type(fd):
    """``f_type`` of fstatfs(2) for ``fd`` (None if it cannot be read): the standard library
    has no fstatfs, so it is called through ctypes on the C library already loaded."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)  # larger than struct statfs on every Linux ABI
    if libc.fstatfs(ctypes.c_int(fd), buf) != 0:
        return None
    # f_type is the first field, a C long (__fsword_t).
    return ctypes.c_long.from_buffer(buf).value


class HostDescriptor:
    """A host (memfd) buffer's descriptor: one fd (none for an empty buffer) and the size. It
    owns the fd: ``close()`` (or ``with``) closes it."""

    def __init__(self, fd, size):
        self.fd, self.size = fd, size

    def encode(self):
        chunks = [] if self.fd is None else [self.size]
        data = encode(KIND_HOST_MEMFD, size=self.size, chunk_sizes=chunks)
        return data, [] if self.fd is None else [self.fd]

    def map(self, max_size=DEFAULT_MAX_IMPORT_SIZE):
        """mmap the memfd shared, read-write, after the checks import makes: ``size`` at most
        ``max_size``, a memfd on tmpfs (hugetlbfs mappings fail on unaligned unmaps and fault
        on holes), sealed against shrinking and growing, at least ``size`` bytes. None for an
        empty buffer."""
        if self.fd is None:
            return None
        if self.size > max_size:
            raise ProtocolError(
                f"host descriptor says {self.size} bytes, more than this importer maps "
                f"({max_size}; pass a larger max_size to map() to accept it)")
        fs_type = _filesystem_type(self.fd)
        if fs_type != TMPFS_MAGIC:
            raise ProtocolError(
                f"host descriptor's fd is not on tmpfs (filesystem type {fs_type:#x})")
        try:
            seals = fcntl.fcntl(self.fd, fcntl.F_GET_SEALS)
        except OSError as e:
            raise ProtocolError(f"host descriptor's fd is not a memfd ({e})") from None
        needed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        if seals & needed != needed:
            raise ProtocolError("host descriptor's memfd is not sealed against resizing")
        actual = os.fstat(self.fd).st_size
        if actual < self.size:
            raise ProtocolError(f"host descriptor says {self.size} bytes, its memfd holds {actual}")
        return mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"HostDescriptor(fd={self.fd}, size={self.size})"


class VmmDescriptor:
    """A CUDA VMM buffer's descriptor: one exported POSIX fd per chunk (address order), the
    chunk sizes, the buffer's size (at most their sum), and where the memory lives. It owns the
    fds: ``close()`` (or ``with``) closes them."""

    def __init__(self, fds, chunk_sizes, size=None, handle_type=HANDLE_TYPE_POSIX_FD,
                 device_uuid=None, device_ordinal=0, location=("device", 0)):
        self.fds = list(fds)
        self.chunk_sizes = [int(s) for s in chunk_sizes]
        self.size = sum(self.chunk_sizes) if size is None else int(size)
        self.handle_type = handle_type
        self.device_uuid = None if device_uuid is None else bytes(device_uuid)
        self.device_ordinal = device_ordinal
        self.location = location

    @classmethod
    def from_cuda_core(cls, descriptor, device_uuid=None, device_ordinal=0):
        """From a cuda.core (1.3+) ``VirtualMemoryIPCBufferDescriptor``: duplicates of its fds
        (the cuda.core descriptor keeps its own)."""
        fds = [os.dup(fd) for fd in descriptor.fds]
        return cls(fds, descriptor.sizes, descriptor.size, device_uuid=device_uuid,
                   device_ordinal=device_ordinal)

    def encode(self):
        kind, node = self.location
        location = (LOCATION_DEVICE, 0) if kind == "device" else (LOCATION_HOST_NUMA, node)
        data = encode(KIND_CUDA_VMM, handle_type=self.handle_type, size=self.size,
                      chunk_sizes=self.chunk_sizes, device_uuid=self.device_uuid,
                      device_ordinal=self.device_ordinal, location=location)
        return data, list(self.fds)

    def close(self):
        for fd in self.fds:
            _close_quietly(fd)
        self.fds = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"VmmDescriptor(fds={self.fds}, chunk_sizes={self.chunk_sizes}, size={self.size}, "
                f"device_uuid={self.device_uuid!r}, location={self.location})")


def _location_fields(location):
    kind, node = location
    if kind == "device":
        return (LOCATION_DEVICE, 0)
    if kind == "host_numa" and isinstance(node, int) and 0 <= node < 2**31:
        return (LOCATION_HOST_NUMA, node)
    raise ValueError(f"location {location!r}: ('device', 0) or ('host_numa', node >= 0)")


class FabricDescriptor:
    """A CUDA VMM buffer's fabric descriptor (``CUDA_FABRIC``, version 2): one 64-byte fabric
    handle (``CUmemFabricHandle``, as ``bytes``) per chunk in chunk order, the chunk sizes, the
    buffer's size (at most their sum), the UUID of the device that owns the memory (required),
    the exporter's ordinal for it (informative only) and where the memory lives. It holds no fd
    (``close()`` does nothing; ``with`` works as for the other descriptors), and crosses an
    endpoint or a byte stream alike.

    A handle is a bearer token: ``repr`` and every error show only how many there are, never a
    byte of one. It does not keep the memory alive: the exporter keeps its allocation until
    the importers say they have imported."""

    handle_type = HANDLE_TYPE_FABRIC

    def __init__(self, handles, chunk_sizes, size=None, owner_uuid=None, owner_ordinal=0,
                 location=("device", 0)):
        handles = [bytes(h) for h in handles]
        chunk_sizes = [int(c) for c in chunk_sizes]
        n = len(chunk_sizes)
        if len(handles) != n:
            raise ValueError(f"{len(handles)} fabric handle(s) for {n} chunk(s): one per chunk")
        if not 1 <= n <= MAX_CHUNKS:
            raise ValueError(f"a fabric descriptor names 1 to {MAX_CHUNKS} chunks, not {n}")
        for i, h in enumerate(handles):
            if len(h) != FABRIC_HANDLE_LEN:
                raise ValueError(f"fabric handle {i + 1} of {n} is {len(h)} bytes, not "
                                 f"{FABRIC_HANDLE_LEN}")
        for i, c in enumerate(chunk_sizes):
            if c <= 0:
                raise ValueError(f"chunk {i + 1} of {n} has size {c}")
        total = sum(chunk_sizes)
        if total > _USIZE_MAX:
            raise ValueError("the sum of the chunk sizes overflows a 64-bit size")
        size = total if size is None else int(size)
        if not 0 <= size <= total:
            raise ValueError(f"size {size} is not within the {total} bytes of the chunks")
        if owner_uuid is None or len(bytes(owner_uuid)) != 16:
            raise ValueError("a fabric descriptor names its owner device: a 16-byte UUID")
        _location_fields(location)
        self.handles, self.chunk_sizes, self.size = handles, chunk_sizes, size
        self.owner_uuid, self.owner_ordinal = bytes(owner_uuid), int(owner_ordinal)
        self.location = location

    @property
    def device_uuid(self):
        """The owner's UUID (the name VmmDescriptor uses)."""
        return self.owner_uuid

    def encode(self):
        data = encode(KIND_CUDA_FABRIC, handle_type=HANDLE_TYPE_FABRIC, size=self.size,
                      chunk_sizes=self.chunk_sizes, device_uuid=self.owner_uuid,
                      device_ordinal=self.owner_ordinal,
                      location=_location_fields(self.location), payload=b"".join(self.handles))
        return data, []

    @classmethod
    def from_cuda_core(cls, descriptor, owner_uuid=None, owner_ordinal=0):
        """From a cuda.core (1.3+) ``VirtualMemoryFabricBufferDescriptor`` (its ``handles``,
        ``sizes`` and ``size``). Not tried: the machines this was written on have cuda.core
        1.2 at most, which has no fabric descriptor. ``owner_uuid`` (16 bytes) is required
        when the cuda.core descriptor does not name its owner."""
        if owner_uuid is None:
            named = getattr(descriptor, "owner_uuid", None)
            if named is not None:
                import uuid
                owner_uuid = uuid.UUID(str(named).removeprefix("GPU-")).bytes
        return cls(descriptor.handles, descriptor.sizes, descriptor.size, owner_uuid,
                   owner_ordinal)

    def to_cuda_core(self):
        """A cuda.core ``VirtualMemoryFabricBufferDescriptor`` (cuda.core 1.3+:
        ``from_handles(handles, sizes, size=, owner_uuid=)``, owner as the canonical UUID
        string), to import with ``Buffer.from_ipc_descriptor``. Not tried (cuda.core 1.2 at
        most here); raises ImportError where cuda.core has no fabric descriptor."""
        import uuid
        try:
            from cuda.core import VirtualMemoryFabricBufferDescriptor as Fabric
        except ImportError:
            try:
                from cuda.core._memory._ipc import VirtualMemoryFabricBufferDescriptor as Fabric
            except ImportError:
                raise ImportError("cuda.core has no VirtualMemoryFabricBufferDescriptor (it "
                                  "needs cuda.core 1.3 or newer)") from None
        return Fabric.from_handles(self.handles, self.chunk_sizes, size=self.size,
                                   owner_uuid=str(uuid.UUID(bytes=self.owner_uuid)))

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"FabricDescriptor(handles=<{len(self.handles)} fabric handle(s), redacted>, "
                f"chunk_sizes={self.chunk_sizes}, size={self.size}, "
                f"owner_uuid={self.owner_uuid.hex()}, owner_ordinal={self.owner_ordinal}, "
                f"location={self.location})")


def encode(kind, *, handle_type=0, size=0, chunk_sizes=(), device_uuid=None, device_ordinal=0,
           location=(LOCATION_DEVICE, 0), payload=b"", version=None):
    """One message's bytes (without the packet's frame byte), marked with the version that
    defines ``kind`` (``version`` overrides it, to forge a message in a test)."""
    chunk_sizes = list(chunk_sizes)
    if len(chunk_sizes) > MAX_CHUNKS:
        raise ValueError(f"at most {MAX_CHUNKS} chunks per message, got {len(chunk_sizes)}")
    if len(payload) > MAX_DATA:
        raise ValueError(f"at most {MAX_DATA} payload bytes per message, got {len(payload)}")
    flags = FLAG_DEVICE if device_uuid is not None else 0
    uuid = device_uuid if device_uuid is not None else bytes(16)
    if len(uuid) != 16:
        raise ValueError("a device UUID is 16 bytes")
    if version is None:
        version = KIND_VERSIONS[kind]
    header = HEADER.pack(MAGIC, version, kind, HEADER.size, flags, handle_type, len(chunk_sizes),
                         len(payload), size, uuid, device_ordinal if flags else 0, location[0],
                         location[1], 0)
    return header + struct.pack(f"<{len(chunk_sizes)}Q", *chunk_sizes) + bytes(payload)


class Hello:
    """The listener admitted this connection."""


class Refused:
    """The listener refused this connection; ``reason`` says why."""

    def __init__(self, reason):
        self.reason = reason


class Data(bytes):
    """Application bytes (a DATA message)."""


def decode(data, fds):
    """Decode one message (without the frame byte) that arrived with ``fds`` (ints, now owned
    here). Returns Hello, Refused, Data, VmmDescriptor, HostDescriptor or FabricDescriptor; on
    any refusal every fd is closed and ProtocolError says which rule was broken
    (docs/protocol.md's order)."""
    try:
        return _decode(bytes(data), list(fds))
    except ProtocolError:
        for fd in fds:
            _close_quietly(fd)
        raise


def _versions_spoken():
    return " and ".join(str(v) for v in VERSIONS)


def _parse_header(data):
    """Rules 1 and 2 and the counts of rule 3 on a message's first bytes (a whole packet, or a
    stream's 64-byte header): the header's fields, or ProtocolError naming the rule."""
    n = len(data)
    if n < 4 or data[:4] != MAGIC:
        raise ProtocolError(f"not a vmm-ipc peer message: it does not start with b'VMMI' ({n} bytes)")
    if n < 6:
        raise ProtocolError(f"{n} bytes end inside the header's version field")
    (version,) = struct.unpack_from("<H", data, 4)
    if version not in VERSIONS:
        raise ProtocolError(f"protocol version {version} is not supported: this peer speaks "
                            f"versions {_versions_spoken()}")
    if n < HEADER.size:
        raise ProtocolError(f"{n} bytes: shorter than the {HEADER.size}-byte header")
    fields = HEADER.unpack_from(data)
    (_, _, kind, header_len, flags, _, count, payload_len, _, _, _, _, _, reserved) = fields
    if kind not in KIND_NAMES:
        raise ProtocolError(f"unknown message kind {kind}")
    if version != KIND_VERSIONS[kind]:
        raise ProtocolError(f"{KIND_NAMES[kind]} message marked protocol version {version}: "
                            f"{KIND_NAMES[kind]} is sent as version {KIND_VERSIONS[kind]}")
    if header_len != HEADER.size:
        raise ProtocolError(f"header length {header_len}: headers are {HEADER.size} bytes")
    if flags & ~FLAG_DEVICE:
        raise ProtocolError(f"unknown flags {flags:#06x}")
    if reserved:
        raise ProtocolError("reserved header field is not 0")
    if count > MAX_CHUNKS:
        raise ProtocolError(f"{count} chunks: at most {MAX_CHUNKS}")
    if payload_len > MAX_DATA:
        raise ProtocolError(f"{payload_len} payload bytes: at most {MAX_DATA}")
    return fields


def _decode(data, fds):
    n = len(data)
    (_, _, kind, _, flags, handle_type, count, payload_len, size, uuid, ordinal,
     location_type, location_id, _) = _parse_header(data)
    expected = HEADER.size + 8 * count + payload_len
    if n != expected:
        raise ProtocolError(f"its header announces {expected} bytes, the message has {n}")
    if kind == KIND_CUDA_FABRIC:
        if fds:
            raise ProtocolError(f"CUDA_FABRIC message arrived with {len(fds)} fd(s): it carries "
                                f"none (its handles are in the payload)")
    elif len(fds) != count:
        raise ProtocolError(f"{KIND_NAMES[kind]} message with {count} chunk(s) arrived with "
                            f"{len(fds)} fd(s): one fd per chunk")
    named = bool(flags & FLAG_DEVICE)
    if not named and (ordinal or any(uuid)):
        raise ProtocolError("device fields set without the device flag")
    if location_type == LOCATION_DEVICE:
        if location_id:
            raise ProtocolError("location type 0 (device) with a non-zero id")
        location = ("device", 0)
    elif location_type == LOCATION_HOST_NUMA:
        if location_id < 0:
            raise ProtocolError(f"host NUMA node {location_id} is negative")
        location = ("host_numa", location_id)
    else:
        raise ProtocolError(f"unknown location type {location_type}")
    chunks = list(struct.unpack_from(f"<{count}Q", data, HEADER.size))
    payload = data[HEADER.size + 8 * count:]
    name = KIND_NAMES[kind]
    descriptor_fields = handle_type or size or named or location_type or count
    if kind == KIND_HELLO:
        if descriptor_fields or payload:
            raise ProtocolError("HELLO: every field after the header length must be zero")
        return Hello()
    if kind in (KIND_REFUSED, KIND_DATA):
        if descriptor_fields:
            raise ProtocolError(f"{name}: carries descriptor fields or fds")
        return Refused(payload.decode("utf-8", "replace")) if kind == KIND_REFUSED else Data(payload)
    if kind == KIND_CUDA_FABRIC:
        if handle_type != HANDLE_TYPE_FABRIC:
            raise ProtocolError(f"CUDA_FABRIC: handle type {handle_type}, not "
                                f"{HANDLE_TYPE_FABRIC} (fabric)")
        if not named:
            raise ProtocolError("CUDA_FABRIC: the device flag is not set (a fabric descriptor "
                                "names the device that owns the memory)")
        if count == 0:
            raise ProtocolError("CUDA_FABRIC: no chunks")
        if payload_len != FABRIC_HANDLE_LEN * count:
            raise ProtocolError(f"CUDA_FABRIC: {payload_len} payload bytes for {count} chunk(s): "
                                f"one {FABRIC_HANDLE_LEN}-byte handle per chunk")
        _check_chunks(name, chunks, size)
        handles = [payload[i:i + FABRIC_HANDLE_LEN]
                   for i in range(0, payload_len, FABRIC_HANDLE_LEN)]
        return FabricDescriptor(handles, chunks, size, bytes(uuid), ordinal, location)
    if payload:
        raise ProtocolError(f"{name}: a descriptor has no payload")
    if kind == KIND_CUDA_VMM:
        if handle_type != HANDLE_TYPE_POSIX_FD:
            why = (" (fabric handles travel in CUDA_FABRIC messages)"
                   if handle_type == HANDLE_TYPE_FABRIC else "")
            raise ProtocolError(f"CUDA_VMM: handle type {handle_type}, not "
                                f"{HANDLE_TYPE_POSIX_FD} (POSIX fd){why}")
        _check_chunks(name, chunks, size)
        return VmmDescriptor(fds, chunks, size, handle_type,
                             bytes(uuid) if named else None, ordinal if named else 0, location)
    # HOST_MEMFD
    if handle_type or named or location_type:
        raise ProtocolError("HOST_MEMFD: handle type, device and location must be zero")
    if count == 0:
        if size:
            raise ProtocolError(f"HOST_MEMFD: size {size} with no fd")
        return HostDescriptor(None, 0)
    if count > 1 or chunks[0] != size or size == 0:
        raise ProtocolError("HOST_MEMFD: one fd whose chunk size equals the (non-zero) size")
    return HostDescriptor(fds[0], size)


def _check_chunks(name, chunks, size):
    """Every chunk non-empty, their sum within a 64-bit size_t, the size within the sum."""
    for i, chunk in enumerate(chunks):
        if chunk == 0:
            raise ProtocolError(f"{name}: chunk {i + 1} of {len(chunks)} has size 0")
    total = sum(chunks)
    if total > _USIZE_MAX:
        raise ProtocolError(f"{name}: the sum of chunk sizes overflows")
    if size > total:
        raise ProtocolError(f"{name}: size {size} exceeds the {total} bytes of its chunks")


def _discard(message):
    """Close an unwanted message's fds on the background closer."""
    if isinstance(message, HostDescriptor):
        if message.fd is not None:
            _close_all([message.fd])
            message.fd = None
    elif isinstance(message, VmmDescriptor):
        _close_all(message.fds)
        message.fds = []


def _address(name):
    """``@name`` is an abstract socket; anything else a path."""
    if isinstance(name, bytes):
        name = name.decode()
    return b"\0" + name[1:].encode() if name.startswith("@") else name


class _Receives:
    """``recv_descriptor`` and ``recv_data`` over a class's ``recv()``, shared by endpoint and
    stream connections. An unwanted descriptor's fds are closed (a stream's carry none)."""

    def recv_descriptor(self):
        message = self.recv()
        if isinstance(message, Data):
            raise ProtocolError(f"expected a descriptor, got DATA ({len(message)} bytes)")
        return message

    def recv_data(self):
        message = self.recv()
        if not isinstance(message, Data):
            _discard(message)
            raise ProtocolError(f"expected DATA, got {type(message).__name__}")
        return bytes(message)


class Connection(_Receives):
    """An admitted connection: send and receive descriptors and DATA messages. ``peer`` is the
    kernel's Credentials for the other side. Every send and receive is bounded by ``timeout``
    (seconds; None for no limit): TimeoutError (socket.timeout) when it passes."""

    def __init__(self, sock, peer, name, timeout=DEFAULT_TIMEOUT):
        self.sock, self.peer, self.name = sock, peer, name
        self.sock.settimeout(timeout)
        self.active = time.monotonic()  # when a message last crossed (either way)
        self.ended_by_listener = None  # why the listener shut it down (idle, or made room)

    def _send(self, data, fds=()):
        if fds:
            socket.send_fds(self.sock, [FRAME_INLINE, data], list(fds))
        else:
            self.sock.sendmsg([FRAME_INLINE, data])
        self.active = time.monotonic()

    @property
    def closed(self):
        return self.sock.fileno() == -1

    def _end(self, why):
        """Shut the connection down from the listener (another thread may be inside a receive
        on it: it wakes, and reads PeerClosed naming ``why``); the owner still closes it."""
        self.ended_by_listener = why
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def send_descriptor(self, descriptor):
        """Send a VmmDescriptor or HostDescriptor (it keeps its fds: close it afterwards), or a
        FabricDescriptor (a bearer token: send it only to a peer you would give the memory)."""
        data, fds = descriptor.encode()
        self._send(data, fds)

    def send_data(self, data):
        self._send(encode(KIND_DATA, payload=bytes(data)))

    def recv(self):
        """The next message: Data, VmmDescriptor, HostDescriptor (the caller owns their fds) or
        FabricDescriptor."""
        message = self._recv()
        if isinstance(message, (Hello, Refused)):
            raise ProtocolError(f"{type(message).__name__.upper()} after the handshake")
        return message


    def _recv(self):
        space = socket.CMSG_SPACE(MAX_CHUNKS * array.array("i").itemsize)
        msg, ancdata, flags, _ = self.sock.recvmsg(1 + MAX_MESSAGE, space,
                                                   getattr(socket, "MSG_CMSG_CLOEXEC", 0))
        fds = array.array("i")
        for level, kind, cmsg in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(cmsg[:len(cmsg) - len(cmsg) % fds.itemsize])
        fds = list(fds)
        if flags & socket.MSG_CTRUNC:
            _close_all(fds)
            raise ProtocolError(f"control message truncated: the sender's fds did not all arrive "
                                f"({len(fds)} did, closed)")
        if flags & socket.MSG_TRUNC:
            _close_all(fds)
            raise ProtocolError(f"packet larger than {1 + MAX_MESSAGE} bytes")
        if not msg:
            _close_all(fds)
            if self.ended_by_listener:
                raise PeerClosed(f"endpoint {self.name}: the listener shut this connection "
                                 f"down ({self.ended_by_listener})")
            raise PeerClosed(f"endpoint {self.name}: the other end has closed")
        self.active = time.monotonic()
        if msg[0] != 0:
            _close_all(fds)
            raise ProtocolError(f"frame byte {msg[0]}: a peer message starts with 0 (its fds "
                                f"closed unread)")
        try:
            return _decode(bytes(msg[1:]), fds)
        except ProtocolError:
            _close_all(fds)  # off this thread: a hostile fd's close may block
            raise

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def connect(name, expect_uids=None, expect_gids=(), timeout=DEFAULT_TIMEOUT):
    """Connect to the endpoint ``name`` (a path, or ``@name``), check the listener's kernel
    credentials before anything is sent or read (default: it must run as this process's uid),
    and wait to be admitted. PeerRefused when the listener is not expected or refuses us."""
    implicit = os.geteuid() if expect_uids is None and not expect_gids else None
    uids = [implicit] if implicit is not None else list(expect_uids or ())
    gids = list(expect_gids)
    deadline = None if timeout is None else time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # close-on-exec (PEP 446)
    try:
        sock.settimeout(timeout)
        address = _address(name)
        while True:
            try:
                sock.connect(address)
                break
            except BlockingIOError as e:
                # The listener's backlog is full: it is alive but slow; try again until the
                # deadline (a Unix socket has no connection in progress to wait on).
                if e.errno != errno.EAGAIN:
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"connecting to endpoint {name}: its backlog stayed "
                                       f"full") from None
                time.sleep(0.0005)
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
        server = peer_credentials(sock)
        if not _admits(uids, gids, server, implicit):
            raise PeerRefused(f"endpoint {name}: its listener is pid {server.pid} (uid {server.uid}, "
                              f"gid {server.gid}), not whom this client expects (uids {uids}, "
                              f"gids {gids}){_overflow_note(server)}: another process may have "
                              f"taken the name; nothing was sent to it")
        conn = Connection(sock, server, name, timeout)
        try:
            first = conn._recv()
        except PeerClosed:
            raise PeerRefused(f"endpoint {name}: the listener closed the connection without "
                              f"admitting it") from None
        if isinstance(first, Refused):
            raise PeerRefused(f"endpoint {name}: its listener refused this process: {first.reason}")
        if not isinstance(first, Hello):
            _discard(first)
            raise ProtocolError(f"endpoint {name}: the listener's first message is not HELLO")
        conn.sock.settimeout(timeout)
        return conn
    except BaseException:
        sock.close()
        raise


def _check_directory(directory):
    why = None
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        why = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is not a directory"
    elif _maybe_overflow_uid(os.geteuid()):
        why = (f"this process's uid {os.geteuid()} is the overflow uid (or "
               f"/proc/sys/kernel/overflowuid cannot be read): the owner of a directory cannot "
               f"tell it from other users that have no mapping in its user namespace")
    elif st.st_uid != os.geteuid():
        why = f"is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    elif st.st_mode & 0o077:
        why = f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others may enter or list it"
    if why:
        raise PermissionError(f"endpoint directory {directory}: {why}; a path endpoint lives in a "
                              f"directory only its owner can enter (0700), or use an abstract name")


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


class Listener(_RefusalLog):
    """Listen on ``name`` (a path, or ``@name``) and admit peers by their kernel credentials
    (default: this process's uid). A path socket is created 0600 in an owner-only directory;
    a dead listener's socket file is replaced, a live one's never (OSError EADDRINUSE).

    Admitted connections are counted while open (until their owner closes them, or they are
    garbage), and ``accept`` keeps one uid from taking every slot:
    - at most ``max_per_uid`` open connections per uid (default 16): the next is refused
      (REFUSED says why), the uid's open ones go on;
    - at most ``max_connections`` open in all (default 64): when full, a newcomer whose uid
      holds fewer than the uid holding most, by two or more, takes the slot of that uid's
      longest-idle connection (shut down), else it is refused as busy (max-min fair);
    - a connection across which no message has gone either way for ``idle_timeout`` seconds
      (default 60; None: never) is shut down by the next ``accept``: its owner's receive wakes
      with PeerClosed saying so.
    None for a cap lifts it."""

    def __init__(self, name, allow_uids=None, allow_gids=(), timeout=DEFAULT_TIMEOUT, log=True,
                 backlog=128, max_connections=MAX_CONNECTIONS, max_per_uid=MAX_PER_UID,
                 idle_timeout=IDLE_TIMEOUT):
        self.name, self.timeout = name, timeout
        self._init_log(f"endpoint {name}", log)
        self._implicit = os.geteuid() if allow_uids is None and not allow_gids else None
        self.uids = [self._implicit] if self._implicit is not None else list(allow_uids or ())
        self.gids = list(allow_gids)
        self.max_connections, self.max_per_uid = max_connections, max_per_uid
        self.idle_timeout = idle_timeout
        self._open = weakref.WeakSet()  # admitted connections (closed ones are skipped)
        self._file = None
        address = _address(name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            if isinstance(address, str):
                self._prepare_path(address)
            self.sock.bind(address)
            if isinstance(address, str):
                os.chmod(address, 0o600)
                st = os.lstat(address)
                self._file = (address, st.st_dev, st.st_ino)
            self.sock.listen(backlog)
        except BaseException:
            self.sock.close()
            raise

    @staticmethod
    def _prepare_path(path):
        _check_directory(os.path.dirname(path) or ".")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"endpoint path {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.setblocking(False)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # a dead listener's file
            return
        except (BlockingIOError, OSError):
            pass
        finally:
            probe.close()
        raise OSError(98, f"{path}: a live listener already serves this name")  # EADDRINUSE

    def open_connections(self):
        """The admitted connections still open (not closed by their owner, not shut down)."""
        return [c for c in list(self._open) if not c.closed and not c.ended_by_listener]

    def _reap_idle(self):
        if self.idle_timeout is None:
            return
        now = time.monotonic()
        for c in self.open_connections():
            idle = now - c.active
            if idle >= self.idle_timeout:
                c._end(f"idle for {idle:.1f} s, at most {self.idle_timeout:g} s")

    def _admission(self, creds):
        """None to admit, else why not (after making room fairly where it can)."""
        self._reap_idle()
        live = self.open_connections()
        mine = sum(c.peer.uid == creds.uid for c in live)
        if self.max_per_uid is not None and mine >= self.max_per_uid:
            return (f"uid {creds.uid} has {mine} connection(s) open on this endpoint, at most "
                    f"{self.max_per_uid} per uid")
        if self.max_connections is not None and len(live) >= self.max_connections:
            held = collections.Counter(c.peer.uid for c in live)
            top_uid, top = held.most_common(1)[0]
            if top < mine + 2:
                return (f"busy: {len(live)} connection(s) open on this endpoint, at most "
                        f"{self.max_connections}, and uid {creds.uid} holds its share")
            victim = min((c for c in live if c.peer.uid == top_uid), key=lambda c: c.active)
            victim._end(f"its slot went to uid {creds.uid}: uid {top_uid} held {top} of the "
                        f"{self.max_connections} slots")
        return None

    def accept(self, timeout=None):
        """The next admitted Connection (refused peers are told, logged, remembered in
        ``refused`` and skipped). TimeoutError after ``timeout`` seconds (None: forever). At
        the fd limit it waits and tries again (see ``_accept_retrying``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            conn, _ = _accept_retrying(self.sock, deadline, f"endpoint {self.name}")
            creds = peer_credentials(conn)
            if not _admits(self.uids, self.gids, creds, self._implicit):
                self._refuse(conn, creds, f"uid {creds.uid} (gid {creds.gid}) is not allowed "
                                          f"to connect{_overflow_note(creds)}")
                continue
            why = self._admission(creds)
            if why is not None:
                self._refuse(conn, creds, why)
                continue
            try:
                conn.sendmsg([FRAME_INLINE, encode(KIND_HELLO)])
            except OSError:
                conn.close()
                continue
            admitted = Connection(conn, creds, self.name, self.timeout)
            self._open.add(admitted)
            return admitted

    def _refuse(self, conn, creds, reason):
        """Stop the refused peer sending, drain what it sent (a Unix socket closed with unread
        messages resets the connection, and its peer would read ECONNRESET instead of the
        reason; and closing it with fds still queued would release them on this thread),
        disposing of every fd it sent (``_close_all``: sockets defused and closed at once),
        tell it why, remember and log it, close."""
        rest, empty = [], False
        try:
            conn.setblocking(False)
            empty = _drain_unix(conn, 0, [_DRAIN_MAX], rest)
            conn.sendmsg([FRAME_INLINE, encode(KIND_REFUSED, payload=reason.encode())])
        except OSError:
            pass
        _Closer.close(rest)
        if empty:
            conn.close()
        else:
            _Closer.close([conn.detach()])  # more queued than the budget: closed off this thread
        self._note_refusal(creds, f"refused pid {creds.pid} (uid {creds.uid}, gid {creds.gid}): "
                                  f"{reason}")

    def close(self):
        self._log_count()
        self.sock.close()
        if self._file:
            path, dev, ino = self._file
            try:
                st = os.lstat(path)
                if (st.st_dev, st.st_ino) == (dev, ino):
                    os.unlink(path)
            except FileNotFoundError:
                pass
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# Byte streams (version 2): DATA and CUDA_FABRIC over a connected stream socket or a pipe.


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


def sealed_memfd(size, name="vmm-ipc-peer"):
    """A memfd of ``size`` bytes sealed against shrinking and growing (what a Rust importer
    requires before it maps), close-on-exec."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---------------------------------------------------------------------------------------------
# Mutual TLS (standard library ssl): the byte-stream framing over TCP, both ends authenticated.


class TlsRefused(PeerRefused):
    """A TLS peer is not trusted, or did not trust this side: its certificate failed the chain
    (CA, validity dates, key usage, CRL), or names none of the allowed names, or matches no
    pinned key; or it sent a TLS alert refusing this side's certificate. ``reason`` says
    which."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


class TlsError(ProtocolError):
    """The TLS layer failed other than by a refusal: a record that did not authenticate (a
    byte changed on the way), a handshake that broke, a plaintext peer. Nothing of the message
    being read was delivered."""


TlsRefusal = namedtuple("TlsRefusal", "address reason")

# TLS alerts that mean "your certificate is refused" (OpenSSL's reason names).
_REFUSAL_ALERTS = ("CERTIFICATE", "UNKNOWN_CA", "ACCESS_DENIED")


def _tls_failure(e, what):
    """The typed exception for ``e`` (raised by ssl or the socket under it), or None to let
    ``e`` through (timeouts, PeerClosed, this module's own)."""
    if ssl is None or isinstance(e, (PeerClosed, PeerRefused, ProtocolError, TimeoutError)):
        return None
    if isinstance(e, ssl.SSLCertVerificationError):
        return TlsRefused(f"{what}: the peer's certificate was refused: {e.verify_message}")
    if isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionResetError,
                      BrokenPipeError, ConnectionAbortedError)):
        return PeerClosed(f"{what}: the connection was cut ({type(e).__name__}); a TLS "
                          f"server closes a client it refuses this way")
    if isinstance(e, ssl.SSLError):
        reason = e.reason or str(e)
        if "ALERT" in reason and any(w in reason for w in _REFUSAL_ALERTS):
            return TlsRefused(f"{what}: the peer refused this side (TLS alert {reason})")
        return TlsError(f"{what}: TLS failed ({reason})")
    return None


def _der_tlv(data, pos, end):
    """The DER element at ``pos`` (within ``end``): (tag, content start, content end). Only
    what a certificate uses: one-byte tags, definite lengths in the fewest bytes."""
    if end - pos < 2:
        raise ValueError("a DER element is cut short")
    tag, length = data[pos], data[pos + 1]
    if tag & 0x1F == 0x1F:
        raise ValueError("a multi-byte DER tag")
    pos += 2
    if length & 0x80:
        n = length & 0x7F
        if not 1 <= n <= 4 or end - pos < n:
            raise ValueError("a DER length of an unsupported form")
        length = int.from_bytes(data[pos:pos + n], "big")
        if data[pos] == 0 or length < 0x80:
            raise ValueError("a DER length not in its shortest form")
        pos += n
    if length > end - pos:
        raise ValueError("a DER element longer than what holds it")
    return tag, pos, pos + length


def spki_of(cert_der):
    """The DER SubjectPublicKeyInfo of an X.509 certificate (DER): Certificate = SEQUENCE {
    tbsCertificate SEQUENCE { [0] version OPTIONAL, serialNumber INTEGER, signature SEQUENCE,
    issuer SEQUENCE, validity SEQUENCE, subject SEQUENCE, subjectPublicKeyInfo SEQUENCE, ... },
    ... }. ValueError for anything else."""
    data = bytes(cert_der)
    tag, start, end = _der_tlv(data, 0, len(data))
    if tag != 0x30 or end != len(data):
        raise ValueError("not one DER SEQUENCE: not a certificate")
    tag, pos, end = _der_tlv(data, start, end)
    if tag != 0x30:
        raise ValueError("a certificate's first element is not tbsCertificate")
    tag, _, after = _der_tlv(data, pos, end)
    if tag == 0xA0:  # [0] EXPLICIT version
        pos = after
    for expected, field in ((0x02, "serialNumber"), (0x30, "signature"), (0x30, "issuer"),
                            (0x30, "validity"), (0x30, "subject")):
        tag, _, after = _der_tlv(data, pos, end)
        if tag != expected:
            raise ValueError(f"tbsCertificate's {field} has tag {tag:#04x}")
        pos = after
    tag, _, after = _der_tlv(data, pos, end)
    if tag != 0x30:
        raise ValueError(f"tbsCertificate's subjectPublicKeyInfo has tag {tag:#04x}")
    return data[pos:after]


def spki_sha256_of(cert_der):
    """The pin of a certificate: SHA-256 of its DER SubjectPublicKeyInfo (32 bytes)."""
    return hashlib.sha256(spki_of(cert_der)).digest()


def _pin_bytes(pin):
    if isinstance(pin, str):
        try:
            pin = bytes.fromhex(pin.replace(":", ""))
        except ValueError:
            raise ValueError("an SPKI pin is 64 hex digits (SHA-256)") from None
    pin = bytes(pin)
    if len(pin) != 32:
        raise ValueError(f"an SPKI pin is a SHA-256: 32 bytes, not {len(pin)}")
    return pin


class TlsConfig:
    """One side's mutual-TLS settings: its certificate chain ``cert`` and key ``key``, the CA
    (``ca``) that must have issued the other side's certificate, an optional CRL (``crl``;
    then the other side's certificate must not be revoked, and a CRL of its issuer must be
    there), all PEM file paths; and whom to accept, exactly one of:
    - ``allow_names``: DNS names; the other side's certificate must carry at least one in its
      subjectAltName (compared whole, ignoring ASCII case; a wildcard is only itself);
    - ``spki_sha256``: pins, each the SHA-256 of the other side's DER SubjectPublicKeyInfo
      (64 hex digits, or 32 bytes).
    There is no mode that accepts any certificate the CA signed: ValueError without one (or
    with both). The chain is always verified, strictly (``VERIFY_X509_STRICT``: RFC 5280's
    rules on the certificates' form), a client certificate fit for client authentication, a
    server's for server authentication (OpenSSL's purpose checks), dates included. TLS 1.3 only; no session tickets or resumption; a stream cut without a TLS
    close_notify is an error, never a clean end.

    ``handshake_timeout`` bounds a whole handshake (seconds); ``timeout`` each whole message
    on a connection (None: no limit)."""

    def __init__(self, cert, key, ca, allow_names=(), spki_sha256=(), crl=None,
                 handshake_timeout=10.0, timeout=DEFAULT_TIMEOUT):
        if ssl is None:
            raise ImportError("this Python has no ssl module: mutual TLS is not available")
        if isinstance(allow_names, str):
            allow_names = (allow_names,)
        if isinstance(spki_sha256, (str, bytes, bytearray)):
            spki_sha256 = (spki_sha256,)
        names = tuple(str(n).lower() for n in allow_names)
        pins = tuple(_pin_bytes(p) for p in spki_sha256)
        if bool(names) == bool(pins):
            raise ValueError("TlsConfig names whom to accept: exactly one of allow_names (DNS "
                             "names the peer's certificate must carry) or spki_sha256 (pins of "
                             "its key); a certificate the CA signed is not enough")
        if any(not n or not n.isascii() for n in names):
            raise ValueError("allow_names: each a non-empty ASCII DNS name")
        if handshake_timeout is None or handshake_timeout <= 0:
            raise ValueError("handshake_timeout: a positive number of seconds")
        self.cert, self.key, self.ca, self.crl = cert, key, ca, crl
        self.allow_names, self.spki_sha256 = names, pins
        self.handshake_timeout, self.timeout = float(handshake_timeout), timeout
        self.server_context = self._context(ssl.PROTOCOL_TLS_SERVER)
        self.client_context = self._context(ssl.PROTOCOL_TLS_CLIENT)

    def _context(self, protocol):
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.maximum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # the names are checked here, against every allowed name
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT
        ctx.options |= ssl.OP_NO_TICKET | ssl.OP_NO_COMPRESSION
        ctx.options &= ~getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)
        if protocol == ssl.PROTOCOL_TLS_SERVER:
            ctx.num_tickets = 0
        try:
            ctx.load_cert_chain(self.cert, self.key)
            ctx.load_verify_locations(cafile=self.ca)
            if self.crl is not None:
                ctx.load_verify_locations(cafile=self.crl)
                ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"TlsConfig: cannot load the certificate, key, CA or CRL: {e}") \
                from None
        return ctx

    def check_peer(self, sock, what):
        """After a verified handshake: the peer's DNS names and pin, or TlsRefused."""
        der = sock.getpeercert(binary_form=True)
        if not der:
            raise TlsRefused(f"{what}: the peer sent no certificate")
        names = [v.lower() for k, v in sock.getpeercert().get("subjectAltName", ())
                 if k == "DNS"]
        try:
            pin = spki_sha256_of(der)
        except ValueError as e:
            raise TlsRefused(f"{what}: the peer's certificate cannot be read ({e})") from None
        if self.allow_names:
            if not set(names) & set(self.allow_names):
                raise TlsRefused(f"{what}: the peer's certificate names "
                                 f"{', '.join(names) or 'no DNS name'}, none of the allowed "
                                 f"{', '.join(self.allow_names)}")
        elif pin not in self.spki_sha256:
            raise TlsRefused(f"{what}: the peer's key (SPKI SHA-256 {pin.hex()}) is not pinned")
        return names, pin.hex()


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
    ``refused`` (the last ``REFUSALS_KEPT``, as TlsRefusal(address, reason)) and logged at a
    bounded rate; ``accept`` goes on to the next connection.

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
            self._refuse(fd, str(failure) or type(failure).__name__)
            return None
        try:
            names, pin = self.config.check_peer(h.sock, what)
        except TlsRefused as e:
            self._refuse(fd, str(e))
            return None
        del self._pending[fd]
        h.sock.settimeout(self.config.timeout)
        return TlsConnection(h.sock, names, pin, h.peer, self.config.timeout)

    def _refuse(self, fd, reason):
        h = self._pending.pop(fd)
        h.sock.close()
        if not reason.startswith("TLS client"):
            reason = f"TLS client {h.peer[0]}:{h.peer[1]}: {reason}"
        self._note(h.peer, reason)

    def _note(self, peer, reason):
        self._note_refusal(TlsRefusal(peer, reason), f"refused: {reason}")

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
