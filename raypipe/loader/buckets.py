"""Step 3 with length bucketing: rows of similar length batch together, less padding.

```
 the rank's rows ─► windows of bucket_window·B rows ─► in each window: a bucket per row
   from its length (edges, or a count: edges at the window's length quantiles), rows sorted
   by bucket and, within one, in a seeded random order ─► cut into batches of B ─► the
   window's batches in a seeded random order (short ones and long ones interleave)
```

The guarantees stay those of plain re-batching: bucketing only reorders the rows a rank
already has, inside a window, so a rank makes ``rows // B`` batches of exactly ``B`` rows
whatever their lengths, the ledger keeps counts equal over ranks as without buckets
(`raypipe.loader.ledger`), every row of the epoch is in one batch (the last window's
remainder short, or dropped with ``drop_last``: the rows last in its seeded order), and the
same seed gives the same batches (windows are cut from the plan's order of rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

from raypipe.loader.rebatch import concat_column

__all__ = ["Bucketing", "bucket_ids", "bucketed", "lengths_of"]
assert __all__ == sorted(__all__)

Columns = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Bucketing:
    """Bucketing of ``field`` by length: ``buckets`` edges or a count, windows of
    ``window`` batches of ``batch_size`` rows, seeded by ``seed``."""

    field: str
    buckets: int | tuple[int, ...]
    window: int
    batch_size: int
    seed: int
    drop_last: bool
    gated = True  # counts are rows // B, as without buckets: the ledger evens them

    def __call__(self, blocks: Iterable[Columns], epoch: int, plan, counts: dict):
        rng = np.random.default_rng([self.seed, epoch, plan.rank, 0xB0C])
        return bucketed(blocks, self.field, self.batch_size, window=self.window,
                        buckets=self.buckets, rng=rng, drop_last=self.drop_last)  # fmt: skip


def lengths_of(column: np.ndarray) -> np.ndarray:
    """Each row's length: the size of the one axis along which the rows differ (tokens:
    their number; audio, (channels, frames): its frames; features, (frames, dims): their
    frames, however many dims), else its array's longest side; 1 for a scalar. A ragged
    column holds one array per row, a fixed one is (rows, ...)."""
    if column.dtype != object:
        return np.full(len(column), max(column.shape[1:], default=1), dtype=np.int64)
    shapes = [np.shape(v) for v in column]
    if len(shapes) > 1 and len({len(s) for s in shapes}) == 1 and len(shapes[0]) > 1:
        sides = np.array(shapes, dtype=np.int64)
        (varies,) = np.nonzero((sides != sides[0]).any(axis=0))
        if len(varies) == 1:
            return sides[:, varies[0]]
    return np.array([max(s, default=1) for s in shapes], dtype=np.int64)


def bucket_ids(lengths: np.ndarray, buckets: int | tuple[int, ...]) -> np.ndarray:
    """Each length's bucket: by ascending ``edges`` (bucket i holds lengths in
    ``[edges[i-1], edges[i])``), or by ``count`` buckets of about equal size."""
    if isinstance(buckets, int):
        edges = np.quantile(lengths, np.linspace(0, 1, buckets + 1)[1:-1]) if buckets > 1 else []
    else:
        edges = np.asarray(buckets)
    return np.searchsorted(edges, lengths, side="right")


def bucketed(blocks: Iterable[Columns], field: str, batch_size: int, *, window: int,
             buckets: int | tuple[int, ...], rng: np.random.Generator,
             drop_last: bool) -> Iterator[Columns]:  # fmt: skip
    """Batches of exactly ``batch_size`` rows of similar ``field`` length, sorted within
    windows of ``window`` batches; the last window's remainder short unless ``drop_last``."""
    size, held = window * batch_size, None
    for block in blocks:
        held = (
            block if held is None else {k: concat_column([held[k], v], k) for k, v in block.items()}
        )
        while len(held["key"]) >= size:
            head = {k: v[:size] for k, v in held.items()}
            held = {k: v[size:] for k, v in held.items()}
            yield from _window(head, field, batch_size, buckets, rng, drop_last)
    if held is not None and len(held["key"]):
        yield from _window(held, field, batch_size, buckets, rng, drop_last)


def _window(rows: Columns, field: str, B: int, buckets, rng, drop_last: bool):
    if field not in rows:  # a name mistyped, or a field the transform no longer makes
        have = sorted(k for k in rows if k != "key")
        raise ValueError(f"PipelineConfig.bucket_by={field!r}: the samples have no such field "
                         f"(they have {have})")  # fmt: skip
    n = len(rows["key"])
    ids = bucket_ids(lengths_of(rows[field]), buckets)
    order = np.lexsort((rng.random(n), ids))  # by bucket, then a seeded random order
    full = n // B
    for i in rng.permutation(full):
        take = order[i * B : (i + 1) * B]
        yield {k: v[take] for k, v in rows.items()}
    if n % B and not drop_last:
        take = order[full * B :]
        yield {k: v[take] for k, v in rows.items()}
