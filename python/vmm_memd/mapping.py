"""A reader's mapping of a committed chunk: read-only, and immutable by construction.

The service seals a committed chunk's memfd against writes (``F_SEAL_WRITE``, checked here
before mapping, with the size seals and ``F_SEAL_SEAL``): no process can hold a writable shared
mapping of it, write(2) it or resize it. This process maps it ``PROT_READ``; a shared mapping
of a write-sealed memfd cannot be made writable either (``mprotect`` fails with ``EACCES``).

The standard library's ``mmap`` hides a mapping's address, and ``ctypes`` cannot point into a
read-only one, so the mapping is made with libc's ``mmap`` through ctypes; its address is what
DLPack hands out. It is unmapped when the last object referring to it (a memoryview, a DLPack
capsule, an array made from one) is gone.
"""

import ctypes
import fcntl
import os
import weakref

from vmm_ipc_peer.constants import TMPFS_MAGIC
from vmm_ipc_peer.memfd import _filesystem_type

from .dlpack import KDL_CPU
from .errors import BadDescriptor, Os

COMMITTED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_NONE, _PROT_READ, _MAP_SHARED, _MAP_PRIVATE = 0x0, 0x1, 0x01, 0x02
_MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x10, 0x20, 0x4000


def check_committed(fd, length):
    """Refuse (BadDescriptor) an fd that is not a tmpfs memfd sealed read-only
    (COMMITTED_SEALS) of at least ``length`` > 0 bytes."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise BadDescriptor(f"F_GET_SEALS: {e} (not a memfd)") from None
    if seals & COMMITTED_SEALS != COMMITTED_SEALS:
        raise BadDescriptor(f"the chunk's memfd is not sealed read-only (seals {seals:#x}, "
                            f"want {COMMITTED_SEALS:#x})")
    fs_type = _filesystem_type(fd)
    if fs_type != TMPFS_MAGIC:
        # hugetlbfs memfds can fault (SIGBUS) on a hole.
        raise BadDescriptor(f"the chunk's fd is not a memfd on tmpfs (f_type {fs_type})")
    size = os.fstat(fd).st_size
    if length <= 0 or size < length:
        raise BadDescriptor(f"the chunk says {length} bytes, its memfd holds {size}")


def _unmap(address, length):
    _libc.munmap(address, length)


class ReadOnlyChunk:
    """``length`` bytes of a committed chunk mapped ``PROT_READ``, ``MAP_SHARED`` at
    ``address``; unmapped once nothing refers to this object. Asleep (``reserve``), the same
    addresses hold a ``PROT_NONE`` reservation instead, until ``remap`` maps a chunk there
    again."""

    def __init__(self, fd, length):
        check_committed(fd, length)
        address = _libc.mmap(None, length, _PROT_READ, _MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            raise Os("mmap(chunk, PROT_READ)", ctypes.get_errno())
        self.address, self.length = address, length
        self.dlpack_device = (KDL_CPU, 0)
        self._unmap = weakref.finalize(self, _unmap, address, length)

    def reserve(self):
        """Replace the mapping by a ``PROT_NONE`` reservation of the same addresses (one
        ``mmap(MAP_FIXED)``: no other mapping can take them meanwhile). The memory is given
        up; a view or array of it faults until ``remap``."""
        got = _libc.mmap(self.address, self.length, _PROT_NONE,
                         _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1, 0)
        if got != self.address:
            raise Os("mmap(PROT_NONE, MAP_FIXED)", ctypes.get_errno())

    def remap(self, fd, length):
        """Map committed chunk ``fd`` (checked as a fresh mapping is) over the reservation."""
        if length != self.length:
            raise BadDescriptor(f"a chunk of {length} bytes for a reservation of {self.length}")
        check_committed(fd, length)
        got = _libc.mmap(self.address, length, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != self.address:
            raise Os("mmap(chunk, MAP_FIXED)", ctypes.get_errno())

    def release(self):
        """Unmap now (the mapping or the reservation): a view or array of it must never be
        used after."""
        self._unmap()

    def read(self, offset, length):
        """``length`` bytes from ``offset``, copied."""
        return bytes(self.view(offset, length))

    def view(self, offset=0, length=None):
        """A read-only memoryview of ``length`` bytes from ``offset`` (default: to the end);
        it keeps this mapping alive."""
        length = self.length - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"bytes {offset}..{offset + length} are outside the chunk's "
                             f"{self.length}")
        array = _Pinned.of(length).from_address(self.address + offset)
        array._owner = self
        return memoryview(array).cast("B").toreadonly()


class _Pinned:
    """ctypes byte arrays that keep the mapping they point into alive (``_owner``)."""

    _types = {}

    @classmethod
    def of(cls, length):
        kind = cls._types.get(length)
        if kind is None:
            kind = type(f"_Bytes{length}", (ctypes.c_ubyte * length,), {})
            if len(cls._types) < 256:
                cls._types[length] = kind
        return kind
