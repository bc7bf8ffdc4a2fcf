"""`train_ddp`: one call from a `PipelineConfig` and a train loop to DDP on Ray Train.

```
 driver: list the shards once; one EpochLedger actor; [an eval Dataset, split by Train]
   ▼ TorchTrainer workers, rank r of W: loop(ctx) → ctx.epochs()
 rank r: Pipeline(config, rank=r, world_size=W): its planned keys of every epoch through
   one run-long execution and one warm actor pool → (epoch, equal exact-size batches)
```

Every rank reads its own seeded slice of each epoch (`raypipe.data.rankplan`), so the same seed
gives every rank the same samples whatever the timing; the ledger keeps batch counts
equal when bad samples are skipped. Checkpoints carry the pipeline's position
(`raypipe.train.checkpoint`): a run resumes mid-epoch, exactly once, with any number of workers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from raypipe.config import PipelineConfig
from raypipe.data.dataset import build_dataset
from raypipe.data.shards import Listing, list_shards
from raypipe.data.skips import SkipLog, write_reports
from raypipe.data.warm import rank_pool
from raypipe.loader.iterator import TorchBatches, iter_torch_batches
from raypipe.loader.ledger import create_ledger
from raypipe.loader.pipeline import Pipeline
from raypipe.train.checkpoint import EpochBatches, Progress, load_checkpoint
from raypipe.train.state import fingerprint

log = logging.getLogger(__name__)

EVAL = "eval"


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


def _warn_if_short_of_cpus(config, eval_config, num_workers: int, cpus_per_worker: float):
    """Say so when the workers and the smallest pools cannot all start on today's cluster
    (the run would wait for the autoscaler, or forever): every rank's pool holds its CPUs
    for the whole run."""
    import ray

    lo, _ = rank_pool(config.actors, num_workers)
    need = num_workers * (cpus_per_worker + lo * config.actor_cpus)
    if eval_config is not None:
        need += eval_config.actors[0] * eval_config.actor_cpus
    have = ray.cluster_resources().get("CPU", 0)
    if need > have:
        log.warning(
            "raypipe: this run needs at least %.2f CPUs (%d workers x %.2f + %d rank pools "
            "of %d actor(s) x %.2f%s) and the cluster has %.2f now: it waits for more nodes; "
            "lower cpus_per_worker, actors or actor_cpus to fit", need, num_workers,
            cpus_per_worker, num_workers, lo, config.actor_cpus,
            " + the eval pool" if eval_config is not None else "", have,
        )  # fmt: skip


def _group_id() -> str:
    """One id for this group of ranks, from rank 0 (a restarted group gets a new one)."""
    import torch.distributed as dist

    ids = [uuid.uuid4().hex]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(ids, src=0)
    return ids[0]


def _check_run(*, num_workers, epochs, cpus_per_worker, checkpoint_every) -> None:
    for name, value, low in (("num_workers", num_workers, 1), ("epochs", epochs, 1),
                             ("checkpoint_every", checkpoint_every, 0)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if not cpus_per_worker > 0:
        raise ValueError(f"{cpus_per_worker=} must be > 0")


def _list_for(config: PipelineConfig, num_workers: int) -> Listing:
    """The source's listing, once on the driver; refuses a batch no rank could fill."""
    listing = list_shards(config)
    per_rank = listing.num_samples // num_workers
    if per_rank < config.batch_size:
        raise ValueError(
            f"batch_size={config.batch_size} is larger than one rank's share "
            f"({listing.num_samples} samples / {num_workers} workers = {per_rank}): "
            "no rank would get a full batch"
        )
    return listing


def _resume_point(resume_from, listing: Listing, seed: int, epochs: int):
    """``(PipelineState, its folder)`` of ``resume_from``, checked against this run."""
    if resume_from is None:
        return None, None
    start, start_dir = load_checkpoint(resume_from)
    start.check(listing, seed)
    if start.epoch >= epochs:
        raise ValueError(f"{resume_from=} is at epoch {start.epoch}: {epochs=} leaves nothing")
    return start, start_dir


