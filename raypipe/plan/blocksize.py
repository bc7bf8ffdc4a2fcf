"""Sizes from the object store: blocks, tasks and read-ahead small enough that backpressure
holds the data in the store instead of spilling it (`notes/ray-memory.md`).

A rank's share of a node's store is the smallest store over the ranks that may share it
(up to `RANKS_PER_NODE`: a node's GPUs), less what the memory cache may hold there first:
with ``cache="memory"`` every node's cache keeps up to its budget (``cache_budget``, by
default `MEMORY_CACHE_SHARE` of the smallest store) in that same store, so the ranks share
the rest. Within that share, with the defaults:

```
 block      rows_per_block × sample      <= 5 % of the share (else ~2 %), one batch if it fits
 task       files_per_task × sample      <= 25 % of the share / (actors × tasks in flight)
 read-ahead the rank's execution          <= 50 % of the share (Ray Data's own fraction,
                                             of one rank's share instead of the whole store)
 lead       lead_batches × batch            <= 20 % of the rank's share of its own node's
                                             store, at most `LEAD_MAX` batches
```

The lead is the blocks a rank of a multi-rank run holds (fetched: in its own node's store)
ahead of the batch it asks the equal-batches ledger about, so that it reports rarely
(`raypipe.loader.ledger`): `LEAD_MAX` batches keep a rank under one report a second at ten
steps a second.

Batches the rank holds (the feeder's queue, ``prefetch_batches``) are copies on the heap
whenever a block is smaller than a batch, and at most a few blocks of the store otherwise.
"""

from __future__ import annotations

import logging

from raypipe.config import PipelineConfig

__all__ = ["BLOCK_SHARE", "BLOCK_TARGET", "LEAD_MAX", "LEAD_SHARE", "MAX_FILES_PER_TASK",
           "MEMORY_CACHE_SHARE", "RANKS_PER_NODE", "READ_AHEAD_SHARE", "TASKS_IN_FLIGHT",
           "TASK_SHARE", "lead_for", "memory_cache_bytes", "rank_store_limit", "sized_blocks",
           "store_share"]  # fmt: skip
assert __all__ == sorted(__all__)

log = logging.getLogger(__name__)

BLOCK_SHARE = 0.05  # a block above this share of the rank's store is warned about
BLOCK_TARGET = 0.02  # the share an automatic block size aims at when batch_size is too big
TASK_SHARE = 0.25  # every task in flight of one rank's pool, at most, by default
READ_AHEAD_SHARE = 0.5  # one rank's execution: Ray Data's default fraction, of its share
TASKS_IN_FLIGHT = 2  # Ray Data 2.60's tasks in flight per actor (2 × max_concurrency 1)
RANKS_PER_NODE = 8  # ranks that may share one node's store: at most a node's GPUs
MAX_FILES_PER_TASK = 256
LEAD_SHARE = 0.2  # the lead's blocks, at most, by default
LEAD_MAX = 20  # batches of lead by default: about 2/3 of a report a second at 10 steps/s
MEMORY_CACHE_SHARE = 0.25  # cache="memory": its default budget, of the smallest store


def memory_cache_bytes(config: PipelineConfig | None, smallest: float | None) -> int:
    """Bytes of every node's object store that ``config``'s memory cache may fill: its
    ``cache_budget``, or `MEMORY_CACHE_SHARE` of ``smallest`` (the smallest alive store);
    0 without ``cache="memory"``. A budget over half of ``smallest`` is refused before any
    work: the blocks would have too little room left."""
    if config is None or config.cache != "memory":
        return 0
    if config.cache_budget is not None:
        budget = config.cache_budget
    else:
        budget = max(1, int(MEMORY_CACHE_SHARE * (smallest or 0)))
    if smallest is not None and budget > smallest // 2:
        raise ValueError(f"PipelineConfig.cache_budget={config.cache_budget!r}: over half the "
                         f"smallest node's object store ({int(smallest)} bytes), where the "
                         "memory cache keeps its pixels")  # fmt: skip
    return budget


def store_share(world_size: int = 1, *, here: bool = False,
                config: PipelineConfig | None = None) -> float | None:  # fmt: skip
    """Bytes of object store one rank of ``world_size`` may count on: the smallest alive
    node's store (``here``: this process's node's), less ``config``'s memory cache budget
    (`memory_cache_bytes`: it lives in the same store), over the ranks that may share it;
    None before Ray knows any store."""
    import ray

    node = ray.get_runtime_context().get_node_id() if here else None
    alive = [
        (n["NodeID"], n["Resources"]["object_store_memory"])
        for n in ray.nodes()
        if n["Alive"] and n["Resources"].get("object_store_memory")
    ]
    stores = [store for i, store in alive if node is None or i == node]
    if not stores:
        return None
    cache = memory_cache_bytes(config, min(store for _, store in alive))
    return (min(stores) - cache) / min(world_size, RANKS_PER_NODE)


