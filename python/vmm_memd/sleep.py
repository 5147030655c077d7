"""Sleep and wake at stable addresses (host regions): ``Client.sleep`` gives a region's memory
up (its chunks' mappings become ``PROT_NONE`` reservations of the same addresses, and the lease
ends) and ``Client.wake`` maps the region's current generation at those addresses again, if its
layout (chunk sizes and metadata) is the one that slept; ``StaleLayout`` otherwise, and the
reservations stay. So pointers into the old mapping (a numpy array, a DLPack consumer's)
point into the new generation after the wake, and fault while asleep: touch nothing of a
sleeping region.

The layout hash is vmm-memd's (``vmm_memd::sleep::layout_hash``): FNV-1a, 64-bit, of the
postcard encoding of the chunk sizes and the metadata in key order.
"""

from .protocol import encode_layout

_FNV_OFFSET, _FNV_PRIME, _MASK = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1


def layout_hash(chunks, meta):
    """The layout hash of a generation with chunk sizes ``chunks`` and metadata ``meta``
    (key -> TensorMeta)."""
    h = _FNV_OFFSET
    for b in encode_layout(chunks, meta):
        h = ((h ^ b) * _FNV_PRIME) & _MASK
    return h


class Sleeping:
    """Region ``region`` asleep in this process since generation ``generation``: its chunks
    (ReadOnlyChunk objects, each now a reservation of its addresses) and its layout hash.
    Give it to ``Client.wake``; dropping it frees the reservations."""

    def __init__(self, region, generation, layout, chunks):
        self.region, self.generation, self.layout, self.chunks = region, generation, layout, chunks

    def addresses(self):
        """Where each chunk is reserved (where the wake maps it)."""
        return [c.address for c in self.chunks]

    def __repr__(self):
        return (f"Sleeping({self.region!r}, generation={self.generation}, "
                f"{len(self.chunks)} chunk(s), layout={self.layout:#018x})")