def train_ddp(
    config: PipelineConfig,
    train_loop: Callable[[TrainContext], None],
    *,
    num_workers: int = 2,
    use_gpu: bool = False,
    epochs: int = 1,
    storage_path: str | None = None,
    eval_config: PipelineConfig | None = None,
    loop_config: dict[str, Any] | None = None,
    cpus_per_worker: float = 1.0,
    max_failures: int = 0,
    name: str | None = None,
    callbacks: list | None = None,
    checkpoint_every: int = 0,
    resume_from: str | os.PathLike | None = None,
):
    """Run ``train_loop(ctx)`` on ``num_workers`` DDP workers fed by raypipe.

    Returns Ray Train's ``Result`` (metrics, checkpoint, error). Checkpoints go under
    ``storage_path`` (default: Ray's ``~/ray_results``). ``max_failures`` is Ray Train's
    ``FailureConfig``: a dead worker restarts the group, which resumes from the run's
    latest checkpoint. ``checkpoint_every`` steps (and at each epoch's end), a checkpoint
    holds the pipeline's position and rank 0's ``state()`` given to ``ctx.epochs``.
    ``resume_from`` (a checkpoint folder, or a run folder for its latest checkpoint)
    starts mid-epoch where that run stopped, with any ``num_workers``.
    ``callbacks`` are ``ray.train.UserCallback`` objects run on the Train controller.
    The samples each dataset skipped (``on_error="skip"``) are written to
    ``skipped_samples.json`` in the run's folder (``result.path``).
    """
    import ray
    import ray.train
    from ray.train.constants import DEFAULT_STORAGE_PATH
    from ray.train.torch import TorchTrainer

    _check_run(num_workers=num_workers, epochs=epochs, cpus_per_worker=cpus_per_worker,
               checkpoint_every=checkpoint_every)  # fmt: skip
    listing = _list_for(config, num_workers)
    start, start_dir = _resume_point(resume_from, listing, config.seed, epochs)
    if not ray.is_initialized():
        ray.init()  # as Ray Train would: the skip logs live in an actor
    name = name or f"raypipe_{uuid.uuid4().hex[:12]}"
    storage = storage_path or DEFAULT_STORAGE_PATH
    storage = storage if "://" in storage else os.path.abspath(storage)
    skips = SkipLog.create()
    skip_logs = {_train_name(e): skips.epoch(e) for e in range(epochs)}
    datasets = {}
    if eval_config is not None:
        skip_logs[EVAL] = SkipLog.create()
        datasets[EVAL] = build_dataset(eval_config, skips=skip_logs[EVAL])
    progress = Progress(seed=config.seed, num_samples=listing.num_samples,
                        fingerprint=fingerprint(listing), start=start, start_dir=start_dir)  # fmt: skip
    _warn_if_short_of_cpus(config, eval_config, num_workers, cpus_per_worker)
    ledger = create_ledger(num_workers) if num_workers > 1 else None
    ctx = TrainContext(config, eval_config, dict(loop_config or {}), epochs, skip_logs=skip_logs,
                       checkpoint_every=checkpoint_every, progress=progress, listing=listing,
                       skips=skips, ledger=ledger)  # fmt: skip

    def per_worker(_: dict) -> None:
        train_loop(ctx)

    trainer = TorchTrainer(
        per_worker,
        train_loop_config={},
        scaling_config=ray.train.ScalingConfig(
            num_workers=num_workers,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": cpus_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storage,
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            callbacks=callbacks or [],
        ),
        datasets=datasets,
    )
    result = trainer.fit()
    path, skipped = write_reports(skip_logs, result.path, result.filesystem)
    if skipped:
        log.warning("raypipe: skipped %d bad samples; the list is in %s", skipped, path)
    return result
