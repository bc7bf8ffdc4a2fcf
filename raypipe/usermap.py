"""Your own transform, run inside the preprocessing actors after decode.

```
 raw sample (image bytes, label, key, the shard's other members or columns)
   ▼ decode: the whole upright image as PIL, numpy H×W×C or torch C×H×W uint8 (transform_input)
   ▼ seed Python's random, NumPy's global generator and torch's CPU generator from
     (seed, epoch, key): the same sample gets the same draws in every run
   ▼ transform(sample) -> dict of arrays (image, mask, boxes, labels, token ids, ...)
   ▼ rows: fixed-shape fields stacked, ragged ones kept per row; "key" always added
 rank iterator: collate (default `pad_collate`: pad ragged fields to the batch maximum
   with a ``<field>_mask``) → tensors → device
```

A transform that raises skips its sample (reason ``transform_error``) or, under
``on_error="raise"``, stops the run naming the file. A transform whose outputs change
their fields or dtypes from one sample to another stops the run with `TransformOutputError`
naming the field, the key and the file.
"""

from __future__ import annotations

import importlib
import io
import json
import pickle
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from raypipe.transforms import sample_rng, to_rgb

__all__ = [
    "RowBuilder",
    "SampleMap",
    "Schema",
    "TransformOutputError",
    "pad_collate",
    "resolve_callable",
    "rows_block",
]
assert __all__ == sorted(__all__)

INPUTS = ("numpy", "pil", "torch")
_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif")


class TransformOutputError(ValueError):
    """A user transform returned fields or dtypes that differ from its earlier samples."""

    def __reduce__(self):
        return (TransformOutputError, self.args)

    def __str__(self) -> str:  # one line, without what Ray Data appends on the way
        return str(self.args[0]).split("\n", 1)[0] if self.args else ""


def resolve_callable(value: Any, field: str) -> Callable | None:
    """``value`` as a callable: itself, or the object a ``"module:attribute"`` path names.

    A callable must pickle by reference (a module-level function, a ``functools.partial``
    of one, an instance of an importable class such as a torchvision ``Compose``): lambdas
    and local functions cannot be re-imported where the actors run, so they are refused here,
    before any work.
    """
    if value is None:
        return None
    if isinstance(value, str):
        module, sep, name = value.partition(":")
        if not sep or not module or not name:
            raise ValueError(f"PipelineConfig.{field}={value!r}: expected 'module:attribute'")
        try:
            obj: Any = importlib.import_module(module)
            for part in name.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"PipelineConfig.{field}={value!r}: cannot import it: {e}") from None
        value = obj
    if not callable(value):
        raise ValueError(f"PipelineConfig.{field}={value!r}: not callable")
    try:
        pickle.dumps(value)
    except Exception as e:
        raise ValueError(
            f"PipelineConfig.{field}={value!r}: cannot be pickled by reference ({e}); define it "
            "at module level in an importable module, or give 'module:function'"
        ) from None
    return value


