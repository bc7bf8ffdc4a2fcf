"""Your own transform, run inside the preprocessing actors after decode.

```
 raw sample (image bytes, label, key, the shard's other members or columns)
   ▼ decode: the whole upright image as PIL, numpy H×W×C or torch C×H×W uint8 (transform_input)
   ▼ seed Python's random, NumPy's global generator and torch's CPU generator from
     (seed, epoch, key): the same sample gets the same draws in every run
   ▼ transform(sample) -> dict of arrays (image, mask, boxes, labels, token ids, ...)
   ▼ rows: fixed-shape fields stacked, ragged ones kept per row; "key" always added
 rank iterator: collate (default `raypipe.loader.collate.pad_collate`: pad ragged fields to the batch maximum
   with a ``<field>_mask``) → tensors → device
```

A transform that raises skips its sample (reason ``transform_error``) or, under
``on_error="raise"``, stops the run naming the file. A transform whose outputs change
their fields or dtypes from one sample to another stops the run with `TransformOutputError`
naming the field, the key and the file.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from raypipe.config import resolve_callable
from raypipe.formats.imagefolder import IMAGE_EXTS
from raypipe.formats.pixels import open_image, upright_rgb
from raypipe.preprocess.augment import sample_rng

__all__ = ["SampleMap", "TransformOutputError", "resolve_callable", "seed_globals"]
assert __all__ == sorted(__all__)

_IMAGE_EXTS = tuple(e.lstrip(".") for e in IMAGE_EXTS)  # member names of image bytes
_SAID = False  # `_say_sizes` warned in this process
log = logging.getLogger(__name__)


class TransformOutputError(ValueError):
    """A user transform returned fields or dtypes that differ from its earlier samples."""

    def __reduce__(self):
        return (TransformOutputError, self.args)

    def __str__(self) -> str:  # one line, without what Ray Data appends on the way
        return str(self.args[0]).split("\n", 1)[0] if self.args else ""


def seed_globals(seed: int, epoch: int, key: int) -> int:
    """Seed Python's ``random``, NumPy's global generator and torch's CPU generator; returns
    the seed (for a transform with a generator of its own, e.g. albumentations)."""
    s = int(sample_rng(seed, epoch, key).integers(2**63 - 1))
    random.seed(s)
    np.random.seed(s % 2**32)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return s
    torch.manual_seed(s)
    return s


class SampleMap:
    """Decode + the user's transform for one raw sample (or one batch of them)."""

    def __init__(self, transform: Callable, *, seed: int, image_input: str, per_batch: bool,
                 max_image_pixels: int | None):  # fmt: skip
        self.transform, self.seed, self.input = transform, seed, image_input
        self.per_batch, self.max_pixels = per_batch, max_image_pixels
        # albumentations: called with keyword targets, and seeded through its own generator
        self.kwargs = type(transform).__module__.startswith("albumentations")
        self.reseed = getattr(transform, "set_random_seed", None)

    def _apply(self, sample: dict[str, Any], seed: int):
        if self.reseed is not None:
            self.reseed(seed % 2**32)
        return self.transform(**sample) if self.kwargs else self.transform(sample)

    @classmethod
    def of(cls, config) -> SampleMap | None:
        """A `PipelineConfig`'s transform, ready to run; None for the built-in crop."""
        transform = resolve_callable(config.transform, "transform")
        if transform is None:
            return None
        return cls(transform, seed=config.seed, image_input=config.transform_input,
                   per_batch=config.transform_batch, max_image_pixels=config.max_image_pixels)  # fmt: skip

    def sample(self, raw, image: np.ndarray | None = None) -> dict[str, Any]:
        """The transform's input for ``raw``: image, label, key and the sample's extras;
        ``image``: the decoded H×W×3 pixels (the decoded cache's), else ``raw``'s decoded."""
        extras = {_name(k): self._extra(k, v) for k, v in (raw.extras or {}).items()}
        pixels = self._image(raw.data) if image is None else self._as_input(np.array(image))
        if image is not None and not _SAID:
            _say_sizes(raw, extras, np.shape(image)[:2])
        return {**extras, "image": pixels, "label": raw.label, "key": raw.key}

    def __call__(self, raw, epoch: int, image: np.ndarray | None = None) -> dict[str, Any]:
        sample = self.sample(raw, image)  # a decode failure keeps its own reason
        seed = seed_globals(self.seed, epoch, raw.key)
        try:
            out = self._apply(sample, seed)
        except Exception as e:
            from raypipe.skips.records import BadSample

            raise BadSample("transform_error", f"{type(e).__name__}: {e}") from e
        return _as_row(out, raw)

    def batch(self, raws: list, epoch: int, samples: list) -> list[dict[str, Any]]:
        """A per-batch transform: lists of each field in, arrays with one row each out;
        ``samples``: the raws' transform inputs (`sample`, each made and checked alone)."""
        seed = seed_globals(self.seed, epoch, raws[0].key)
        fields = dict.fromkeys(k for s in samples for k in s)  # every member any sample has
        try:
            out = self._apply({k: [s.get(k) for s in samples] for k in fields}, seed)
        except Exception as e:
            from raypipe.skips.records import BadSample

            raise BadSample("transform_error", f"{type(e).__name__}: {e}") from e
        if not isinstance(out, dict):
            raise TransformOutputError(f"the transform returned {type(out).__name__}, not a dict")
        rows: list[dict[str, Any]] = [{} for _ in raws]
        for field, values in out.items():
            where = (
                f"for a batch of {len(raws)} (keys {raws[0].key}..{raws[-1].key}, {raws[0].where})"
            )
            if (isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__")
                    or getattr(values, "ndim", 1) == 0):  # a 0-d array or tensor  # fmt: skip
                raise TransformOutputError(f"field {field!r} is {type(values).__name__}, not "
                                           f"one value a row, {where}")  # fmt: skip
            if len(values) != len(raws):
                raise TransformOutputError(f"field {field!r} has {len(values)} rows {where}")
            for row, value in zip(rows, values, strict=True):
                row[field] = value
        return [_as_row(row, raw) for row, raw in zip(rows, raws, strict=True)]

    def _extra(self, ext: str, data: Any) -> Any:
        """`_decode_extra`; a member that does not decode is a bad sample that names the
        member and its own bytes (the main image may be fine)."""
        from raypipe.skips.records import BadSample, detail_of, reason_of

        try:
            return _decode_extra(ext, data, self.max_pixels)
        except Exception as e:
            raw = data if isinstance(data, bytes) else None
            raise BadSample(reason_of(e, raw), f"member {ext}: {detail_of(e, raw)}") from e

    def _image(self, data: bytes):
        with open_image(data) as img:
            _check_pixels(img, self.max_pixels)
            rgb = upright_rgb(img)
            rgb.load()
        return rgb if self.input == "pil" else self._as_input(np.asarray(rgb))

    def _as_input(self, arr: np.ndarray):
        """An H×W×3 uint8 array as ``transform_input`` says (the caller's copy)."""
        if self.input == "pil":
            from PIL import Image

            return Image.fromarray(arr, "RGB")
        if self.input == "numpy":
            return arr
        import torch

        return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def _name(ext: str) -> str:
    """A member's field name: an image member loses its image extension (``mask.png`` →
    ``mask``, as albumentations' targets are named); others keep theirs (``json``)."""
    stem, _, last = ext.rpartition(".")
    return stem if stem and last in _IMAGE_EXTS else ext


