"""A user transform's rows into blocks, in the actors: the fields checked against the
actor's first row (`TransformOutputError` otherwise), fixed-shape fields stacked, ragged
ones kept one array per row (`raypipe.loader.collate` pads them in the rank iterator).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raypipe.preprocess.usermap import SampleMap, TransformOutputError

__all__ = ["RowBuilder", "Schema", "rows_block"]
assert __all__ == sorted(__all__)


class Schema:
    """The fields and dtypes of an actor's first row; every later row must match them.

    ``arrays_ragged`` (samples without an image): every array field of one or more
    dimensions is kept one array per row from the first row on, so each batch pads it with
    its mask; decided by shape, the first blocks of a field mostly of one length (text
    chunked to 512 tokens, clips cut to a length) stacked without a mask, the later ones
    padded with one. A ragged field's rows may differ in numeric type (not in dimensions)."""

    def __init__(self, arrays_ragged: bool = False) -> None:
        self.fields: dict[str, tuple[str, int | None]] | None = None  # dtype, ndim
        self.ragged: set[str] = set()
        self.shapes: dict[str, tuple] = {}
        self.arrays_ragged = arrays_ragged

    def check(self, row: dict[str, Any], key: int, where: str) -> None:
        spec = {k: _spec(v) for k, v in row.items()}
        if self.fields is None:
            self.fields = spec
            self.shapes = {k: np.shape(v) for k, v in row.items() if isinstance(v, np.ndarray)}
            if self.arrays_ragged:
                self.ragged = {k for k, shape in self.shapes.items() if shape}
            return
        if spec.keys() != self.fields.keys():
            diff = sorted(spec.keys() ^ self.fields.keys())
            raise TransformOutputError(
                f"field(s) {diff} differ from the earlier samples' {sorted(self.fields)} "
                f"at key {key} ({where})"
            )
        for k, s in spec.items():
            if k in self.shapes and np.shape(row[k]) != self.shapes[k]:
                self.ragged.add(k)  # before the types: a ragged field's may differ
            if s != self.fields[k] and not _numbers(s, self.fields[k], k in self.ragged, row[k]):
                raise TransformOutputError(
                    f"field {k!r} is {_says(s)} at key {key} ({where}), but {_says(self.fields[k])} "
                    "in the earlier samples"
                )


def _spec(v: Any) -> tuple[str, int | None]:
    if isinstance(v, np.ndarray):
        return (str(v.dtype), v.ndim)
    return (type(v).__name__, None)


def _numbers(a: tuple[str, int | None], b: tuple[str, int | None], ragged: bool, value) -> bool:
    """Two numeric arrays of as many dimensions that may share a field: a ragged field's,
    padded into the type that holds both (uint16 and int32 token ids of two files), or an
    empty one (an empty list has no type of its own: numpy makes it float64)."""
    return (
        a[1] is not None
        and a[1] == b[1]
        and all(np.dtype(d).kind in "biuf" for d in (a[0], b[0]))
        and (ragged or value.size == 0)
    )


def _says(spec: tuple[str, int | None]) -> str:
    dtype, ndim = spec
    return f"{dtype} with {ndim} dims" if ndim is not None else dtype


def rows_block(rows: list[dict[str, Any]], ragged: set[str]) -> dict[str, np.ndarray]:
    """Rows as one block: fixed-shape arrays stacked, ragged ones and objects one per row."""
    block: dict[str, np.ndarray] = {}
    for field in rows[0]:
        values = [r[field] for r in rows]
        if field not in ragged and isinstance(values[0], np.ndarray):
            block[field] = np.stack(values)
        else:
            column = np.empty(len(values), dtype=object)
            column[:] = values
            block[field] = column
    return block


class RowBuilder:
    """`Preprocessor`'s block builder for a user transform: rows (per-sample transform) or
    raw samples (per-batch transform, applied when the block is full) in, blocks out.

    ``bad(raw, error)`` makes a skip record of a sample (or raises under ``"raise"``);
    a per-batch transform that fails skips every sample of its batch into ``self.bad``.
    """

    def __init__(self, rows: int, usermap: SampleMap, schema: Schema, bad, epoch: int):
        self.rows, self.map, self.schema, self.bad_of, self.epoch = (
            rows,
            usermap,
            schema,
            bad,
            epoch,
        )
        self.items: list[tuple[Any, Any]] = []
        self.bad: list = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item, raw) -> bool:
        self.items.append((item, raw))
        return len(self.items) == self.rows

    def take(self) -> dict[str, np.ndarray] | None:
        items, self.items = self.items, []
        raws = [raw for _, raw in items]
        if self.map.per_batch:
            samples, good = [], []
            for raw in raws:  # a sample that does not decode is bad alone, with its reason
                try:
                    samples.append(self.map.sample(raw))
                    good.append(raw)
                except Exception as e:
                    self.bad.append(self.bad_of(raw, e))
            if not good:
                return None
            try:
                rows = self.map.batch(good, self.epoch, samples)
            except TransformOutputError:
                raise
            except Exception as e:  # the transform failed on the batch: all of it is bad
                self.bad.extend(self.bad_of(raw, e) for raw in good)
                return None
            raws = good
        else:
            rows = [row for row, _ in items]
        for row, raw in zip(rows, raws, strict=True):
            self.schema.check(row, raw.key, raw.where)
        return rows_block(rows, self.schema.ragged)
