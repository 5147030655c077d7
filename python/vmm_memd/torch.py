"""torch models on vmm-memd: publish a state dict once, and let every engine process attach it
zero-copy, so that an engine restarts (or a second one starts) without loading weights again.

    import torch, vmm_memd
    from vmm_memd import torch as memd_torch

    # The loader, once: weights from wherever (a checkpoint, a training run).
    generation = memd_torch.publish_state_dict(client, "llama", memd_torch.model_state(model))

    # Each engine process: the model built on the meta device (no memory), then bound.
    with torch.device("meta"):
        model = build_the_model()
    attached, tensors = memd_torch.attach_state_dict(client, "llama")
    memd_torch.bind(model, tensors)        # load_state_dict(assign=True, strict=True) and more
    logits = model(input_ids)              # the weights are the service's memory, read-only

What a generation holds, and how:
- Every tensor of the state dict, made contiguous first (a non-contiguous tensor is copied to a
  contiguous one; strides are therefore not stored: each tensor is C-contiguous in the region),
  at an offset that is a multiple of ``alignment`` (256 bytes by default, what cuBLAS and
  vectorised loads want), in as few chunks as possible: tensors go in state-dict order into
  the current chunk, and a new chunk starts when the next tensor would take it past
  ``chunk_bytes`` (16 GiB by default; a tensor larger than that gets a chunk of its own size).
  A generation has at most 64 chunks (vmm-memd's MAX_CHUNKS): ``TooManyChunks`` otherwise.
- One metadata entry per name: dtype (any torch dtype vmm-memd's Dtype names: u8, i8, u16, i16,
  u32, i32, u64, i64, f16, bf16, f32, f64, bool; ``UnsupportedDtype`` for the others, fp8 and
  complex among them), shape, chunk, offset, length.
- Names whose tensors are the same memory (tied weights: ``lm_head.weight`` and
  ``model.embed_tokens.weight`` of a model with tied embeddings are one tensor) are stored
  once: both names point at the same chunk and offset. Same memory means the same device,
  data pointer, dtype, shape and strides; views that overlap otherwise are stored separately.
- ``model_state(model)``: the state dict plus the model's non-persistent buffers (rotary
  embeddings' ``inv_freq``, for instance), which ``state_dict()`` leaves out: a model built on
  the meta device has those on the meta device too, and ``bind`` takes them from the
  generation as well. Publishing them makes the reader's buffers the writer's bit for bit.

Readers get a read-only mapping: a GPU region's tensors are CUDA tensors over the service's
memory (``data_ptr()`` inside ``attached.chunks``), mapped read-only for the device (a kernel
that writes them faults); nothing is copied, so an engine's GPU memory holds its activations and
caches only. Each tensor keeps the mapping alive (DLPack): the model's parameters keep it as
long as the model lives, whatever happens to the lease, the connection or the service (a
service restarted after a crash serves the same generation again: attach it after
``Client.reconnect``).

torch is imported inside the functions that need it: ``import vmm_memd`` works without it. The
layout (``plan``) is a pure function of the tensors' names, sizes, dtypes and shapes.
"""

import ctypes
import math
from dataclasses import dataclass
from typing import Hashable, Optional, Tuple

from .errors import BadReply, StateDictError, StateDictMismatch, TooManyChunks, \
    UnsupportedDevice, UnsupportedDtype
from .protocol import MAX_CHUNKS, MAX_KEY_LEN, Acl, Dtype, TensorMeta
from .publishing import ALIGNMENT
from .tensor import Tensor

#: The largest chunk ``publish_state_dict`` asks for by default: 16 GiB (a tensor larger than
#: that gets a chunk of its own size). 64 chunks of it cover any one GPU's memory.
DEFAULT_CHUNK_BYTES = 16 << 30

#: torch dtype names (``str(dtype)`` without ``torch.``) -> vmm-memd Dtype.
TORCH_DTYPES = {
    "uint8": Dtype.U8, "int8": Dtype.I8, "uint16": Dtype.U16, "int16": Dtype.I16,
    "uint32": Dtype.U32, "int32": Dtype.I32, "uint64": Dtype.U64, "int64": Dtype.I64,
    "float16": Dtype.F16, "bfloat16": Dtype.BF16, "float32": Dtype.F32, "float64": Dtype.F64,
    "bool": Dtype.Bool,
}


