"""The vmm-memd client: one connection to the service (the connection is the lease: every lease
it holds ends when it closes, process death included), speaking postcard requests in DATA
messages of the peer protocol (``vmm_ipc_peer``)."""

import contextlib
import errno
import functools
import os
import time
import weakref

import vmm_ipc_peer as peer
from vmm_ipc_peer.decoding import _discard

from . import protocol as p
from . import gpu
from .errors import (BadReply, GpuImportFailed, GpuRegion, GpuSleepFailed, InvalidRequest,
                     MemdError, NotMapped, Refused, ServiceGone, StaleLayout, Transport)
from .mapping import ReadOnlyChunk
from .service import default_socket
from .keep_alive import Renewer, Turns
from .sleep import Sleeping, layout_hash, layout_hash_on
from .writer import Writer
from .attached import Attached

_GONE_ERRNOS = (errno.ENOENT, errno.ECONNREFUSED, errno.ECONNRESET, errno.EPIPE)


class _Transport:
    """Translates the transport's failures into this package's: the service gone, a message
    that broke the peer protocol (BadReply), anything else (Transport)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, MemdError):
            return False
        if isinstance(e, peer.PeerClosed) or (
                isinstance(e, OSError) and e.errno in _GONE_ERRNOS):
            raise ServiceGone(str(e)) from e
        if isinstance(e, peer.ProtocolError):
            raise BadReply(str(e)) from e
        if isinstance(e, (peer.PeerRefused, OSError)):  # TimeoutError is an OSError
            raise Transport(str(e)) from e
        return False


def _exchange(method):
    """The method is one exchange with the service (a request and every message of its
    reply): it holds the connection's turn throughout, so the renewal thread waits."""
    @functools.wraps(method)
    def exchange(self, *args, **kwargs):
        with self._turns.call():
            return method(self, *args, **kwargs)
    return exchange


