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
from .errors import NotAsleep, NotMapped


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
    it).

    Asleep (``sleep()``), the chunks are unmapped and their imports released while the address
    range stays reserved in this process; ``wake(fds, sizes)`` maps other chunks of the same
    sizes there: ``address`` never changes, so pointers into the mapping (Tensors, DLPack
    consumers, torch tensors) point at the woken bytes. Meanwhile they point at no memory:
    a copy through this object raises NotMapped, a kernel that touches them faults."""

    def __init__(self, cuda, ctx, fds, sizes, uuid, writable=False, region=None):
        self._cuda, self._ctx, self.uuid, self.writable = cuda, ctx, uuid, writable
        self.region, self._range = region, None
        self._mapping = self._import(fds, sizes)
        self.ordinal, self.sizes, self.address = ctx.ordinal, list(sizes), self._mapping.va
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self._close = weakref.finalize(self, _release, self._mapping)

    def _import(self, fds, sizes, at=None):
        descriptor = self._cuda.peer.VmmDescriptor(list(fds), sizes, device_uuid=self.uuid,
                                                   device_ordinal=self._ctx.ordinal)
        return self._cuda.import_descriptor(self._ctx, descriptor, read_only=not self.writable,
                                            at=at)

    @property
    def mapped(self):
        """Whether the chunks are mapped (not asleep, not closed)."""
        return self._close.alive

    @property
    def asleep(self):
        """Whether the chunks sleep: unmapped, the address range still reserved here."""
        return self._range is not None and self._range.reserved

    def sleep(self):
        """Unmap the chunks and release their imports, keeping the address range reserved
        (NotMapped if they are not mapped). RuntimeError if the driver refuses: what it left
        mapped is released by ``close`` (or once nothing refers to this object)."""
        if not self.mapped:
            raise NotMapped(self.region, "the GPU mapping is asleep or closed already")
        self._close.detach()  # the mapping is taken apart here: its finalizer must not
        try:
            self._ctx.make_current()
            self._range = self._mapping.unmap_keep_range()
        except BaseException:
            self._close = weakref.finalize(self, _release, self._mapping)
            raise

    def wake(self, fds, sizes):
        """Import ``fds`` (chunks of these ``sizes``, as the ones that slept) and map them
        into the reserved range: at ``address`` again. NotAsleep if this does not sleep;
        RuntimeError or ValueError if the driver or the sizes refuse, nothing mapped and the
        range still reserved."""
        if not self.asleep:
            raise NotAsleep(self.region, "the GPU mapping is not asleep (woken already, or "
                                         "closed)")
        if list(sizes) != self.sizes:
            raise ValueError(f"chunks of {list(sizes)} bytes for a range that slept with "
                             f"{self.sizes}")
        self._ctx.make_current()
        self._mapping = self._import(fds, sizes, at=self._range)
        self._range = None
        self._close = weakref.finalize(self, _release, self._mapping)

    @property
    def dlpack_device(self):
        return (dlpack.KDL_CUDA, self.ordinal)

    def chunk(self, index):
        """Chunk ``index`` as the view a Tensor points into."""
        return GpuChunk(self, index)

    def _check_mapped(self):
        if not self.mapped:
            raise NotMapped(self.region, "the GPU mapping is asleep or closed")

    def read(self, offset, length):
        """``length`` bytes from ``offset`` (across chunks), copied to the host."""
        self._check_mapped()
        self._mapping.ctx.make_current()
        return self._mapping.read(offset, length)

    def write(self, chunk, offset, data):
        """Copy host bytes ``data`` to ``offset`` in chunk ``chunk`` (a writable mapping)."""
        self._bounds(chunk, offset, len(data))
        self._check_mapped()
        self._mapping.ctx.make_current()
        self._mapping.write(self.offsets[chunk] + offset, data)

    def copy_from_device(self, chunk, offset, source, length):
        """Copy ``length`` bytes from device address ``source`` (any device memory this
        process can address: a torch tensor's ``data_ptr()``) to ``offset`` in chunk
        ``chunk``. cuMemcpyDtoD runs on the legacy default stream: it starts after work
        queued there (torch's default stream) and is done when this returns; synchronize
        other streams that write ``source`` first."""
        self._bounds(chunk, offset, length)
        self._check_mapped()
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
        """Unmap now, or free the reserved range if asleep (a Tensor of it must not be used
        after)."""
        self._close()
        if self._range is not None:
            kept, self._range = self._range, None
            kept.close()


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
