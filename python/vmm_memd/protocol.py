"""vmm-memd's requests and replies (vmm-memd/src/protocol.rs), postcard-encoded: one per DATA
message of the peer protocol. Field order and variant order here are the Rust declarations'
order, which is the wire format; a change there is a change here.

Replies are decoded strictly (see :mod:`vmm_memd.postcard`), every sequence checked against the
protocol's caps before it is read, and the whole message must be exactly one reply.
"""

import enum
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

from .errors import REFUSALS, DecodeError
from .postcard import Reader, Writer

MAX_REQUEST = 8 * 1024  # the service refuses longer requests (TooLarge) without decoding them
MAX_DATA = 16 * 1024  # the peer protocol's DATA payload cap: no reply is longer
MAX_CHUNKS = 64
MAX_META_ENTRIES = 65_536
MAX_KEY_LEN = 256
MAX_REGION_NAME = 128
MAX_ACL_ENTRIES = 64
# Sequences without a protocol cap of their own (a shape, a status's regions and readers, a
# message's text) are capped by the message: no element takes less than a byte.
_BY_MESSAGE = MAX_DATA


class Dtype(enum.IntEnum):
    """A tensor's element type; the value is the variant's wire index."""
    U8 = 0
    I8 = 1
    U16 = 2
    I16 = 3
    U32 = 4
    I32 = 5
    U64 = 6
    I64 = 7
    F16 = 8
    BF16 = 9
    F32 = 10
    F64 = 11
    Bool = 12

    @property
    def itemsize(self):
        return _ITEMSIZE[self]


_ITEMSIZE = {Dtype.U8: 1, Dtype.I8: 1, Dtype.U16: 2, Dtype.I16: 2, Dtype.U32: 4, Dtype.I32: 4,
             Dtype.U64: 8, Dtype.I64: 8, Dtype.F16: 2, Dtype.BF16: 2, Dtype.F32: 4,
             Dtype.F64: 8, Dtype.Bool: 1}


class TensorMeta(NamedTuple):
    """Where one named tensor lies in a generation: chunk, byte offset and length in it,
    element type, shape. A named tuple, not a frozen dataclass: an attach makes one per tensor
    (hundreds for a model), and a frozen dataclass takes about 1.3 us to construct against a
    tuple's 0.2 (on the development VM); it is hashable, so a tensor's place is its key."""
    chunk: int
    offset: int
    len: int
    dtype: Dtype
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class Uid:
    """An ACL entry naming a user id."""
    id: int


@dataclass(frozen=True)
class Gid:
    """An ACL entry naming a group id (primary or supplementary, as the kernel reports)."""
    id: int


@dataclass(frozen=True)
class Acl:
    """Who besides the owner may read, write and delete a region the Begin creates."""
    read: Tuple = ()
    write: Tuple = ()
    delete: Tuple = ()


@dataclass(frozen=True)
class RegionSummary:
    region: str
    generation: int
    bytes: int
    sleep: str = "Awake"  # the current generation's: "Awake", "Falling" or "Asleep"


@dataclass(frozen=True)
class GenerationStatus:
    generation: int
    bytes: int
    current: bool
    readers: Tuple[int, ...]
    sleep: str = "Awake"  # "Awake", "Falling" (asleep once its leases end) or "Asleep"


@dataclass(frozen=True)
class RegionStatus:
    region: str
    owner: int
    generations: Tuple[GenerationStatus, ...]
    pending: Optional[Tuple[int, int, int]]
    waiting_writers: int


@dataclass(frozen=True)
class Status:
    uid: int
    used: int
    quota: int
    regions: Tuple[RegionStatus, ...]
    refusals: int
    expired_leases: int
    truncated: bool


# Replies other than Refused (which decodes to its Refused exception).
@dataclass(frozen=True)
class Began:
    generation: int
    chunks: Tuple[int, ...]


@dataclass(frozen=True)
class Done:
    pass


@dataclass(frozen=True)
class Committed:
    generation: int


@dataclass(frozen=True)
class AttachedReply:
    lease: int
    generation: int
    chunks: Tuple[int, ...]
    meta_pages: int
    ttl_ms: int


@dataclass(frozen=True)
class MetaPage:
    entries: Tuple[Tuple[str, TensorMeta], ...]


@dataclass(frozen=True)
class Renewed:
    count: int


@dataclass(frozen=True)
class Metrics:
    text: str


@dataclass(frozen=True)
class RegionList:
    regions: Tuple[RegionSummary, ...]