class Client:
    """A connection to vmm-memd on endpoint ``name`` (``@abstract`` or a path). One request
    at a time: use it from one thread at a time (or a connection per thread).

    Its leases are kept alive while it holds any: from the first attach on, a daemon thread
    of this client renews them every third of their TTL (``Attached.ttl``), taking turns with
    the client's own calls on the connection; :meth:`set_keep_alive` turns that off (then
    call :meth:`renew` within the TTL). A stopped process stops that thread too, so its
    leases still end by TTL."""

    def __init__(self, conn, name):
        self.conn, self.name = conn, name
        self._contexts = {}  # device UUID -> vmm_ipc_cuda.Context (GPU regions)
        self._devices = {}  # device ordinal -> vmm_ipc_cuda.Context (GPU writers)
        self._turns = Turns()
        self._renewer = None

    @classmethod
    def connect(cls, name=None, expect_uids=None, expect_gids=(), timeout=10.0):
        """Connect to ``name``, by default ``$VMM_MEMD_SOCKET`` or else ``@vmm-memd``
        (:func:`vmm_memd.service.default_socket`: where ``python -m vmm_memd`` serves); the
        service must run as this process's uid unless ``expect_uids`` or ``expect_gids`` say
        otherwise (checked by the kernel's credentials before anything is sent). ServiceGone
        when nobody listens there."""
        if name is None:
            name = default_socket()
        with _Transport():
            conn = peer.connect(name, expect_uids=expect_uids, expect_gids=expect_gids,
                                timeout=timeout)
        return cls(conn, name)

    @classmethod
    def reconnect(cls, name=None, within=10.0, **connect_args):
        """Connect, trying again every 10 ms for up to ``within`` seconds while nobody listens
        (ServiceGone): what a client does after its service died and is being restarted (its
        mappings stay valid meanwhile; its leases are gone, attach again). The last
        ServiceGone when ``within`` passes."""
        deadline = time.monotonic() + within
        while True:
            try:
                return cls.connect(name, **connect_args)
            except ServiceGone:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def close(self):
        """Close the connection (every lease it holds ends), after the renewal thread."""
        self._turns.end()
        if self._renewer is not None:
            self._renewer.join()
        self.conn.close()

    def set_keep_alive(self, on):
        """Keep this connection's leases alive (the default) or not: with it on, a thread
        renews them every third of their TTL while the connection holds any; with it off,
        they end one TTL after the last :meth:`renew`."""
        self._turns.set_enabled(on)

    def _lease_taken(self, ttl):
        """A lease with this TTL (seconds) was taken: renew from now on (the thread starts
        with the first lease)."""
        if self._turns.lease_taken(ttl) and self._renewer is None:
            self._renewer = Renewer(self._turns, weakref.WeakMethod(self._renew_now))
            # A client dropped without close() stops its thread too.
            weakref.finalize(self, self._turns.end)

    def _renew_now(self):
        """The renewal thread's exchange (it holds the connection): leases renewed."""
        with _Transport():
            self.conn.send_data(p.encode_renew())
            data = self.conn.recv_data()
        reply = p.decode_response(data)
        if isinstance(reply, Refused):
            raise reply
        if not isinstance(reply, p.Renewed):
            raise BadReply(f"expected Renewed, got {type(reply).__name__}")
        return reply.count

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the exchange --------------------------------------------------------------------

    @_exchange
    def request_raw(self, data):
        """Send ``data`` as one request; the decoded reply (a Refused is returned, not
        raised). For conformance and attack tests."""
        with _Transport():
            self.conn.send_data(data)
        return self.reply()

    def reply(self):
        """The next reply: one DATA message, decoded strictly."""
        with _Transport():
            data = self.conn.recv_data()
        return p.decode_response(data)

    def request(self, data, expect):
        """Send a request; its reply if it is of type ``expect``, raise the refusal if it is
        one, BadReply otherwise."""
        reply = self.request_raw(data)
        return self._expect(reply, expect)

    @staticmethod
    def _expect(reply, expect):
        if isinstance(reply, Refused):
            raise reply
        if not isinstance(reply, expect):
            raise BadReply(f"expected {expect.__name__}, got {type(reply).__name__}")
        return reply

    def descriptor(self, size):
        """The next message: a HOST_MEMFD descriptor of ``size`` bytes (the caller closes it);
        BadReply (its fds closed) for anything else."""
        with _Transport():
            message = self.conn.recv()
        if isinstance(message, peer.HostDescriptor) and message.fd is not None \
                and message.size == size:
            return message
        _discard(message)
        raise BadReply(f"expected a host descriptor of {size} bytes, got {message!r}")

    # ---- reading -------------------------------------------------------------------------

    def list(self):
        """Regions this uid may read (RegionSummary: name, current generation, bytes)."""
        return list(self.request(p.encode_list(), p.RegionList).regions)

    def status(self):
        """The service's Status as this uid may see it."""
        return self.request(p.encode_status(), p.Status)

    def metrics(self):
        """The service's metrics (Prometheus text) as this uid may see them."""
        return self.request(p.encode_metrics(), p.Metrics).text

    def vmm_descriptor(self, size, uuid):
        """The next message: a CUDA_VMM descriptor of one ``size``-byte chunk (one fd) of the
        device ``uuid`` (the caller closes it); BadReply (its fds closed) for anything else."""
        with _Transport():
            message = self.conn.recv()
        if isinstance(message, peer.VmmDescriptor) and len(message.fds) == 1 \
                and message.chunk_sizes == [size] and message.size == size \
                and message.device_uuid == uuid and message.location == ("device", 0):
            return message
        _discard(message)
        raise BadReply(f"expected a GPU chunk of {size} bytes on {uuid.hex()}, got {message!r}")

    def attach(self, region, generation=None):
        """A lease on ``region``'s current committed generation (or ``generation``, if the
        service still holds it), its metadata, and its chunks mapped read-only: an Attached.
        A GPU region's chunks are imported into this process's device of the same UUID
        (cuda.bindings needed: GpuRegion without it, or without that device)."""
        return self._attach(region, generation, None)

    @_exchange
    def _attach(self, region, generation, sleeping):
        """``attach``, mapping the generation at ``sleeping``'s addresses if it is given
        (StaleLayout, with nothing mapped and the lease given back, for another layout)."""
        reply = self.request_raw(p.encode_attach(region, generation))
        if not isinstance(reply, p.AttachedGpuReply):
            reply = self._expect(reply, p.AttachedReply)
        if len(reply.chunks) > p.MAX_CHUNKS or reply.meta_pages > p.MAX_META_ENTRIES:
            raise BadReply(f"{len(reply.chunks)} chunks and {reply.meta_pages} metadata pages "
                           f"announced")
        self._lease_taken(reply.ttl_ms / 1000.0)
        meta = {}
        for _ in range(reply.meta_pages):
            page = self._expect(self.reply(), p.MetaPage)
            if len(meta) + len(page.entries) > p.MAX_META_ENTRIES:
                raise BadReply(f"more than {p.MAX_META_ENTRIES} metadata entries")
            meta.update(page.entries)
        for key, m in meta.items():
            if m.chunk >= len(reply.chunks) or m.offset + m.len > reply.chunks[m.chunk]:
                self._skip_descriptors(reply.chunks)
                self._detach_quietly(reply.lease)
                raise BadReply(f"tensor {key!r} lies outside its chunk ({m})")
        gpu_reply = isinstance(reply, p.AttachedGpuReply)
        if sleeping is not None:
            layout = layout_hash_on(reply.chunks, meta, reply.device if gpu_reply else None)
            if layout != sleeping.layout or gpu_reply != (sleeping.gpu is not None):
                self._skip_descriptors(reply.chunks)
                self._detach_quietly(reply.lease)
                raise StaleLayout(region, sleeping.layout, layout)
        mapped = None
        if gpu_reply:
            mapped = self._gpu_chunks(region, reply, sleeping)
            chunks = [mapped.chunk(i) for i in range(len(reply.chunks))] if sleeping is None \
                else sleeping.chunks
        elif sleeping is None:
            chunks = self._host_chunks(reply, lambda i, d, size: ReadOnlyChunk(d.fd, size))
        else:
            try:
                chunks = self._host_chunks(reply,
                                           lambda i, d, size: _remapped(sleeping, i, d, size))
            except MemdError:
                for chunk in sleeping.chunks:  # those remapped already go back to sleep
                    chunk.reserve()
                raise
        if sleeping is not None:
            sleeping.state = "woken"
        return Attached(self, region, reply.lease, reply.generation, chunks, meta,
                        reply.ttl_ms / 1000.0, gpu=mapped)

    def _host_chunks(self, reply, place):
        """Each host chunk's descriptor given to ``place(index, descriptor, size)``, which
        maps it; what it made. On a failure the reply's other descriptors are read and closed
        and the lease given back (unless the service is gone)."""
        chunks = []
        for i, size in enumerate(reply.chunks):
            try:
                with self.descriptor(size) as d:
                    chunks.append(place(i, d, size))
            except MemdError as e:
                if not isinstance(e, ServiceGone):
                    self._skip_descriptors(reply.chunks[i + 1:])
                    self._detach_quietly(reply.lease)
                raise
        return chunks

    # ---- sleep and wake ----------------------------------------------------------------

    def sleep(self, attached, discard=False):
        """Give ``attached``'s memory up, keeping its addresses reserved in this process, and
        end its lease: a Sleeping for :meth:`wake`. A host region's chunks become
        ``PROT_NONE`` reservations of their addresses; a GPU region's chunks are unmapped and
        their imports released while the mapping's address range stays reserved (no other
        allocation of this process can take it).

        Anything that points into the mapping (Tensors, views, DLPack consumers, torch
        tensors over a GPU region) may be kept but must not be used until the wake, after
        which it points at the woken generation's bytes at the same addresses; this client
        cannot know who holds such pointers and does not refuse the sleep for them.

        With ``discard`` (needs the region's write right: for memory whose contents need not
        survive, such as a KV cache) the service frees the generation's memory once every
        lease on it has ended, and the wake gets it again, zeroed. A discard refused
        (AccessDenied) leaves ``attached`` untouched: still mapped and leased. A lease the
        service no longer has (expired, the service gone) is no failure. A GPU attachment
        whose mapping is asleep or closed already is NotMapped (nothing sent); a driver that
        refuses to unmap it, GpuSleepFailed."""
        gpu = getattr(attached, "gpu", None)
        if gpu is not None and not gpu.mapped:
            raise NotMapped(attached.region, "its GPU mapping is asleep or closed already")
        lease_gone = False
        if discard:
            try:
                self.request(p.encode_discard(attached.lease), p.Done)
                lease_gone = True
            except ServiceGone:
                lease_gone = True
            except InvalidRequest as e:
                if e.rule != "NoSuchLease":
                    raise
                lease_gone = True
        if gpu is not None:
            layout = layout_hash_on(gpu.sizes, attached.meta, gpu.uuid)
            try:
                gpu.sleep()
            except (RuntimeError, ValueError) as e:
                raise GpuSleepFailed(attached.region, str(e)) from e
        else:
            layout = layout_hash([c.length for c in attached.chunks], attached.meta)
            for chunk in attached.chunks:
                chunk.reserve()
        if not lease_gone:
            try:
                self.detach(attached.lease)
            except (ServiceGone, Refused):
                pass
        return Sleeping(attached.region, attached.generation, layout, list(attached.chunks),
                        gpu=gpu)

    def wake(self, sleeping):
        """Attach ``sleeping``'s region's current generation and map it at the slept
        addresses: an Attached whose chunks are the slept ones (for a GPU region, its
        ``gpu`` is the slept GpuChunks, mapped again at the same device address). StaleLayout
        if the layout changed (nothing mapped, the lease given back, ``sleeping`` still
        reserved, to wake later); GpuImportFailed if the driver refuses the chunks (the same,
        the range still reserved). NotAsleep, with nothing sent, for a sleeper woken already
        or closed."""
        sleeping._check_asleep()
        return self._attach(sleeping.region, None, sleeping)

    def _gpu_chunks(self, region, reply, sleeping=None):
        """A GPU generation's descriptors (one per chunk, after its metadata), imported and
        mapped read-only: a GpuChunks, or ``sleeping``'s, mapped again into its reserved
        range. On any failure the descriptors are read and closed and the lease given back
        (unless the service is gone)."""
        descriptors = []
        try:
            for i, size in enumerate(reply.chunks):
                try:
                    descriptors.append(self.vmm_descriptor(size, reply.device))
                except MemdError as e:
                    if not isinstance(e, ServiceGone):
                        self._skip_descriptors(reply.chunks[i + 1:])
                        self._detach_quietly(reply.lease)
                    raise
            try:
                if sleeping is None:
                    return self._import_gpu(region, reply, descriptors)
                return self._wake_gpu(region, reply, descriptors, sleeping.gpu)
            except MemdError:
                self._detach_quietly(reply.lease)
                raise
        finally:
            for d in descriptors:
                d.close()

    @staticmethod
    def _wake_gpu(region, reply, descriptors, slept):
        try:
            slept.wake([d.fds[0] for d in descriptors], reply.chunks)
        except (RuntimeError, ValueError) as e:
            raise GpuImportFailed(region, str(e)) from e
        return slept

    def _import_gpu(self, region, reply, descriptors):
        cuda = gpu._cuda()
        if cuda is None:
            raise GpuRegion(region, reply.device, "cuda.bindings is not installed")
        try:
            ctx = self._contexts.get(reply.device)
            if ctx is None:
                ctx = cuda.context_for_uuid(reply.device)
                if ctx is None:
                    raise GpuRegion(region, reply.device, "no device of this process has it")
                self._contexts[reply.device] = ctx
            return gpu.GpuChunks(cuda, ctx, [d.fds[0] for d in descriptors], reply.chunks,
                                 reply.device, region=region)
        except (RuntimeError, ValueError) as e:
            raise GpuImportFailed(region, str(e)) from e

    def verify(self, region, generation=None):
        """Check a committed generation against the digests taken at its commit (GPU
        regions; a host region is sealed and has none): Verified, or DigestMismatch raised."""
        return self.request(p.encode_verify(region, generation), p.Verified)

    def _skip_descriptors(self, sizes):
        for size in sizes:
            try:
                self.descriptor(size).close()
            except BadReply:
                pass

    def _detach_quietly(self, lease):
        try:
            self.detach(lease)
        except MemdError:
            pass

    def detach(self, attached):
        """End a lease (an Attached or its lease number). The mapping stays valid."""
        lease = attached.lease if isinstance(attached, Attached) else int(attached)
        self.request(p.encode_detach(lease), p.Done)

    def renew(self):
        """Renew every lease of this connection for another TTL; how many."""
        return self.request(p.encode_renew(), p.Renewed).count

    # ---- writing -------------------------------------------------------------------------

    def _begin_request(self, data, expect, wait):
        """A Begin or BeginOn request, whose reply may take ``wait`` seconds more."""
        timeout = self.conn.sock.gettimeout()
        if timeout is not None:
            self.conn.sock.settimeout(timeout + wait)
        try:
            return self.request(data, expect)
        finally:
            self.conn.sock.settimeout(timeout)

    @_exchange
    def begin_gpu(self, region, chunks, device=0, acl=p.Acl(), wait=0.0, token=None):
        """Begin the next generation of GPU region ``region`` on device ``device`` (an ordinal
        of this process; the region is created there if new) with chunks of at least these
        sizes (the service rounds each up to the device's granularity). A Writer whose ``gpu``
        maps the chunks writable here. Needs cuda.bindings (GpuRegion otherwise, before
        anything is sent)."""
        chunks = [int(c) for c in chunks]
        cuda = gpu._cuda()
        if cuda is None:
            raise GpuRegion(region, b"", "cuda.bindings is not installed")
        ctx = self._devices.get(device)
        if ctx is None:
            try:
                ctx = self._devices[device] = cuda.Context(device)
            except (RuntimeError, ValueError) as e:
                raise GpuImportFailed(region, str(e)) from e
        reply = self._begin_request(
            p.encode_begin_gpu(region, chunks, ctx.uuid, acl, int(wait * 1000)), p.BeganGpu,
            wait)
        if reply.device != ctx.uuid or len(reply.chunks) != len(chunks) or any(
                got < asked for got, asked in zip(reply.chunks, chunks)):
            self.abort_pending_quietly()
            raise BadReply(f"asked for chunks {chunks} on {ctx.uuid.hex()}, the service "
                           f"announced {list(reply.chunks)} on {reply.device.hex()}")
        descriptors, received = [], 0
        try:
            for size in reply.chunks:
                received += 1
                descriptors.append(self.vmm_descriptor(size, ctx.uuid))
            try:
                mapped = gpu.GpuChunks(cuda, ctx, [d.fds[0] for d in descriptors],
                                       reply.chunks, ctx.uuid, writable=True, region=region)
            except (RuntimeError, ValueError) as e:
                raise GpuImportFailed(region, str(e)) from e
        except MemdError as e:
            if not isinstance(e, ServiceGone):
                self._skip_descriptors(reply.chunks[received:])
                self.abort_pending_quietly()
            raise
        finally:
            for d in descriptors:
                d.close()
        return self._named(Writer(self, region, reply.generation, [], gpu=mapped), token)

    def _named(self, writer, token):
        """``writer``, its generation named by ``token`` if one is given (a refusal aborts
        the generation and is raised)."""
        if token is not None:
            try:
                self.request(p.encode_token(token), p.Done)
            except MemdError:
                writer._unmap()
                writer.finished = True
                self.abort_pending_quietly()
                raise
        return writer

    def commit_state(self, region, token):
        """What became of ``region``'s generation named ``token`` (``begin(..., token=)``):
        a CommitState, "Landed" (with its generation), "Pending" (its writer's connection is
        open and has not committed: ask again once it has ended) or "Unknown" (it did not
        land). Needs the region's write right."""
        return self.request(p.encode_commit_state(region, token), p.CommitState)

    @_exchange
    def begin(self, region, chunks, acl=p.Acl(), wait=0.0, token=None):
        """Begin the next generation of ``region`` with chunks of these sizes (bytes); wait up
        to ``wait`` seconds for another writer to finish. A Writer, its chunks mapped writable.
        ``token`` (16 bytes of the writer's choosing, ``commit_token()``) names the generation:
        after a commit whose reply was lost, :meth:`commit_state` says whether it landed; a
        token the region knows already is refused (InvalidRequest, rule "Token") and the
        generation aborted."""
        chunks = [int(c) for c in chunks]
        reply = self._begin_request(p.encode_begin(region, chunks, acl, int(wait * 1000)),
                                    p.Began, wait)
        if list(reply.chunks) != chunks:
            raise BadReply(f"asked for chunks {chunks}, the service announced "
                           f"{list(reply.chunks)}")
        maps = []
        try:
            for size in chunks:
                with self.descriptor(size) as d:
                    try:
                        maps.append(d.map(max_size=size))
                    except peer.ProtocolError as e:
                        raise BadReply(f"a pending chunk: {e}") from None
        except MemdError as e:
            for m in maps:
                m.close()
            if not isinstance(e, ServiceGone):
                self.abort_pending_quietly()
            raise
        return self._named(Writer(self, region, reply.generation, maps), token)

    def commit_pending(self, timeout=None):
        """Commit this connection's pending generation; its number. ``timeout`` (seconds), when
        longer than the connection's own, is how long the reply may take: the service takes a
        GPU generation's digests (reads every byte) before it answers."""
        with self._patience(timeout):
            return self.request(p.encode_commit(), p.Committed).generation

    @contextlib.contextmanager
    def _patience(self, seconds):
        """The connection's timeout raised to ``seconds`` for the block (never lowered; a
        connection without a timeout keeps none)."""
        current = self.conn.sock.gettimeout()
        if seconds is None or current is None or seconds <= current:
            yield
            return
        self.conn.sock.settimeout(seconds)
        try:
            yield
        finally:
            self.conn.sock.settimeout(current)

    def abort_pending(self):
        """Free this connection's pending generation."""
        self.request(p.encode_abort(), p.Done)

    def abort_pending_quietly(self):
        try:
            self.abort_pending()
        except MemdError:
            pass

    def put_meta(self, entries):
        """Send metadata entries (key, TensorMeta) of the pending generation, in requests
        that each fit the service's request cap."""
        for page in p.meta_pages(list(entries)):
            self.request(page, p.Done)

    def delete(self, region):
        """Delete ``region`` (needs the delete right)."""
        self.request(p.encode_delete(region), p.Done)

    def release_all(self):
        """Delete every region of the service, giving their memory back for good (a stop, a
        restart or an upgrade of the service keeps it): the service's admins only
        (``NotAdmin`` for anyone else). A region a writer is filling or waiting for stays:
        ``Released(regions, busy)``."""
        return self.request(p.encode_release_all(), p.Released)


def commit_token():
    """A fresh commit token: 16 random bytes (``os.urandom``)."""
    return os.urandom(16)


def _remapped(sleeping, index, descriptor, size):
    """Chunk ``index`` of ``sleeping`` with ``descriptor``'s memory mapped over its
    reservation."""
    if index >= len(sleeping.chunks):
        raise BadReply(f"a chunk {index} for a region that slept with {len(sleeping.chunks)}")
    chunk = sleeping.chunks[index]
    chunk.remap(descriptor.fd, size)
    return chunk