def dtype_of(name, torch_dtype):
    """The vmm-memd Dtype of tensor ``name``, whose torch dtype is ``torch_dtype`` (a
    ``torch.dtype`` or its name, with or without ``torch.``); UnsupportedDtype if it has none."""
    text = str(torch_dtype)
    text = text[len("torch."):] if text.startswith("torch.") else text
    dtype = TORCH_DTYPES.get(text)
    if dtype is None:
        raise UnsupportedDtype(name, text)
    return dtype


def parse_device(device):
    """``("cuda", ordinal or None)`` or ``("cpu", None)`` for a target device: an int (a CUDA
    ordinal), ``"cuda"``, ``"cuda:N"``, ``"cpu"``, or a ``torch.device``. UnsupportedDevice
    for anything else."""
    if isinstance(device, bool):
        raise UnsupportedDevice(None, repr(device))
    if isinstance(device, int):
        if device < 0:
            raise UnsupportedDevice(None, repr(device))
        return ("cuda", device)
    kind = getattr(device, "type", None)
    if kind is not None:  # a torch.device
        index = getattr(device, "index", None)
    elif isinstance(device, str):
        kind, _, rest = device.partition(":")
        index = None
        if rest:
            if not rest.isdigit():
                raise UnsupportedDevice(None, device)
            index = int(rest)
    else:
        raise UnsupportedDevice(None, repr(device))
    if kind == "cuda":
        return ("cuda", index)
    if kind == "cpu" and not index:
        return ("cpu", None)
    raise UnsupportedDevice(None, str(device))


@dataclass(frozen=True)
class Item:
    """One named tensor to place: ``nbytes`` bytes of ``dtype`` in ``shape``. Items with the
    same ``share`` key (not None) are the same bytes and are placed once."""
    name: str
    nbytes: int
    dtype: Dtype
    shape: Tuple[int, ...]
    share: Optional[Hashable] = None


@dataclass(frozen=True)
class Plan:
    """Where a state dict goes: ``chunks`` (each chunk's size in bytes, as asked of the
    service, which may round it up), ``meta`` ((name, TensorMeta) for every item, in order),
    ``copies`` ((index of an item, its TensorMeta) once per distinct placement with bytes:
    what to copy)."""
    chunks: Tuple[int, ...]
    meta: Tuple[Tuple[str, TensorMeta], ...]
    copies: Tuple[Tuple[int, TensorMeta], ...]


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


def plan(items, chunk_bytes=DEFAULT_CHUNK_BYTES, alignment=ALIGNMENT, max_chunks=MAX_CHUNKS):
    """The Plan for ``items`` (Item): each tensor with bytes at an ``alignment``-aligned offset,
    in order, in the current chunk unless it would take that chunk past ``chunk_bytes`` (then
    in a new one; a tensor larger than ``chunk_bytes`` alone in a chunk of its own size);
    items sharing a ``share`` key placed once; tensors of no bytes at offset 0 of chunk 0.
    StateDictError for a bad name, size or share; TooManyChunks past ``max_chunks``."""
    if alignment <= 0 or chunk_bytes <= 0:
        raise ValueError(f"alignment {alignment} and chunk_bytes {chunk_bytes} must be positive")
    items = list(items)
    names, shared = set(), {}
    chunks, meta, copies = [], [], []
    used = 0  # bytes used in the last chunk
    for index, item in enumerate(items):
        dtype = Dtype(item.dtype)
        shape = tuple(int(d) for d in item.shape)
        key = item.name.encode("utf-8") if isinstance(item.name, str) else b""
        if not 1 <= len(key) <= MAX_KEY_LEN:
            raise StateDictError(f"tensor name {item.name!r}: a name is 1 to {MAX_KEY_LEN} "
                                 f"bytes of UTF-8")
        if item.name in names:
            raise StateDictError(f"tensor name {item.name!r} appears twice")
        names.add(item.name)
        if any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != item.nbytes:
            raise StateDictError(f"tensor {item.name!r}: shape {list(shape)} of {dtype.name} "
                                 f"is not {item.nbytes} bytes")
        if item.share is not None and item.share in shared:
            first = shared[item.share]
            if (first.len, first.dtype, first.shape) != (item.nbytes, dtype, shape):
                raise StateDictError(f"tensor {item.name!r} shares its memory with another of "
                                     f"another size, dtype or shape")
            meta.append((item.name, first))
            continue
        if item.nbytes == 0:
            placed = TensorMeta(0, 0, 0, dtype, shape)
        else:
            offset = _round_up(used, alignment)
            if not chunks or (used > 0 and offset + item.nbytes > chunk_bytes):
                chunks.append(0)
                offset = 0
            placed = TensorMeta(len(chunks) - 1, offset, item.nbytes, dtype, shape)
            used = offset + item.nbytes
            chunks[-1] = used
            copies.append((index, placed))
        if item.share is not None:
            shared[item.share] = placed
        meta.append((item.name, placed))
    if not chunks:  # nothing with bytes: one small chunk, for the zero-byte tensors
        chunks.append(alignment)
    chunks = [_round_up(c, alignment) for c in chunks]
    if len(chunks) > max_chunks:
        raise TooManyChunks(len(chunks), max_chunks, chunk_bytes)
    return Plan(tuple(chunks), tuple(meta), tuple(copies))


