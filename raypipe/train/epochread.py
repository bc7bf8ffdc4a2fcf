"""What `raypipe.train.loader.Loader` keeps of the epoch it reads (`EpochRead`), where it
starts (`start_point`, which the ranks compare), and the ``sampler`` it shows Lightning
(`EpochSampler`); its arguments, checked when it is made (`check_arguments`)."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from typing import Any

import numpy as np

from raypipe.config import LoaderConfig, PipelineConfig, rank_loader
from raypipe.loader.args import check_options
from raypipe.loader.pipeline import Pipeline

__all__ = ["EpochRead", "EpochSampler", "MISUSE", "called_within", "check_arguments", "held",
           "start_point", "state_bytes", "state_tensor", "stop_reading"]  # fmt: skip
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
    left: bool = False  # over before its end (break, an error): its state still holds it
    stale: str | None = None  # why its iterator may not go on (else `MISUSE`)


def stop_reading(run: EpochRead | None, why: str) -> None:
    """A loop over ``run``, if one is still going, ends at its next step with ``why``
    (the Loader no longer holds ``run``: its identity check finds it)."""
    if run is not None:
        run.stale = why


def called_within(call: str, run: EpochRead | None) -> str:
    """Why a loop ends that a ``set_epoch`` or ``load_state_dict`` within it restarted (an
    epoch's loop that set its own epoch at every step was told of nested or zipped loops)."""
    reading = f"epoch {run.epoch}" if run is not None else "an epoch"
    then = ("set the epoch before the loop (for e in range(E): loader.set_epoch(e); for batch "
            "in loader: ...)" if call.startswith("set_epoch") else "the next iter() resumes "
            "where the state says")  # fmt: skip
    return (f"{call} was called while {reading} was being read: it starts the pool anew, "
            f"and ends this loop; {then}")  # fmt: skip


def check_arguments(config: PipelineConfig, epochs: int, options: dict[str, Any]) -> None:
    """A `Loader`'s arguments, checked when it is made, as a `raypipe.Pipeline` checks its
    own; ``options`` are the Pipeline's keywords the Loader passes on."""
    if not isinstance(config, PipelineConfig):
        raise TypeError(f"config must be a PipelineConfig, got {type(config).__name__}")
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"{epochs=} must be an integer >= 1")
    for name in ("rank", "world_size", "ledger", "group", "start", "listing", "epochs"):
        if name in options:
            raise TypeError(f"Loader() sets {name}= itself")
    if unknown := sorted(set(options) - set(inspect.signature(Pipeline).parameters)):
        raise TypeError(f"Loader() got {unknown}, which raypipe.Pipeline does not take")
    fields = {f.name for f in dataclasses.fields(LoaderConfig)}  # checked now, as by a Pipeline
    rank_loader(config, **{k: v for k, v in options.items() if k in fields})
    checked = ("progress_s", "skips", "drop_last")  # drop_last=None too: rank_loader's unset
    check_options(**{k: options[k] for k in checked if k in options})


def held(run: EpochRead | None) -> EpochRead | None:
    """``run`` as `Loader.close` keeps it: the keys it handed out, so that ``state_dict()``
    still says where the run stands, without its batches (their host-to-device ring,
    pinned memory on CUDA)."""
    if run is None or (run.over and not run.left):  # an epoch left early: still where it stands
        return None
    return dataclasses.replace(run, batches=_Handed(run.batches.state_dict()))


class _Handed:
    """What `held` keeps of an epoch's batches: their ``state_dict()``."""

    def __init__(self, state: dict[str, Any]):
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


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
