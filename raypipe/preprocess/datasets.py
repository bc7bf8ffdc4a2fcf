"""The Ray Datasets that run the preprocessing actor, both from the same plan rows and the
same `Preprocessor` (`raypipe.preprocess.actor`):

```
 build_dataset(config, epoch=)       one epoch: the driver's seeded shard order
   from_items(shard rows)              (`raypipe.plan.shards`) → Preprocessor(epoch=e)
   ▼ blocks {image, label, key}

 rank_dataset(config, listing, plan, epochs)   one rank's run (`raypipe.Pipeline`)
   from_items(task ids): one block per task (up to MAX_ID_BLOCKS blocks of consecutive
     task ids), all epochs in order (epoch e's tasks first)
   ▼ preserve_order: blocks come out in task order, so epochs never interleave
   RankPreprocessor pool (this rank's share of config.actors), started once for the run:
   task id → (epoch, shard rows) (`raypipe.plan.ranktasks.RankTasks`) → read + decode + crop
   ▼ blocks {image, label, key, epoch}; one task's rows are one epoch's (a block Ray
     Data merged from several tasks' outputs may hold two)
 the rank's Feeder cuts epochs where the ``epoch`` column changes, within a block too
```

Ray Data keeps an actor pool for exactly one execution (``StreamingExecutor.shutdown``
kills it), so a dataset per epoch starts a new pool per epoch. One execution over all
epochs keeps the same actors warm for the whole run, and decodes epoch e+1 while the
trainer still consumes epoch e, as far as the object store's budget allows.
"""

from __future__ import annotations

import numpy as np

from raypipe import localnode
from raypipe.config import PipelineConfig
from raypipe.plan.blocksize import rank_store_limit, sized_blocks
from raypipe.plan.rankplan import RankPlan, rank_pool
from raypipe.plan.ranktasks import RankTasks
from raypipe.plan.shards import Listing, list_shards
from raypipe.preprocess.actor import Preprocessor, RankPreprocessor, preprocess_task
from raypipe.preprocess.cache import node as node_cache
from raypipe.skips.log import SkipLog

__all__ = ["build_dataset", "rank_dataset"]
assert __all__ == sorted(__all__)

# Ray Data puts every block of from_items into the object store, 0.7 ms each on 2 cores:
# a run of more tasks (ImageNet at one rank: 5,005 a epoch, 450k over 90 epochs) gives
# each block consecutive task ids, so the dataset is built in seconds, not minutes.
MAX_ID_BLOCKS = 8192


def build_dataset(
    config: PipelineConfig,
    *,
    epoch: int = 0,
    listing: Listing | None = None,
    skips: SkipLog | None = None,
    consumed: np.ndarray | None = None,
):
    """The dataset of one epoch: rows ``image`` (uint8 C×H×W), ``label``, ``key`` (int64).

    ``listing`` lets a caller list the shards once and build many epochs from it.
    ``consumed`` (bool per key, e.g. ``PipelineState.consumed``) resumes an interrupted
    epoch: those keys are left out before their shards are read or decoded.
    Skipped samples go to ``skips``, a `SkipLog` (``SkipLog.create()``); pass the same log
    to ``iter_torch_batches(ds, config, skips=skips)`` for its counts in ``stats()``. Without
    one the dataset makes its own, for the skip budget.
    """
    import ray
    import ray.data

    if not isinstance(config, PipelineConfig):
        raise TypeError(f"config must be a PipelineConfig, got {type(config).__name__}")
    if not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"{epoch=} must be an integer >= 0")
    listing = listing or list_shards(config)
    if consumed is not None and np.shape(consumed) != (listing.num_samples,):
        raise ValueError(f"consumed has shape {np.shape(consumed)}, not ({listing.num_samples},)")
    lo, hi = config.actors
    if skips is None:  # after listing: a bad source fails before Ray starts
        localnode.ensure()
        skips = SkipLog.create()
    config = sized_blocks(config, listing=listing)
    node_cache.ensure(config)  # the decoded cache's actors, one per node, if it is on
    # the plan of one rank of one: the epoch's seeded order, minus what ``consumed`` marks
    plan = RankPlan.of(listing, seed=config.seed, shuffle=config.shuffle_files, rank=0,
                       world_size=1, per_task=config.files_per_task,
                       resume_epoch=epoch if consumed is not None else -1,
                       consumed=consumed)  # fmt: skip
    tasks = RankTasks.of(listing, plan, range(epoch, epoch + 1))
    ds = _task_ids(len(tasks))
    kwargs = {"config": config, "reader": listing.reader, "epoch": epoch, "skips": skips,
              "tasks": tasks}  # fmt: skip
    common = {"batch_size": 1, "batch_format": "numpy", "num_cpus": config.actor_cpus}
    if config.compute == "tasks":  # pooled workers stay warm across epochs: no pool start
        pool = ray.data.TaskPoolStrategy(size=hi)
        ds = ds.map_batches(preprocess_task, fn_kwargs=kwargs, compute=pool, **common)
    else:
        pool = ray.data.ActorPoolStrategy(min_size=lo, max_size=hi)
        ds = ds.map_batches(Preprocessor, fn_constructor_kwargs=kwargs, compute=pool, **common)
    return ds


