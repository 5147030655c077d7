"""Sleep and wake at stable addresses: ``Client.sleep`` gives a region's memory up and ends
the lease while its addresses stay reserved in this process, and ``Client.wake`` maps the
region's current generation at those addresses again, if its layout (chunk sizes, metadata,
and for a GPU region its device) is the one that slept; ``StaleLayout`` otherwise, and the
reservations stay.

- Host regions: each chunk's mapping becomes a ``PROT_NONE`` reservation of the same
  addresses (one ``mmap(MAP_FIXED)``).
- GPU regions: the chunks are unmapped and their imports released (``cuMemUnmap``,
  ``cuMemRelease``) while the mapping's address range stays reserved (``cuMemAddressReserve``
  kept: ``vmm_ipc_cuda.Mapping.unmap_keep_range``); the wake imports the current
  generation's chunks and maps them back to back into that range.

So pointers into the old mapping (a numpy array, a Tensor, a DLPack consumer's, a torch
tensor's ``data_ptr()``) point into the new generation after the wake. While asleep they point
at no memory: a host access faults, a GPU kernel faults, a copy through a Tensor raises
NotMapped. Touch nothing of a sleeping region (as with vLLM's sleep mode, keeping them
unused is the caller's part: this client cannot know who holds a pointer).

The layout hash is vmm-memd's (``vmm_memd::sleep::layout_hash``): FNV-1a, 64-bit, of the
postcard encoding of the chunk sizes and the metadata in key order; for a GPU region
(``layout_hash_on``) the device's 16-byte UUID is hashed on after it.
"""

from .errors import NotAsleep
from .protocol import encode_layout

_FNV_OFFSET, _FNV_PRIME, _MASK = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1


def _fold(h, data):
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & _MASK
    return h


def layout_hash(chunks, meta):
    """The layout hash of a generation with chunk sizes ``chunks`` and metadata ``meta``
    (key -> TensorMeta)."""
    return _fold(_FNV_OFFSET, encode_layout(chunks, meta))


def layout_hash_on(chunks, meta, device=None):
    """``layout_hash`` of a generation on GPU ``device`` (its 16-byte UUID; None for host
    memory, where it is ``layout_hash``): the UUID's bytes are hashed on after the layout, as
    vmm-memd's ``layout_hash_on`` does, so a wake onto another device or backend is stale."""
    h = layout_hash(chunks, meta)
    return h if device is None else _fold(h, bytes(device))


class Sleeping:
    """Region ``region`` asleep in this process since generation ``generation``: its chunks
    (``ReadOnlyChunk`` objects, each now a reservation of its addresses, for a host region;
    the ``GpuChunk`` views of ``gpu``, a ``GpuChunks`` whose range stays reserved, for a GPU
    region) and its layout hash. Give it to ``Client.wake``. The reservations go with
    ``close()``, or once nothing refers to them (this object, and every Tensor, view or
    DLPack capsule made before the sleep)."""

    def __init__(self, region, generation, layout, chunks, gpu=None):
        self.region, self.generation, self.layout, self.chunks = region, generation, layout, chunks
        self.gpu = gpu
        self.state = "asleep"  # then "woken" (by Client.wake) or "closed"

    def addresses(self):
        """Where each chunk is reserved (where the wake maps it)."""
        return [c.address for c in self.chunks]

    def gpu_address(self):
        """A GPU region's device address before the sleep, where the wake maps it (None for
        a host region)."""
        return None if self.gpu is None else self.gpu.address

    def close(self):
        """Give the reserved addresses back now (nothing once woken): this sleeper cannot be
        woken after, and anything that still points there (a Tensor, a view, a DLPack
        consumer of the slept region) must never be used again (other memory may be mapped
        there later)."""
        if self.state != "asleep":
            return
        self.state = "closed"
        if self.gpu is not None:
            self.gpu.close()
        else:
            for chunk in self.chunks:
                chunk.release()

    def _check_asleep(self):
        """NotAsleep unless this can be woken (before anything is sent)."""
        if self.state != "asleep":
            raise NotAsleep(self.region, f"this sleeper is {self.state}: wake what a sleep "
                                         f"gives, once")
        if self.gpu is not None and not self.gpu.asleep:
            raise NotAsleep(self.region, "its GPU mapping is not asleep (closed, or woken "
                                         "through another sleeper)")

    def __repr__(self):
        kind = "" if self.gpu is None else f" on GPU {self.gpu.uuid.hex()} at " \
                                           f"{self.gpu.address:#x}"
        return (f"Sleeping({self.region!r}, generation={self.generation}, "
                f"{len(self.chunks)} chunk(s){kind}, layout={self.layout:#018x})")
