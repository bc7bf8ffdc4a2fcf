"""Block size from the object store: blocks small enough that backpressure holds the data
in the store instead of spilling it (`notes/ray-memory.md`: spilling follows block size).
"""

from __future__ import annotations

import logging

from raypipe.config import PipelineConfig

__all__ = ["sized_blocks"]

log = logging.getLogger(__name__)

BLOCK_SHARE = 0.05  # a block above this share of the object store is warned about
BLOCK_TARGET = 0.02  # the share an automatic block size aims at when batch_size is too big


def sized_blocks(config: PipelineConfig) -> PipelineConfig:
    """``config`` with ``rows_per_block`` set: ``batch_size`` when unset, or fewer rows when
    such a block would be over 5 % of the smallest node's object store (then about 2 %).
    Warns about a block set over 5 %; refuses, before any work, one no store can hold."""
    import ray

    sample = 3 * config.image_size**2
    stores = [
        n["Resources"]["object_store_memory"]
        for n in ray.nodes()
        if n["Alive"] and n["Resources"].get("object_store_memory")
    ]
    if not stores:
        return config if config.rows_per_block else config.replace(rows_per_block=config.batch_size)
    if config.rows_per_block is None:
        rows = config.batch_size
        if rows * sample > min(stores) * BLOCK_SHARE:
            rows = max(1, int(min(stores) * BLOCK_TARGET) // sample)
        return config.replace(rows_per_block=rows)
    block = config.rows_per_block * sample
    if block > max(stores):
        raise ValueError(
            f"PipelineConfig.rows_per_block={config.rows_per_block} x image_size="
            f"{config.image_size} (3x{config.image_size}x{config.image_size} uint8) makes "
            f"blocks of {block / 2**20:.1f} MiB, more than the largest object store "
            f"({max(stores) / 2**20:.1f} MiB): lower rows_per_block or image_size"
        )
    if block > min(stores) * BLOCK_SHARE:
        log.warning(
            "raypipe: blocks of %.1f MiB are %.0f%% of the object store (%.0f MiB): expect "
            "spilling under backpressure; keep them near 2%% (lower rows_per_block)",
            block / 2**20, 100 * block / min(stores), min(stores) / 2**20,
        )  # fmt: skip
    return config
