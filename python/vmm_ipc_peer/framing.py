"""A message's bytes: encoding one, and the header rules (docs/protocol.md's rules 1 and 2
and the counts of rule 3) every reader checks first; the messages without a descriptor."""

import struct

from .constants import (
    FLAG_DEVICE, HEADER, KIND_NAMES, KIND_VERSIONS, LOCATION_DEVICE, MAGIC, MAX_CHUNKS,
    MAX_DATA, VERSIONS,
)
from .errors import ProtocolError


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
