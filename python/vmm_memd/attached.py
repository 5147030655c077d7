"""A committed generation attached: its lease, metadata, and chunks mapped read-only."""

from .tensor import Tensor


class Attached:
    """Generation ``generation`` of ``region``, attached through ``client``: lease ``lease``
    (renew it within ``ttl`` seconds with ``client.renew()``; it ends with ``client.detach``
    or the connection), ``meta`` (key -> TensorMeta), ``chunks`` (ReadOnlyChunk; for a GPU
    region GpuChunk views of ``gpu``, the GpuChunks that maps them back to back; ``gpu`` is
    None for a host region).

    The mappings are this process's and stay valid after the lease ends (the kernel keeps the
    pages while a mapping holds them): each Tensor, memoryview or DLPack array keeps the chunk
    it points into mapped."""

    def __init__(self, client, region, lease, generation, chunks, meta, ttl, gpu=None):
        self.client, self.region, self.lease, self.generation = client, region, lease, generation
        self.chunks, self.meta, self.ttl, self.gpu = chunks, meta, ttl, gpu

    def tensor(self, key):
        """Tensor ``key`` (KeyError if there is none)."""
        meta = self.meta[key]
        return Tensor(key, self.chunks[meta.chunk], meta)

    def __getitem__(self, key):
        return self.tensor(key)

    def tensors(self):
        """Every tensor, by key."""
        return {key: self.tensor(key) for key in self.meta}

    def detach(self):
        """End the lease (the mappings stay valid)."""
        self.client.detach(self)

    def __repr__(self):
        return (f"Attached({self.region!r}, generation={self.generation}, lease={self.lease}, "
                f"{len(self.chunks)} chunk(s), {len(self.meta)} tensor(s))")
