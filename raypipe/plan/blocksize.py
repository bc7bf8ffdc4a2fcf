"""Sizes from the object store: blocks, tasks and read-ahead small enough that backpressure
holds the data in the store instead of spilling it (`notes/ray-memory.md`).

A rank's share of a node's store is the smallest store over the ranks that may share it
(up to `RANKS_PER_NODE`: a node's GPUs). Within that share, with the defaults:

```
 block      rows_per_block × sample      <= 5 % of the share (else ~2 %), one batch if it fits
 task       files_per_task × sample      <= 25 % of the share / (actors × tasks in flight):
                                            image files, or samples of one shard (a longer
                                            shard is read in pieces: `RankPlan.task_bounds`)
 read-ahead the rank's execution          <= 50 % of the share (Ray Data's own fraction,
                                             of one rank's share instead of the whole store)
 lead       lead_batches × batch            <= 20 % of the rank's share of its own node's
                                             store, at most `LEAD_MAX` batches
```

The lead is the blocks a rank of a multi-rank run holds (fetched: in its own node's store)
ahead of the batch it asks the equal-batches ledger about, so that it reports rarely
(`raypipe.loader.ledger`): `LEAD_MAX` batches keep a rank under one report a second at ten
steps a second.

A sample is an image's ``3 × image_size²`` uint8 pixels (`sample_bytes`); one with no image
(tokens, audio, tables) is taken as `NO_IMAGE_EXPANSION` times its bytes on storage, a guess
on the large side (int32 tokens become int64, compressed columns expand).

Batches the rank holds (the feeder's queue, ``prefetch_batches``) are copies on the heap
whenever a block is smaller than a batch, and at most a few blocks of the store otherwise.
"""

from __future__ import annotations

import logging

from raypipe.config import PipelineConfig
from raypipe.formats import get_format

__all__ = ["BLOCK_SHARE", "BLOCK_TARGET", "LEAD_MAX", "LEAD_SHARE", "MAX_FILES_PER_TASK",
           "MAX_PIECE_ROWS", "NO_IMAGE_EXPANSION", "RANKS_PER_NODE", "READ_AHEAD_SHARE",
           "TASKS_IN_FLIGHT", "TASK_SHARE", "lead_for", "rank_store_limit", "sample_bytes",
           "sized_blocks", "store_share"]  # fmt: skip
assert __all__ == sorted(__all__)

log = logging.getLogger(__name__)

BLOCK_SHARE = 0.05  # a block above this share of the rank's store is warned about
BLOCK_TARGET = 0.02  # the share an automatic block size aims at when batch_size is too big
TASK_SHARE = 0.25  # every task in flight of one rank's pool, at most, by default
READ_AHEAD_SHARE = 0.5  # one rank's execution: Ray Data's default fraction, of its share
TASKS_IN_FLIGHT = 2  # Ray Data 2.60's tasks in flight per actor (2 × max_concurrency 1)
RANKS_PER_NODE = 8  # ranks that may share one node's store: at most a node's GPUs
MAX_FILES_PER_TASK = 256  # image files a task reads at most
MAX_PIECE_ROWS = 1 << 16  # samples of one shard a task reads at most, where the store allows
NO_IMAGE_EXPANSION = 4  # a sample with no image: bytes in a block per byte on storage
NO_IMAGE_SAMPLE = 64 << 10  # ... where no shard file's size is known
MIN_SAMPLE = 1 << 10  # a sample, at least (a row's arrays and their share of a block)
LEAD_SHARE = 0.2  # the lead's blocks, at most, by default
LEAD_MAX = 20  # batches of lead by default: about 2/3 of a report a second at 10 steps/s


def store_share(world_size: int = 1, *, here: bool = False) -> float | None:
    """Bytes of object store one rank of ``world_size`` may count on: the smallest alive
    node's store (``here``: this process's node's) over the ranks that may share it; None
    before Ray knows any store."""
    import ray

    node = ray.get_runtime_context().get_node_id() if here else None
    stores = [
        n["Resources"]["object_store_memory"]
        for n in ray.nodes()
        if n["Alive"]
        and n["Resources"].get("object_store_memory")
        and (node is None or n["NodeID"] == node)
    ]
    return min(stores) / min(world_size, RANKS_PER_NODE) if stores else None


