"""One cache entry as a file: what `raypipe.preprocess.cache.disk.DiskStore` writes and reads.

```
 MAGIC, header length (4 bytes, little-endian), JSON header: ident, where, seconds,
 shape or reason + detail, crc, check (its kind), of (what it covers: "pixels" or
 "encoded"), encoding ("raw" or "jpeg"), head_crc last (CRC32C of the header's bytes
 before it, closed: a changed byte anywhere in the header is a corrupt entry, a bad
 sample's reason and detail too); then the body: the raw pixels, or their JPEG
```

Files written before a header named ``check``, ``of`` or ``head_crc`` are read as they were
written: a zlib CRC32, of the pixels (a jpeg entry's then decoded to check them), and the
header unchecked.
"""

from __future__ import annotations

import json
import struct

import crc32c
import numpy as np

from raypipe.preprocess.cache.capped import decode_stored
from raypipe.preprocess.cache.store import Entry
from raypipe.preprocess.decode import jpeg_size

__all__ = ["MAGIC", "head_of", "parse", "parts"]
assert __all__ == sorted(__all__)

MAGIC = b"RPCACHE1"
_SEAL = b', "head_crc": '  # the header's last field: the CRC32C of the JSON before it


def parts(entry: Entry) -> tuple[bytes, memoryview]:
    """An entry's file: its header (MAGIC, length, JSON), and its body as a buffer."""
    head = {"ident": list(entry.ident), "where": entry.where, "seconds": entry.seconds,
            "reason": entry.reason, "detail": entry.detail, "crc": entry.crc, "check": entry.check,
            "shape": None if entry.shape is None else list(entry.shape),
            "encoding": "raw" if entry.encoded is None else "jpeg",
            "of": "pixels" if entry.encoded is None else "encoded"}  # fmt: skip
    text = json.dumps(head).encode()  # then the CRC of those bytes, as its last field
    text = text[:-1] + _SEAL + b"%d}" % crc32c.crc32c(text)
    if entry.encoded is not None:
        body = memoryview(entry.encoded)
    elif entry.pixels is None:
        body = memoryview(b"")
    else:
        body = memoryview(np.ascontiguousarray(entry.pixels)).cast("B")
    return MAGIC + struct.pack("<I", len(text)) + text, body


def head_of(data: bytes) -> dict | None:
    """The JSON header at the start of ``data`` (an entry's first bytes); None where they
    do not hold a whole one."""
    try:
        if data[:8] != MAGIC:
            return None
        (n,) = struct.unpack("<I", data[8:12])
        head = json.loads(data[12 : 12 + n]) if len(data) >= 12 + n else None
        return head if isinstance(head, dict) else None  # a list, a number: no header
    except MemoryError:
        raise
    except Exception:
        return None


def parse(data: bytes) -> Entry | None:
    """The entry in ``data``; None when it is not a whole, well-formed entry (the CRC of
    what it stores is checked by `Entry.sound`)."""
    try:
        if data[:8] != MAGIC:
            return None
        (n,) = struct.unpack("<I", data[8:12])
        text = bytes(data[12 : 12 + n])
        at = text.rfind(_SEAL)  # none: written before the header had its CRC
        if at >= 0 and crc32c.crc32c(text[:at] + b"}") != int(text[at + len(_SEAL) : -1]):
            return None
        head = json.loads(text)
        body = memoryview(data)[12 + n :]
        shape, pixels, encoded = None, None, None
        if head["shape"] is not None:
            shape = tuple(int(s) for s in head["shape"])
            pixels, encoded = _stored(head, body, shape)
        elif len(body):
            raise ValueError("a bad sample's record with a body")
        return Entry((int(head["ident"][0]), int(head["ident"][1])), str(head["where"]),
                     float(head["seconds"]), pixels, head["reason"], head["detail"],
                     int(head["crc"]), str(head.get("check", "crc32")), shape,
                     encoded)  # fmt: skip
    except MemoryError:  # the worker's state, not the entry's
        raise
    except Exception:  # any damage (a number too large, nesting too deep...): not an entry
        return None


def _stored(head: dict, body: memoryview, shape: tuple[int, ...]):
    """An image entry's ``(pixels, encoded)``: raw pixels (a view of ``body``), or a JPEG's
    bytes, left to the crop to decode (but for an entry from before its checksum covered
    them). Raises ValueError where they do not fit ``shape``."""
    if len(shape) != 3:
        raise ValueError(f"shape {shape}")
    if head.get("encoding", "raw") != "jpeg":
        if len(body) != int(np.prod(shape)):
            raise ValueError("the pixels are cut short")
        return np.frombuffer(body, dtype=np.uint8).reshape(shape), None
    encoded, pixels = bytes(body), None
    if head.get("of", "pixels") == "pixels":  # written before: a CRC of its pixels
        pixels = decode_stored(encoded)
    if (jpeg_size(encoded) if pixels is None else pixels.shape[:2]) != shape[:2]:
        raise ValueError("the JPEG is not the size its header says")
    return pixels, encoded
