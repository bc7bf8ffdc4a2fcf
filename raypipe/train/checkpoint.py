"""Pipeline checkpoints in a Ray Train run: saved with each checkpoint, found, resumed.

```
 every rank: EpochBatches hands out the batches, counts steps; every ``checkpoint_every``
   steps (and at the epoch's end) → RunPosition.save: one all_reduce ORs the ranks'
   delivered keys (N/8 bytes on gloo) → rank 0 writes raypipe_state.bin (+ state.pt) into the
   Ray Train checkpoint
 driver: load_checkpoint(resume_from) → PipelineState; every rank (when the worker
   group starts or restarts) builds its Pipeline from it: the interrupted epoch leaves
   out its consumed keys before they are split, read or decoded
```

Which position a run resumes from: the latest checkpoint of the run itself (Ray Train's
``get_checkpoint()`` after a worker-group restart, or a rerun with the same ``name`` and
``storage_path``), else the one ``resume_from`` names, else the start.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from raypipe.train.state import STATE_FILE, PipelineState, merge_states

__all__ = ["EpochBatches", "RunPosition", "any_rank", "latest_state", "load_checkpoint",
           "new_run_name", "run_folder", "storage_uri"]  # fmt: skip
assert __all__ == sorted(__all__)

USER_STATE = "state.pt"


def storage_uri(path: str | os.PathLike) -> str:
    """A storage URI as it is; a local path made absolute, ``~`` expanded (a relative one
    is no URI to Ray Train, and ``~/runs`` was a folder named ``~``)."""
    path = os.fspath(path)
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def new_run_name() -> str:
    """The name of a run whose caller gives none (`raypipe.train_ddp`, `raypipe run`)."""
    import uuid

    return f"raypipe_{uuid.uuid4().hex[:12]}"


def run_folder(storage_path: str | None, name: str) -> str:
    """Where run ``name`` keeps its checkpoints: under ``storage_path`` (`storage_uri`),
    Ray Train's ``~/ray_results`` when it is None."""
    from ray.train.constants import DEFAULT_STORAGE_PATH

    return f"{storage_uri(storage_path or DEFAULT_STORAGE_PATH)}/{name}"


def load_checkpoint(path):
    """The pipeline state to resume from and its checkpoint (a ``ray.train.Checkpoint``,
    which keeps its filesystem): ``path`` itself when it holds one, else the latest
    checkpoint of the Ray Train run folder ``path``; a local path, a storage URI
    (``s3://...``), or a ``ray.train.Checkpoint`` (``result.checkpoint``)."""
    import ray.train

    if isinstance(path, ray.train.Checkpoint):
        checkpoint, path = path, path.path
    else:
        checkpoint = ray.train.Checkpoint(path := storage_uri(path))
    state = _read(checkpoint, STATE_FILE, PipelineState.load)
    if state is not None:
        return state, checkpoint
    found = _latest_in_run(path)
    if found is None:
        raise ValueError(f"{path!r} is neither a raypipe checkpoint nor a run folder with one")
    return found


def _read(checkpoint, name: str, load: Callable[[str], Any]):
    """``load(path)`` of the file ``name`` in ``checkpoint`` (a ``ray.train.Checkpoint``,
    local or remote: that one file is fetched, not the whole checkpoint); None when there
    is no checkpoint or it has no such file."""
    import pyarrow.fs

    if checkpoint is None:
        return None
    fs, where = checkpoint.filesystem, f"{checkpoint.path.rstrip('/')}/{name}"
    if fs.get_file_info(where).type != pyarrow.fs.FileType.File:
        return None
    if isinstance(fs, pyarrow.fs.LocalFileSystem):
        return load(where)
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, name)
        pyarrow.fs.copy_files(where, local, source_filesystem=fs)
        return load(local)


def latest_state(run_dir: str) -> PipelineState | None:
    """The state of the latest checkpoint Ray Train registered in ``run_dir``, or None."""
    found = _latest_in_run(run_dir)
    return None if found is None else found[0]


def _latest_in_run(run_dir: str):
    """The state in the latest checkpoint Ray Train registered in ``run_dir`` (a local
    path or a storage URI), with that checkpoint; None when there is none."""
    import ray.train

    from raypipe import rayapi

    try:
        checkpoint = ray.train.Result.from_path(run_dir).checkpoint
    except (RuntimeError, OSError):  # no run folder, or nothing registered in it yet
        return None
    except rayapi.checkpoint_manager_error():  # read while Ray Train rewrites its state
        return None
    state = _read(checkpoint, STATE_FILE, PipelineState.load)
    return None if state is None else (state, checkpoint)


@dataclasses.dataclass(frozen=True)
class _Where:
    """A rank's position: in ``epoch``, the batches handed out so far, and ``base``, the
    keys consumed before this run resumed (None: nothing before)."""

    epoch: int
    batches: Any = None  # the epoch's batches (their state_dict() has the delivered keys)
    base: np.ndarray | None = None