def _check_pixels(img, limit: int | None) -> None:
    if limit is not None and img.width * img.height > limit:
        from raypipe.skips.records import BadSample

        raise BadSample(
            "decompression_bomb",
            f"{img.width}x{img.height} = {img.width * img.height} pixels > "
            f"max_image_pixels={limit}",
        )


def _say_sizes(raw, extras: dict[str, Any], size: tuple[int, ...]) -> None:
    """Warn, once a process, where an image member (``mask.png``) is not the size of the
    capped image the decoded cache gives the transform: a target cropped with the image
    would not line up (the cache scales the image only)."""
    global _SAID
    for ext in raw.extras or {}:
        value = extras[_name(ext)]
        if (ext.rsplit(".", 1)[-1] in _IMAGE_EXTS and isinstance(value, np.ndarray)
                and value.shape[:2] != tuple(size)):  # fmt: skip
            log.warning("raypipe: with the decoded cache the transform's image is the capped "
                        "%dx%d one, but member %r of %s is %dx%d: scale it to the image in "
                        "the transform, or leave the cache off", size[1], size[0], ext,
                        raw.where, value.shape[1], value.shape[0])  # fmt: skip
            _SAID = True
            return


def _decode_extra(ext: str, data: Any, max_pixels: int | None = None) -> Any:
    """A WebDataset member by its extension: images → numpy (their own mode, under
    ``max_image_pixels``), ``json`` → parsed, ``txt``/``cls`` → str, anything else bytes.
    Parquet columns come as values."""
    if not isinstance(data, bytes):
        return data
    last = ext.rsplit(".", 1)[-1]
    if last in _IMAGE_EXTS:
        with open_image(data) as img:
            _check_pixels(img, max_pixels)
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
    row = {str(k): _to_numpy(v, k, raw) for k, v in out.items() if k != "key"}
    row["key"] = np.int64(raw.key)
    return row


def _to_numpy(value: Any, field: Any = None, raw=None) -> Any:
    """A field's value as NumPy holds it: tensors, images and lists of numbers (Python's
    or NumPy's) as arrays; strings, bytes, dicts as the objects they are."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        try:
            return value.detach().cpu().numpy()
        except (TypeError, RuntimeError) as e:  # bfloat16: NumPy has no such type
            at = f" at key {raw.key} ({raw.where})" if raw is not None else ""
            raise TransformOutputError(f"field {field!r}{at} is a {value.dtype} tensor, which "
                                       f"NumPy cannot hold ({e}): return another type") from e  # fmt: skip
    if hasattr(value, "getbands"):  # a PIL image
        return np.asarray(value)
    if isinstance(value, (bool, int, float, np.generic)):
        return np.asarray(value)
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, _NUMBERS) for v in value):
        return np.asarray(value)
    return value  # strings, bytes, dicts: kept as objects


_NUMBERS = (int, float, np.number, np.bool_)
