"""One named tensor of an attached generation: zero-copy views over the read-only mapping
(a memoryview, and DLPack for numpy, torch and other consumers)."""

import math

from . import dlpack
from .errors import BadReply
from .protocol import Dtype

_INT64_MAX = 2**63 - 1


class Tensor:
    """Tensor ``key`` of an attached generation: ``nbytes`` bytes at ``address`` (inside the
    chunk's read-only mapping, which this object keeps alive), ``dtype``, ``shape``
    (C-contiguous). ``numpy.from_dlpack(tensor)`` gives a read-only array over the mapping
    itself; so does ``torch.from_dlpack`` (a CPU tensor whose writes fault)."""

    def __init__(self, key, chunk, meta):
        dtype = Dtype(meta.dtype)
        elements = math.prod(meta.shape)
        if any(d > _INT64_MAX for d in meta.shape) or elements * dtype.itemsize != meta.len:
            raise BadReply(f"tensor {key!r}: shape {list(meta.shape)} of {dtype.name} is "
                           f"{elements * dtype.itemsize} bytes, its length says {meta.len}")
        self.key, self.dtype, self.shape = key, dtype, tuple(meta.shape)
        self.nbytes, self.offset, self.chunk_index = meta.len, meta.offset, meta.chunk
        self._chunk = chunk
        self.address = chunk.address + meta.offset

    def memoryview(self):
        """The tensor's bytes, read-only."""
        return self._chunk.view(self.offset, self.nbytes)

    def __dlpack_device__(self):
        return (dlpack.KDL_CPU, 0)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if stream not in (None, -1):
            raise BufferError("a CPU tensor takes no stream (stream=None)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"the tensor is on the CPU (1, 0), not on {tuple(dl_device)}")
        if copy:
            raise BufferError("this tensor is exported without a copy only (copy=True asked)")
        versioned = max_version is not None and tuple(max_version)[0] >= dlpack.DLPACK_VERSION[0]
        return dlpack.capsule(self._chunk, self.address, self.shape, self.dtype, versioned)

    def __repr__(self):
        return (f"Tensor({self.key!r}, {self.dtype.name}, shape={list(self.shape)}, "
                f"{self.nbytes} bytes at {self.address:#x})")
