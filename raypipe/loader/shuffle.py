"""The rank's local shuffle: a buffer of rows, batches drawn from it at random, seeded.

One shuffle for both public paths: a `raypipe.Pipeline` rank's feeder (seeded by
``(seed, epoch, rank)``) and `raypipe.iter_torch_batches` with ``shuffle_buffer`` (seeded
by ``shuffle_seed``). Every batch but the last has exactly ``batch_size`` rows, so the
batch counts stay ``rows // batch_size`` as re-batching makes them.
"""

from __future__ import annotations

import numpy as np

from raypipe.loader.collate import holding_dtype

__all__ = ["shuffled"]
assert __all__ == sorted(__all__)

Columns = dict[str, np.ndarray]


def shuffled(blocks, batch_size: int, buffer: int, rng: np.random.Generator, *,
             drop_last: bool = True):  # fmt: skip
    """Step 3 with a local shuffle: batches of rows drawn at random from a pool of
    ``buffer`` + ``batch_size`` rows (seeded); the last short batch too unless
    ``drop_last``.

    A batch is drawn each time the pool is full, and the next rows fill the slots it
    freed, so the batches depend on the rows and their order alone, not on how they come
    cut into blocks (tasks of another size on another machine); a batch costs its own
    rows, not the pool's."""
    capacity = buffer + batch_size
    pool: dict[str, np.ndarray] | None = None
    free = np.arange(capacity)  # the slots the next rows fill, in order
    for block in blocks:
        if not _rows(block):
            continue
        if pool is None:
            pool = {k: np.empty((capacity, *v.shape[1:]), v.dtype) for k, v in block.items()}
        n, at = _rows(block), 0
        while at < n:
            unfilled = free
            slots, free = free[: n - at], free[n - at :]
            _put(pool, slots, block, at, unfilled)
            at += len(slots)
            if not len(free):  # full: a batch out, and its slots are the next to fill
                free = rng.choice(capacity, batch_size, replace=False)
                yield {k: v[free] for k, v in pool.items()}
    if pool is None:
        return
    held = np.setdiff1d(np.arange(capacity), free)  # the rows left, in slot order
    held = held[rng.permutation(len(held))]
    last = len(held) if not drop_last else len(held) - len(held) % batch_size
    for lo in range(0, last, batch_size):
        yield {k: v[held[lo : lo + batch_size]] for k, v in pool.items()}


def _put(pool: dict[str, np.ndarray], slots: np.ndarray, block: Columns, at: int,
         unfilled: np.ndarray) -> None:  # fmt: skip
    """Rows ``at`` onwards of ``block`` into ``slots`` (of the pool's ``unfilled``). A
    column whose rows need a wider type than the pool's (longer strings, floats after
    ints, signed after unsigned integers) widens it, as concatenating them would; one whose
    rows differ in shape (a transform's ragged field) becomes one of objects, a row each."""
    for k, v in block.items():
        rows = v[at : at + len(slots)]
        column = pool[k]
        ragged = column.dtype == object or rows.dtype == object
        if not ragged and rows.shape[1:] == column.shape[1:]:
            wide = np.result_type(column.dtype, rows.dtype)
            if wide.kind == "f" and {column.dtype.kind, rows.dtype.kind} == {"i", "u"}:
                held = np.setdiff1d(np.arange(len(column)), unfilled)  # the rows it holds
                wide = holding_dtype(k, [column[held], rows])  # int64, if both fit it
            if wide != column.dtype:
                column = pool[k] = column.astype(wide)
        elif column.dtype != object:
            objects = np.empty(len(column), dtype=object)
            for i, row in enumerate(column):
                objects[i] = row
            column = pool[k] = objects
        if column.dtype == object and rows.dtype != object:
            for slot, row in zip(slots.tolist(), rows, strict=True):
                column[slot] = row
        else:
            column[slots] = rows


def _rows(columns: Columns) -> int:
    return len(next(iter(columns.values())))
