"""A strict fake of the part of ``cuda.bindings.driver`` that ``python/vmm_ipc_cuda.py`` uses, so
its logic (handle and fd ownership, reserve/map/access order, copies across chunk boundaries,
rollback) is tested without a GPU. Physical allocations are memfds named ``MEMFD_NAME``; an
exported "POSIX fd" is a duplicate of one; an import takes the fd by value and leaves it open, as
the driver does, and refuses any other fd. The Rust fake driver (``vmm-fake-driver``, a fake
``libcuda.so`` the real vmm-memd runs on in ``vmm-memd/tests/python_fake_gpu.rs``) makes its
allocations the same way and has the same device ``UUID``: fds cross between the two fakes.

Calls return ``(CUresult, value...)`` tuples like the real bindings, and refuse what the real
driver refuses (unknown handles, unmapped or unaccessible addresses, a wrong handle type, sizes
that are not multiples of the granularity, an fd that is not one of ours).
"""

import ctypes
import enum
import mmap
import os
import secrets

GRANULARITY = 2 << 20
MEMFD_NAME = "fake-cuda"  # vmm-fake-driver's too: /proc/self/fd shows "/memfd:fake-cuda (deleted)"


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_PERMITTED = 800


class CUmemAllocationHandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_NONE = 0
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
    CU_MEM_HANDLE_TYPE_FABRIC = 8


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_INVALID = 0
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAccess_flags(enum.IntEnum):
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(enum.IntEnum):
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUmemLocation:
    def __init__(self):
        self.type = CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID
        self.id = 0


class CUmemAllocationProp:
    def __init__(self):
        self.type = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_INVALID
        self.location = CUmemLocation()
        self.requestedHandleTypes = CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE


class CUmemAccessDesc:
    def __init__(self):
        self.location = CUmemLocation()
        self.flags = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE


class CUuuid:
    def __init__(self, data):
        self.bytes = data


class CUmemGenericAllocationHandle(int):
    pass


class CUmemFabricHandle:
    """64 opaque bytes (``data``), as cuda.bindings' CUmemFabricHandle."""

    def __init__(self, data=bytes(64)):
        self.data = bytes(data)

    def __repr__(self):
        return "CUmemFabricHandle(<64 bytes>)"


class CUdeviceptr(int):
    pass


_state = {"init": False, "current": False}
_allocations = {}  # handle -> (memfd, size, requested handle type: NONE when imported)
_fabric = {}  # fabric handle bytes -> the allocation's handle, while it lives
_reservations = {}  # va -> size
_mappings = {}  # va -> (size, handle, mmap, access: None, "read" or "rw")
_next = {"handle": 1, "va": 1 << 40}
UUID = bytes(range(16))


def _ok(*values):
    return (CUresult.CUDA_SUCCESS, *values)


def _err(code):
    return (code,)


def _ready():
    return _state["init"] and _state["current"]


def cuGetErrorName(error):
    return _ok(CUresult(error).name.encode())


def cuInit(flags):
    _state["init"] = True
    return _ok()


def cuDeviceGetCount():
    if not _state["init"]:
        return _err(CUresult.CUDA_ERROR_NOT_INITIALIZED)
    return _ok(1)


def cuDeviceGet(ordinal):
    if not _state["init"]:
        return _err(CUresult.CUDA_ERROR_NOT_INITIALIZED)
    if ordinal != 0:
        return _err(CUresult.CUDA_ERROR_INVALID_DEVICE)
    return _ok(ordinal)


def cuDevicePrimaryCtxRetain(device):
    return _ok(("context", device))


def cuCtxSetCurrent(context):
    _state["current"] = context is not None
    return _ok()


def cuDeviceGetUuid(device):
    return _ok(CUuuid(UUID))


def cuMemGetAllocationGranularity(prop, option):
    if not isinstance(prop, CUmemAllocationProp) or not isinstance(
            option, CUmemAllocationGranularity_flags):
        raise TypeError("cuMemGetAllocationGranularity(prop, option)")
    return _ok(GRANULARITY)


def cuMemCreate(size, prop, flags):
    if not _ready():
        return _err(CUresult.CUDA_ERROR_INVALID_CONTEXT)
    if size % GRANULARITY or prop.type != CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED \
            or prop.location.type != CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    handle = CUmemGenericAllocationHandle(_next["handle"])
    _next["handle"] += 1
    requested = CUmemAllocationHandleType(prop.requestedHandleTypes)
    _allocations[handle] = (fd, size, requested)
    return _ok(handle)


def cuMemExportToShareableHandle(handle, handle_type, flags):
    entry = _allocations.get(int(handle))
    if entry is None or flags or handle_type not in (
            CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC):
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    fd, _, requested = entry
    if requested != handle_type:  # not requested at cuMemCreate, or an imported allocation
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    if handle_type == CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC:
        for data, owner in _fabric.items():
            if owner == int(handle):
                return _ok(CUmemFabricHandle(data))
        data = secrets.token_bytes(64)
        _fabric[data] = int(handle)
        return _ok(CUmemFabricHandle(data))
    return _ok(os.dup(fd))


def _import_fabric(os_handle):
    if isinstance(os_handle, (int, CUmemFabricHandle)):
        raise TypeError("this fake takes a fabric handle's bytes (a buffer), as cuda.bindings "
                        "passes a bytes object's address")
    data = bytes(memoryview(os_handle))
    if len(data) != 64:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    owner = _fabric.get(data)
    if owner is None:  # forged, or the exporter released the memory
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    fd, size, _ = _allocations[owner]
    handle = CUmemGenericAllocationHandle(_next["handle"])
    _next["handle"] += 1
    _allocations[handle] = (os.dup(fd), size, CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE)
    return _ok(handle)


