"""compare.py --cpu only: the strict fake of ``cuda.bindings.driver`` that the Python client's
tests use (``python/tests/fake_cuda``: allocations are memfds, an exported POSIX fd is a
duplicate of one and crosses processes), plus the few calls GMS makes that it lacks
(``cuCtxSynchronize``, ``cuGetErrorString``, ``cuPointerGetAttribute``), so that GMS's
unmodified server and client run their whole protocol (fds over SCM_RIGHTS, locks, metadata,
commit) on a machine without a GPU. Numbers measured on it mean nothing; behaviours do.

GMS's server creates allocations without a context (the real driver allows it), so the fake
is told a context is current from the start."""

import enum
import importlib.util
import os

_here = os.path.dirname(os.path.abspath(__file__))
_root = os.path.abspath(os.path.join(_here, "..", "..", "..", "..", ".."))
_path = os.path.join(_root, "python", "tests", "fake_cuda", "cuda", "bindings", "driver.py")
_spec = importlib.util.spec_from_file_location("_vmm_fake_cuda_driver", _path)
_fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fake)
globals().update({k: v for k, v in vars(_fake).items() if not k.startswith("__")})
_fake._state["current"] = True


class CUpointer_attribute(enum.IntEnum):
    CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3


def cuCtxSynchronize():
    return _fake._ok()


def cuGetErrorString(error):
    return _fake._ok(_fake.CUresult(error).name.encode())


def cuPointerGetAttribute(attribute, ptr):
    ptr = int(ptr)
    if not any(va <= ptr < va + size for va, (size, _, _, _) in _fake._mappings.items()):
        return (_fake.CUresult.CUDA_ERROR_INVALID_VALUE, None)
    return _fake._ok(ptr)