def seed_globals(seed: int, epoch: int, key: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's CPU generator."""
    s = int(sample_rng(seed, epoch, key).integers(2**63 - 1))
    random.seed(s)
    np.random.seed(s % 2**32)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return
    torch.manual_seed(s)


class SampleMap:
    """Decode + the user's transform for one raw sample (or one batch of them)."""

    def __init__(self, transform: Callable, *, seed: int, image_input: str, per_batch: bool,
                 max_image_pixels: int | None):  # fmt: skip
        self.transform, self.seed, self.input = transform, seed, image_input
        self.per_batch, self.max_pixels = per_batch, max_image_pixels

    def sample(self, raw, epoch: int) -> dict[str, Any]:
        """The transform's input for ``raw``: image, label, key and the sample's extras."""
        extras = {k: _decode_extra(k, v) for k, v in (raw.extras or {}).items()}
        return {**extras, "image": self._image(raw.data), "label": raw.label, "key": raw.key}

    def __call__(self, raw, epoch: int) -> dict[str, Any]:
        sample = self.sample(raw, epoch)  # a decode failure keeps its own reason
        seed_globals(self.seed, epoch, raw.key)
        try:
            out = self.transform(sample)
        except Exception as e:
            from raypipe.skips import BadSample

            raise BadSample("transform_error", f"{type(e).__name__}: {e}") from e
        return _as_row(out, raw)

    def batch(self, raws: list, epoch: int) -> list[dict[str, Any]]:
        """A per-batch transform: lists of each field in, arrays with one row each out."""
        samples = [self.sample(r, epoch) for r in raws]
        seed_globals(self.seed, epoch, raws[0].key)
        try:
            out = self.transform({k: [s[k] for s in samples] for k in samples[0]})
        except Exception as e:
            from raypipe.skips import BadSample

            raise BadSample("transform_error", f"{type(e).__name__}: {e}") from e
        if not isinstance(out, dict):
            raise TransformOutputError(f"the transform returned {type(out).__name__}, not a dict")
        rows: list[dict[str, Any]] = [{} for _ in raws]
        for field, values in out.items():
            if len(values) != len(raws):
                raise TransformOutputError(
                    f"field {field!r} has {len(values)} rows for a batch of {len(raws)} "
                    f"(keys {raws[0].key}..{raws[-1].key}, {raws[0].where})"
                )
            for row, value in zip(rows, values, strict=True):
                row[field] = value
        return [_as_row(row, raw) for row, raw in zip(rows, raws, strict=True)]

    def _image(self, data: bytes):
        from PIL import Image, ImageOps

        with Image.open(io.BytesIO(data)) as img:
            if self.max_pixels is not None and img.width * img.height > self.max_pixels:
                from raypipe.skips import BadSample

                raise BadSample(
                    "decompression_bomb",
                    f"{img.width}x{img.height} = {img.width * img.height} pixels > "
                    f"max_image_pixels={self.max_pixels}",
                )
            rgb = to_rgb(ImageOps.exif_transpose(img))
            rgb.load()
        if self.input == "pil":
            return rgb
        arr = np.asarray(rgb)
        if self.input == "numpy":
            return arr
        import torch

        return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def _decode_extra(ext: str, data: Any) -> Any:
    """A WebDataset member by its extension: images → numpy (their own mode), ``json`` →
    parsed, ``txt``/``cls`` → str, anything else bytes. Parquet columns come as values."""
    if not isinstance(data, bytes):
        return data
    last = ext.rsplit(".", 1)[-1]
    if last in _IMAGE_EXTS:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            return np.asarray(img)
    if last == "json":
        return json.loads(data)
    if last in ("txt", "cls"):
        return data.decode()
    return data


def _as_row(out: Any, raw) -> dict[str, Any]:
    """The transform's output as a row of numpy values (objects for strings and the like)."""
    if not isinstance(out, dict) or not out:
        raise TransformOutputError(
            f"the transform returned {type(out).__name__} for key {raw.key} ({raw.where}): "
            "it must return a non-empty dict of fields"
        )
    row = {str(k): _to_numpy(v) for k, v in out.items() if k != "key"}
    row["key"] = np.int64(raw.key)
    return row


def _to_numpy(value: Any) -> Any:
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        return value.detach().cpu().numpy()
    if hasattr(value, "getbands"):  # a PIL image
        return np.asarray(value)
    if isinstance(value, (bool, int, float, np.generic)):
        return np.asarray(value)
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return np.asarray(value)
    return value  # strings, bytes, dicts: kept as objects


class Schema:
    """The fields and dtypes of an actor's first row; every later row must match them."""

    def __init__(self) -> None:
        self.fields: dict[str, tuple[str, int | None]] | None = None  # dtype, ndim
        self.ragged: set[str] = set()
        self.shapes: dict[str, tuple] = {}

    def check(self, row: dict[str, Any], key: int, where: str) -> None:
        spec = {k: _spec(v) for k, v in row.items()}
        if self.fields is None:
            self.fields = spec
            self.shapes = {k: np.shape(v) for k, v in row.items() if isinstance(v, np.ndarray)}
            return
        if spec.keys() != self.fields.keys():
            diff = sorted(spec.keys() ^ self.fields.keys())
            raise TransformOutputError(
                f"field(s) {diff} differ from the earlier samples' {sorted(self.fields)} "
                f"at key {key} ({where})"
            )
        for k, s in spec.items():
            if s != self.fields[k]:
                raise TransformOutputError(
                    f"field {k!r} is {_says(s)} at key {key} ({where}), but {_says(self.fields[k])} "
                    "in the earlier samples"
                )
            if k in self.shapes and np.shape(row[k]) != self.shapes[k]:
                self.ragged.add(k)


def _spec(v: Any) -> tuple[str, int | None]:
    if isinstance(v, np.ndarray):
        return (str(v.dtype), v.ndim)
    return (type(v).__name__, None)


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
            try:
                rows = self.map.batch(raws, self.epoch)
            except TransformOutputError:
                raise
            except Exception as e:
                self.bad.extend(self.bad_of(raw, e) for raw in raws)
                return None
        else:
            rows = [row for row, _ in items]
        for row, raw in zip(rows, raws, strict=True):
            self.schema.check(row, raw.key, raw.where)
        return rows_block(rows, self.schema.ragged)


def pad_collate(batch: dict[str, np.ndarray], *, pad_value: int = 0) -> dict[str, Any]:
    """The default collate: numeric columns as tensors; a column of arrays (ragged) padded
    to the batch's maximum shape with ``<field>_mask`` (True where the row has data, over the
    varying leading dimension when only that one varies, else over every element); any
    other column (strings, dicts) as a list."""
    import torch

    out: dict[str, Any] = {}
    for field, column in batch.items():
        if column.dtype != object:
            out[field] = torch.from_numpy(np.ascontiguousarray(column))
        elif all(isinstance(v, np.ndarray) for v in column):
            out[field], out[f"{field}_mask"] = _pad([np.asarray(v) for v in column], pad_value)
        else:
            out[field] = list(column)
    return out


def _pad(arrays: list[np.ndarray], pad_value: int):
    import torch

    shapes = np.array([a.shape for a in arrays])
    top = tuple(shapes.max(axis=0))
    varies = np.flatnonzero((shapes != shapes[0]).any(axis=0))
    padded = np.full((len(arrays), *top), pad_value, dtype=arrays[0].dtype)
    leading_only = list(varies) in ([0], [])
    mask = np.zeros((len(arrays), top[0] if top else 1) if leading_only else padded.shape, bool)
    for i, a in enumerate(arrays):
        index = (i, *(slice(0, n) for n in a.shape))
        padded[index] = a
        mask[(i, slice(0, a.shape[0] if a.ndim else 1)) if leading_only else index] = True
    return torch.from_numpy(padded), torch.from_numpy(mask)
