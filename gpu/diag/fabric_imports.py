#!/usr/bin/env python3
"""Diagnostic, driver only (cuda.bindings, no vmm-core): does one fabric export serve several
importing processes on this machine, one after another, at once, and after an importer exited?

vmm-core's `one_fabric_export_serves_many_children_that_acknowledge` hung at its second child on
an H200 (driver 580, an IMEX channel node, no IMEX service). This script replays the same driver
calls without vmm-core, so that a hang here is the driver's and the machine's, not ours.

Run as root where the IMEX channel node may be missing (gpu/run.sh creates it), with a timeout:
    python3 gpu/diag/fabric_imports.py
Each scenario prints one line per step with its time; an importer that does not finish within
IMPORT_LIMIT seconds is reported as HUNG (with where it got to) and killed.
"""

import os
import subprocess
import sys
import time

from cuda.bindings import driver as cu

# The repository's Python helpers (python/): `check` raises on a CUresult other than success.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from vmm_ipc_cuda import check  # noqa: E402

FABRIC = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
IMPORT_LIMIT = 20.0


def log(who, what, since=None):
    took = "" if since is None else f" ({(time.monotonic() - since) * 1e6:.0f} us)"
    print(f"[{who} {os.getpid()}] {what}{took}", flush=True)


def context():
    check(cu.cuInit(0), "cuInit")
    device = check(cu.cuDeviceGet(0), "cuDeviceGet")
    ctx = check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return device


def prop():
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = 0
    p.requestedHandleTypes = FABRIC
    return p


