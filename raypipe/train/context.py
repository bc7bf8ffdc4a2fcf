"""`TrainContext`: what a train loop gets on each Ray Train worker of `train_ddp`: this
rank's warm `Pipeline` of every epoch, its share of the held-out set (a warm pipeline of
its own, one pass per epoch), the collectives and the checkpointing report."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from raypipe.config import PipelineConfig
from raypipe.loader.iterator import TorchBatches
from raypipe.loader.pipeline import Pipeline, rank_batches
from raypipe.plan.shards import Listing
from raypipe.preprocess.cache import node as node_cache
from raypipe.skips.log import SkipLog
from raypipe.train.checkpoint import EpochBatches, RunPosition
from raypipe.train.ranks import start_id
from raypipe.train.state import PipelineState


def _group_id() -> str:
    """One id for this group of ranks, from rank 0 (a restarted group gets a new one)."""
    return start_id() or uuid.uuid4().hex


def _train_name(epoch: int) -> str:
    return f"train_epoch_{epoch}"


def _eval_name(epoch: int) -> str:
    return f"eval_epoch_{epoch}"


@dataclasses.dataclass
class TrainContext:
    """What a train loop gets on each Ray Train worker.

    Attributes:
        config: the training `PipelineConfig`.
        eval_config: the held-out `PipelineConfig`, or None.
        loop_config: the user's own settings, passed through unchanged.
        num_epochs: epochs to run.
        checkpoint_every: steps between the checkpoints `epochs` saves (0: none).
        progress: the run's pipeline position (`raypipe.train.checkpoint.RunPosition`).
        listing: the training source's shards, listed once on the driver.
        skips: the training run's `SkipLog` (one log per epoch under it).
        ledger: the ranks' `raypipe.loader.ledger.EpochLedger` (None with one worker).
        eval_listing: the held-out source's shards, listed once on the driver.
        eval_skips: the held-out run's `SkipLog` (one log per epoch's pass under it).
    """

    config: PipelineConfig
    eval_config: PipelineConfig | None
    loop_config: dict[str, Any]
    num_epochs: int
    checkpoint_every: int = 0
    progress: RunPosition | None = None
    listing: Listing | None = None
    skips: SkipLog | None = None
    ledger: Any = None
    eval_listing: Listing | None = None
    eval_skips: SkipLog | None = None
    # this worker's own held-out pipeline and its passes, made on first use
    _eval: Any = dataclasses.field(default=None, init=False, repr=False)
    # this worker's training pipeline, started by `start` before the loop runs
    _train: Any = dataclasses.field(default=None, init=False, repr=False)

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
        if self.checkpoint_every and state is None:
            raise ValueError(
                f"checkpoint_every={self.checkpoint_every} saves ctx.epochs(state=...)'s state "
                "(model, optimizer) with the data's position: without state= a resume would go "
                "on with a fresh model"
            )
        pipeline = self._train or self._training_pipeline()
        if pipeline is None:
            return
        self._train = None  # epochs() owns it now
        with pipeline:
            for epoch, batches in pipeline.epochs():
                # the epoch's planned last step, whose checkpoint is the epoch's end
                most = rank_batches(pipeline.config, pipeline.listing, pipeline.plan, epoch,
                                    pipeline.drop_last)  # fmt: skip
                counted = EpochBatches(batches, epoch, self.progress, self.checkpoint_every,
                                       state, most)  # fmt: skip
                yield epoch, counted
                counted.end()  # the loop's own end-of-epoch work is done: in the checkpoint

    def start(self) -> None:
        """Start this rank's training pipeline before the loop runs (`train_ddp` does so),
        so that its pool starts while the loop builds and wraps its model."""
        if self._train is None:
            self._train = self._training_pipeline()
            if self._train is not None:
                self._train.start()

    def _training_pipeline(self) -> Pipeline | None:
        """This rank's Pipeline of the run's remaining epochs; None when none remain."""
        if self.progress.first_epoch() >= self.num_epochs:
            return None
        return Pipeline(
            self.config, epochs=self.num_epochs, rank=self.rank, world_size=self.world_size,
            ledger=self.ledger, group=_group_id(), listing=self.listing, skips=self.skips,
            start=self.progress.start,
        )  # fmt: skip

    def restored(self) -> dict[str, Any] | None:
        """The ``state`` saved with the checkpoint this run resumed from, or None."""
        return self.progress.restored()

    def eval_batches(self) -> TorchBatches:
        """This rank's share of the next pass over the held-out set: one pass per epoch.

        Over all ranks a pass holds every good held-out sample once; nothing is dropped,
        so a rank's last batch is short and ranks may get a batch more or less than each
        other: evaluate with the unwrapped model (``model.module``), whose forward calls no
        collective, and sum the results with `all_reduce_sum`. The passes come from one
        warm preprocessing pool for the whole run, which prepares the next pass while
        training runs.
        """
        if self.eval_config is None:
            raise ValueError("train_ddp was called without eval_config")
        if self._eval is None:
            pipeline = Pipeline(
                self.eval_config, epochs=self.num_epochs, rank=self.rank,
                world_size=self.world_size, listing=self.eval_listing, skips=self.eval_skips,
                start=self._eval_start(), progress_s=0, drop_last=False,
            )  # fmt: skip
            self._eval = (pipeline, pipeline.epochs())
        pipeline, passes = self._eval
        try:
            return next(passes)[1]
        except StopIteration:
            raise RuntimeError(
                "eval_batches() gives one pass per epoch: the last epoch's "
                f"({pipeline.num_epochs - 1}) was already taken"
            ) from None

    def _eval_start(self) -> PipelineState | None:
        """A resumed run's passes start at its first epoch (pass e is epoch e's), whole."""
        resumed = self.progress.start
        if resumed is None or resumed.epoch == 0:
            return None
        n = self.eval_listing.num_samples
        return PipelineState(resumed.epoch, self.eval_config.seed, n,
                             self.eval_listing.fingerprint, np.zeros(n, dtype=bool))  # fmt: skip

    def close(self) -> None:
        """End this worker's held-out pipeline, if it has one, and its decoded caches
        (`train_ddp` does so when the loop returns or raises: Ray Train ends its workers
        without their exit hooks, which left a memory cache in /dev/shm after the run)."""
        if self._eval is not None:
            self._eval[0].close()
        if self._train is not None:  # started, never iterated
            self._train.close()
        for config in (self.config, self.eval_config):
            if config is not None and config.cache is not None:
                node_cache.release(config)

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
