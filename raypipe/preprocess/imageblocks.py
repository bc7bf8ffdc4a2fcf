"""The block builder of decoded images: each image written once, into its block.

`raypipe.preprocess.actor.Preprocessor` picks it when neither a user transform
(`raypipe.preprocess.userrows.RowBuilder`) nor ``decode="gpu"``
(`raypipe.preprocess.encoded.EncodedBlocks`) takes the rows.
"""

from __future__ import annotations

import numpy as np

from raypipe.formats.sample import RawSample
from raypipe.preprocess.decode import put_chw
from raypipe.skips.records import SkipRecord

__all__ = ["ImageBlocks"]
assert __all__ == sorted(__all__)


class ImageBlocks:
    """`Preprocessor`'s block builder for decoded images: ``image`` (uint8 N×3×S×S),
    ``label``, ``key``, written into preallocated arrays, so a block is built without
    concatenation copies."""

    def __init__(self, size: int, rows: int):
        self.size, self.rows = size, rows
        self.bad: list[SkipRecord] = []  # never any: only a per-batch user transform fails late
        self._reset()

    def _reset(self) -> None:
        self.image = np.empty((self.rows, 3, self.size, self.size), dtype=np.uint8)
        self.label = np.empty(self.rows, dtype=np.int64)
        self.key = np.empty(self.rows, dtype=np.int64)
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def add(self, image: np.ndarray, raw: RawSample) -> bool:
        """Append one sample; True when the block is full."""
        put_chw(self.image[self.n], image)
        self.label[self.n], self.key[self.n] = raw.label, raw.key
        self.n += 1
        return self.n == self.rows

    def take(self) -> dict[str, np.ndarray]:
        n = self.n
        block = {"image": self.image[:n], "label": self.label[:n], "key": self.key[:n]}
        self._reset()
        return block