# ---- torch -------------------------------------------------------------------------------


def _torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError("vmm_memd.torch needs torch (pip install torch)") from e
    return torch


def _items(torch, state_dict):
    """(Items, tensors) of a state dict ({name: tensor}), each checked: a dense tensor of a
    dtype vmm-memd names, on a CUDA device or the CPU."""
    items, tensors = [], []
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise StateDictError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.layout != torch.strided:
            raise StateDictError(f"tensor {name!r} is {tensor.layout}, not a dense tensor")
        if tensor.device.type not in ("cuda", "cpu"):
            raise UnsupportedDevice(name, str(tensor.device))
        dtype = dtype_of(name, tensor.dtype)
        shape = tuple(int(d) for d in tensor.shape)
        nbytes = tensor.numel() * tensor.element_size()
        share = None
        if nbytes:
            share = (str(tensor.device), tensor.data_ptr(), str(tensor.dtype), shape,
                     tuple(tensor.stride()))
        items.append(Item(name, nbytes, dtype, shape, share))
        tensors.append(tensor)
    return items, tensors


def commit_timeout_for(total_bytes):
    """How long ``publish_state_dict`` lets a commit's reply take: 60 s, and 1 s more per GiB
    (the service reads every byte of a GPU generation for its digests before it answers,
    measured at about 1.2 GB/s)."""
    return 60.0 + total_bytes / float(1 << 30)


def publish_state_dict(client, region, state_dict, device=0, chunk_bytes=DEFAULT_CHUNK_BYTES,
                       acl=Acl(), wait=0.0, alignment=ALIGNMENT, commit_timeout=None):
    """Publish ``state_dict`` ({name: tensor}; ``model_state(model)`` for a whole model) as
    the next generation of ``region``; its number.

    ``device``: where the generation lives: a CUDA device (an ordinal of this process, an int,
    ``"cuda:N"`` or a ``torch.device``) makes a GPU region there, ``"cpu"`` a host region.
    Tensors are packed by ``plan`` (see the module's doc: contiguous, aligned, few chunks,
    shared memory stored once) and copied in: device to device from CUDA tensors (a tensor on
    another device, or on the CPU, is first copied to the target device by torch), or from
    the host. Work queued on the source tensors' devices is waited for first, and every copy
    is done before the commit. ``acl`` and ``wait`` are ``Client.begin``'s; ``commit_timeout``
    (seconds; default ``commit_timeout_for(total)``) how long the commit may take. Any
    failure before the commit aborts the generation (the current one stays)."""
    torch = _torch()
    kind, index = parse_device(device)
    items, tensors = _items(torch, state_dict)
    layout = plan(items, chunk_bytes=chunk_bytes, alignment=alignment)
    if commit_timeout is None:
        commit_timeout = commit_timeout_for(sum(layout.chunks))
    if kind == "cuda":
        if index is None:
            index = torch.cuda.current_device()
        return _publish_gpu(torch, client, region, layout, tensors, index, acl, wait,
                            commit_timeout)
    return _publish_host(torch, client, region, layout, tensors, acl, wait, commit_timeout)


