"""Turning a received message (bytes and fds) into Hello, Refused, Data or a descriptor,
after every rule of docs/protocol.md; closing the fds of a refused or unwanted one."""

import struct

from .constants import (
    FABRIC_HANDLE_LEN, FLAG_DEVICE, HANDLE_TYPE_FABRIC, HANDLE_TYPE_POSIX_FD, HEADER,
    KIND_CUDA_FABRIC, KIND_CUDA_VMM, KIND_DATA, KIND_HELLO, KIND_NAMES, KIND_REFUSED,
    LOCATION_DEVICE, LOCATION_HOST_NUMA, _USIZE_MAX,
)
from .descriptors import FabricDescriptor, HostDescriptor, VmmDescriptor
from .errors import ProtocolError
from .framing import Data, Hello, Refused, _parse_header
from .hostile_fds import _close_all, _close_quietly


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