def rank_store_limit(world_size: int, config: PipelineConfig | None = None) -> float | None:
    """The object store one rank's execution may fill ahead of its trainer, in bytes (of
    its `store_share`, with ``config``'s memory cache left out)."""
    share = store_share(world_size, config=config)
    return None if share is None else READ_AHEAD_SHARE * share


def lead_for(batch_bytes: int, share: float | None) -> int:
    """The default lead of a rank with ``share`` bytes of store: `LEAD_MAX` batches, or
    what `LEAD_SHARE` of the share holds (`LEAD_MAX` when no store is known yet)."""
    if share is None:
        return LEAD_MAX
    return max(0, min(LEAD_MAX, int(LEAD_SHARE * share // max(batch_bytes, 1))))


def sized_blocks(config: PipelineConfig, *, world_size: int = 1,
                 actors: int | None = None) -> PipelineConfig:  # fmt: skip
    """``config`` with ``rows_per_block``, ``files_per_task`` and ``lead_batches`` set from
    the object store: each rank's `store_share`, less the memory cache's budget with
    ``cache="memory"`` (an over-large budget is refused here, before any work).

    ``actors``: the most actors of one rank's pool (default ``config.actors[1]``). Unset
    fields are sized to fit (module docstring); a set block over 5 % of the share is warned
    about; a set block or task that no store can hold is refused before any work."""
    actors = config.actors[1] if actors is None else actors
    sample = 3 * config.image_size**2
    share = store_share(world_size, config=config)
    if config.lead_batches is None and world_size == 1:
        config = config.replace(lead_batches=0)
    elif config.lead_batches is None:
        here = store_share(world_size, here=True, config=config)
        config = config.replace(lead_batches=lead_for(config.batch_size * sample, here))
    if share is None:
        rows = config.rows_per_block or config.batch_size
        return config.replace(rows_per_block=rows,
                              files_per_task=config.files_per_task or MAX_FILES_PER_TASK)  # fmt: skip
    config = _with_rows(config, sample, share, world_size)
    in_flight = actors * TASKS_IN_FLIGHT
    if config.files_per_task is None:
        files = int(TASK_SHARE * share / (in_flight * sample))
        return config.replace(files_per_task=max(1, min(MAX_FILES_PER_TASK, files)))
    need = config.files_per_task * sample * in_flight
    if need > share:
        fits = max(1, int(share / (in_flight * sample)))
        raise ValueError(
            f"PipelineConfig.files_per_task={config.files_per_task}: {in_flight} tasks in flight "
            f"({actors} actors x {TASKS_IN_FLIGHT}) of {config.files_per_task} images at "
            f"{config.image_size}x{config.image_size} need {need / 2**20:.0f} MiB, more than "
            f"one rank's object store ({share / 2**20:.0f} MiB): set files_per_task <= {fits}, "
            "or leave it unset to size it from the store"
        )
    return config


def _with_rows(config: PipelineConfig, sample: int, share: float, world_size: int):
    if config.rows_per_block is None:
        rows = config.batch_size
        if rows * sample > share * BLOCK_SHARE:
            rows = max(1, int(share * BLOCK_TARGET) // sample)
        return config.replace(rows_per_block=rows)
    block = config.rows_per_block * sample
    if block > share:
        ranks = f" with {world_size} ranks" if world_size > 1 else ""
        raise ValueError(
            f"PipelineConfig.rows_per_block={config.rows_per_block} x image_size="
            f"{config.image_size} (3x{config.image_size}x{config.image_size} uint8) makes "
            f"blocks of {block / 2**20:.1f} MiB, more than one rank's object store"
            f"{ranks} ({share / 2**20:.1f} MiB): lower rows_per_block or image_size"
        )
    if block > share * BLOCK_SHARE:
        log.warning(
            "raypipe: blocks of %.1f MiB are %.0f%% of one rank's object store (%.0f MiB): "
            "expect spilling under backpressure; keep them near 2%% (lower rows_per_block)",
            block / 2**20, 100 * block / share, share / 2**20,
        )  # fmt: skip
    return config