@dataclass(frozen=True)
class BeganGpu:
    generation: int
    chunks: Tuple[int, ...]
    device: bytes
    fabric: bool


@dataclass(frozen=True)
class AttachedGpuReply:
    lease: int
    generation: int
    chunks: Tuple[int, ...]
    meta_pages: int
    ttl_ms: int
    device: bytes
    fabric: bool


@dataclass(frozen=True)
class Verified:
    generation: int
    digests: Tuple[bytes, ...]


@dataclass(frozen=True)
class Slept:
    generation: int
    leases: int


@dataclass(frozen=True)
class Woke:
    generation: int
    zeroed: bool


@dataclass(frozen=True)
class Released:
    """The reply to ``encode_release_all``: regions deleted, and regions left because a
    writer was at work on them or waiting for them."""
    regions: int
    busy: int


@dataclass(frozen=True)
class CommitState:
    """What became of a generation named by a writer's token: ``state`` is "Landed" (then
    ``generation`` is its number), "Pending" (its writer's connection is open and has not
    committed: ask again once it has ended) or "Unknown" (it did not land)."""
    state: str
    generation: Optional[int] = None


# ---- requests -------------------------------------------------------------------------------

(_LIST, _STATUS, _BEGIN, _PUT_META, _COMMIT, _ABORT, _ATTACH, _DETACH, _RENEW, _DELETE,
 _METRICS, _BEGIN_ON, _VERIFY, _DISCARD, _ATTACH_FABRIC, _SLEEP, _WAKE, _TOKEN,
 _COMMIT_STATE, _RELEASE_ALL, _SET_ACL, _SET_QUOTA) = range(22)

#: The tokens of a region's latest tokened commits that ``CommitState`` remembers.
MAX_LANDED_TOKENS = 64


def _request(index, body=None):
    w = Writer()
    w.variant(index)
    if body is not None:
        body(w)
    return w.bytes()


def _principals(w, entries):
    w.usize(len(entries))
    for p in entries:
        if isinstance(p, Uid):
            w.variant(0)
        elif isinstance(p, Gid):
            w.variant(1)
        else:
            raise TypeError(f"an ACL entry is a Uid or a Gid, not {p!r}")
        w.u32(p.id)


def _tensor_meta(w, meta):
    w.u32(meta.chunk)
    w.u64(meta.offset)
    w.u64(meta.len)
    w.variant(int(Dtype(meta.dtype)))
    w.usize(len(meta.shape))
    for d in meta.shape:
        w.u64(d)


def encode_list():
    return _request(_LIST)


def encode_status():
    return _request(_STATUS)


def encode_metrics():
    return _request(_METRICS)


def _begin_body(w, region, chunks, acl, wait_ms):
    w.str(region)
    w.usize(len(chunks))
    for c in chunks:
        w.u64(c)
    for entries in (acl.read, acl.write, acl.delete):
        _principals(w, entries)
    w.u64(wait_ms)


def encode_begin(region, chunks, acl=Acl(), wait_ms=0):
    return _request(_BEGIN, lambda w: _begin_body(w, region, chunks, acl, wait_ms))


def encode_begin_gpu(region, chunks, device_uuid, acl=Acl(), wait_ms=0):
    """``BeginOn`` with ``Backend::Gpu { uuid }``: the region lives on that device."""
    if len(device_uuid) != 16:
        raise ValueError(f"a device UUID is 16 bytes, not {len(device_uuid)}")

    def body(w):
        _begin_body(w, region, chunks, acl, wait_ms)
        w.variant(1)  # Backend::Gpu
        for b in device_uuid:
            w.u8(b)
    return _request(_BEGIN_ON, body)


def encode_put_meta(entries):
    def body(w):
        w.usize(len(entries))
        for key, meta in entries:
            w.str(key)
            _tensor_meta(w, meta)
    return _request(_PUT_META, body)


def encode_commit():
    return _request(_COMMIT)


def encode_abort():
    return _request(_ABORT)


def encode_attach(region, generation=None):
    def body(w):
        w.str(region)
        if generation is None:
            w.bool(False)
        else:
            w.bool(True)
            w.u64(generation)
    return _request(_ATTACH, body)


def encode_verify(region, generation=None):
    def body(w):
        w.str(region)
        if generation is None:
            w.bool(False)
        else:
            w.bool(True)
            w.u64(generation)
    return _request(_VERIFY, body)


def encode_detach(lease):
    return _request(_DETACH, lambda w: w.u64(lease))