class RunPosition:
    """One rank's place in the run: its epoch, the batches of it, and what came before.

    Args:
        seed, num_samples, fingerprint: the header of every state it saves, and what a
            state resumed must match (`PipelineState.check`).
        start: the state ``train_ddp`` resumed from (``resume_from``), or None.
        start_from: the ``ray.train.Checkpoint`` of ``start`` (its ``state.pt`` for
            `restored`).
    """

    def __init__(self, *, seed: int, num_samples: int, fingerprint: str,
                 start: PipelineState | None = None, start_from=None):  # fmt: skip
        self.seed, self.num_samples, self.fingerprint = seed, num_samples, fingerprint
        self.start, self.start_from = start, start_from
        self._where: _Where | None = None
        self.saved_end = False  # the loop saved its state at the last epoch's end itself

    def _resumed(self) -> PipelineState | None:
        """This run's latest checkpoint (after a restart, or a rerun into the same run
        folder) beats ``start``: the last one that Ray Train registered, checked as
        ``resume_from`` is (the same samples and seed)."""
        import ray.train

        latest = _read(ray.train.get_checkpoint(), STATE_FILE, PipelineState.load)
        if latest is None:
            return self.start
        latest.check(self, self.seed)  # this run's num_samples and fingerprint
        return latest

    def first_epoch(self) -> int:
        """The epoch to start at; later reports count from the state resumed."""
        state = self.start = self._resumed()
        self._where = _Where(state.epoch, base=state.consumed) if state else _Where(0)
        return self._where.epoch

    def begin(self, epoch: int, batches) -> None:
        base = self.start.consumed if self.start and self.start.epoch == epoch else None
        self._where = _Where(epoch, batches, base)

    def end(self, epoch: int) -> None:
        self._where, self.saved_end = _Where(epoch + 1), False

    def state(self) -> PipelineState:
        """The run's position over all ranks (a collective: every rank calls it together)."""
        if self._where is None:  # a report before the first epoch
            self.first_epoch()
        where = self._where
        keys = where.batches.state_dict()["keys"] if where.batches is not None else []
        mine = merge_states([{"keys": keys}], self.num_samples, where.base)
        return PipelineState(where.epoch, self.seed, self.num_samples, self.fingerprint,
                             any_rank(mine))  # fmt: skip

    def save(self, metrics: dict[str, Any], user_state: dict[str, Any] | None) -> None:
        """``ray.train.report`` on every rank; rank 0 adds the checkpoint when ``user_state``."""
        import ray.train
        import torch

        # the run's position is one all_reduce of a bit per sample: taken only when a rank
        # saves (one bit asked of every rank first), not for each report of metrics alone
        first = ray.train.get_context().get_world_rank() == 0
        mine = user_state is not None
        saving, written = any_rank(np.array([mine, first and mine]))  # (a rank, rank 0) saves
        state = self.state() if saving else None
        # the epoch's end is saved only where rank 0 wrote its state there (only it writes)
        self.saved_end = self.saved_end or bool(written and self._where.batches is None)
        if state is None or not mine or not first:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as tmp:
            state.save(os.path.join(tmp, STATE_FILE))
            torch.save(user_state, os.path.join(tmp, USER_STATE))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))

    def restored(self) -> dict[str, Any] | None:
        """The ``state`` saved with the checkpoint this run resumed from, or None."""
        import ray.train
        import torch

        checkpoint = ray.train.get_checkpoint() or self.start_from
        return _read(checkpoint, USER_STATE, lambda path: torch.load(path, weights_only=False))


def any_rank(consumed: np.ndarray, device=None, world_size: int | None = None) -> np.ndarray:
    """OR of every rank's mask in one all_reduce: BOR of the packed bits (N/8 bytes) on
    gloo; NCCL has no bitwise ops, so MAX of one byte per key there, on ``device`` (None:
    Ray Train's device of this worker). A collective: every rank calls it together.

    ``world_size``: the ranks the masks are parts of (None: the process group's); another
    number than the group's size (a loader of its own on each rank): this rank's mask."""
    import torch
    import torch.distributed as dist

    group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if group == 1 or world_size not in (None, group):
        return consumed
    if dist.get_backend() == "nccl":
        if device is None:
            import ray.train.torch

            device = ray.train.torch.get_device()
        flags = torch.from_numpy(consumed.view(np.uint8)).to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags.cpu().numpy().astype(bool)
    bits = torch.from_numpy(np.packbits(consumed))
    dist.all_reduce(bits, op=dist.ReduceOp.BOR)
    return np.unpackbits(bits.numpy(), count=len(consumed)).astype(bool)


class EpochBatches:
    """One epoch's batches as `TrainContext.epochs` yields them: a `TorchBatches` that
    checkpoints every ``every`` steps and at the epoch's end (``every`` > 0).

    A checkpoint is taken when the consumer asks for the next batch, so the steps on the
    batches before it are done; at the epoch's planned last step (``most``: the batches it
    has if no sample is skipped) the epoch's end is saved instead, once, not a second
    checkpoint of the same step. The epoch's end is saved by `end` when the loop asks for
    the next epoch, so what it does after the batches (a scheduler's step) is in it.
    ``stats()`` and ``state_dict()`` are the batches' own.
    """

    def __init__(self, batches, epoch: int, progress: RunPosition, every: int,
                 user_state: Callable[[], dict[str, Any]] | None,
                 most: int | None = None):  # fmt: skip
        self._batches, self._epoch, self._progress = batches, epoch, progress
        self._every, self._user_state, self._most = every, user_state, most
        self._steps, self._ended = 0, False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        steps = 0
        self._progress.begin(self._epoch, self._batches)
        for batch in self._batches:
            yield batch
            steps += 1
            if self._every and steps % self._every == 0 and steps != self._most:
                self._checkpoint(steps)
        self._progress.end(self._epoch)
        self._steps, self._ended = steps, True

    def end(self) -> None:
        """The epoch's end checkpoint (all ranks together), once the loop is done with the
        epoch; none where it saved its state there itself (``ctx.report(state=...)``)."""
        if self._every and self._ended and not self._progress.saved_end:
            self._checkpoint(self._steps)

    def _checkpoint(self, steps: int) -> None:
        user = self._user_state() if self._user_state else {}
        self._progress.save({"raypipe_epoch": self._epoch, "raypipe_step": steps}, user)

    def __getattr__(self, name: str):
        return getattr(self._batches, name)