def _is_allocation(fd):
    """Whether ``fd`` is an exported allocation of either fake: a memfd named MEMFD_NAME (the
    driver refuses an fd that is no exported allocation, a host region's memfd included)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:{MEMFD_NAME} (deleted)"
    except OSError:
        return False


def cuMemImportFromShareableHandle(os_handle, handle_type):
    if handle_type == CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC:
        return _import_fabric(os_handle)
    if not isinstance(os_handle, int) or handle_type != \
            CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    if not _is_allocation(os_handle):
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    st = os.fstat(os_handle)
    if st.st_size == 0 or st.st_size % GRANULARITY:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    # The driver keeps its own reference; the caller's fd stays the caller's.
    fd = os.dup(os_handle)
    handle = CUmemGenericAllocationHandle(_next["handle"])
    _next["handle"] += 1
    _allocations[handle] = (fd, st.st_size, CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE)
    return _ok(handle)


def cuMemRelease(handle):
    entry = _allocations.pop(int(handle), None)
    if entry is None:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    if any(h == int(handle) for (_, h, _, _) in _mappings.values()):
        raise AssertionError("cuMemRelease of a handle that is still mapped (release after unmap)")
    os.close(entry[0])
    for data in [d for d, owner in _fabric.items() if owner == int(handle)]:
        del _fabric[data]  # the exporter's last reference: its fabric handles die with it
    return _ok()


def cuMemAddressReserve(size, alignment, addr, flags):
    """A fresh range; at the hint ``addr`` when it is aligned and overlaps no reservation (as
    the driver, and vmm-fake-driver, honour a hint where the range is free), else elsewhere."""
    if size == 0 or size % GRANULARITY or (alignment and alignment % GRANULARITY) or flags:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    addr = int(addr)
    free = addr and addr % (alignment or GRANULARITY) == 0 and not any(
        va < addr + size and addr < va + total for va, total in _reservations.items())
    va = addr if free else _next["va"]
    _next["va"] = max(_next["va"], va + size + GRANULARITY)
    _reservations[va] = size
    return _ok(CUdeviceptr(va))


def cuMemAddressFree(ptr, size):
    if _reservations.get(int(ptr)) != size:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    if any(int(ptr) <= va < int(ptr) + size for va in _mappings):
        raise AssertionError("cuMemAddressFree of a range that is still mapped")
    del _reservations[int(ptr)]
    return _ok()


def cuMemMap(ptr, size, offset, handle, flags):
    ptr = int(ptr)
    entry = _allocations.get(int(handle))
    inside = any(va <= ptr and ptr + size <= va + total for va, total in _reservations.items())
    if entry is None or not inside or offset or flags or size != entry[1]:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    view = mmap.mmap(entry[0], size)
    _mappings[ptr] = (size, int(handle), view, None)
    return _ok()


def cuMemUnmap(ptr, size):
    entry = _mappings.pop(int(ptr), None)
    if entry is None or entry[0] != size:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    entry[2].close()
    return _ok()


def cuMemSetAccess(ptr, size, desc, count):
    if not isinstance(desc, (list, tuple)) or len(desc) != count or not all(
            isinstance(d, CUmemAccessDesc) for d in desc):
        raise TypeError("cuMemSetAccess(ptr, size, [CUmemAccessDesc], count)")
    ptr, covered = int(ptr), 0
    for va in sorted(_mappings):
        chunk, handle, view, _ = _mappings[va]
        if ptr <= va and va + chunk <= ptr + size:
            flags = {d.flags for d in desc}
            access = ("rw" if CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE in flags
                      else "read" if CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ in flags
                      else None)
            _mappings[va] = (chunk, handle, view, access)
            covered += chunk
    if covered != size:
        return _err(CUresult.CUDA_ERROR_INVALID_VALUE)
    return _ok()


def _pieces(ptr, length, write):
    """(view, offset, length) for each mapped, accessible chunk the range crosses (for a
    ``write``: accessible read-write; the real device faults on a write to a read-only one)."""
    ptr, pieces = int(ptr), []
    while length:
        for va, (chunk, _, view, access) in _mappings.items():
            if va <= ptr < va + chunk:
                if access is None:
                    raise AssertionError("access to memory without cuMemSetAccess")
                if write and access != "rw":
                    raise AssertionError("a write to memory mapped read-only")
                n = min(length, va + chunk - ptr)
                pieces.append((view, ptr - va, n))
                ptr, length = ptr + n, length - n
                break
        else:
            raise AssertionError(f"access to unmapped device address {ptr:#x}")
    return pieces


def cuMemcpyHtoD(dst, src, count):
    if not isinstance(src, int):
        raise TypeError("this fake takes host addresses as ints")
    done = 0
    for view, offset, n in _pieces(dst, count, write=True):
        view[offset:offset + n] = ctypes.string_at(src + done, n)
        done += n
    return _ok()


def cuMemcpyDtoD(dst, src, count):
    data = bytearray()
    for view, offset, n in _pieces(src, count, write=False):
        data += view[offset:offset + n]
    done = 0
    for view, offset, n in _pieces(dst, count, write=True):
        view[offset:offset + n] = data[done:done + n]
        done += n
    return _ok()


def cuMemcpyDtoH(dst, src, count):
    if not isinstance(dst, int):
        raise TypeError("this fake takes host addresses as ints")
    done = 0
    for view, offset, n in _pieces(src, count, write=False):
        ctypes.memmove(dst + done, bytes(view[offset:offset + n]), n)
        done += n
    return _ok()
