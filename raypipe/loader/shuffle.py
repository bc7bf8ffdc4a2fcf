"""The rank's local shuffle: a buffer of rows, batches drawn from it at random, seeded.

One shuffle for both public paths: a `raypipe.Pipeline` rank's feeder (seeded by
``(seed, epoch, rank)``) and `raypipe.iter_torch_batches` with ``shuffle_buffer`` (seeded
by ``shuffle_seed``). Every batch but the last has exactly ``batch_size`` rows, so the
batch counts stay ``rows // batch_size`` as re-batching makes them.
"""

from __future__ import annotations

import numpy as np

from raypipe.loader.rebatch import concat_column

__all__ = ["shuffled"]
assert __all__ == sorted(__all__)

Columns = dict[str, np.ndarray]


def shuffled(blocks, batch_size: int, buffer: int, rng: np.random.Generator, *,
             drop_last: bool = True):  # fmt: skip
    """Step 3 with a local shuffle: batches of rows drawn at random from ``buffer`` +
    ``batch_size`` held rows (seeded, so the same blocks give the same batches); the
    last short batch too unless ``drop_last``."""
    held: Columns | None = None
    for block in blocks:
        held = block if held is None else {k: concat_column([held[k], v]) for k, v in block.items()}
        while _rows(held) >= buffer + batch_size:
            yield from _draw(held, batch_size, rng, out := [])
            held = out[0]
    while held is not None and _rows(held) >= batch_size:
        yield from _draw(held, batch_size, rng, out := [])
        held = out[0]
    if held is not None and _rows(held) and not drop_last:
        yield from _draw(held, _rows(held), rng, [])


def _draw(held: Columns, n: int, rng: np.random.Generator, rest: list):
    order = rng.permutation(_rows(held))
    take, keep = order[:n], order[n:]
    rest.append({k: v[keep] for k, v in held.items()})
    yield {k: v[take] for k, v in held.items()}


def _rows(columns: Columns) -> int:
    return len(next(iter(columns.values())))
