"""What the cache holds per sample (`Entry`), and its counters (`Tally`).

An entry is a sample's capped pixels, or the reason it is bad, under the identity of its
source file (size and modification time) when it was decoded: a file that changed since
is a miss, and its entry is replaced. Every entry carries a checksum of what it stores: its
raw pixels, or its JPEG (``cache_encoding="jpeg"``, which a hit then decodes only where its
crop needs). CRC32C with the CPU's instruction where the `crc32c` package has it, else
zlib's CRC32; the entry names which. One that does not match is dropped and decoded again
from the source, never served.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib

import crc32c
import numpy as np

__all__ = ["CHECKS", "Entry", "Tally", "checksum"]
assert __all__ == sorted(__all__)

# a checksum of the pixels, by the name an entry records: CRC32C runs 4-5x faster than
# zlib's CRC32 where the CPU has an instruction for it; "+shape": the shape's numbers after
# them (entries written before covered the bytes alone)
CHECKS = {"crc32c": crc32c.crc32c, "crc32": zlib.crc32}
CHECK = ("crc32c" if crc32c.hardware_based else "crc32") + "+shape"  # what new entries use


def checksum(check: str, data, shape: tuple[int, ...]) -> int | None:
    """``data``'s checksum of kind ``check`` (with ``shape``'s numbers where it says so);
    None for a kind this version does not know."""
    name, _, covers = check.partition("+")
    fn = CHECKS.get(name)
    if fn is None or covers not in ("", "shape"):
        return None
    crc = fn(data)
    return fn(struct.pack(f"<{len(shape)}q", *shape), crc) if covers else crc


@dataclasses.dataclass
class Entry:
    """One sample's cached result: ``pixels`` (uint8 H×W×3) or ``reason`` + ``detail``."""

    ident: tuple[int, int]  # the source file's (size, mtime in ns) at decode time
    where: str
    seconds: float  # what reading and decoding it took: what each hit saves
    pixels: np.ndarray | None = None
    reason: str | None = None
    detail: str | None = None
    crc: int = 0
    check: str = CHECK  # which of `CHECKS` made ``crc`` (and what it covers: `checksum`)
    shape: tuple[int, ...] | None = None  # the pixels' (H, W, 3)
    # cache_encoding="jpeg": what is stored. Without ``pixels`` (left to the crop) ``crc``
    # covers these bytes; with them (an entry from before) it covers the pixels.
    encoded: bytes | None = None

    @classmethod
    def image(cls, ident, where: str, seconds: float, pixels: np.ndarray) -> Entry:
        """A decoded image's entry: its raw ``pixels``, the checksum theirs."""
        return cls(ident, where, seconds, pixels, crc=checksum(CHECK, pixels.data, pixels.shape),
                   shape=tuple(pixels.shape))  # fmt: skip

    @classmethod
    def stored(cls, ident, where: str, seconds: float, data: bytes,
               shape: tuple[int, int, int]) -> Entry:  # fmt: skip
        """A ``cache_encoding="jpeg"`` entry: the JPEG ``data`` of a ``shape`` image, the
        checksum its bytes'."""
        return cls(ident, where, seconds, None, crc=checksum(CHECK, data, tuple(shape)),
                   shape=tuple(shape), encoded=data)  # fmt: skip

    def sound(self) -> bool:
        """True when the entry can be served: a reason, or pixels (or a JPEG) that match
        their shape and CRC."""
        if self.shape is None:
            return self.reason is not None and self.pixels is None
        if len(self.shape) != 3 or self.shape[2] != 3:
            return False
        p = self.pixels
        if p is None:  # a JPEG, its bytes checked
            return (self.encoded is not None
                    and checksum(self.check, self.encoded, self.shape) == self.crc)  # fmt: skip
        return (p.dtype == np.uint8 and p.shape == tuple(self.shape) and p.flags.c_contiguous
                and checksum(self.check, p.data, self.shape) == self.crc)  # fmt: skip


@dataclasses.dataclass
class Tally:
    """A node's cache counters: summed over nodes for ``stats()``."""

    hits: int = 0  # samples served from the cache (bad ones included)
    misses: int = 0  # samples read and decoded
    bad_hits: int = 0  # of the hits: samples remembered as bad, not decoded again
    reads: int = 0  # of the hits: entries read from their file and checked (a memory
    # cache's process does that once an entry, then keeps it mapped; a disk cache, every hit)
    corrupt: int = 0  # entries that failed their check and were decoded again
    saved_s: float = 0.0  # read + decode seconds the hits did not spend, less the lookups
    entries: int = 0
    bytes: int = 0  # held: pixels and records
    refused: int = 0  # decoded samples left out: the budget was full

    def add(self, other: Tally) -> Tally:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_dict(self) -> dict[str, float | int]:
        out = dataclasses.asdict(self)
        out["saved_s"] = round(self.saved_s, 3)
        return out
