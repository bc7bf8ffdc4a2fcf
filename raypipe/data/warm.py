"""One rank's run-long dataset: every epoch it still has to read, through one actor pool.

```
 from_items(task ids): one block per task, all epochs in order (epoch e's tasks first)
   ▼ preserve_order: blocks come out in task order, so epochs never interleave
 RankPreprocessor pool (this rank's share of config.actors), started once for the run:
   task id → (epoch, lo, hi) → keys plan.keys(epoch)[lo:hi] → read + decode + crop
   ▼ blocks {image, label, key, epoch}; one task's blocks never mix epochs
 the rank's Feeder cuts epochs where the ``epoch`` column changes
```

Ray Data keeps an actor pool for exactly one execution (``StreamingExecutor.shutdown``
kills it), so a dataset per epoch starts a new pool per epoch. One execution over all
epochs keeps the same actors warm for the whole run, and decodes epoch e+1 while the
trainer still consumes epoch e, as far as the object store's budget allows.
"""

from __future__ import annotations

import numpy as np

from raypipe.config import PipelineConfig
from raypipe.data.blocksize import rank_store_limit
from raypipe.data.dataset import Preprocessor
from raypipe.data.rankplan import RankPlan
from raypipe.data.shards import Listing, Reader

__all__ = ["RankPreprocessor", "rank_dataset", "rank_pool", "rank_task", "task_table"]
assert __all__ == sorted(__all__)


def rank_pool(actors: tuple[int, int], world_size: int) -> tuple[int, int]:
    """Each rank's share of ``PipelineConfig.actors`` (the run's total), at least one."""
    lo, hi = actors
    share_lo = max(1, lo // world_size)
    return share_lo, max(share_lo, -(-hi // world_size))


def task_table(plan: RankPlan, epochs: range) -> np.ndarray:
    """``(epoch, lo, hi)`` of every task of the rank, epochs in order."""
    rows = [(e, lo, hi) for e in epochs for lo, hi in plan.tasks(e)]
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def rank_dataset(config: PipelineConfig, listing: Listing, plan: RankPlan, epochs: range,
                 skips, *, world_size: int, shared_skips: bool = False):  # fmt: skip
    """The lazy run-long dataset of ``plan``'s rank over ``epochs``; None if it has no task.

    ``shared_skips``: every rank writes to ``skips``, so the skip budget is the epoch's
    (all ranks' samples); else this rank's own samples."""
    import ray.data

    table = task_table(plan, epochs)
    if len(table) == 0:
        return None
    lo, hi = rank_pool(config.actors, world_size)
    # One block per task, so that every task can go to another actor; no read tasks,
    # which would compete with the pool for CPUs.
    ids = [{"id": i} for i in range(len(table))]
    ds = ray.data.from_items(ids, override_num_blocks=len(table))
    kwargs = {
        "config": config, "reader": listing.reader, "plan": plan, "table": table,
        "paths": [s.path for s in listing.shards],
        "labels": np.fromiter((s.label for s in listing.shards), np.int64),
        "skips": skips, "shared_skips": shared_skips,
    }  # fmt: skip
    common = {"batch_size": 1, "batch_format": "numpy", "num_cpus": config.actor_cpus}
    if config.compute == "tasks":  # Ray tasks on pooled workers, at most ``hi`` at once
        tasks = ray.data.TaskPoolStrategy(size=hi)
        ds = ds.map_batches(rank_task, fn_kwargs=kwargs, compute=tasks, **common)
    else:
        # a following pool starts at its max, as a fixed one would, and sheds what the
        # trainer leaves idle (raypipe.data.follow); else Ray Data grows it from its min
        start = hi if config.follow else None
        pool = ray.data.ActorPoolStrategy(min_size=lo, max_size=hi, initial_size=start)
        ds = ds.map_batches(RankPreprocessor, fn_constructor_kwargs=kwargs, compute=pool,
                            **common)  # fmt: skip
    ds.context.execution_options.preserve_order = True
    ds.context.enable_progress_bars = (
        False  # one rank's inner dataset: raypipe.loader.progress instead
    )
    # no thread per task polling the actor's memory for Ray Data's high-memory warning:
    # raypipe's blocks are sized from the object store (raypipe.data.blocksize)
    ds.context.memory_usage_poll_interval_s = None
    # every rank's execution counts the whole cluster's store as its own: limit each
    # one's read-ahead to its share, so that ranks on one node together stay within it
    limit = rank_store_limit(world_size)
    if limit is not None:
        ds.context.execution_options.resource_limits = (
            ds.context.execution_options.resource_limits.copy(object_store_memory=limit)
        )
    return ds


def rank_task(ids: dict[str, np.ndarray], **kwargs):
    """`RankPreprocessor` as a plain Ray task (``PipelineConfig.compute="tasks"``)."""
    yield from RankPreprocessor(**kwargs)(ids)


class RankPreprocessor(Preprocessor):
    """`Preprocessor` over task ids: each names ``(epoch, lo, hi)`` of the rank's plan.

    Blocks carry an ``epoch`` column; skips go to that epoch's log (``skips.epoch(e)``).
    """

    def __init__(self, config: PipelineConfig, reader: Reader, plan: RankPlan, table: np.ndarray,
                 paths: list[str], labels: np.ndarray, skips=None, shared_skips=False):  # fmt: skip
        super().__init__(config, reader, 0, skips)
        self.plan, self.table, self.paths, self.labels = plan, table, paths, labels
        self.shared_skips = shared_skips

    def epoch_samples(self, epoch: int) -> int:
        sizes = self.plan.sizes(epoch)
        return int(sum(sizes)) if self.shared_skips else sizes[self.plan.rank]

    def __call__(self, ids: dict[str, np.ndarray]):
        for task in ids["id"]:
            epoch, lo, hi = (int(v) for v in self.table[int(task)])
            skips = self.skips.epoch(epoch) if self.skips is not None else None
            for block in self._blocks(self._shard_rows(epoch, lo, hi), epoch, skips):
                block["epoch"] = np.full(len(block["key"]), epoch, dtype=np.int64)
                yield block

    def _shard_rows(self, epoch: int, lo: int, hi: int) -> dict[str, list]:
        """The task's keys as shard rows (`raypipe.train.state.pending_rows` layout): members
        of a shard that are not the task's are marked done, so they are not read."""
        keys = self.plan.keys(epoch)[lo:hi]
        shard = self.plan.shard_of(keys)
        cuts = np.flatnonzero(np.diff(shard)) + 1
        rows: dict[str, list] = {
            k: [] for k in ("path", "first_key", "num_samples", "label", "done")
        }
        for piece, s in zip(np.split(keys, cuts), shard[np.r_[0, cuts]], strict=True):
            s = int(s)
            first, count = int(self.plan.first[s]), int(self.plan.counts[s])
            done = b""
            if len(piece) < count:
                mask = np.ones(count, dtype=bool)
                mask[piece - first] = False
                done = np.packbits(mask).tobytes()
            rows["path"].append(self.paths[s])
            rows["first_key"].append(first)
            rows["num_samples"].append(count)
            rows["label"].append(int(self.labels[s]))
            rows["done"].append(done)
        return rows
