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
"""

import ctypes

from cuda.bindings import driver as cu

import vmm_ipc_peer as peer

POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


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

    def prop(self):
        """Pinned device memory on this device, exportable as a POSIX fd per chunk (requested
        at cuMemCreate: without it, export fails)."""
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.ordinal
        prop.requestedHandleTypes = POSIX_FD
        return prop

    def make_current(self):
        check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")


class Mapping:
    """Chunks mapped back to back in one reservation, read-write for the context's device.
    ``close()`` unmaps, frees the reservation and releases the chunk handles."""

    def __init__(self, ctx, handles, chunk_sizes, size):
        self.ctx, self.handles, self.chunk_sizes, self.size = ctx, list(handles), list(chunk_sizes), size
        total = sum(self.chunk_sizes)
        self.va = None
        self.mapped = []
        try:
            self.va = int(check(cu.cuMemAddressReserve(total, ctx.granularity, 0, 0),
                                "cuMemAddressReserve"))
            offset = 0
            for handle, chunk in zip(self.handles, self.chunk_sizes):
                check(cu.cuMemMap(self.va + offset, chunk, 0, handle, 0), "cuMemMap")
                self.mapped.append((self.va + offset, chunk))
                offset += chunk
            access = cu.CUmemAccessDesc()
            access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = ctx.ordinal
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            check(cu.cuMemSetAccess(self.va, total, [access], 1), "cuMemSetAccess")
        except BaseException:
            self.close()
            raise

    def write(self, offset, data):
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
        for va, chunk in reversed(self.mapped):
            check(cu.cuMemUnmap(va, chunk), "cuMemUnmap")
        self.mapped = []
        if self.va is not None:
            check(cu.cuMemAddressFree(self.va, sum(self.chunk_sizes)), "cuMemAddressFree")
            self.va = None
        for handle in self.handles:
            check(cu.cuMemRelease(handle), "cuMemRelease")
        self.handles = []


class Allocation(Mapping):
    """``chunks`` fresh granules (cuMemCreate, exportable), mapped here."""

    def __init__(self, ctx, chunks=1, chunk_size=None, size=None):
        chunk_size = chunk_size or ctx.granularity
        handles = []
        try:
            for _ in range(chunks):
                handles.append(check(cu.cuMemCreate(chunk_size, ctx.prop(), 0), "cuMemCreate"))
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


def import_descriptor(ctx, descriptor):
    """Import a received VmmDescriptor into ``ctx``'s device: cuMemImportFromShareableHandle per
    fd (the fd is passed by value and stays the descriptor's: close the descriptor after),
    then reserve, map and set access. Checks the descriptor names this device, if it names one."""
    if descriptor.location != ("device", 0):
        raise ValueError(f"this helper imports device memory, not {descriptor.location}")
    if descriptor.device_uuid is not None and descriptor.device_uuid != ctx.uuid:
        raise ValueError("the descriptor's device UUID is not this context's device")
    handles = []
    try:
        for fd in descriptor.fds:
            handles.append(check(cu.cuMemImportFromShareableHandle(fd, POSIX_FD),
                                 "cuMemImportFromShareableHandle"))
    except BaseException:
        for handle in handles:
            cu.cuMemRelease(handle)
        raise
    return Mapping(ctx, handles, descriptor.chunk_sizes, descriptor.size)