def encode_discard(lease):
    return _request(_DISCARD, lambda w: w.u64(lease))


def encode_renew():
    return _request(_RENEW)


def encode_delete(region):
    return _request(_DELETE, lambda w: w.str(region))


def encode_layout(chunks, meta):
    """The bytes a generation's layout hash is taken of: postcard of (chunk sizes, metadata
    entries in key order), as vmm-memd's ``layout_hash`` encodes them."""
    w = Writer()
    w.usize(len(chunks))
    for c in chunks:
        w.u64(c)
    w.usize(len(meta))
    for key in sorted(meta):
        w.str(key)
        _tensor_meta(w, meta[key])
    return w.bytes()


def encode_sleep(region):
    """An operator's sleep of the region's current generation (needs the write right)."""
    return _request(_SLEEP, lambda w: w.str(region))


def encode_wake(region):
    """An operator's wake of the region's current generation (needs the write right)."""
    return _request(_WAKE, lambda w: w.str(region))


def encode_release_all():
    """An operator's release of every region (the service's admins only: NotAdmin else)."""
    return _request(_RELEASE_ALL)


def _token(token):
    token = bytes(token)
    if len(token) != 16:
        raise ValueError(f"a commit token is 16 bytes, not {len(token)}")
    return token


def encode_token(token):
    """Name this connection's pending generation with ``token`` (16 bytes)."""
    token = _token(token)
    return _request(_TOKEN, lambda w: w.out.extend(token))


def encode_commit_state(region, token):
    """What became of ``region``'s generation named ``token`` (needs the write right)."""
    token = _token(token)

    def body(w):
        w.str(region)
        w.out.extend(token)
    return _request(_COMMIT_STATE, body)


def meta_pages(entries):
    """``PutMeta`` requests carrying ``entries`` (key, TensorMeta), each at most MAX_REQUEST
    bytes: cut by their exact encoded size. Each entry is encoded once (a page's size is its
    header plus its entries' sizes), so a model's hundreds of entries cost linear time."""
    pages, page, size = [], [], 0
    for entry in entries:
        w = Writer()
        w.str(entry[0])
        _tensor_meta(w, entry[1])
        encoded = w.bytes()
        if _put_meta_size(1, len(encoded)) > MAX_REQUEST:
            raise ValueError(f"metadata entry {entry[0]!r} alone is larger than a request "
                             f"({MAX_REQUEST} bytes)")
        if page and _put_meta_size(len(page) + 1, size + len(encoded)) > MAX_REQUEST:
            pages.append(_put_meta_request(page))
            page, size = [], 0
        page.append(encoded)
        size += len(encoded)
    if page:
        pages.append(_put_meta_request(page))
    return pages


def _put_meta_size(count, entry_bytes):
    """The bytes of a PutMeta request of ``count`` entries that encode to ``entry_bytes``."""
    return len(_request(_PUT_META, lambda w: w.usize(count))) + entry_bytes


def _put_meta_request(encoded_entries):
    """A PutMeta request of entries encoded already (each key then TensorMeta)."""
    def body(w):
        w.usize(len(encoded_entries))
        for encoded in encoded_entries:
            w.out += encoded
    return _request(_PUT_META, body)


# ---- replies --------------------------------------------------------------------------------

_RIGHTS = ("Read", "Write", "Delete")
_RULES = ("Decode", "RegionName", "Chunks", "Metadata", "NotWriting", "AlreadyWriting", "Acl",
          "NoSuchLease", "Backend", "NotAsleep", "Token")
_GPU_OPS = ("Allocate", "Import", "Read", "Copy")
_SCOPES = ("Connection", "Uid", "All")
_REPLIES = ("Refused", "List", "Status", "Began", "Done", "Committed", "Attached", "MetaPage",
            "Renewed", "Metrics", "BeganGpu", "AttachedGpu", "Verified", "Slept", "Woke",
            "CommitState", "Released")
_COMMIT_STATES = ("Landed", "Pending", "Unknown")
_SLEEP_STATES = ("Awake", "Falling", "Asleep")


def _fixed(r, n, what):
    """A `[u8; n]`: n bytes, each its own byte."""
    return bytes(r.u8(what) for _ in range(n))


def _region(r):
    return r.str(MAX_REGION_NAME, "a region name")


