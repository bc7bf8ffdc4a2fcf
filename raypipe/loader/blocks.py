"""Blocks straight from a Ray Data execution: RefBundles → ``ray.get`` → numpy columns.

The rank iterator reads blocks itself instead of through ``Dataset.iter_batches``: one
``ray.get`` per bundle and a zero-copy Arrow → numpy view per column is all a batch costs
when a block is one batch (Ray's batcher adds its own threads, queues and formatting).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from raypipe import rayapi
from raypipe.loader.errors import quiet_ray_data_aborts

__all__ = ["block_columns", "dataset_columns", "execute"]
assert __all__ == sorted(__all__)

Columns = dict[str, np.ndarray]


def execute(ds, follower=None):
    """Start ``ds``'s execution here: its blocks as numpy columns, and ``stop()``, which
    shuts the execution down (and with it its actor pools) from any thread. ``follower``:
    a `raypipe.pool.follow.Follower` that sizes the execution's actor pools.

    Not through ``Dataset._execute_to_iterator``: Ray 2.60's returns
    ``itertools.chain([first], rest)``, whose arguments hold the first bundle until the
    iterator ends. A run-long execution kept that block in the object store of the node
    that made it, which then never went idle: the autoscaler could not remove it while the
    pool had shed its actors there (``tests/loader/test_blocks.py``)."""
    quiet_ray_data_aborts()  # its error is raised as itself, by the rank
    bundles, executor = rayapi.execute_to_iterator(ds)
    if follower is not None:
        from raypipe.pool.autoscale import follow

        follow(executor, follower)

    def stop() -> None:
        executor.shutdown(force=True)
        # the executor is its scheduling thread (`raypipe.rayapi` checks it): once that has
        # ended, what a failed run left in its frames is garbage that
        # `raypipe.loader.errors.collect_failed` can free
        executor.join(timeout=10)

    return block_columns(bundles), stop


def dataset_columns(ds) -> Iterator[Columns]:
    """Every block of ``ds`` as numpy columns; the execution stops when this generator does."""
    columns, stop = execute(ds)
    try:
        yield from columns
    finally:
        stop()


def block_columns(bundles) -> Iterator[Columns]:
    """The numpy columns of every non-empty block of a stream of ``RefBundle``s."""
    import ray

    for bundle in bundles:
        slices = getattr(bundle, "slices", None) or [None] * len(bundle.blocks)
        kept = [(e, s) for e, s in zip(bundle.blocks, slices, strict=True)
                if e.metadata.num_rows != 0]  # all-skipped tasks; None: rows not counted  # fmt: skip
        if not kept:
            continue
        for block, (_, piece) in zip(ray.get([e.ref for e, _ in kept]), kept, strict=True):
            columns = _columns(block)
            if piece is not None:
                columns = {k: v[piece.start_offset : piece.end_offset] for k, v in columns.items()}
            yield columns


def _columns(block) -> Columns:
    """Zero-copy numpy views of an Arrow block's columns (Ray's own conversion otherwise)."""
    import pyarrow as pa
    from ray.data.block import BlockAccessor

    if isinstance(block, pa.Table) and all(c.num_chunks == 1 for c in block.columns):
        try:
            return {
                name: column.chunk(0).to_numpy(zero_copy_only=True)
                for name, column in zip(block.column_names, block.columns, strict=True)
            }
        except (pa.ArrowInvalid, TypeError, NotImplementedError):
            pass  # nulls, strings, ragged tensors: let Ray convert them
    return BlockAccessor.for_block(block).to_batch_format("numpy")
