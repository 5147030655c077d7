"""The protocol's constants and this peer's limits: the header layout, message kinds and
their versions, handle types, and the bounds a Listener or TlsListener enforces."""

import struct


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
# The kernel's queue of connections a TlsListener has not accepted yet (clamped by the kernel to
# net.core.somaxconn), and how many it accepts per turn of its loop before it drives the
# handshakes that can move again (Rust: wire::tls::LISTEN_BACKLOG and its ACCEPT_BATCH).
LISTEN_BACKLOG, ACCEPT_BATCH = 1024, 16
# How often a TLS listener looks again at connections whose first TLS record came in part
# (seconds): such a connection gets no TLS state until the record is whole, and its bytes,
# there already, would wake every poll.
RECORD_RECHECK = 0.05
# How much longer each TCP connection attempt of tls_connect waits for an answer than the one
# before (seconds; Rust: wire::tls::CONNECT_ATTEMPT).
CONNECT_ATTEMPT = 0.05
# The most intermediate certificates a TLS peer's chain may have between its leaf and a
# trusted root; one more is refused (TlsReason.CHAIN_TOO_LONG). Rust's
# vmm_core::wire::tls::MAX_INTERMEDIATES (webpki's own limit) is the same.
MAX_INTERMEDIATES = 6
