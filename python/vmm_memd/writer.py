"""A pending generation, as its writer holds it: chunks mapped writable in this process,
metadata to send, then the commit."""

from .errors import MemdError, Refused


class Writer:
    """Generation ``generation`` of ``region``, pending: fill ``chunks`` (``mmap.mmap``
    objects, writable; for a GPU region ``gpu``, a writable GpuChunks, filled with
    :meth:`write` or :meth:`copy_from_device`), describe tensors with :meth:`put`, then
    :meth:`commit`. Used as a context manager, it aborts the generation unless it was
    committed.

    Commit unmaps the chunks here first, since the service cannot seal a memfd against writes
    while any process maps it writable: a memoryview of a chunk still alive keeps it mapped,
    and the service then refuses the commit with StillMapped (the generation stays pending:
    release the view and call :meth:`commit` again, or :meth:`abort`)."""

    def __init__(self, client, region, generation, chunks, gpu=None):
        self.client, self.region, self.generation = client, region, generation
        self.chunks, self.gpu = chunks, gpu
        self._meta = []
        self._meta_sent = False
        self.finished = False

    def chunk(self, index):
        return self.chunks[index]

    def write(self, chunk, offset, data):
        """Copy ``data`` (bytes-like) to ``offset`` in chunk ``chunk``."""
        if self.gpu is not None:
            self.gpu.write(chunk, offset, bytes(data))
        else:
            self.chunks[chunk][offset:offset + len(data)] = data

    def copy_from_device(self, chunk, offset, source, length):
        """GPU regions: copy ``length`` bytes from device address ``source`` (see
        GpuChunks.copy_from_device for the stream it runs on)."""
        if self.gpu is None:
            raise TypeError("a host region is filled from the host (write)")
        self.gpu.copy_from_device(chunk, offset, source, length)

    def put(self, key, meta):
        """Describe tensor ``key`` (a TensorMeta); sent at commit, and checked by the service
        to lie inside its chunk."""
        if self._meta_sent:
            raise RuntimeError("the metadata was sent already (a commit was tried)")
        self._meta.append((key, meta))

    def _unmap(self):
        # The GPU mapping goes first: the service's digests at commit then see the final
        # bytes, and nothing of ours can write after.
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
        kept = []
        for m in self.chunks:
            try:
                m.close()
            except BufferError:  # a view of it is alive: the service will say StillMapped
                kept.append(m)
        self.chunks = kept

    def commit(self, timeout=None):
        """Unmap, send the metadata, commit: the generation becomes current, read-only for
        everyone. Its number. Metadata the service refuses aborts the generation. ``timeout``
        (seconds): how long the commit's reply may take, when longer than the connection's
        timeout (see ``Client.commit_pending``)."""
        self._unmap()
        if not self._meta_sent:
            self._meta_sent = True
            try:
                self.client.put_meta(self._meta)
            except Refused:
                self.finished = True
                self.client.abort_pending_quietly()
                raise
        generation = self.client.commit_pending(timeout)
        self.finished = True
        return generation

    def abort(self):
        """Free the generation now."""
        self._unmap()
        self.finished = True
        self.client.abort_pending()

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if not self.finished:
            self._unmap()
            self.finished = True
            try:
                self.client.abort_pending()
            except MemdError:
                if e is None:
                    raise
        return False
