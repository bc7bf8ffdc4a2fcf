"""TFRecord framing and ``tf.train.Example`` records, in pure Python (no TensorFlow).

A TFRecord file is a run of records::

    uint64 length | uint32 masked CRC32C(length) | length bytes of data | uint32 masked CRC32C(data)

(little-endian; ``masked(c) = ((c >> 15 | c << 17) + 0xa282ead8) mod 2**32``). Each record's
data is an ``Example``: ``features`` (field 1) holds ``feature`` map entries (field 1: key
string 1, ``Feature`` 2); a ``Feature`` is one of ``bytes_list`` (1), ``float_list`` (2) or
``int64_list`` (3), each a message whose field 1 repeats the values (numbers packed or not).
CRC32C comes from the ``crc32c`` package (or ``google-crc32c``): ``pip install
'raypipe[tfrecord]'``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np

__all__ = ["HEADER", "encode_example", "frame", "masked_crc", "parse_example", "values"]
assert __all__ == sorted(__all__)

HEADER = 12  # bytes before a record's data: its length and the length's CRC
MASK_DELTA = 0xA282EAD8
MISSING = "TFRecord needs a CRC32C library: pip install 'raypipe[tfrecord]' (the crc32c package)"
_crc32c = None


def masked_crc(data: bytes) -> int:
    """The masked CRC32C TFRecord stores after a record's length and after its data."""
    global _crc32c
    if _crc32c is None:
        _crc32c = _crc_function()
    crc = _crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + MASK_DELTA) & 0xFFFFFFFF


def _crc_function():
    try:
        import crc32c

        return crc32c.crc32c
    except ImportError:
        pass
    try:
        import google_crc32c

        return lambda data: google_crc32c.value(bytes(data))
    except ImportError:
        raise ImportError(MISSING) from None


def frame(data: bytes) -> bytes:
    """One record as TFRecord frames it."""
    length = struct.pack("<Q", len(data))
    return b"".join(
        (length, struct.pack("<I", masked_crc(length)), data, struct.pack("<I", masked_crc(data)))
    )


# --- the protobuf wire format ---------------------------------------------------------


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]  # IndexError at the end: a truncated message
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """``(field number, wire type, value)`` of a message; length-delimited values as views."""
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            n, pos = _varint(buf, pos)
            if pos + n > end:
                raise ValueError(f"field {number} runs past the end of its message")
            value, pos = buf[pos : pos + n], pos + n
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise ValueError(f"field {number} has wire type {wire}")
        yield number, wire, value


def parse_example(data: bytes) -> dict[str, tuple[int, memoryview]]:
    """``{name: (kind, list message)}`` of an ``Example``: kind 1 bytes, 2 float, 3 int64
    (0: no value set). Raises ValueError (or IndexError) for bytes that are not one."""
    out: dict[str, tuple[int, memoryview]] = {}
    for number, wire, features in _fields(memoryview(data)):
        if number == 1 and wire == 2:
            for n, w, entry in _fields(features):
                if n == 1 and w == 2:
                    name, feature = _entry(entry)
                    out[name] = feature
    return out


def _entry(entry: memoryview) -> tuple[str, tuple[int, memoryview]]:
    """One ``feature`` map entry: its name, and its feature's kind and list message."""
    name, kind, payload = None, 0, memoryview(b"")
    for k, kw, item in _fields(entry):
        if k == 1 and kw == 2:
            name = bytes(item).decode()
        elif k == 2 and kw == 2:
            for n, w, value in _fields(item):
                if n in (1, 2, 3) and w == 2:
                    kind, payload = n, value
    if name is None:
        raise ValueError("a feature map entry without a name")
    return name, (kind, payload)


def values(kind: int, payload: memoryview) -> list:
    """The values of one feature: bytes, floats or ints."""
    out: list = []
    for number, wire, value in _fields(payload):
        if number != 1:
            continue
        if kind == 1 and wire == 2:
            out.append(bytes(value))
        elif kind == 2:
            out.extend(np.frombuffer(value, "<f4").tolist() if wire in (2, 5) else [])
        elif kind == 3 and wire == 2:
            pos = 0
            while pos < len(value):
                v, pos = _varint(value, pos)
                out.append(v - (1 << 64) if v >= 1 << 63 else v)
        elif kind == 3 and wire == 0:
            out.append(value - (1 << 64) if value >= 1 << 63 else value)
    return out


def _key(number: int, wire: int) -> bytes:
    return _uvarint(number << 3 | wire)


def _uvarint(v: int) -> bytes:
    v &= (1 << 64) - 1  # int64 as two's complement
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _message(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _uvarint(len(payload)) + payload


def encode_example(features: dict[str, bytes | int]) -> bytes:
    """An ``Example`` of bytes (``bytes_list``) and int (``int64_list``) features."""
    entries = []
    for name, value in features.items():
        if isinstance(value, bytes):
            feature = _message(1, _message(1, value))
        else:
            feature = _message(3, _message(1, _uvarint(int(value))))
        entries.append(_message(1, _message(1, name.encode()) + _message(2, feature)))
    return _message(1, b"".join(entries))
