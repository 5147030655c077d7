"""A minimal, strict postcard codec: exactly the wire forms vmm-memd's serde types use.

postcard (the Rust crate the service encodes with) writes unsigned integers of 16 bits and
more as LEB128 varints, signed ones zigzagged first, ``u8`` and ``bool`` as one byte, an
``Option`` as a 0/1 tag byte then the value, a ``Vec`` or ``String`` as a varint length then
the elements (UTF-8 bytes), a struct or tuple as its fields in order, and an enum as its variant
index (a varint) then the variant's fields. Nothing else is needed here, so nothing else is
accepted.

Decoding refuses, with :class:`DecodeError`: bytes that end inside a value, a varint longer
than its type allows or not in its shortest form, a value past its type's range, a ``bool`` or
``Option`` tag other than 0 or 1, invalid UTF-8, a length past the caller's cap (checked
before anything is allocated), an unknown enum variant, and trailing bytes after the value.
"""

from .errors import DecodeError

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


def _varint_bytes(value):
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class Writer:
    """Appends postcard encodings to a byte buffer."""

    def __init__(self):
        self.out = bytearray()

    def varint(self, value, bits):
        value = int(value)
        if not 0 <= value < (1 << bits):
            raise ValueError(f"{value} does not fit an unsigned {bits}-bit integer")
        self.out += _varint_bytes(value)

    def u32(self, value):
        self.varint(value, 32)

    def u64(self, value):
        self.varint(value, 64)

    def usize(self, value):
        self.varint(value, 64)

    def i32(self, value):
        value = int(value)
        if not -(1 << 31) <= value < (1 << 31):
            raise ValueError(f"{value} does not fit a signed 32-bit integer")
        self.out += _varint_bytes(((value << 1) ^ (value >> 31)) & U32_MAX)

    def u8(self, value):
        if not 0 <= int(value) <= 0xFF:
            raise ValueError(f"{value} does not fit a u8")
        self.out.append(int(value))

    def bool(self, value):
        self.out.append(1 if value else 0)

    def str(self, value):
        data = value.encode("utf-8")
        self.usize(len(data))
        self.out += data

    def variant(self, index):
        self.u32(index)

    def bytes(self):
        return bytes(self.out)


class _Lazy:
    """The words "``prefix`` ``what``", formatted only when an error message needs them: a
    reader names what it reads on every call, and most calls succeed."""

    __slots__ = ("prefix", "what")

    def __init__(self, prefix, what):
        self.prefix, self.what = prefix, what

    def __str__(self):
        return f"{self.prefix} {self.what}"

    def __format__(self, spec):
        return format(str(self), spec)


class Reader:
    """Reads postcard encodings from ``data``; every method raises DecodeError on bytes that
    are not exactly what it reads."""

    def __init__(self, data):
        self.data = bytes(data)  # at most a DATA message; indexing bytes is the fast path
        self.pos = 0

    def remaining(self):
        return len(self.data) - self.pos

    def _byte(self, what):
        if self.pos >= len(self.data):
            raise DecodeError(f"the bytes end inside {what} (at byte {self.pos})")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self, bits, what="an integer"):
        """An unsigned LEB128 varint of a ``bits``-bit type: at most ceil(bits / 7) bytes, its
        value within the type, in its shortest form."""
        data, pos = self.data, self.pos
        end = len(data)
        start, value, shift = pos, 0, 0
        for i in range((bits + 6) // 7):
            if pos >= end:
                raise DecodeError(f"the bytes end inside {what} (at byte {pos})")
            b = data[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                if i > 0 and b == 0:
                    raise DecodeError(f"{what} at byte {start}: an overlong varint (not in its "
                                      f"shortest form)")
                if value >> bits:
                    raise DecodeError(f"{what} at byte {start}: {value} does not fit "
                                      f"{bits} bits")
                self.pos = pos
                return value
        raise DecodeError(f"{what} at byte {start}: a varint longer than the "
                          f"{(bits + 6) // 7} bytes of a {bits}-bit integer")

    def varint_at(self, pos, bits, what="an integer"):
        """``varint`` of the bytes at ``pos``, for a decoder that keeps the position in a local
        (a MetaPage's entries): ``(value, the position after it)``, with ``varint``'s checks
        and errors. The reader's own position is left alone unless it raises."""
        data, end = self.data, len(self.data)
        start, value, shift = pos, 0, 0
        while pos < end:
            b = data[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            if b < 0x80:
                if (b or pos - start == 1) and not value >> bits \
                        and pos - start <= (bits + 6) // 7:
                    return value, pos
                break
            shift += 7
        self.pos = start  # varint says which rule it breaks
        self.varint(bits, what)
        raise AssertionError("varint accepted what varint_at refused")

    def u32(self, what="a u32"):
        return self.varint(32, what)

    def u64(self, what="a u64"):
        return self.varint(64, what)

    def i32(self, what="an i32"):
        z = self.varint(32, what)
        return (z >> 1) ^ -(z & 1)

    def u8(self, what="a u8"):
        return self._byte(what)

    def bool(self, what="a bool"):
        b = self._byte(what)
        if b > 1:
            raise DecodeError(f"{what} at byte {self.pos - 1}: {b} is not a bool (0 or 1)")
        return b == 1

    def option_tag(self, what="an Option"):
        b = self._byte(what)
        if b > 1:
            raise DecodeError(f"{what} at byte {self.pos - 1}: tag {b} is neither None (0) "
                              f"nor Some (1)")
        return b == 1

    def length(self, cap, what):
        """A sequence length, refused past ``cap`` and past the bytes left (each element takes
        at least one byte) before anything is allocated for it."""
        n = self.varint(64, _Lazy("the length of", what))
        if n > cap:
            raise DecodeError(f"{what}: {n} elements announced, the cap is {cap}")
        if n > self.remaining():
            raise DecodeError(f"{what}: {n} elements announced, {self.remaining()} bytes left")
        return n

    def str(self, cap, what="a string"):
        n = self.length(cap, what)
        raw = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DecodeError(f"{what}: not UTF-8 ({e.reason})") from None

    def seq(self, cap, what, element):
        return [element() for _ in range(self.length(cap, what))]

    def variant(self, names, what):
        """An enum's variant index, checked against ``names`` (the variants in declaration
        order); returns the index."""
        index = self.u32(_Lazy("the variant of", what))
        if index >= len(names):
            raise DecodeError(f"{what}: unknown variant {index} (it has {len(names)}: "
                              f"{', '.join(names)})")
        return index

    def finish(self, what):
        if self.remaining():
            raise DecodeError(f"{what}: {self.remaining()} trailing bytes after the value")