def rank_store_limit(world_size: int) -> float | None:
    """The object store one rank's execution may fill ahead of its trainer, in bytes."""
    share = store_share(world_size)
    return None if share is None else READ_AHEAD_SHARE * share


def lead_for(batch_bytes: int, share: float | None) -> int:
    """The default lead of a rank with ``share`` bytes of store: `LEAD_MAX` batches, or
    what `LEAD_SHARE` of the share holds (`LEAD_MAX` when no store is known yet)."""
    if share is None:
        return LEAD_MAX
    return max(0, min(LEAD_MAX, int(LEAD_SHARE * share // max(batch_bytes, 1))))


def sample_bytes(config: PipelineConfig, listing=None) -> int:
    """Bytes one sample of ``config`` takes in a block: an image's ``3 × image_size²``;
    with no image (``image_column=None``), `NO_IMAGE_EXPANSION` times its mean size on
    storage in ``listing`` (a `raypipe.plan.shards.Listing`; `NO_IMAGE_SAMPLE` unknown)."""
    if config.image_column is not None:
        return 3 * config.image_size**2
    stored = listing.stored_per_sample if listing is not None else None
    return NO_IMAGE_SAMPLE if stored is None else max(MIN_SAMPLE, int(NO_IMAGE_EXPANSION * stored))


def sized_blocks(config: PipelineConfig, *, world_size: int = 1, actors: int | None = None,
                 listing=None) -> PipelineConfig:  # fmt: skip
    """``config`` with ``rows_per_block``, ``files_per_task`` and ``lead_batches`` set from
    the object store.

    ``actors``: the most actors of one rank's pool (default ``config.actors[1]``);
    ``listing``: the source's `raypipe.plan.shards.Listing` (a sample's size with no image,
    and whether a task reads image files or a piece of a shard). Unset fields are sized to
    fit (module docstring); a set block over 5 % of the share is warned about; a set block
    or task that no store can hold is refused before any work."""
    actors = config.actors[1] if actors is None else actors
    sample = sample_bytes(config, listing)
    files = listing is None or get_format(listing.format).one_per_file
    most = MAX_FILES_PER_TASK if files else MAX_PIECE_ROWS
    share = store_share(world_size)
    if config.lead_batches is None:
        lead = 0 if world_size == 1 else lead_for(config.batch_size * sample,
                                                  store_share(world_size, here=True))  # fmt: skip
        config = config.replace(lead_batches=lead)
    if share is None:
        rows = config.rows_per_block or config.batch_size
        return config.replace(rows_per_block=rows, files_per_task=config.files_per_task or most)
    config = _with_rows(config, sample, share, world_size)
    in_flight = actors * TASKS_IN_FLIGHT
    if config.files_per_task is None:
        fit = int(TASK_SHARE * share / (in_flight * sample))
        return config.replace(files_per_task=max(1, min(most, fit)))
    need = config.files_per_task * sample * in_flight
    if need > share:
        fits = max(1, int(share / (in_flight * sample)))
        raise ValueError(
            f"PipelineConfig.files_per_task={config.files_per_task}: {in_flight} tasks in flight "
            f"({actors} actors x {TASKS_IN_FLIGHT}) of {config.files_per_task} {_samples(config, sample)}"
            f" need {need / 2**20:.0f} MiB, more than "
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
        if config.image_column is None:
            raise ValueError(
                f"PipelineConfig.rows_per_block={config.rows_per_block} {_samples(config, sample)}"
                f" make blocks of {block / 2**20:.1f} MiB, more than one rank's object store"
                f"{ranks} ({share / 2**20:.1f} MiB): lower rows_per_block"
            )
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


def _samples(config: PipelineConfig, sample: int) -> str:
    """What a count of ``config``'s samples holds, for a refusal."""
    if config.image_column is not None:
        return f"images at {config.image_size}x{config.image_size}"
    how = (
        "size unknown"
        if sample == NO_IMAGE_SAMPLE
        else f"{NO_IMAGE_EXPANSION}x their size on storage"
    )
    return f"samples of about {sample / 2**10:.0f} KiB ({how})"