def _publish_gpu(torch, client, region, layout, tensors, index, acl, wait, commit_timeout):
    target = torch.device("cuda", index)
    # Work queued on any stream of the sources' devices is done before the driver copies.
    for device in sorted({t.device.index for t in tensors if t.device.type == "cuda"}):
        torch.cuda.synchronize(device)
    with client.begin_gpu(region, layout.chunks, device=index, acl=acl, wait=wait) as writer:
        for item, meta in layout.copies:
            original = tensors[item].detach()
            source = original
            if source.device != target:
                source = source.to(target)
            source = source.contiguous()
            made = source.data_ptr() != original.data_ptr() or source.device != original.device
            if made:  # made on torch's current stream: done before the driver's copy reads it
                torch.cuda.synchronize(target)
            writer.copy_from_device(meta.chunk, meta.offset, source.data_ptr(), meta.len)
            if made:  # the copy (asynchronous for the host) is done before the memory goes
                torch.cuda.synchronize(target)
            del source
        # Device-to-device copies do not wait for the host: all done before the chunks are
        # unmapped and the service reads them.
        torch.cuda.synchronize(target)
        for name, meta in layout.meta:
            writer.put(name, meta)
        return writer.commit(timeout=commit_timeout)


def _publish_host(torch, client, region, layout, tensors, acl, wait, commit_timeout):
    with client.begin(region, layout.chunks, acl=acl, wait=wait) as writer:
        for item, meta in layout.copies:
            source = tensors[item].detach()
            if source.device.type != "cpu":
                source = source.to("cpu")
            source = source.contiguous()
            data = (ctypes.c_ubyte * meta.len).from_address(source.data_ptr())
            writer.chunk(meta.chunk)[meta.offset:meta.offset + meta.len] = data
            del data, source
        for name, meta in layout.meta:
            writer.put(name, meta)
        return writer.commit(timeout=commit_timeout)


def attach_state_dict(client, region, generation=None):
    """Attach ``region`` (its current generation, or ``generation``): ``(attached,
    tensors)``, where ``tensors`` maps every name to a torch tensor over the read-only mapping
    (CUDA tensors for a GPU region, CPU tensors for a host region; no copy). Names stored at
    the same place (tied weights) get the same tensor. Each tensor keeps the mapping alive;
    ``attached`` holds the lease (renew it with ``client.renew()`` within ``attached.ttl``, or
    let it lapse: the mapping stays valid, the service just forgets this reader).

    Each chunk is one ``torch.from_dlpack`` (a byte tensor over the whole chunk), and each
    tensor a strided view of it (``torch.as_strided`` at its offset): a view costs a few
    microseconds where a DLPack import per tensor cost about 40 (6.4 ms for a 1B model's 148
    tensors on the H200). So a tensor's storage is its whole chunk (``untyped_storage()``,
    ``torch.save``: what shares the storage shares the chunk). A tensor whose offset is not
    a multiple of its element size (which ``plan`` never makes, but another writer may) or
    that has no bytes is imported on its own, as before."""
    torch = _torch()
    attached = client.attach(region, generation)
    try:
        tensors = _views(torch, attached)
    except BaseException:
        try:
            client.detach(attached)
        except Exception:  # noqa: BLE001 (the first failure is the one to see)
            pass
        raise
    return attached, tensors


