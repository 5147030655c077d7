"""The descriptors a message carries: a host memfd buffer (HostDescriptor), a CUDA VMM
buffer by POSIX fds (VmmDescriptor) or by fabric handles (FabricDescriptor)."""

import fcntl
import mmap
import os

from .constants import (
    DEFAULT_MAX_IMPORT_SIZE, FABRIC_HANDLE_LEN, HANDLE_TYPE_FABRIC, HANDLE_TYPE_POSIX_FD,
    KIND_CUDA_FABRIC, KIND_CUDA_VMM, KIND_HOST_MEMFD, LOCATION_DEVICE, LOCATION_HOST_NUMA,
    MAX_CHUNKS, TMPFS_MAGIC, _USIZE_MAX,
)
from .errors import ProtocolError
from .framing import encode
from .hostile_fds import _close_quietly
from .memfd import _filesystem_type


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
