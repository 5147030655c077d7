"""Typed failures, mirroring vmm-memd's ``MemdError`` and ``Refusal`` (vmm-memd/src/error.rs).

Every refusal the service sends arrives as an instance of the subclass of :class:`Refused`
named after its variant, with the variant's fields as attributes, so callers catch
``QuotaExceeded`` or ``NoSuchRegion`` rather than parse messages.
"""


class MemdError(Exception):
    """Anything a vmm-memd client call can fail with."""


class ServiceGone(MemdError):
    """The service's end of the connection is gone (it stopped or died, or nobody listens on
    the name). Memory already mapped stays valid; connect again to go on (leases are gone)."""


class BadReply(MemdError):
    """The service's reply broke the protocol: a reply of the wrong kind, too many entries,
    or bytes that do not decode. The rest of that reply may still be queued (the connection
    out of step): close the client and connect again."""


class DecodeError(BadReply):
    """A reply's bytes are not exactly one postcard-encoded value of the expected type."""


class BadDescriptor(MemdError):
    """A descriptor the service sent is refused: not a memfd on tmpfs, not sealed as the
    protocol promises, shorter than announced."""


class Transport(MemdError):
    """The peer-protocol transport failed other than by the service going away (the service
    refused this process at connect, or is not whom the client expects); ``__cause__`` is
    vmm_ipc_peer's exception."""


class Refused(MemdError):
    """The service refused the request. ``FIELDS`` names the variant's fields, each an
    attribute."""

    FIELDS = ()

    def __init__(self, *values):
        if len(values) != len(self.FIELDS):
            raise TypeError(f"{type(self).__name__} takes {len(self.FIELDS)} fields")
        for name, value in zip(self.FIELDS, values):
            setattr(self, name, value)
        shown = ", ".join(f"{n}={v!r}" for n, v in zip(self.FIELDS, values))
        super().__init__(f"{type(self).__name__}({shown})")

    def __eq__(self, other):
        return type(self) is type(other) and all(
            getattr(self, n) == getattr(other, n) for n in self.FIELDS)

    def __hash__(self):
        return hash((type(self).__name__,) + tuple(getattr(self, n) for n in self.FIELDS))


class QuotaExceeded(Refused):
    """The generation would take ``uid`` past its quota; nothing was allocated."""
    FIELDS = ("uid", "used", "asked", "quota")


class AccessDenied(Refused):
    """The caller may not ``right`` (``"read"``, ``"write"``, ``"delete"``) the region."""
    FIELDS = ("region", "right", "uid")


class NoSuchRegion(Refused):
    """No region of that name that the caller may read, or none committed yet."""
    FIELDS = ("region",)


class NoSuchGeneration(Refused):
    """The region holds no such generation any more."""
    FIELDS = ("region", "generation")


class WriterBusy(Refused):
    """Another connection wrote the region for the whole wait."""
    FIELDS = ("region", "waited_ms")


class TooLarge(Refused):
    """The request was larger than the service decodes; it was not decoded."""
    FIELDS = ("size", "cap")


class InvalidRequest(Refused):
    """The request broke a rule of the protocol; ``rule`` is the RequestRule's name
    (``"Decode"``, ``"RegionName"``, ``"Chunks"``, ``"Metadata"``, ``"NotWriting"``,
    ``"AlreadyWriting"``, ``"Acl"``, ``"NoSuchLease"``)."""
    FIELDS = ("rule", "detail")


class StillMapped(Refused):
    """Commit refused: the pending generation is still mapped writable somewhere."""
    FIELDS = ("region", "generation")


class FdsInFlight(Refused):
    """Too many descriptor fds in flight (``scope``: ``"Connection"``, ``"Uid"``,
    ``"All"``); nothing was sent or kept."""
    FIELDS = ("scope", "in_flight", "cap")


class ServiceFailed(Refused):
    """The service failed for a reason of its own (``errno`` is the kernel's)."""
    FIELDS = ("op", "errno")


class NoSuchDevice(Refused):
    """The service has no usable CUDA device with this UUID (16 bytes); nothing allocated."""
    FIELDS = ("uuid",)


class DeviceFailed(Refused):
    """The CUDA driver refused the service an operation (``op``: ``"Allocate"``,
    ``"Import"``, ``"Read"``, ``"Copy"``) on ``device`` (a UUID); ``error`` is vmm-core's account."""
    FIELDS = ("device", "op", "error")


class DigestMismatch(Refused):
    """A GPU generation's chunk no longer matches the SHA-256 taken at its commit: someone
    wrote it through a writable mapping of their own."""
    FIELDS = ("region", "generation", "chunk", "expected", "found")


class FabricUnavailable(Refused):
    """The generation's chunks cannot be given as fabric handles here."""
    FIELDS = ("region", "generation")


class NotAdmin(Refused):
    """An operator's request (``release_all``) from a uid that is no admin of the service."""
    FIELDS = ("uid",)


#: The Refusal variants in declaration order: the index is the variant's wire tag.
REFUSALS = (QuotaExceeded, AccessDenied, NoSuchRegion, NoSuchGeneration, WriterBusy, TooLarge,
            InvalidRequest, StillMapped, FdsInFlight, ServiceFailed, NoSuchDevice, DeviceFailed,
            DigestMismatch, FabricUnavailable, NotAdmin)


class GpuRegion(MemdError):
    """The region lives in GPU memory that this process cannot map: ``why`` says whether
    cuda.bindings is missing or no device of this process has the region's UUID (see
    ``CUDA_VISIBLE_DEVICES``). Its lease was given back and its descriptors closed."""

    def __init__(self, region, device, why):
        self.region, self.device, self.why = region, device, why
        super().__init__(f"region {region!r} lives on GPU {device.hex()}: {why}")


