"""Host memory: sealed memfds, the filesystem check an import makes, and the test pattern
both languages write into buffers."""

import fcntl
import os


def pattern(seed, length):
    """The test pattern both languages use: byte i is (seed + i % 251) mod 256."""
    period = bytes((seed + i) & 0xFF for i in range(251))
    return (period * (length // 251 + 1))[:length]


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