def _refusal(r):
    index = r.variant([c.__name__ for c in REFUSALS], "a refusal")
    kind = REFUSALS[index]
    text = lambda what: r.str(_BY_MESSAGE, what)  # noqa: E731
    readers = {
        "QuotaExceeded": lambda: (r.u32(), r.u64(), r.u64(), r.u64()),
        "AccessDenied": lambda: (_region(r), _RIGHTS[r.variant(_RIGHTS, "a right")].lower(),
                                 r.u32()),
        "NoSuchRegion": lambda: (_region(r),),
        "NoSuchGeneration": lambda: (_region(r), r.u64()),
        "WriterBusy": lambda: (_region(r), r.u64()),
        "TooLarge": lambda: (r.u64(), r.u64()),
        "InvalidRequest": lambda: (_RULES[r.variant(_RULES, "a request rule")],
                                   text("a refusal's detail")),
        "StillMapped": lambda: (_region(r), r.u64()),
        "FdsInFlight": lambda: (_SCOPES[r.variant(_SCOPES, "a scope")], r.u64(), r.u64()),
        "ServiceFailed": lambda: (text("a refusal's operation"), r.i32()),
        "NoSuchDevice": lambda: (_fixed(r, 16, "a device UUID"),),
        "DeviceFailed": lambda: (_fixed(r, 16, "a device UUID"),
                                 _GPU_OPS[r.variant(_GPU_OPS, "a GPU operation")],
                                 text("a refusal's detail")),
        "DigestMismatch": lambda: (_region(r), r.u64(), r.u32(), _fixed(r, 32, "a digest"),
                                   _fixed(r, 32, "a digest")),
        "FabricUnavailable": lambda: (_region(r), r.u64()),
        "NotAdmin": lambda: (r.u32(),),
    }
    return kind(*readers[kind.__name__]())


_DTYPES = tuple(Dtype)
_DTYPE_NAMES = tuple(d.name for d in _DTYPES)


