"""What `raypipe.train.loader.Loader` keeps of the epoch it reads (`EpochRead`), where it
starts (`start_point`, which the ranks compare), and the ``sampler`` it shows Lightning
(`EpochSampler`)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

__all__ = ["EpochRead", "EpochSampler", "MISUSE", "start_point", "state_bytes", "state_tensor"]
assert __all__ == sorted(__all__)

MISUSE = (
    "a Loader gives one epoch at a time: an iterator of it was used after a later iter() "
    "(the same Loader iterated twice at once: nested or zipped loops?)"
)


@dataclasses.dataclass
class EpochRead:
    """The epoch being read: its batches, the keys consumed before a resume, and whether it
    is over for the consumer (read to the end, or left)."""

    epoch: int
    batches: Any  # a TorchBatches: state_dict()["keys"] are the keys handed out
    base: np.ndarray | None
    most: int | None  # batches the epoch has at most (drop_last); reached: it is over
    count: int = 0
    over: bool = False
    reading: bool = False  # an iterator of it between its first next() and its end


class EpochSampler:
    """`Loader.sampler`: Lightning's ``set_epoch`` moves a Loader that has read nothing yet
    (a fit resumed from an epoch-end checkpoint gives it no state, only the epoch) on to a
    later epoch; once it reads, it goes on by itself (a validation Loader, whose passes
    need not match the training epochs, is left to read on)."""

    def __init__(self, loader, fresh: bool):
        self._loader, self._fresh = loader, fresh

    def set_epoch(self, epoch: int) -> None:
        if self._fresh and self._loader.epoch < epoch < self._loader.num_epochs:
            self._loader.set_epoch(epoch)


def start_point(epoch: int, consumed: np.ndarray | None) -> str:
    """Where a rank's reading starts, as the ranks compare it when they join: a state
    loaded on some ranks only, or another epoch set, would have them read apart and wait on
    each other for ever."""
    if consumed is None:
        return f"epoch {epoch}"
    digest = hashlib.sha1(np.packbits(consumed).tobytes()).hexdigest()[:12]
    return f"epoch {epoch}, {int(consumed.sum())} keys consumed before ({digest})"


def state_bytes(state: Any) -> bytes:
    """The bytes of a `Loader.state_dict()`'s ``state`` (a uint8 tensor, on any device, or
    its bytes or NumPy array); ValueError in one line for anything else."""
    data = state.get("state") if isinstance(state, dict) else None
    if data is None:
        raise ValueError(f"not a Loader.state_dict(): {type(state).__name__} without 'state'")
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    given = data
    data = data.cpu().numpy() if hasattr(data, "cpu") else np.asarray(data)  # a tensor: any device
    if data.ndim != 1 or data.dtype.kind not in "iu" or (data.size and not 0 <= data.min() <= data.max() <= 255):  # fmt: skip
        raise ValueError(f"not a Loader.state_dict(): its 'state' is {type(given).__name__} of "
                         f"{data.dtype}, not the bytes state_dict() gives")  # fmt: skip
    return data.astype(np.uint8).tobytes()


def state_tensor(data: bytes):
    """``data`` as the uint8 tensor a `Loader.state_dict()` holds (what Lightning saves)."""
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
