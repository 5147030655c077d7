"""The writer's convenience: publish a dict of named arrays as the next generation of a region,
in one chunk, each tensor at an aligned offset: host arrays into a host region (``publish``),
host or CUDA arrays into a GPU region (``publish_gpu``)."""

import math

from .protocol import Acl, Dtype, TensorMeta

#: Where each tensor starts in the chunk: a multiple of this (enough for any vector load).
ALIGNMENT = 256

# PEP 3118 format characters (native sizes on a 64-bit little-endian Linux) -> Dtype.
_FORMATS = {"B": Dtype.U8, "b": Dtype.I8, "H": Dtype.U16, "h": Dtype.I16, "I": Dtype.U32,
            "i": Dtype.I32, "L": Dtype.U64, "l": Dtype.I64, "Q": Dtype.U64, "q": Dtype.I64,
            "e": Dtype.F16, "f": Dtype.F32, "d": Dtype.F64, "?": Dtype.Bool, "c": Dtype.U8}


def describe(value):
    """(bytes as a flat 'B' memoryview, Dtype, shape) of ``value``: an object with the buffer
    protocol (bytes, bytearray, array.array, numpy arrays, memoryviews), C-contiguous, or a
    tuple (buffer, Dtype, shape) for what the buffer protocol cannot name (bfloat16)."""
    if isinstance(value, tuple):
        buffer, dtype, shape = value
        view = memoryview(buffer)
        dtype, shape = Dtype(dtype), tuple(int(d) for d in shape)
    else:
        view = memoryview(value)
        fmt = view.format.lstrip("@=<")
        if fmt not in _FORMATS or view.format.startswith((">", "!")):
            raise TypeError(f"buffer format {view.format!r} has no vmm-memd dtype: pass "
                            f"(buffer, Dtype, shape)")
        dtype, shape = _FORMATS[fmt], tuple(view.shape or ())
        if dtype.itemsize != view.itemsize:
            raise TypeError(f"buffer format {view.format!r}: item size {view.itemsize}, "
                            f"{dtype.name} is {dtype.itemsize}")
    if not view.c_contiguous:
        raise ValueError("the buffer is not C-contiguous")
    flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    count = 1
    for d in shape:
        count *= d
    if count * dtype.itemsize != flat.nbytes:
        raise ValueError(f"shape {list(shape)} of {dtype.name} is {count * dtype.itemsize} "
                         f"bytes, the buffer {flat.nbytes}")
    return flat, dtype, shape


# __cuda_array_interface__ type strings (little-endian) -> Dtype.
_TYPESTRS = {"|u1": Dtype.U8, "|i1": Dtype.I8, "<u2": Dtype.U16, "<i2": Dtype.I16,
             "<u4": Dtype.U32, "<i4": Dtype.I32, "<u8": Dtype.U64, "<i8": Dtype.I64,
             "<f2": Dtype.F16, "<f4": Dtype.F32, "<f8": Dtype.F64, "|b1": Dtype.Bool}


def describe_device(value):
    """(device address, byte length, Dtype, shape) of a CUDA array: an object with
    ``__cuda_array_interface__`` (torch and CuPy tensors), C-contiguous; or a tuple
    (tensor, Dtype, shape) for what the interface cannot name (a torch bfloat16 tensor: its
    ``data_ptr()`` is used). None for anything else (host memory)."""
    if isinstance(value, tuple):
        tensor, dtype, shape = value
        pointer = getattr(tensor, "data_ptr", None)
        if pointer is None:
            if not hasattr(tensor, "__cuda_array_interface__"):
                return None
            address = tensor.__cuda_array_interface__["data"][0]
        else:
            address = pointer()
        dtype, shape = Dtype(dtype), tuple(int(d) for d in shape)
        return address, math.prod(shape) * dtype.itemsize, dtype, shape
    interface = getattr(value, "__cuda_array_interface__", None)
    if interface is None:
        return None
    typestr, shape = interface["typestr"], tuple(int(d) for d in interface["shape"])
    if typestr not in _TYPESTRS:
        raise TypeError(f"CUDA array type {typestr!r} has no vmm-memd dtype: pass "
                        f"(tensor, Dtype, shape)")
    dtype = _TYPESTRS[typestr]
    strides = interface.get("strides")
    if strides is not None:
        expected, step = [], dtype.itemsize
        for d in reversed(shape):
            expected.append(step)
            step *= d
        if tuple(strides) != tuple(reversed(expected)):
            raise ValueError("the CUDA array is not C-contiguous")
    return interface["data"][0], math.prod(shape) * dtype.itemsize, dtype, shape


def _layout(arrays, describe_one):
    """[(name, source, TensorMeta)] at ALIGNMENT-aligned offsets of one chunk, and its size."""
    described, offset = [], 0
    for name, value in arrays.items():
        source, nbytes, dtype, shape = describe_one(value)
        offset = -(-offset // ALIGNMENT) * ALIGNMENT
        described.append((name, source, TensorMeta(0, offset, nbytes, dtype, shape)))
        offset += nbytes
    return described, max(offset, ALIGNMENT)


def _host(value):
    flat, dtype, shape = describe(value)
    return flat, flat.nbytes, dtype, shape


def _source(value):
    """(("device", address) or ("host", flat view), byte length, Dtype, shape) of a CUDA or
    a host array."""
    on_device = describe_device(value)
    if on_device is not None:
        address, nbytes, dtype, shape = on_device
        return ("device", address), nbytes, dtype, shape
    flat, dtype, shape = describe(value)
    return ("host", flat), flat.nbytes, dtype, shape


def publish_gpu(client, region, arrays, device=0, acl=Acl(), wait=0.0):
    """Publish ``arrays`` ({name: array}) as the next generation of GPU region ``region`` on
    device ``device`` (an ordinal of this process): one chunk, each CUDA array copied device
    to device (see ``GpuChunks.copy_from_device`` for the stream), each host array copied
    from the host; described; committed. The generation's number. Any failure before the
    commit aborts the generation."""
    described, size = _layout(arrays, _source)
    with client.begin_gpu(region, [size], device=device, acl=acl, wait=wait) as writer:
        for name, (kind, source), meta in described:
            if kind == "device":
                writer.copy_from_device(0, meta.offset, source, meta.len)
            else:
                writer.write(0, meta.offset, source)
            writer.put(name, meta)
        return writer.commit()


def publish(client, region, arrays, acl=Acl(), wait=0.0):
    """Publish ``arrays`` ({name: array}) as the next generation of ``region``: begin one
    chunk, copy each array into it, describe it, commit. The generation's number. Any failure
    before the commit aborts the generation."""
    described, size = _layout(arrays, _host)
    with client.begin(region, [size], acl=acl, wait=wait) as writer:
        chunk = writer.chunk(0)
        for name, flat, meta in described:
            chunk[meta.offset:meta.offset + meta.len] = flat
            writer.put(name, meta)
        del chunk
        return writer.commit()
