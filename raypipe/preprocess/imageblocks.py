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

__all__ = ["ImageBlocks", "Reused"]
assert __all__ == sorted(__all__)


class Reused:
    """The image arrays of a pooled worker's blocks, lent again at its next task
    (``compute="tasks"``, `raypipe.preprocess.tasks`).

    Ray copies a task's returned blocks into the object store (or its reply) before the
    worker runs another task, so at the next task (`next_task`) their arrays are free. A
    fresh array's pages are zeroed by the kernel as the first images are written into
    them; reused, cached epochs ran about 10% faster on a 2-core VM (RESULTS, "The decoded
    cache"). The worker holds at most one task's arrays between tasks. Never for an actor:
    Ray Data may keep an actor's yielded blocks past its next call.
    """

    def __init__(self):
        self._free: list[np.ndarray] = []
        self._lent: list[np.ndarray] = []

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        """A uint8 array of ``shape``: one the last task used, or a new one."""
        for i, a in enumerate(self._free):
            if a.shape == shape:
                array = self._free.pop(i)
                break
        else:
            array = np.empty(shape, dtype=np.uint8)
        self._lent.append(array)
        return array

    def next_task(self) -> None:
        """The last task's blocks are Ray's now: its arrays are free; older ones go."""
        self._free, self._lent = self._lent, []


class ImageBlocks:
    """`Preprocessor`'s block builder for decoded images: ``image`` (uint8 N×3×S×S),
    ``label``, ``key``, written into preallocated arrays, so a block is built without
    concatenation copies; with ``reused``, the image arrays are that `Reused`'s."""

    def __init__(self, size: int, rows: int, reused: Reused | None = None):
        self.size, self.rows, self.reused = size, rows, reused
        self.bad: list[SkipRecord] = []  # never any: only a per-batch user transform fails late
        self._reset()

    def _reset(self) -> None:
        shape = (self.rows, 3, self.size, self.size)
        if self.reused is not None:
            self.image = self.reused.take(shape)
        else:
            self.image = np.empty(shape, dtype=np.uint8)
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
