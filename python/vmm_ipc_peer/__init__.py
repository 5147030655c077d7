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
library's ``ssl``, Python 3.10+) carries the same framing with both ends authenticated, by a
CA and a certificate name (DNS subjectAltName) or a pin of the peer's key, under the trust
rules Rust's peer enforces too (docs/security.md):

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

# The package's modules, each with one job (no module imports one that imports it):
# constants, errors, credentials (SO_PEERCRED), hostile_fds (refused SCM_RIGHTS fds), memfd,
# framing (encoding, header rules), descriptors, decoding, accepting (what both listeners
# share), endpoint (Unix SOCK_SEQPACKET), stream (byte streams), tls_config and tls. Every
# name the single-file module had is here, as are the private ones the tests reach.

from .constants import (  # noqa: F401
    ACCEPT_BATCH, CONNECT_ATTEMPT, LISTEN_BACKLOG, RECORD_RECHECK, DEFAULT_MAX_IMPORT_SIZE,
    DEFAULT_TIMEOUT, FABRIC_HANDLE_LEN, FD_LIMIT_PAUSE, FLAG_DEVICE,
    FRAME_INLINE, HANDLE_TYPE_FABRIC, HANDLE_TYPE_POSIX_FD, HEADER, IDLE_TIMEOUT,
    KIND_CUDA_FABRIC, KIND_CUDA_VMM, KIND_DATA, KIND_HELLO, KIND_HOST_MEMFD, KIND_NAMES,
    KIND_REFUSED, KIND_VERSIONS, LOCATION_DEVICE, LOCATION_HOST_NUMA, LOG_BURST, LOG_INTERVAL,
    MAGIC, MAX_BODY, MAX_CHUNKS, MAX_CONNECTIONS, MAX_DATA, MAX_HANDSHAKES, MAX_INTERMEDIATES,
    MAX_MESSAGE, MAX_PER_UID, REFUSALS_KEPT, STREAM_KINDS, TMPFS_MAGIC, VERSION, VERSIONS,
)
from .errors import (  # noqa: F401
    PeerClosed, PeerRefused, ProtocolError, TlsError, TlsReason, TlsRefused,
)
from .credentials import Credentials, overflow_ids, peer_credentials  # noqa: F401
from .hostile_fds import SO_PEEK_OFF, SO_TIMESTAMP, _Closer, _close_all, _drain_unix  # noqa: F401
from .memfd import pattern, sealed_memfd  # noqa: F401
from .framing import Data, Hello, Refused, encode  # noqa: F401
from .descriptors import FabricDescriptor, HostDescriptor, VmmDescriptor  # noqa: F401
from .decoding import decode  # noqa: F401
from .endpoint import Connection, Listener, connect, _address  # noqa: F401
from .stream import StreamConnection, read_message, write_message  # noqa: F401
from .tls_config import TlsConfig, spki_of, spki_sha256_of  # noqa: F401
from .tls import (  # noqa: F401
    TlsConnection, TlsListener, TlsRefusal, tls_connect, tls_listen, _tls_failure,
)

__all__ = [
    "VERSION", "VERSIONS", "MAX_CHUNKS", "MAX_DATA", "FABRIC_HANDLE_LEN", "ProtocolError",
    "PeerRefused", "PeerClosed", "Credentials", "HostDescriptor", "VmmDescriptor",
    "FabricDescriptor", "Connection", "Listener", "connect", "StreamConnection", "write_message",
    "read_message", "encode", "decode", "sealed_memfd", "pattern", "TlsConfig", "TlsRefused",
    "TlsReason", "TlsError", "TlsRefusal", "TlsListener", "TlsConnection", "tls_listen",
    "tls_connect", "spki_of", "spki_sha256_of", "MAX_HANDSHAKES", "MAX_INTERMEDIATES",
    "MAX_CONNECTIONS", "MAX_PER_UID", "IDLE_TIMEOUT", "LISTEN_BACKLOG", "ACCEPT_BATCH",
    "RECORD_RECHECK", "CONNECT_ATTEMPT",
]
