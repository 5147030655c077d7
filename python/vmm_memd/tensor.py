"""One named tensor of an attached generation: zero-copy views over the read-only mapping
(a memoryview of host memory, and DLPack for numpy, torch and other consumers: on the CPU for
a host region, on the GPU for a GPU region)."""

import math

from . import dlpack
from .errors import BadReply
from .protocol import Dtype

_INT64_MAX = 2**63 - 1


class Tensor:
    """Tensor ``key`` of an attached generation: ``nbytes`` bytes at ``address`` (inside the
    chunk's read-only mapping, which this object keeps alive), ``dtype``, ``shape``
    (C-contiguous). For a host region, ``numpy.from_dlpack(tensor)`` gives a read-only array
    over the mapping itself; so does ``torch.from_dlpack`` (a CPU tensor whose writes fault).
    For a GPU region, ``address`` is a device address of this process and
    ``torch.from_dlpack(tensor)`` gives a CUDA tensor whose ``data_ptr()`` is it."""

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
        """The tensor's bytes, read-only (host memory only: BufferError for a GPU tensor)."""
        if self.__dlpack_device__() != (dlpack.KDL_CPU, 0):
            raise BufferError(f"tensor {self.key!r} is in GPU memory: use DLPack or tobytes()")
        return self._chunk.view(self.offset, self.nbytes)

    def tobytes(self):
        """A copy of the tensor's bytes (from the GPU for a GPU region)."""
        return self._chunk.read(self.offset, self.nbytes)

    def __dlpack_device__(self):
        return self._chunk.dlpack_device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        device = self.__dlpack_device__()
        # A committed generation never changes, so a consumer's stream has nothing to wait
        # for: any stream is accepted for GPU memory (the DLPack rule is to synchronise with
        # it, and there is no pending work). A CPU tensor takes none.
        if device[0] == dlpack.KDL_CPU and stream not in (None, -1):
            raise BufferError("a CPU tensor takes no stream (stream=None)")
        if dl_device is not None and tuple(dl_device) != device:
            raise BufferError(f"the tensor is on {device}, not on {tuple(dl_device)}")
        if copy:
            raise BufferError("this tensor is exported without a copy only (copy=True asked)")
        versioned = max_version is not None and tuple(max_version)[0] >= dlpack.DLPACK_VERSION[0]
        return dlpack.capsule(self._chunk, self.address, self.shape, self.dtype, versioned,
                              device)

    def __repr__(self):
        return (f"Tensor({self.key!r}, {self.dtype.name}, shape={list(self.shape)}, "
                f"{self.nbytes} bytes at {self.address:#x})")
