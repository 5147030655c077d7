"""CUDA VMM buffers for vmm_ipc_peer, through cuda.bindings (the driver API): allocate and export
a buffer as a Python exporter does, or import a received descriptor as a Python importer does.

Not standard library: it needs ``cuda.bindings`` (``pip install cuda-python``) and a GPU. The
protocol itself is in ``vmm_ipc_peer`` (standard library only).

    import vmm_ipc_cuda as vc, vmm_ipc_peer as peer

    ctx = vc.Context(0)
    owned = vc.Allocation(ctx, chunks=2)             # 2 granules, mapped here, exportable
    owned.write(0, b"hello")
    with peer.connect("@weights") as conn, owned.export() as desc:
        conn.send_descriptor(desc)                   # desc closes its fds on leaving the block

    with peer.connect("@weights") as conn, conn.recv_descriptor() as desc:
        mapping = vc.import_descriptor(ctx, desc)    # import, reserve, map, set access
        data = mapping.read(0, 5)
        mapping.close()

Sleep at a stable address: ``kept = mapping.unmap_keep_range()`` unmaps the chunks and
releases their handles (the memory goes once no one else holds it) but keeps the address
range reserved, an ``AddressRange``; ``import_descriptor(ctx, desc, at=kept)`` maps a
descriptor of the same total size back into it, so device pointers into the old mapping point
into the new one (a failed import leaves ``kept`` reserved, nothing mapped). Closing or
dropping ``kept`` frees the range.

Fabric handles (protocol version 2; needs a GPU with fabric support and an IMEX channel in both
processes): ``Allocation(ctx, chunks=2, fabric=True)`` allocates with
``CU_MEM_HANDLE_TYPE_FABRIC`` requested, ``export_fabric()`` gives a ``peer.FabricDescriptor``
(one 64-byte ``CUmemFabricHandle`` per chunk, no fds: it crosses an endpoint or a byte stream),
and ``import_fabric(ctx, desc)`` imports one. A fabric handle is a bearer token and does not
keep the memory alive: keep the exporting Allocation until the importers have said they
imported. The owner device may be one this process cannot see (another node's, or one hidden by
``CUDA_VISIBLE_DEVICES``): ``import_fabric`` does not compare the owner's UUID with ``ctx``'s;
the driver decides.

cuda.core: ``peer.FabricDescriptor.to_cuda_core()`` builds cuda.core's
``VirtualMemoryFabricBufferDescriptor.from_handles(...)`` and ``from_cuda_core`` reads one back.
That class is new in cuda.core 1.3; the GPU machine has cuda.core 1.2, so neither was tried.
"""

import ctypes
import weakref

from cuda.bindings import driver as cu

import vmm_ipc_peer as peer

POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
FABRIC = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC


def check(result, call):
    """Raise on a CUresult other than success; return the call's other results."""
    err, rest = result[0], result[1:]
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"{call} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


