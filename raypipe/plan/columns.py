"""A listing's shards column by column: `Shards` (and its paths, `Paths`).

An ImageNet folder is 1.28 million shards. As a tuple of `Shard` objects its listing took
407 MiB of each rank's heap, pickled to 101 MiB and took 1.9 s to unpickle (every rank
gets the listing from the driver, and its tasks carry the paths to the workers). As
columns (the paths' UTF-8 bytes in one array and where each ends, the numbers in int64
arrays) it is a few arrays: pickled as they are, and held at the size of their bytes.

`Shards` is still a sequence of `Shard`: indexing, iterating and slicing make the `Shard`
objects as they are asked for, so code that reads a few shards reads them as before; code
that reads every shard takes the columns (`first_key`, `num_samples`, `label`, `paths`).
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

__all__ = ["Paths", "Shard", "Shards"]
assert __all__ == sorted(__all__)

# any path a file system gives, the bytes UTF-8 cannot decode too
_ENCODING = ("utf-8", "surrogateescape")


@dataclasses.dataclass(frozen=True)
class Shard:
    path: str
    first_key: int
    num_samples: int
    label: int = -1  # image folders only: the class index from the parent directory


class Paths(Sequence):
    """Strings in one byte array: ``data[ends[i-1]:ends[i]]`` is the i-th, UTF-8."""

    __slots__ = ("data", "ends")

    def __init__(self, data: np.ndarray, ends: np.ndarray):
        self.data, self.ends = _fixed(data), _fixed(ends)

    @classmethod
    def of(cls, paths: Iterable[str]) -> Paths:
        encoded = [os.fspath(p).encode(*_ENCODING) for p in paths]
        ends = np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)))
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), ends)

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Paths.of(self[j] for j in range(*i.indices(len(self))))
        n, i = len(self.ends), operator.index(i)
        if not -n <= i < n:
            raise IndexError(f"path {i} of {n}")
        i %= n
        start = int(self.ends[i - 1]) if i else 0
        return self.data[start : int(self.ends[i])].tobytes().decode(*_ENCODING)

    def __iter__(self) -> Iterator[str]:
        text, start = self.data.tobytes(), 0
        for end in self.ends.tolist():
            yield text[start:end].decode(*_ENCODING)
            start = end

    def __eq__(self, other) -> bool:
        if not isinstance(other, Paths):
            return NotImplemented  # as a tuple and a list: equal to their own kind only
        return np.array_equal(self.ends, other.ends) and np.array_equal(self.data, other.data)

    def __hash__(self) -> int:
        return hash((len(self), self.data[:64].tobytes(), self.data[-64:].tobytes()))

    def __reduce__(self):
        return Paths, (self.data, self.ends)


class Shards(Sequence):
    """A listing's shards, as columns; a sequence of `Shard` to read."""

    __slots__ = ("first_key", "label", "num_samples", "paths")

    def __init__(self, paths: Paths, first_key: np.ndarray, num_samples: np.ndarray,
                 label: np.ndarray):  # fmt: skip
        self.paths, self.first_key, self.num_samples, self.label = (
            paths, _fixed(first_key), _fixed(num_samples), _fixed(label))  # fmt: skip

    @classmethod
    def of(cls, shards: Iterable[Shard]) -> Shards:
        """``shards`` as columns (a `Shards` as it is)."""
        if isinstance(shards, Shards):
            return shards
        shards = list(shards)
        n = len(shards)
        return cls(Paths.of(s.path for s in shards),
                   np.fromiter((s.first_key for s in shards), np.int64, n),
                   np.fromiter((s.num_samples for s in shards), np.int64, n),
                   np.fromiter((s.label for s in shards), np.int64, n))  # fmt: skip

    def __len__(self) -> int:
        return len(self.first_key)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Shards.of(self[j] for j in range(*i.indices(len(self))))
        i = operator.index(i)
        return Shard(self.paths[i], int(self.first_key[i]), int(self.num_samples[i]),
                     int(self.label[i]))  # fmt: skip

    def __iter__(self) -> Iterator[Shard]:
        columns = (self.first_key.tolist(), self.num_samples.tolist(), self.label.tolist())
        for path, first, n, label in zip(self.paths, *columns, strict=True):
            yield Shard(path, first, n, label)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Shards):
            return NotImplemented  # compare list(shards) with a list of `Shard`
        return self.paths == other.paths and all(
            np.array_equal(getattr(self, c), getattr(other, c))
            for c in ("first_key", "num_samples", "label")
        )

    def __hash__(self) -> int:
        return hash((self.paths, int(self.num_samples.sum())))

    def __repr__(self) -> str:
        return f"Shards({len(self)} shards, {int(self.num_samples.sum())} samples)"

    def __reduce__(self):
        return Shards, (self.paths, self.first_key, self.num_samples, self.label)


def _fixed(column: np.ndarray) -> np.ndarray:
    """``column``, read-only: a listing's columns are shared (a rank's plan holds the same
    arrays), so none of them may change under another."""
    column.flags.writeable = False
    return column
