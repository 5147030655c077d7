#!/usr/bin/env python3
"""Diagnostic, driver only (cuda.bindings): what a process pays the first time it uses the VMM
calls after its primary context exists, against the second time.

Written to explain the bench's `gpu-child/warm-acked` (take a ready warm child, import a POSIX-fd
descriptor, acknowledge, join): about 75-90 ms on an H200. It prints each step of two identical
cycles in a fresh process (allocate, export, import, reserve, map, set access, copy, unmap,
release). Found on the H200 (driver 580): the first cycle costs about 250 us more than the
second, so first use is not where the time goes; the bench's `warm-returned` / `warm-exit`
split then put it in the child's exit (the kernel's teardown of a CUDA context). A warm child
that also ran one such cycle while it waited returned no sooner (683 us without, 693 us with),
so vmm-core's warm children only retain their primary contexts.

    python3 gpu/diag/first_use.py
"""

import ctypes
import os
import sys
import time

from cuda.bindings import driver as cu

# The repository's Python helpers (python/): `check` raises on a CUresult other than success.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from vmm_ipc_cuda import check  # noqa: E402

POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def timed(label, call, *args):
    t = time.monotonic()
    out = check(call(*args), label)
    print(f"  {label:<34} {(time.monotonic() - t) * 1e6:>10.0f} us", flush=True)
    return out


def prop():
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = 0
    p.requestedHandleTypes = POSIX_FD
    return p


def cycle(n, size):
    print(f"cycle {n}", flush=True)
    handle = timed("cuMemCreate", cu.cuMemCreate, size, prop(), 0)
    fd = int(timed("cuMemExportToShareableHandle(fd)", cu.cuMemExportToShareableHandle,
                   handle, POSIX_FD, 0))
    imported = timed("cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle,
                     fd, POSIX_FD)
    os.close(fd)
    va = int(timed("cuMemAddressReserve", cu.cuMemAddressReserve, size, 0, 0, 0))
    timed("cuMemMap", cu.cuMemMap, va, size, 0, imported, 0)
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = 0
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    timed("cuMemSetAccess", cu.cuMemSetAccess, va, size, [access], 1)
    host = ctypes.create_string_buffer(1)
    timed("cuMemcpyHtoD (1 byte)", cu.cuMemcpyHtoD, va, ctypes.addressof(host), 1)
    timed("cuMemcpyDtoH (1 byte)", cu.cuMemcpyDtoH, ctypes.addressof(host), va, 1)
    timed("cuMemUnmap", cu.cuMemUnmap, va, size)
    timed("cuMemAddressFree", cu.cuMemAddressFree, va, size)
    timed("cuMemRelease(imported)", cu.cuMemRelease, imported)
    timed("cuMemRelease(created)", cu.cuMemRelease, handle)


def main():
    print("start", flush=True)
    timed("cuInit", cu.cuInit, 0)
    device = timed("cuDeviceGet", cu.cuDeviceGet, 0)
    ctx = timed("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain, device)
    timed("cuCtxSetCurrent", cu.cuCtxSetCurrent, ctx)
    size = timed("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity, prop(),
                 cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    cycle(1, size)
    cycle(2, size)


if __name__ == "__main__":
    main()
