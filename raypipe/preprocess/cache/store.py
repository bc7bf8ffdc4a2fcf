"""What the cache holds per sample (`Entry`), and `MemoryStore`, a node's entries in memory.

An entry is a sample's capped pixels, or the reason it is bad, under the identity of its
source file (size and modification time) when it was decoded: a file that changed since
is a miss, and its entry is replaced. Every entry carries a CRC32 of its pixels; one that
does not match is dropped and decoded again from the source, never served.

The budget is first-come: the first samples decoded are kept until the next one would
pass it, and nothing is evicted. An epoch reads every sample once, so least-recently-used
eviction would throw out each sample just before it is read again; first-come keeps a
fixed part of the dataset cached in every epoch.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any

import numpy as np

__all__ = ["Entry", "MemoryStore", "Tally"]
assert __all__ == sorted(__all__)

ENTRY_OVERHEAD = 160  # bytes counted per entry on top of its pixels and strings


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
    shape: tuple[int, ...] | None = None  # the pixels' (H, W, 3)
    ref: Any = None  # the pixels in the object store, where a NodeCache keeps them

    @classmethod
    def image(cls, ident, where: str, seconds: float, pixels: np.ndarray) -> Entry:
        return cls(ident, where, seconds, pixels, crc=zlib.crc32(pixels.data),
                   shape=tuple(pixels.shape))  # fmt: skip

    @property
    def nbytes(self) -> int:
        strings = len(self.where) + len(self.detail or "") + len(self.reason or "")
        return ENTRY_OVERHEAD + strings + (0 if self.shape is None else math.prod(self.shape))

    def sound(self) -> bool:
        """True when the entry can be served: a reason, or pixels that match their shape and
        CRC (pixels still in the object store are checked where they are fetched)."""
        if self.shape is None:
            return self.reason is not None and self.pixels is None
        if self.pixels is None:
            return self.ref is not None
        p = self.pixels
        return (p.dtype == np.uint8 and p.shape == tuple(self.shape) and p.shape[2] == 3
                and p.flags.c_contiguous and zlib.crc32(p.data) == self.crc)  # fmt: skip


@dataclasses.dataclass
class Tally:
    """A node's cache counters: summed over nodes for ``stats()``."""

    hits: int = 0  # samples served from the cache (bad ones included)
    misses: int = 0  # samples read and decoded
    bad_hits: int = 0  # of the hits: samples remembered as bad, not decoded again
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


class MemoryStore:
    """Entries by id (a sample's path and index in its shard), within ``budget`` bytes."""

    def __init__(self, budget: int):
        self.budget = budget
        self._entries: dict[str, Entry] = {}
        self.tally = Tally()

    def get_many(self, ids: list[str], idents: list[tuple[int, int]]) -> list[Entry | None]:
        """The sound entries of ``ids`` whose source is unchanged; None for the rest (a
        stale or corrupt entry is dropped)."""
        out: list[Entry | None] = []
        for i, ident in zip(ids, idents, strict=True):
            entry = self._entries.get(i)
            if entry is not None and (tuple(entry.ident) != tuple(ident) or not entry.sound()):
                self.tally.corrupt += tuple(entry.ident) == tuple(ident)
                self._drop(i)
                entry = None
            out.append(entry)
        return out

    def fits(self, entry: Entry) -> bool:
        """Whether ``entry`` is within the budget left now."""
        return self.tally.bytes + entry.nbytes <= self.budget

    def put_many(self, items: list[tuple[str, Entry]]) -> None:
        for i, entry in items:
            self._drop(i)  # a changed source's entry is replaced
            if not self.fits(entry):
                self.tally.refused += 1
                continue
            if entry.pixels is not None and not entry.pixels.flags.writeable:
                entry.pixels = entry.pixels.copy()  # out of the object store, into this heap
                entry.shape = tuple(entry.pixels.shape)
            self._entries[i] = entry
            self.tally.bytes += entry.nbytes
            self.tally.entries += 1

    def _drop(self, i: str) -> None:
        old = self._entries.pop(i, None)
        if old is not None:
            self.tally.bytes -= old.nbytes
            self.tally.entries -= 1