def _views(torch, attached):
    """{name: torch tensor} over ``attached``'s chunks (see ``attach_state_dict``).

    One pass over the metadata, which runs at every attach for every tensor (hundreds for a
    model): the typed base of each (chunk, dtype), and each shape's strides and byte count,
    are made once and looked up after; a tensor's place (its TensorMeta, a tuple) is the key
    that finds tied weights. 0.8 ms for 291 tensors where the general code took 1.6 (the
    development VM, CPU tensors), about 1 us of it each tensor's ``as_strided``."""
    chunks = attached.chunks
    wholes, bases, tensors, by_place, shapes = {}, {}, {}, {}, {}
    for key, meta in attached.meta.items():
        tensor = by_place.get(meta)
        if tensor is None:
            chunk, offset, nbytes, dtype, shape = meta
            itemsize = _ITEMSIZES[dtype]
            known = shapes.get((shape, itemsize))
            if known is None:
                known = shapes[(shape, itemsize)] = (_strides(shape),
                                                     math.prod(shape) * itemsize)
            strides, size = known
            # The client checked that the bytes lie inside the chunk; the shape must say as
            # many bytes (as Tensor checks for an import of its own).
            if size != nbytes:
                raise BadReply(f"tensor {key!r}: shape {list(shape)} of {Dtype(dtype).name} "
                               f"is not {nbytes} bytes")
            base = bases.get((chunk, dtype), bases)  # bases itself: not made yet
            if base is bases:
                base = bases[(chunk, dtype)] = _typed_chunk(torch, wholes, chunks, chunk, dtype)
            if nbytes == 0 or offset % itemsize or base is None:
                tensor = torch.from_dlpack(attached.tensor(key))
            else:
                tensor = base.as_strided(shape, strides, offset // itemsize)
            by_place[meta] = tensor
        tensors[key] = tensor
    return tensors


def _typed_chunk(torch, wholes, chunks, index, dtype):
    """Chunk ``index`` as one 1-D torch tensor of ``dtype`` (a view of the chunk's one DLPack
    import, kept in ``wholes`` for its other dtypes), or None where its length is not a
    multiple of the type's size."""
    length = chunks[index].length
    if length % _ITEMSIZES[dtype]:
        return None
    whole = wholes.get(index)
    if whole is None:
        whole = wholes[index] = torch.from_dlpack(
            Tensor(f"chunk {index}", chunks[index],
                   TensorMeta(index, 0, length, Dtype.U8, (length,))))
    return whole.view(getattr(torch, _TORCH_NAMES[Dtype(dtype)]))


def _strides(shape):
    """The C-contiguous strides (in elements) of ``shape``."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


#: vmm-memd Dtype (or its wire index) -> its element size in bytes.
_ITEMSIZES = {dtype: dtype.itemsize for dtype in Dtype}

#: vmm-memd Dtype -> the name of its torch dtype.
_TORCH_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def model_state(model):
    """``model.state_dict()`` plus the model's non-persistent buffers (which ``state_dict``
    leaves out: rotary embeddings' ``inv_freq``, say), by their dotted names: what
    ``publish_state_dict`` publishes so that ``bind`` can fill a model built on the meta
    device completely."""
    state = dict(model.state_dict())
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if name not in state and buffer is not None:
            state[name] = buffer
    return state


def bind(model, tensors, requires_grad=False):
    """Make ``tensors`` (from ``attach_state_dict``) the model's parameters and buffers, with
    no copy: what ``model.load_state_dict(tensors, strict=True, assign=True)`` does for the
    state dict's keys, and the non-persistent buffers (see ``model_state``) assigned directly.
    Checked first, before the model changes (StateDictMismatch): every key of the model's
    state dict is there, no key is unknown to the model, shapes and dtypes agree; and after:
    nothing of the model is left on the meta device (a non-persistent buffer that was not
    published, say). Parameters get ``requires_grad`` (False by default: the weights are
    read-only). The model, its parameters being the mapping: they keep it alive as long as it
    lives.

    A model whose modules all keep torch's own state-dict behaviour (no state-dict or
    load hooks, no override of ``_save_to_state_dict``, ``_load_from_state_dict``,
    ``state_dict``, ``load_state_dict``, ``get_extra_state``, ``__setattr__``, no global
    registration hooks) is bound by one walk over its modules, each tensor set as
    ``load_state_dict`` would (a parameter wrapped in a new ``Parameter``, a buffer set as
    is): ``load_state_dict`` looks at every key once per module, quadratic in the model's
    size (6.4 ms for a 1B model's 148 tensors on the H200). Any other model goes through
    ``load_state_dict`` itself, hooks and all."""
    torch = _torch()
    modules = _plain_modules(torch, model)
    if modules is None:
        return _bind_through_load_state_dict(model, tensors, requires_grad)
    expected, extra = {}, {}  # name -> (module, leaf, is_parameter, the current tensor)
    for prefix, module in modules:
        dotted = prefix + "." if prefix else ""
        for leaf, parameter in module._parameters.items():
            if parameter is not None:
                expected[dotted + leaf] = (module, leaf, True, parameter)
        for leaf, buffer in module._buffers.items():
            if buffer is not None:
                persistent = leaf not in module._non_persistent_buffers_set
                (expected if persistent else extra)[dotted + leaf] = (module, leaf, False,
                                                                        buffer)
    _check_keys(tensors, {name: e[3] for name, e in expected.items()},
                {name: e[3] for name, e in extra.items()})
    for name, (module, leaf, is_parameter, _) in expected.items():
        tensor = tensors[name]
        if is_parameter:
            module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=requires_grad)
        else:
            module._buffers[leaf] = tensor
    unbound = []
    for name, (module, leaf, _, buffer) in extra.items():
        if name in tensors:
            module._buffers[leaf] = tensors[name]
        elif buffer.is_meta:
            unbound.append(name)
    # Every parameter and persistent buffer was set above: only a non-persistent buffer that
    # was not published can be left on the meta device.
    if unbound:
        raise StateDictMismatch(unbound=unbound)
    return model


def _plain_modules(torch, model):
    """``model.named_modules(remove_duplicate=False)`` as a list if every module keeps torch's
    own state-dict behaviour (see ``bind``), else None."""
    Module = torch.nn.Module
    registration = torch.nn.modules.module
    if any(getattr(registration, hooks, None) for hooks in (
            "_global_parameter_registration_hooks", "_global_buffer_registration_hooks",
            "_global_module_registration_hooks")):
        return None
    modules = list(model.named_modules(remove_duplicate=False))
    plain_classes = set()
    for _, module in modules:
        cls = type(module)
        if cls not in plain_classes:
            if any(getattr(cls, method, None) is not getattr(Module, method)
                   for method in _STATE_DICT_METHODS):
                return None
            plain_classes.add(cls)
        if module._state_dict_hooks or module._state_dict_pre_hooks \
                or module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
            return None
    return modules


#: The torch.nn.Module methods whose override makes ``bind`` go through load_state_dict.
_STATE_DICT_METHODS = ("_save_to_state_dict", "_load_from_state_dict", "state_dict",
                       "load_state_dict", "get_extra_state", "__setattr__")


def _check_keys(tensors, expected, extra):
    """StateDictMismatch unless ``tensors`` has every name of ``expected`` (the model's state
    dict: name -> its current tensor) and no name of neither it nor ``extra`` (the
    non-persistent buffers), with their shapes and dtypes."""
    missing = [name for name in expected if name not in tensors]
    unexpected = [name for name in tensors if name not in expected and name not in extra]
    mismatched = []
    for name, tensor in tensors.items():
        want = expected.get(name, extra.get(name))
        if want is None:
            continue
        if tuple(want.shape) != tuple(tensor.shape) or want.dtype != tensor.dtype:
            mismatched.append(f"{name} (the model: {want.dtype} {list(want.shape)}, the "
                              f"tensors: {tensor.dtype} {list(tensor.shape)})")
    if missing or unexpected or mismatched:
        raise StateDictMismatch(missing, unexpected, mismatched)


def _check_bound(model):
    """StateDictMismatch naming what of ``model`` is still on the meta device."""
    unbound = [name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    unbound += [name for name, b in model.named_buffers(remove_duplicate=False)
                if b is not None and b.is_meta]
    if unbound:
        raise StateDictMismatch(unbound=unbound)


def _bind_through_load_state_dict(model, tensors, requires_grad):
    """``bind`` for a model with state-dict hooks or overrides: torch's own
    ``load_state_dict(assign=True)``."""
    expected = model.state_dict(keep_vars=True)
    buffers = dict(model.named_buffers(remove_duplicate=False))
    extra = {name: b for name, b in buffers.items() if name not in expected}
    _check_keys(tensors, expected, extra)
    model.load_state_dict({name: tensors[name] for name in expected}, strict=True, assign=True)
    for name in sorted(extra):
        if name in tensors:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            module._buffers[leaf] = tensors[name]
    _check_bound(model)
    for parameter in model.parameters():
        parameter.requires_grad_(requires_grad)
    return model


def mapped(attached, tensor):
    """Whether ``tensor``'s memory lies inside ``attached``'s mapping (one of its chunks):
    the zero-copy check. A tensor of no bytes is not anywhere, and is not mapped."""
    nbytes = tensor.numel() * tensor.element_size()
    start = tensor.data_ptr()
    return nbytes > 0 and any(c.address <= start and start + nbytes <= c.address + c.length
                              for c in attached.chunks)