def rank_dataset(config: PipelineConfig, listing: Listing, plan: RankPlan, epochs: range,
                 skips, *, world_size: int, shared_skips: bool = False):  # fmt: skip
    """The lazy run-long dataset of ``plan``'s rank over ``epochs`` on its actor pool
    (``compute="actors"``; `raypipe.preprocess.tasks` runs ``"tasks"``); None if it has no
    task.

    ``shared_skips``: every rank writes to ``skips``, so the skip budget is the epoch's
    (all ranks' samples); else this rank's own samples."""
    import ray.data

    tasks = RankTasks.of(listing, plan, epochs, shared_skips=shared_skips)
    if len(tasks) == 0:
        return None
    lo, hi = rank_pool(config.actors, world_size, plan.rank)
    node_cache.ensure(config)  # the decoded cache's actors, one per node, if it is on
    ds = _task_ids(len(tasks))
    kwargs = {"config": config, "reader": listing.reader, "skips": skips, "tasks": tasks}
    common = {"batch_size": 1, "batch_format": "numpy", "num_cpus": config.actor_cpus}
    # a following pool starts at its max, as a fixed one would, and sheds what the
    # trainer leaves idle (raypipe.pool.follow); else Ray Data grows it from its min
    start = hi if config.follow else None
    pool = ray.data.ActorPoolStrategy(min_size=lo, max_size=hi, initial_size=start)
    ds = ds.map_batches(RankPreprocessor, fn_constructor_kwargs=kwargs, compute=pool,
                        **common)  # fmt: skip
    ds.context.execution_options.preserve_order = True
    ds.context.enable_progress_bars = (
        False  # one rank's inner dataset: raypipe.loader.progress instead
    )
    # no thread per task polling the actor's memory for Ray Data's high-memory warning:
    # raypipe's blocks are sized from the object store (raypipe.plan.blocksize)
    ds.context.memory_usage_poll_interval_s = None
    # every rank's execution counts the whole cluster's store as its own: limit each
    # one's read-ahead to its share, so that ranks on one node together stay within it
    limit = rank_store_limit(world_size)
    if limit is not None:
        ds.context.execution_options.resource_limits = (
            ds.context.execution_options.resource_limits.copy(object_store_memory=limit)
        )
    return ds


def _task_ids(count: int):
    """The dataset of task ids: one block per task, so that every task can go to another
    actor (up to `MAX_ID_BLOCKS` blocks of consecutive ids); no read tasks, which would
    compete with the pool for CPUs."""
    import ray.data

    return ray.data.from_items([{"id": i} for i in range(count)],
                               override_num_blocks=max(1, min(count, MAX_ID_BLOCKS)))  # fmt: skip
