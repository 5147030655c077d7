"""Probe: can a process that imported a chunk from a POSIX fd (as vmm-memd after a restart, from
its keeper) export that chunk as a fabric handle, where the chunk was made with both handle
types requested? Three processes: `creator` (cuMemCreate with POSIX_FD|FABRIC, pattern, export
an fd, release its own handle, so the fd alone keeps the memory), `reexporter` (imports the fd,
exports FABRIC from the imported handle), `importer` (imports the fabric handle, reads).

    python3 gpu/probe_fabric_reexport.py        # from the repository root, on the GPU machine
"""

import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import vmm_ipc_cuda as vc  # noqa: E402
from cuda.bindings import driver as cu  # noqa: E402

PATTERN = b"kept-by-the-keeper" * 4


def creator():
    ctx = vc.Context(0)
    prop = ctx.prop()
    both = int(vc.POSIX_FD) | int(vc.FABRIC)
    try:
        prop.requestedHandleTypes = both
    except (TypeError, ValueError):
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType(both)
    size = ctx.granularity
    handle = vc.check(cu.cuMemCreate(size, prop, 0), "cuMemCreate (fd|fabric)")
    fd = int(vc.check(cu.cuMemExportToShareableHandle(handle, vc.POSIX_FD, 0), "export fd"))
    mapping = vc.Mapping(ctx, [handle], [size], size)
    mapping.write(0, PATTERN)
    mapping.close()  # the handle is released: the fd alone keeps the memory
    me = os.path.abspath(__file__)
    re = subprocess.Popen([sys.executable, me, "reexporter", str(fd), str(size)], pass_fds=[fd],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    os.close(fd)
    line = re.stdout.readline().strip()
    print("reexporter:", line[:40] + ("..." if len(line) > 40 else ""), flush=True)
    ok = False
    if line.startswith("FABRIC "):
        imp = subprocess.run([sys.executable, me, "importer", line.split()[1], str(size)],
                             capture_output=True, text=True, timeout=120)
        print("importer:", imp.stdout.strip(), imp.stderr.strip()[-400:], flush=True)
        ok = imp.returncode == 0 and "EQUAL" in imp.stdout
    re.stdin.close()
    re.wait(timeout=60)
    print("PROBE fabric re-export of an imported fd:", "WORKS" if ok else "FAILS", flush=True)


def reexporter(fd, size):
    ctx = vc.Context(0)
    handle = vc.check(cu.cuMemImportFromShareableHandle(fd, vc.POSIX_FD), "import fd")
    try:
        exported = vc.check(cu.cuMemExportToShareableHandle(handle, vc.FABRIC, 0),
                            "export fabric from the imported handle")
        data = bytes(getattr(exported, "data", exported))
        print("FABRIC", data.hex(), flush=True)
    except RuntimeError as e:
        print("REFUSED", e, flush=True)
    # Also: what the driver says the imported handle's properties are.
    prop = vc.check(cu.cuMemGetAllocationPropertiesFromHandle(handle), "properties")
    print(f"(imported handle's requestedHandleTypes: {int(prop.requestedHandleTypes)})",
          file=sys.stderr, flush=True)
    sys.stdin.read()  # keep the import until the creator says
    vc.check(cu.cuMemRelease(handle), "release")
    del ctx, size


def importer(hexdata, size):
    ctx = vc.Context(0)
    handle = vc.check(vc._import_fabric_handle(bytes.fromhex(hexdata)), "import fabric")
    mapping = vc.Mapping(ctx, [handle], [size], size)
    got = mapping.read(0, len(PATTERN))
    print("EQUAL" if got == PATTERN else f"DIFFERENT {got[:16]!r}", flush=True)
    mapping.close()


if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else "creator"
    if role == "creator":
        creator()
    elif role == "reexporter":
        reexporter(int(sys.argv[2]), int(sys.argv[3]))
    else:
        importer(sys.argv[2], int(sys.argv[3]))
