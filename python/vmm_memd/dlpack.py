"""DLPack export of a tensor in a read-only chunk, with ctypes: ``__dlpack__`` hands out a
capsule whose data pointer is the mapping itself (zero-copy), and the capsule, or the array a
consumer made from it, keeps the mapping alive until the consumer calls the deleter.

Two capsule kinds, as the consumer asks (the DLPack Python specification):
- ``dltensor_versioned`` (DLPack 1.0, when the consumer passes ``max_version`` >= (1, 0), as
  numpy 2.1+ and recent torch do): the ``READ_ONLY`` flag is set, so numpy makes a read-only
  array;
- ``dltensor`` (the legacy kind, for older consumers): it cannot say read-only, so the
  consumer may believe the array writable; a write through it faults (SIGSEGV) because the
  pages are mapped ``PROT_READ``, and the memory cannot change.

Ownership: each exported tensor's structs live in ``_LIVE`` (keyed by the managed struct's
address) until its deleter runs: called by the consumer once it is done, or by the capsule's
destructor when no consumer took the capsule.
"""

import ctypes
import threading

from .protocol import Dtype

KDL_CPU = 1
KDL_CUDA = 2
(KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT, KDL_BOOL) = (0, 1, 2, 4, 6)
FLAG_READ_ONLY = 1
DLPACK_VERSION = (1, 0)

_DTYPES = {
    Dtype.U8: (KDL_UINT, 8), Dtype.I8: (KDL_INT, 8), Dtype.U16: (KDL_UINT, 16),
    Dtype.I16: (KDL_INT, 16), Dtype.U32: (KDL_UINT, 32), Dtype.I32: (KDL_INT, 32),
    Dtype.U64: (KDL_UINT, 64), Dtype.I64: (KDL_INT, 64), Dtype.F16: (KDL_FLOAT, 16),
    Dtype.BF16: (KDL_BFLOAT, 16), Dtype.F32: (KDL_FLOAT, 32), Dtype.F64: (KDL_FLOAT, 64),
    Dtype.Bool: (KDL_BOOL, 8),
}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


_LIVE = {}  # managed struct address -> what must outlive it (structs, shape, the mapping)
_LIVE_LOCK = threading.Lock()


@_DELETER
def _delete(address):
    """The DLPack deleter: forget what the exported tensor held (the mapping goes with its
    last holder). Idempotent, so a consumer's call and the capsule destructor cannot both
    free it. At interpreter exit the module's globals may be gone already: nothing to do."""
    try:
        with _LIVE_LOCK:
            _LIVE.pop(address, None)
    except Exception:  # noqa: BLE001 (a C callback must not raise)
        pass


_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


def _destroy(capsule, name):
    # A consumer renames the capsule (``used_...``) when it takes it over; only a capsule
    # nobody took still has its name, and then its tensor is ours to delete.
    if _capsule_is_valid(capsule, name):
        _delete(_capsule_pointer(capsule, name))


@_CAPSULE_DESTRUCTOR
def _destroy_legacy(capsule):
    _destroy(capsule, _NAME)


@_CAPSULE_DESTRUCTOR
def _destroy_versioned(capsule):
    _destroy(capsule, _NAME_VERSIONED)


def dl_dtype(dtype):
    code, bits = _DTYPES[Dtype(dtype)]
    return DLDataType(code, bits, 1)


def capsule(owner, address, shape, dtype, versioned, device=(KDL_CPU, 0)):
    """A DLPack capsule over ``address`` (in a mapping ``owner`` keeps alive): a C-contiguous
    tensor of ``shape`` and ``dtype`` on ``device`` (a DLPack (type, id) pair: the CPU, or a
    GPU's ordinal in this process); ``versioned`` marks it read-only."""
    ndim = len(shape)
    shape_array = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides = [1] * ndim
    for i in range(ndim - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    strides_array = (ctypes.c_int64 * max(ndim, 1))(*strides)
    tensor = DLTensor(address, DLDevice(*device), ndim, dl_dtype(dtype),
                      ctypes.cast(shape_array, ctypes.POINTER(ctypes.c_int64)),
                      ctypes.cast(strides_array, ctypes.POINTER(ctypes.c_int64)), 0)
    if versioned:
        managed = DLManagedTensorVersioned(DLPackVersion(*DLPACK_VERSION), None, _delete,
                                           FLAG_READ_ONLY, tensor)
        name, destructor = _NAME_VERSIONED, _destroy_versioned
    else:
        managed = DLManagedTensor(tensor, None, _delete)
        name, destructor = _NAME, _destroy_legacy
    key = ctypes.addressof(managed)
    with _LIVE_LOCK:
        _LIVE[key] = (managed, shape_array, strides_array, owner)
    try:
        return _capsule_new(key, name, destructor)
    except BaseException:
        _delete(key)
        raise


def live_exports():
    """How many exported tensors are held now (for leak tests)."""
    with _LIVE_LOCK:
        return len(_LIVE)
