"""`TrainContext`: what a train loop gets on each Ray Train worker of `train_ddp`: this
rank's warm `Pipeline` of every epoch, its share of the held-out set, the collectives and
the checkpointing report."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from raypipe.config import PipelineConfig
from raypipe.data.shards import Listing
from raypipe.data.skips import SkipLog
from raypipe.loader.iterator import TorchBatches, iter_torch_batches
from raypipe.loader.pipeline import Pipeline
from raypipe.train.checkpoint import EpochBatches, Progress

EVAL = "eval"


def _group_id() -> str:
    """One id for this group of ranks, from rank 0 (a restarted group gets a new one)."""
    import torch.distributed as dist

    ids = [uuid.uuid4().hex]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(ids, src=0)
    return ids[0]


def _train_name(epoch: int) -> str:
    return f"train_epoch_{epoch}"


@dataclasses.dataclass
class TrainContext:
    """What a train loop gets on each Ray Train worker.

    Attributes:
        config: the training `PipelineConfig`.
        eval_config: the held-out `PipelineConfig`, or None.
        loop_config: the user's own settings, passed through unchanged.
        num_epochs: epochs to run.
        skip_logs: the `SkipLog` of each dataset, by dataset name; the batches'
            ``stats()["skipped"]`` reads them.
        checkpoint_every: steps between the checkpoints `epochs` saves (0: none).
        progress: the run's pipeline position (`raypipe.train.checkpoint.Progress`).
        listing: the training source's shards, listed once on the driver.
        skips: the training run's `SkipLog` (one log per epoch under it).
        ledger: the ranks' `raypipe.loader.ledger.EpochLedger` (None with one worker).
    """

    config: PipelineConfig
    eval_config: PipelineConfig | None
    loop_config: dict[str, Any]
    num_epochs: int
    skip_logs: dict[str, SkipLog] = dataclasses.field(default_factory=dict)
    checkpoint_every: int = 0
    progress: Progress | None = None
    listing: Listing | None = None
    skips: SkipLog | None = None
    ledger: Any = None

    @property
    def prefetch_batches(self) -> int:
        """Batches each rank's iterator holds ready: ``config.prefetch_batches``."""
        return self.config.prefetch_batches

    @property
    def rank(self) -> int:
        import ray.train

        return ray.train.get_context().get_world_rank()

    @property
    def world_size(self) -> int:
        import ray.train

        return ray.train.get_context().get_world_size()

    @property
    def device(self):
        import ray.train.torch

        return ray.train.torch.get_device()

    def prepare_model(self, model):
        """Move ``model`` to this worker's device and wrap it in DDP."""
        import ray.train.torch

        return ray.train.torch.prepare_model(model)

    def epochs(
        self, state: Callable[[], dict[str, Any]] | None = None
    ) -> Iterator[tuple[int, EpochBatches]]:
        """Yield ``(epoch, batches)``; every rank gets the same number of full batches.

        A resumed run starts at the interrupted epoch with its not yet consumed samples.
        With ``checkpoint_every``, a checkpoint is saved every that many steps and at each
        epoch's end, holding rank 0's ``state()`` (model, optimizer; see `restored`).
        """
        first = self.progress.first_epoch()
        if first >= self.num_epochs:
            return
        pipeline = Pipeline(
            self.config, epochs=self.num_epochs, rank=self.rank, world_size=self.world_size,
            ledger=self.ledger, group=_group_id(), listing=self.listing, skips=self.skips, start=self.progress.start,
        )  # fmt: skip
        with pipeline:
            for epoch, batches in pipeline.epochs():
                yield epoch, EpochBatches(batches, epoch, self.progress, self.checkpoint_every,
                                          state)  # fmt: skip

    def restored(self) -> dict[str, Any] | None:
        """The ``state`` saved with the checkpoint this run resumed from, or None."""
        return self.progress.restored()

    def eval_batches(self) -> TorchBatches:
        """This rank's share of the held-out set (no rows dropped beyond the equal split)."""
        import ray.train

        if self.eval_config is None:
            raise ValueError("train_ddp was called without eval_config")
        shard = ray.train.get_dataset_shard(EVAL)
        return self._batches(shard, self.eval_config, drop_last=False, name=EVAL)

    def _batches(
        self, shard, config: PipelineConfig, *, drop_last: bool, name: str
    ) -> TorchBatches:
        return iter_torch_batches(
            shard, config, drop_last=drop_last, skips=self.skip_logs.get(name)
        )

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum numbers over all ranks (e.g. correct / total for accuracy)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(t)
        return t.tolist()

    def report(self, metrics: dict[str, Any], *, state: dict[str, Any] | None = None) -> None:
        """Report metrics from every rank; rank 0 also checkpoints ``state`` if given,
        with the pipeline's position (all ranks call it together, as Ray Train wants)."""
        self.progress.save(metrics, state)