class Context:
    """cuInit, the device's primary context made current (as vmm-core does per call)."""

    def __init__(self, ordinal=0):
        check(cu.cuInit(0), "cuInit")
        self.ordinal = ordinal
        self.device = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        # The _v2 UUID (a MIG instance's own where there is one), as vmm-core names devices;
        # bindings that no longer have _v2 give that UUID under the plain name.
        get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
        self.uuid = bytes(check(get_uuid(self.device), "cuDeviceGetUuid").bytes)
        self.granularity = check(
            cu.cuMemGetAllocationGranularity(
                self.prop(), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity")

    def prop(self, handle_type=POSIX_FD):
        """Pinned device memory on this device, exportable as ``handle_type`` per chunk (a
        POSIX fd, or a fabric handle with FABRIC; requested at cuMemCreate: without it, export
        fails)."""
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.ordinal
        prop.requestedHandleTypes = handle_type
        return prop

    def make_current(self):
        check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")


class AddressRange:
    """``size`` bytes of device address space at ``va`` (a ``cuMemAddressReserve`` of
    ``ctx``'s process), reserved with nothing mapped: what ``Mapping.unmap_keep_range`` keeps
    of a mapping, so that no other allocation of this process can take those addresses, and
    where ``import_descriptor(..., at=range)`` maps again. Freed (``cuMemAddressFree``) by
    ``close()``, or once nothing refers to it; an import at it takes it over (``reserved`` is
    False after: the mapping frees it), and a failed one gives it back intact."""

    def __init__(self, ctx, va, size):
        self.ctx, self.va, self.size = ctx, int(va), int(size)
        self._free = weakref.finalize(self, _free_range, ctx, self.va, self.size)

    @property
    def reserved(self):
        """Whether this object still holds the reservation (not freed, not taken by a
        mapping)."""
        return self._free.alive

    def close(self):
        """Free the reservation now (nothing may be mapped in it); nothing if it is not held
        any more."""
        if self._free.detach() is not None:
            self.ctx.make_current()
            check(cu.cuMemAddressFree(self.va, self.size), "cuMemAddressFree")

    def _take(self):
        """The reservation's address, now owned by the caller (a Mapping)."""
        if self._free.detach() is None:
            raise ValueError("this address range is not reserved here any more (freed, or "
                             "mapped by an import at it)")
        return self.va

    def _give_back(self):
        """The reservation ``_take`` gave, owned by this object again."""
        self._free = weakref.finalize(self, _free_range, self.ctx, self.va, self.size)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "reserved" if self.reserved else "not held"
        return f"AddressRange({self.size} bytes at {self.va:#x}, {state})"


def _free_range(ctx, va, size):
    """An AddressRange's finalizer: quiet (at interpreter exit the driver may be gone)."""
    try:
        ctx.make_current()
        cu.cuMemAddressFree(va, size)
    except Exception:  # noqa: BLE001 (a finalizer must not raise)
        pass


class Mapping:
    """Chunks mapped back to back in one reservation, read-write for the context's device, or
    with ``read_only=True`` read-only (``CU_MEM_ACCESS_FLAGS_PROT_READ``: the device faults on
    a write, and ``write`` refuses). The reservation is a fresh one, or with ``at`` the given
    AddressRange of the sum of the chunk sizes on the same device (taken over on success,
    given back intact, nothing mapped, on failure). ``close()`` unmaps, frees the reservation
    and releases the chunk handles; ``unmap_keep_range()`` unmaps and releases them but keeps
    the reservation, as an AddressRange. The chunk handles are released on failure too."""

    def __init__(self, ctx, handles, chunk_sizes, size, read_only=False, at=None):
        self.ctx, self.handles, self.chunk_sizes, self.size = ctx, list(handles), list(chunk_sizes), size
        self.read_only = read_only
        total = sum(self.chunk_sizes)
        self.va = None
        self.mapped = []
        try:
            if at is None:
                self.va = int(check(cu.cuMemAddressReserve(total, ctx.granularity, 0, 0),
                                    "cuMemAddressReserve"))
            else:
                _check_range(ctx, at, total)
                self.va = at._take()
            offset = 0
            for handle, chunk in zip(self.handles, self.chunk_sizes):
                check(cu.cuMemMap(self.va + offset, chunk, 0, handle, 0), "cuMemMap")
                self.mapped.append((self.va + offset, chunk))
                offset += chunk
            access = cu.CUmemAccessDesc()
            access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = ctx.ordinal
            access.flags = (cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only
                            else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            check(cu.cuMemSetAccess(self.va, total, [access], 1), "cuMemSetAccess")
        except BaseException:
            if at is not None and self.va is not None:
                # The given range goes back to its owner, with nothing mapped in it.
                try:
                    self._unmap_all()
                finally:
                    at._give_back()
                    self.va = None
            self.close()
            raise

    def _unmap_all(self):
        while self.mapped:
            va, chunk = self.mapped[-1]
            check(cu.cuMemUnmap(va, chunk), "cuMemUnmap")
            self.mapped.pop()

    def unmap_keep_range(self):
        """Unmap every chunk and release the chunk handles, but keep the address range
        reserved: an AddressRange of it (``import_descriptor(..., at=range)`` maps there
        again; closing or dropping it frees it). This mapping is closed after (``close`` does
        nothing); device pointers into it must not be used until something is mapped there
        again."""
        if self.va is None:
            raise ValueError("this mapping is closed")
        self._unmap_all()
        kept = AddressRange(self.ctx, self.va, sum(self.chunk_sizes))
        self.va = None
        try:
            self._release_handles()
        except BaseException:
            kept.close()
            raise
        return kept

    def _release_handles(self):
        """Release every chunk handle; the first refusal raised once all were tried."""
        failed = None
        for handle in self.handles:
            try:
                check(cu.cuMemRelease(handle), "cuMemRelease")
            except RuntimeError as e:
                failed = failed or e
        self.handles = []
        if failed is not None:
            raise failed

    def write(self, offset, data):
        if self.read_only:
            raise PermissionError("this mapping is read-only for the device")
        if offset < 0 or offset + len(data) > self.size:
            raise ValueError("write out of bounds")
        host = ctypes.create_string_buffer(bytes(data), len(data))
        check(cu.cuMemcpyHtoD(self.va + offset, ctypes.addressof(host), len(data)), "cuMemcpyHtoD")

    def read(self, offset, length):
        if offset < 0 or offset + length > self.size:
            raise ValueError("read out of bounds")
        host = ctypes.create_string_buffer(length)
        check(cu.cuMemcpyDtoH(ctypes.addressof(host), self.va + offset, length), "cuMemcpyDtoH")
        return host.raw

    def close(self):
        self._unmap_all()
        if self.va is not None:
            check(cu.cuMemAddressFree(self.va, sum(self.chunk_sizes)), "cuMemAddressFree")
            self.va = None
        for handle in self.handles:
            check(cu.cuMemRelease(handle), "cuMemRelease")
        self.handles = []


class Allocation(Mapping):
    """``chunks`` fresh granules (cuMemCreate, exportable), mapped here: as POSIX fds
    (``export``), or with ``fabric=True`` as fabric handles (``export_fabric``)."""

    def __init__(self, ctx, chunks=1, chunk_size=None, size=None, fabric=False):
        chunk_size = chunk_size or ctx.granularity
        self.fabric = fabric
        prop = ctx.prop(FABRIC if fabric else POSIX_FD)
        handles = []
        try:
            for _ in range(chunks):
                handles.append(check(cu.cuMemCreate(chunk_size, prop, 0), "cuMemCreate"))
        except BaseException:
            for handle in handles:
                cu.cuMemRelease(handle)
            raise
        super().__init__(ctx, handles, [chunk_size] * chunks,
                         chunk_size * chunks if size is None else size)

    def export(self):
        """A VmmDescriptor owning one fresh POSIX fd per chunk, naming this device."""
        fds = []
        try:
            for handle in self.handles:
                fds.append(int(check(cu.cuMemExportToShareableHandle(handle, POSIX_FD, 0),
                                     "cuMemExportToShareableHandle")))
        except BaseException:
            peer._close_all(fds)
            raise
        return peer.VmmDescriptor(fds, self.chunk_sizes, self.size, device_uuid=self.ctx.uuid,
                                  device_ordinal=self.ctx.ordinal)

    def export_fabric(self):
        """A FabricDescriptor: one 64-byte fabric handle per chunk (cuMemExportToShareableHandle
        with CU_MEM_HANDLE_TYPE_FABRIC), naming this device as the owner. Needs an Allocation
        made with ``fabric=True``. The handles are bearer tokens and keep nothing alive: keep
        this Allocation until the importers have imported."""
        if not self.fabric:
            raise ValueError("this allocation was not made with fabric=True: the driver exports "
                             "fabric handles only when they were requested at cuMemCreate")
        handles = []
        for i, handle in enumerate(self.handles):
            exported = check(cu.cuMemExportToShareableHandle(handle, FABRIC, 0),
                             f"cuMemExportToShareableHandle (fabric, chunk {i + 1} of "
                             f"{len(self.handles)})")
            data = bytes(getattr(exported, "data", exported))
            if len(data) != peer.FABRIC_HANDLE_LEN:
                raise RuntimeError(f"cuMemExportToShareableHandle gave a {len(data)}-byte fabric "
                                   f"handle for chunk {i + 1}, not {peer.FABRIC_HANDLE_LEN}")
            handles.append(data)
        return peer.FabricDescriptor(handles, self.chunk_sizes, self.size,
                                     owner_uuid=self.ctx.uuid, owner_ordinal=self.ctx.ordinal)


def context_for_uuid(uuid):
    """A Context on the device whose UUID is ``uuid`` (16 bytes), or None if this process
    sees no such device (``CUDA_VISIBLE_DEVICES`` may hide it)."""
    check(cu.cuInit(0), "cuInit")
    get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
    for ordinal in range(check(cu.cuDeviceGetCount(), "cuDeviceGetCount")):
        device = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        if bytes(check(get_uuid(device), "cuDeviceGetUuid").bytes) == bytes(uuid):
            return Context(ordinal)
    return None


def _check_range(ctx, at, total):
    """Refuse (ValueError) an AddressRange that is not one ``total`` bytes of chunks can be
    mapped into on ``ctx``'s device, or that is not held any more."""
    if not isinstance(at, AddressRange):
        raise TypeError(f"at= takes an AddressRange, not {type(at).__name__}")
    if at.ctx.uuid != ctx.uuid:
        raise ValueError("the address range was reserved for another device")
    if at.size != total:
        raise ValueError(f"the address range is {at.size} bytes, the chunks {total}")
    if not at.reserved:
        raise ValueError("the address range is not reserved here any more (freed, or mapped "
                         "by an import at it)")


def import_descriptor(ctx, descriptor, read_only=False, at=None):
    """Import a received VmmDescriptor into ``ctx``'s device: cuMemImportFromShareableHandle per
    fd (the fd is passed by value and stays the descriptor's: close the descriptor after),
    then reserve, map and set access (read-only with ``read_only``). Checks the descriptor
    names this device, if it names one. With ``at`` (an AddressRange of exactly the chunks'
    total size, on this device: ``Mapping.unmap_keep_range``'s) the chunks are mapped into
    that range instead of a fresh reservation, so the mapping's ``va`` is ``at.va``; on any
    failure nothing is mapped and ``at`` is still reserved, to try again."""
    if descriptor.location != ("device", 0):
        raise ValueError(f"this helper imports device memory, not {descriptor.location}")
    if descriptor.device_uuid is not None and descriptor.device_uuid != ctx.uuid:
        raise ValueError("the descriptor's device UUID is not this context's device")
    if at is not None:
        _check_range(ctx, at, sum(descriptor.chunk_sizes))
    handles = []
    try:
        for fd in descriptor.fds:
            handles.append(check(cu.cuMemImportFromShareableHandle(fd, POSIX_FD),
                                 "cuMemImportFromShareableHandle"))
    except BaseException:
        for handle in handles:
            cu.cuMemRelease(handle)
        raise
    return Mapping(ctx, handles, descriptor.chunk_sizes, descriptor.size, read_only=read_only,
                   at=at)


def _import_fabric_handle(data):
    """cuMemImportFromShareableHandle for one 64-byte fabric handle: the driver takes the
    handle's address. cuda.bindings passes a bytes object's buffer as that address; older
    bindings that refuse bytes take a CUmemFabricHandle's address (getPtr()). Errors name no
    handle byte."""
    try:
        return cu.cuMemImportFromShareableHandle(data, FABRIC)
    except TypeError:
        pass
    handle = cu.CUmemFabricHandle()
    handle.data = data
    return cu.cuMemImportFromShareableHandle(handle.getPtr(), FABRIC)


def import_fabric(ctx, descriptor):
    """Import a FabricDescriptor into ``ctx``'s device: cuMemImportFromShareableHandle per
    fabric handle, one reservation of the sum of the chunk sizes, the chunks mapped back to
    back, access set for ``ctx``'s device; on any failure everything done so far is undone
    (imports released, mappings and reservation freed). The owner device (its UUID) may be
    one this process cannot see: it is not compared with ``ctx``'s, the driver decides
    (importing needs an IMEX channel, and fails once the exporter has released the memory)."""
    if not isinstance(descriptor, peer.FabricDescriptor):
        raise TypeError(f"import_fabric takes a FabricDescriptor, not {type(descriptor).__name__}")
    if descriptor.location != ("device", 0):
        raise ValueError(f"this helper imports device memory, not {descriptor.location}")
    n = len(descriptor.handles)
    if n != len(descriptor.chunk_sizes) or n == 0:
        raise ValueError(f"{n} fabric handle(s) for {len(descriptor.chunk_sizes)} chunk(s)")
    for i, chunk in enumerate(descriptor.chunk_sizes):
        if chunk <= 0 or chunk % ctx.granularity:
            raise ValueError(f"chunk {i + 1} of {n}: size {chunk} is not a positive multiple of "
                             f"this device's granularity {ctx.granularity}")
    if not 0 <= descriptor.size <= sum(descriptor.chunk_sizes):
        raise ValueError(f"size {descriptor.size} exceeds the chunks")
    handles = []
    try:
        for i, data in enumerate(descriptor.handles):
            try:
                result = _import_fabric_handle(data)
            except (TypeError, ValueError) as e:  # never echo the argument (a bearer token)
                raise RuntimeError(f"cuMemImportFromShareableHandle (fabric) while importing "
                                   f"chunk {i + 1} of {n}: the bindings refused the handle "
                                   f"({type(e).__name__})") from None
            handles.append(check(result, f"cuMemImportFromShareableHandle (fabric) while "
                                         f"importing chunk {i + 1} of {n}"))
    except BaseException:
        for handle in handles:
            cu.cuMemRelease(handle)
        raise
    # Mapping rolls back its reservation, mappings and these handles if anything fails.
    return Mapping(ctx, handles, descriptor.chunk_sizes, descriptor.size)