class StaleLayout(MemdError):
    """A wake found the region's current generation laid out differently (chunk sizes or
    metadata) from the one that slept: nothing was mapped, the lease was given back, and the
    region stays asleep (its reservations kept)."""

    def __init__(self, region, slept, now):
        self.region, self.slept, self.now = region, slept, now
        super().__init__(f"region {region!r}: its layout changed while asleep "
                         f"({slept:#018x} slept, {now:#018x} now)")


class NotMapped(MemdError):
    """A GPU region's mapping in this process is asleep or closed: a sleep of it (nothing was
    sent to the service) or a copy from or to it (wake it first) is refused. ``region`` may
    be None (a writer's mapping)."""

    def __init__(self, region, why):
        self.region, self.why = region, why
        super().__init__(f"region {region!r}: {why}")


class NotAsleep(MemdError):
    """A wake of a Sleeping that is not asleep any more (woken already, or closed): nothing
    was sent to the service."""

    def __init__(self, region, why):
        self.region, self.why = region, why
        super().__init__(f"region {region!r}: {why}")


class GpuSleepFailed(MemdError):
    """The CUDA driver refused to unmap a GPU region's chunks or release their imports during
    a sleep (``why`` is the driver's error). The lease is still held for a plain sleep (a
    discard sleep had ended it); what stays mapped is released with the attachment's last
    reference."""

    def __init__(self, region, why):
        self.region, self.why = region, why
        super().__init__(f"region {region!r}: unmapping its chunks for a sleep failed: {why}")


class GpuImportFailed(MemdError):
    """The CUDA driver refused to import or map a GPU region's chunks (``why`` is the
    driver's error): its lease was given back and its descriptors closed."""

    def __init__(self, region, why):
        self.region, self.why = region, why
        super().__init__(f"region {region!r}: importing its chunks failed: {why}")


class StateDictError(MemdError, ValueError):
    """A state dict ``vmm_memd.torch`` cannot publish or bind (raised before anything is sent
    to the service, or before the model is changed). Subclasses say which rule it breaks."""


class UnsupportedDtype(StateDictError):
    """Tensor ``name`` is of torch dtype ``dtype`` (its name, ``"float8_e4m3fn"``), which
    vmm-memd's Dtype cannot name."""

    def __init__(self, name, dtype):
        self.name, self.dtype = name, dtype
        super().__init__(f"tensor {name!r}: torch dtype {dtype} has no vmm-memd Dtype (it names "
                         f"u8, i8, u16, i16, u32, i32, u64, i64, f16, bf16, f32, f64, bool)")


class UnsupportedDevice(StateDictError):
    """Tensor ``name`` lives on ``device`` (or, with ``name`` None, the target ``device`` asked
    for): only CUDA devices and the CPU are published from or to."""

    def __init__(self, name, device):
        self.name, self.device = name, device
        what = "the target device" if name is None else f"tensor {name!r}"
        super().__init__(f"{what}: {device} is neither a CUDA device nor the CPU")


class StateDictMismatch(StateDictError):
    """The tensors do not fit the model: keys it has that they lack (``missing``), keys it has
    no place for (``unexpected``), tensors of another shape or dtype (``mismatched``: one line
    each), and what is still on the meta device after binding (``unbound``)."""

    def __init__(self, missing=(), unexpected=(), mismatched=(), unbound=()):
        self.missing, self.unexpected = list(missing), list(unexpected)
        self.mismatched, self.unbound = list(mismatched), list(unbound)
        parts = [f"{label}: {', '.join(items[:8])}{' ...' if len(items) > 8 else ''} "
                 f"({len(items)})"
                 for label, items in (("missing", self.missing),
                                      ("unexpected", self.unexpected),
                                      ("mismatched", self.mismatched),
                                      ("still on the meta device", self.unbound)) if items]
        super().__init__("the tensors do not fit the model: " + "; ".join(parts))


class TooManyChunks(StateDictError):
    """Packing needs ``needed`` chunks of at most ``chunk_bytes`` bytes; a generation has at
    most ``cap`` (vmm-memd's MAX_CHUNKS): ask for larger chunks."""

    def __init__(self, needed, cap, chunk_bytes):
        self.needed, self.cap, self.chunk_bytes = needed, cap, chunk_bytes
        super().__init__(f"{needed} chunks of at most {chunk_bytes} bytes are needed, a "
                         f"generation has at most {cap}: pass a larger chunk_bytes")


class Os(MemdError):
    """A system call of this process failed: ``op`` names it, ``errno`` is the kernel's."""

    def __init__(self, op, errno):
        import os
        super().__init__(f"{op} failed: {os.strerror(errno)} (errno {errno})")
        self.op, self.errno = op, errno


class ExecutableNotFound(MemdError, FileNotFoundError):
    """A program of the package (``vmm-memd``, ``vmm-memctl``) is not where ``pip install``
    puts it nor on ``PATH``: ``name`` is the program, ``searched`` the directories looked in
    (in order), ``why`` what else is known (``$VMM_MEMD_BIN`` naming no executable)."""

    def __init__(self, name, searched, why=""):
        self.name, self.searched, self.why = name, tuple(searched), why
        where = ", ".join(self.searched) or "nowhere"
        super().__init__(
            f"no {name} executable{': ' + why if why else ''} (looked in {where}); "
            f"`pip install` the vmm-ipc package (its wheel carries {name}), or set "
            f"VMM_MEMD_BIN to a {name} built with `cargo build --release -p vmm-memd`")