def _meta_entries(r):
    """A sequence of (key, TensorMeta): a MetaPage's body (and a PutMeta's).

    An attach decodes every tensor's entry (hundreds for a model), so this is one loop that
    keeps the position in a local and reads a one-byte varint or length (most of them: a
    chunk, a dtype, short keys, small dimensions) in line; anything longer goes through
    ``Reader.varint_at``, and anything ``Reader`` would refuse is handed to it to raise its
    own error. About 2.3 us an entry against 4.3 for the general reader calls (the development
    VM, 250 Llama-shaped entries). The values and errors are the general reader's."""
    data = r.data
    end = len(data)
    varint_at = r.varint_at
    count = r.length(MAX_META_ENTRIES, "a metadata page")
    pos = r.pos
    entries = []
    append = entries.append
    for _ in range(count):
        n = data[pos] if pos < end else 0x80
        if n < 0x80 and n < end - pos:  # MAX_KEY_LEN is more than any one-byte length
            pos += 1
        else:
            r.pos = pos
            n = r.length(MAX_KEY_LEN, "a metadata key")
            pos = r.pos
        try:
            key = data[pos:pos + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise DecodeError(f"a metadata key: not UTF-8 ({e.reason})") from None
        pos += n
        chunk = data[pos] if pos < end else 0x80
        if chunk < 0x80:
            pos += 1
        else:
            chunk, pos = varint_at(pos, 32, _META)
        offset = data[pos] if pos < end else 0x80
        if offset < 0x80:
            pos += 1
        else:
            offset, pos = varint_at(pos, 64, _META)
        length = data[pos] if pos < end else 0x80
        if length < 0x80:
            pos += 1
        else:
            length, pos = varint_at(pos, 64, _META)
        dtype = data[pos] if pos < end else 0x80
        if dtype < 0x80:
            pos += 1
        else:
            dtype, pos = varint_at(pos, 32, _META)
        if dtype >= len(_DTYPES):
            raise DecodeError(f"a dtype: unknown variant {dtype} (it has {len(_DTYPES)}: "
                              f"{', '.join(_DTYPE_NAMES)})")
        ndim = data[pos] if pos < end else 0x80
        if ndim < 0x80 and ndim < end - pos:  # the cap (_BY_MESSAGE) is more too
            pos += 1
        else:
            r.pos = pos
            ndim = r.length(_BY_MESSAGE, "a shape")
            pos = r.pos
        shape = []
        for _ in range(ndim):
            d = data[pos] if pos < end else 0x80
            if d < 0x80:
                pos += 1
            else:
                d, pos = varint_at(pos, 64, "a shape")
            shape.append(d)
        append((key, _new_tuple(TensorMeta, (chunk, offset, length, _DTYPES[dtype],
                                             tuple(shape)))))
    r.pos = pos
    return tuple(entries)


_META = "a tensor's metadata"
_new_tuple = tuple.__new__  # TensorMeta's own __new__, without its argument handling


def _chunks(r):
    return tuple(r.seq(MAX_CHUNKS, "chunk sizes", r.u64))


def _generation_status(r):
    return GenerationStatus(r.u64(), r.u64(), r.bool(),
                            tuple(r.seq(_BY_MESSAGE, "readers", r.i32)), _sleep_state(r))


def _sleep_state(r):
    return _SLEEP_STATES[r.variant(_SLEEP_STATES, "a sleep state")]


def _region_status(r):
    region, owner = _region(r), r.u32()
    generations = tuple(r.seq(_BY_MESSAGE, "generations", lambda: _generation_status(r)))
    pending = (r.u64(), r.u64(), r.i32()) if r.option_tag("a pending generation") else None
    return RegionStatus(region, owner, generations, pending, r.u32())


def _status(r):
    uid, used, quota = r.u32(), r.u64(), r.u64()
    regions = tuple(r.seq(_BY_MESSAGE, "regions", lambda: _region_status(r)))
    return Status(uid, used, quota, regions, r.u64(), r.u64(), r.bool())


def decode_response(data):
    """One reply from the bytes of one DATA message: a reply dataclass, or the Refused
    exception the service sent (returned, not raised). DecodeError for anything else."""
    if len(data) > MAX_DATA:
        raise DecodeError(f"a reply of {len(data)} bytes: the transport's cap is {MAX_DATA}")
    r = Reader(data)
    index = r.variant(_REPLIES, "a reply")
    name = _REPLIES[index]
    if name == "Refused":
        value = _refusal(r)
    elif name == "List":
        value = RegionList(tuple(r.seq(_BY_MESSAGE, "a region list",
                                       lambda: RegionSummary(_region(r), r.u64(), r.u64(),
                                                             _sleep_state(r)))))
    elif name == "Status":
        value = _status(r)
    elif name == "Began":
        value = Began(r.u64(), _chunks(r))
    elif name == "Done":
        value = Done()
    elif name == "Committed":
        value = Committed(r.u64())
    elif name == "Attached":
        value = AttachedReply(r.u64(), r.u64(), _chunks(r), r.u32(), r.u64())
    elif name == "MetaPage":
        value = MetaPage(_meta_entries(r))
    elif name == "Renewed":
        value = Renewed(r.u32())
    elif name == "Metrics":
        value = Metrics(r.str(_BY_MESSAGE, "metrics text"))
    elif name == "BeganGpu":
        value = BeganGpu(r.u64(), _chunks(r), _fixed(r, 16, "a device UUID"), r.bool())
    elif name == "AttachedGpu":
        value = AttachedGpuReply(r.u64(), r.u64(), _chunks(r), r.u32(), r.u64(),
                                 _fixed(r, 16, "a device UUID"), r.bool())
    elif name == "Slept":
        value = Slept(r.u64(), r.u32())
    elif name == "Woke":
        value = Woke(r.u64(), r.bool())
    elif name == "CommitState":
        state = _COMMIT_STATES[r.variant(_COMMIT_STATES, "a commit state")]
        value = CommitState(state, r.u64() if state == "Landed" else None)
    elif name == "Released":
        value = Released(r.u32(), r.u32())
    else:
        value = Verified(r.u64(), tuple(r.seq(MAX_CHUNKS, "digests",
                                              lambda: _fixed(r, 32, "a digest"))))
    r.finish(f"a {name} reply")
    return value


__all__ = [
    "Dtype", "TensorMeta", "Uid", "Gid", "Acl", "RegionSummary", "GenerationStatus",
    "RegionStatus", "Status", "Began", "Done", "Committed", "AttachedReply", "MetaPage",
    "Renewed", "Metrics", "RegionList", "BeganGpu", "AttachedGpuReply", "Verified",
    "Slept", "Woke", "CommitState", "Released", "decode_response", "encode_verify",
    "encode_begin_gpu", "encode_layout", "encode_discard", "encode_sleep", "encode_wake",
    "encode_token", "encode_commit_state", "encode_release_all",
    "meta_pages", "MAX_LANDED_TOKENS", "MAX_REQUEST",
    "MAX_DATA", "MAX_CHUNKS", "MAX_META_ENTRIES", "MAX_KEY_LEN", "MAX_REGION_NAME",
]
