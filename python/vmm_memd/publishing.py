"""The writer's convenience: publish a dict of named arrays as the next generation of a region,
in one chunk, each tensor at an aligned offset."""

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


def publish(client, region, arrays, acl=Acl(), wait=0.0):
    """Publish ``arrays`` ({name: array}) as the next generation of ``region``: begin one
    chunk, copy each array into it, describe it, commit. The generation's number. Any failure
    before the commit aborts the generation."""
    described, offset = [], 0
    for name, value in arrays.items():
        flat, dtype, shape = describe(value)
        offset = -(-offset // ALIGNMENT) * ALIGNMENT
        described.append((name, flat, TensorMeta(0, offset, flat.nbytes, dtype, shape)))
        offset += flat.nbytes
    size = max(offset, ALIGNMENT)
    with client.begin(region, [size], acl=acl, wait=wait) as writer:
        chunk = writer.chunk(0)
        for name, flat, meta in described:
            chunk[meta.offset:meta.offset + meta.len] = flat
            writer.put(name, meta)
        del chunk
        return writer.commit()
