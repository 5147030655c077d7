"""A GPU region's generation in this process: the chunks the service sent (one exported POSIX
fd each) imported through cuda.bindings (``vmm_ipc_cuda``), mapped back to back in one
reservation on the device the reply names: read-only for a reader, read-write for the writer
of a pending generation (which fills them by copies from the host or from device memory).

Read-only on the GPU is this client's choice, not a guarantee: the importer sets its own
access, so a hostile reader of the same region can map it writable. Our clients never do, and
``Client.verify`` compares the bytes with the digests the service took at commit, which finds
such a write.

cuda.bindings is imported only here and only when a GPU region is attached: the package stays
standard library only for host regions (``GpuRegion`` is raised where cuda.bindings is
missing or no visible device has the region's UUID).
"""

import weakref

from . import dlpack


def _cuda():
    """vmm_ipc_cuda, or None where cuda.bindings is not installed."""
    try:
        import vmm_ipc_cuda
    except ImportError:
        return None
    return vmm_ipc_cuda


def _release(mapping):
    """Unmap, free the reservation, release the imports: in whichever thread the last
    reference went (its context made current there), quietly at interpreter exit, when the
    driver may be gone already."""
    try:
        mapping.ctx.make_current()
        mapping.close()
    except Exception:  # noqa: BLE001 (a finalizer must not raise)
        pass


class GpuChunks:
    """Chunks of ``sizes`` bytes, imported from ``fds`` (the caller keeps and closes them: the
    import takes each by value) into the device of ``ctx`` and mapped back to back from
    ``address``, read-only unless ``writable``. Unmapped, and the imports released, by
    ``close()`` or once nothing refers to this object (a Tensor or a DLPack consumer keeps
    it)."""

    def __init__(self, cuda, ctx, fds, sizes, uuid, writable=False):
        descriptor = cuda.peer.VmmDescriptor(list(fds), sizes, device_uuid=uuid,
                                             device_ordinal=ctx.ordinal)
        self._cuda = cuda
        self._mapping = cuda.import_descriptor(ctx, descriptor, read_only=not writable)
        self.ordinal, self.sizes, self.address = ctx.ordinal, list(sizes), self._mapping.va
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self._close = weakref.finalize(self, _release, self._mapping)

    @property
    def dlpack_device(self):
        return (dlpack.KDL_CUDA, self.ordinal)

    def chunk(self, index):
        """Chunk ``index`` as the view a Tensor points into."""
        return GpuChunk(self, index)

    def read(self, offset, length):
        """``length`` bytes from ``offset`` (across chunks), copied to the host."""
        self._mapping.ctx.make_current()
        return self._mapping.read(offset, length)

    def write(self, chunk, offset, data):
        """Copy host bytes ``data`` to ``offset`` in chunk ``chunk`` (a writable mapping)."""
        self._bounds(chunk, offset, len(data))
        self._mapping.ctx.make_current()
        self._mapping.write(self.offsets[chunk] + offset, data)

    def copy_from_device(self, chunk, offset, source, length):
        """Copy ``length`` bytes from device address ``source`` (any device memory this
        process can address: a torch tensor's ``data_ptr()``) to ``offset`` in chunk
        ``chunk``. cuMemcpyDtoD runs on the legacy default stream: it starts after work
        queued there (torch's default stream) and is done when this returns; synchronize
        other streams that write ``source`` first."""
        self._bounds(chunk, offset, length)
        if self._mapping.read_only:
            raise PermissionError("this mapping is read-only for the device")
        self._mapping.ctx.make_current()
        cu = self._cuda.cu
        self._cuda.check(cu.cuMemcpyDtoD(self.address + self.offsets[chunk] + offset, source,
                                         length), "cuMemcpyDtoD")

    def _bounds(self, chunk, offset, length):
        if not 0 <= chunk < len(self.sizes) or offset < 0 or length < 0 \
                or offset + length > self.sizes[chunk]:
            raise ValueError(f"{length} bytes at {offset} lie outside chunk {chunk}")

    def close(self):
        """Unmap now (a Tensor of it must not be used after)."""
        self._close()


class GpuChunk:
    """Chunk ``index`` of a GpuChunks: what a Tensor needs (its device address, its DLPack
    device, a copy of its bytes), keeping the whole mapping alive."""

    def __init__(self, chunks, index):
        self.chunks, self.index = chunks, index
        self.address = chunks.address + chunks.offsets[index]
        self.length = chunks.sizes[index]
        self.dlpack_device = chunks.dlpack_device

    def read(self, offset, length):
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"{length} bytes at {offset} lie outside a {self.length}-byte chunk")
        return self.chunks.read(self.chunks.offsets[self.index] + offset, length)
