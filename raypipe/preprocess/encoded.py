"""``decode="gpu"``, the actors' half: they ship JPEG bytes and the seeded crop plan; the
rank decodes (`raypipe.loader.devicedecode`).

```
 actor     JPEG header → plan(width, height, rng(seed, epoch, key))      no pixel decoded
           row: payload = the file's bytes, plan = (left, top, width, height, flip)
           (a PNG, CMYK or EXIF-rotated JPEG: decoded and cropped here as with "cpu";
            its row's payload is the uint8 3×S×S pixels, plan width 0)
 iterator  step 4: label/key through the pinned ring; then on the copy stream:
           nvJPEG decodes the batch (torchvision.io.decode_jpeg, device=...) → crop the
           plan's box → resize to S×S (bilinear, antialiased) → flip → uint8 N×3×S×S
```

The plan is the one ``decode="cpu"`` draws for the key, so a key gets the same crop and
flip either way; only the resampling arithmetic differs (a few grey levels on average).

A JPEG that nvJPEG refuses is decoded on the CPU (libjpeg-turbo, then Pillow). One that
both refuse is a bad sample as usual: ``on_error="raise"`` raises `SampleError` naming the
file; ``"skip"`` records it in the run's `SkipLog` and leaves it out of its batch — that
batch is one row short, the batch *count* (what DDP needs) is unchanged. The actors check
each JPEG's header, so only files damaged after their header get that far.

On a CPU device (tests, machines without CUDA) the same step runs with libjpeg-turbo.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from raypipe.preprocess.augment import Plan
from raypipe.preprocess.decode import jpeg_size
from raypipe.skips.records import SkipRecord

__all__ = ["Encoded", "EncodedBlocks", "PLAN_FIELDS"]
assert __all__ == sorted(__all__)

_END_OF_IMAGE = b"\xff\xd9"  # the JPEG marker a file cut short lacks
PLAN_FIELDS = 5  # left, top, width, height, flip; width 0: the payload is decoded pixels


class Encoded(NamedTuple):
    """One sample the actor did not decode: its JPEG bytes and the plan drawn for it."""

    data: bytes
    plan: Plan

    @classmethod
    def of(cls, data: bytes, choose) -> Encoded | None:
        """``data`` with ``choose(width, height)``'s plan when it is a JPEG the device path
        handles (YCbCr/grey, upright, ending in its end-of-image marker); None otherwise:
        the actor decodes it as ``decode="cpu"`` does (a truncated file is then read or
        skipped exactly as there; nvJPEG would hand back a partly grey image)."""
        size = jpeg_size(data)
        if size is None or _END_OF_IMAGE not in data[-1024:]:  # cut short: the CPU decides
            return None
        height, width = size
        return cls(bytes(data), choose(width, height))


class EncodedBlocks:
    """The actor's block builder for ``decode="gpu"``: ``payload`` (bytes per row), ``plan``
    (float32 N×5), ``where`` (the file), ``label``, ``key``."""

    def __init__(self, size: int, rows: int):
        self.size, self.rows = size, rows
        self.bad: list[SkipRecord] = []  # never any: nothing fails after the actor's checks
        self._reset()

    def _reset(self) -> None:
        self.payload: list[bytes] = []
        self.plan = np.zeros((self.rows, PLAN_FIELDS), dtype=np.float32)
        self.where: list[str] = []
        self.label = np.empty(self.rows, dtype=np.int64)
        self.key = np.empty(self.rows, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.payload)

    def add(self, item: Encoded | np.ndarray, raw) -> bool:
        """Append a sample (`Encoded`, or pixels the actor decoded); True when full."""
        n = len(self.payload)
        if isinstance(item, Encoded):
            box, flip = item.plan
            self.plan[n] = (*box, float(flip))
            self.payload.append(item.data)
        else:
            self.payload.append(np.ascontiguousarray(item, dtype=np.uint8).tobytes())
        self.where.append(raw.where)
        self.label[n], self.key[n] = raw.label, raw.key
        return n + 1 == self.rows

    def take(self) -> dict[str, np.ndarray]:
        n = len(self.payload)
        payload, where = np.empty(n, dtype=object), np.empty(n, dtype=object)
        payload[:], where[:] = self.payload, self.where
        block = {"payload": payload, "plan": self.plan[:n], "where": where,
                 "label": self.label[:n], "key": self.key[:n]}  # fmt: skip
        self._reset()
        return block