def granularity():
    return check(cu.cuMemGetAllocationGranularity(
        prop(), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity")


def handle_bytes(fabric_handle):
    data = fabric_handle.data
    raw = bytes(data) if not isinstance(data, (list, tuple)) else bytes(int(b) & 0xFF for b in data)
    assert len(raw) == 64, len(raw)
    return raw


def import_handle(raw):
    try:
        return check(cu.cuMemImportFromShareableHandle(raw, FABRIC), "cuMemImportFromShareableHandle")
    except TypeError:
        fh = cu.CUmemFabricHandle()
        fh.data = raw
        return check(cu.cuMemImportFromShareableHandle(fh, FABRIC), "cuMemImportFromShareableHandle")


def map_chunks(handles, chunk):
    total = chunk * len(handles)
    va = int(check(cu.cuMemAddressReserve(total, chunk, 0, 0), "cuMemAddressReserve"))
    for i, h in enumerate(handles):
        check(cu.cuMemMap(va + i * chunk, chunk, 0, h, 0), "cuMemMap")
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = 0
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    check(cu.cuMemSetAccess(va, total, [access], 1), "cuMemSetAccess")
    return va, total


def unmap(va, total, handles, chunk):
    for i in range(len(handles)):
        check(cu.cuMemUnmap(va + i * chunk, chunk), "cuMemUnmap")
    check(cu.cuMemAddressFree(va, total), "cuMemAddressFree")
    for h in handles:
        check(cu.cuMemRelease(h), "cuMemRelease")


def read_byte(va):
    import ctypes
    host = ctypes.create_string_buffer(1)
    check(cu.cuMemcpyDtoH(ctypes.addressof(host), va, 1), "cuMemcpyDtoH")
    return host.raw[0]


def write_byte(va, value):
    import ctypes
    host = ctypes.create_string_buffer(bytes([value]), 1)
    check(cu.cuMemcpyHtoD(va, ctypes.addressof(host), 1), "cuMemcpyHtoD")


def importer(argv):
    """Child: import, map, read and write one byte, then release (or not) and exit (skipping the
    atexit handlers, or with them)."""
    ending, hold, chunk, hexes = argv[0], argv[1] == "hold", int(argv[2]), argv[3:]
    t = time.monotonic()
    context()
    log("importer", "context", t)
    handles = []
    for h in hexes:
        t = time.monotonic()
        log("importer", "importing")
        handles.append(import_handle(bytes.fromhex(h)))
        log("importer", "imported", t)
    t = time.monotonic()
    va, total = map_chunks(handles, chunk)
    value = read_byte(va)
    write_byte(va, value ^ 0xFF)
    log("importer", f"mapped, read {value:#04x}, wrote", t)
    if hold:
        print("HOLDING", flush=True)
        sys.stdin.readline()
    if ending in ("release", "release-atexit"):
        t = time.monotonic()
        unmap(va, total, handles, chunk)
        log("importer", "released", t)
    log("importer", f"exiting ({ending})")
    if ending == "release-atexit":
        # A normal exit: the CUDA driver's atexit teardown runs, as it does in a Rust child.
        sys.exit(0)
    os._exit(0)


def start(ending, hold, chunk, hexes):
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "importer", ending,
         "hold" if hold else "go", str(chunk), *hexes],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(child, label):
    t = time.monotonic()
    try:
        out, _ = child.communicate(timeout=IMPORT_LIMIT)
        print(out, end="")
        verdict = "ok" if child.returncode == 0 else f"FAILED rc={child.returncode}"
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
        print(out, end="")
        verdict = f"HUNG (killed after {IMPORT_LIMIT:.0f} s)"
    log("exporter", f"{label}: {verdict}", t)
    return verdict == "ok"


def wait_holding(child, label):
    line = ""
    deadline = time.monotonic() + IMPORT_LIMIT
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line or line.startswith("HOLDING"):
            break
        print(line, end="")
    if not line.startswith("HOLDING"):
        log("exporter", f"{label}: never imported")
        return False
    return True


def scenario(name, body):
    print(f"=== {name}", flush=True)
    t = time.monotonic()
    try:
        ok = body()
    except Exception as error:  # noqa: BLE001 - a diagnostic reports everything
        print(f"error: {error}", flush=True)
        ok = False
    log("exporter", f"{name}: {'PASS' if ok else 'FAIL'}", t)
    return ok


def main():
    t = time.monotonic()
    context()
    log("exporter", "context", t)
    chunk = granularity()
    handles = [check(cu.cuMemCreate(chunk, prop(), 0), "cuMemCreate") for _ in range(2)]
    va, total = map_chunks(handles, chunk)
    write_byte(va, 0x5A)
    exported = []
    for h in handles:
        t = time.monotonic()
        exported.append(handle_bytes(check(cu.cuMemExportToShareableHandle(h, FABRIC, 0),
                                           "cuMemExportToShareableHandle")))
        log("exporter", "exported", t)
    hexes = [h.hex() for h in exported]
    results = {}

    def in_process_twice():
        for n in range(2):
            t = time.monotonic()
            try:
                h = import_handle(exported[0])
            except RuntimeError as error:
                log("exporter", f"in-process import {n}: {error}", t)
                return n > 0 or "INVALID" in str(error)
            log("exporter", f"in-process import {n}", t)
            check(cu.cuMemRelease(h), "cuMemRelease")
        return True

    def sequential(ending):
        return lambda: all(finish(start(ending, False, chunk, hexes), f"importer {n} ({ending})")
                           for n in range(3))

    def overlapping():
        first = start("release", True, chunk, hexes)
        if not wait_holding(first, "first"):
            first.kill()
            return False
        second_ok = finish(start("release", False, chunk, hexes), "second, while the first holds")
        first.stdin.write("\n")
        first.stdin.flush()
        first_ok = finish(first, "first, released after the second")
        third_ok = finish(start("release", False, chunk, hexes), "third, after both exited")
        return second_ok and first_ok and third_ok

    def concurrent():
        children = [start("release", False, chunk, hexes) for _ in range(3)]
        return all([finish(c, f"concurrent importer {n}") for n, c in enumerate(children)])

    results["in-process import twice"] = scenario("in-process import twice", in_process_twice)
    results["sequential, each releases"] = scenario("sequential, each releases", sequential("release"))
    results["sequential, each exits holding"] = scenario("sequential, each exits holding", sequential("exit"))
    results["sequential, each releases, exit with atexit"] = scenario(
        "sequential, each releases, exit with atexit", sequential("release-atexit"))
    results["overlapping"] = scenario("overlapping", overlapping)
    results["concurrent"] = scenario("concurrent", concurrent)
    print(f"exporter byte now {read_byte(va):#04x}", flush=True)
    for name, ok in results.items():
        print(f"RESULT {name}: {'PASS' if ok else 'FAIL'}", flush=True)
    unmap(va, total, handles, chunk)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "importer":
        importer(sys.argv[2:])
    else:
        main()
