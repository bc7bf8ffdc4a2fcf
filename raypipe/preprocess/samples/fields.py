"""A sample with no image, in the actors: its fields decoded, then the user's transform.

```
 raw sample: Parquet column values, or WebDataset member bytes by extension
   ▼ decode each member by its extension: audio (.flac .wav .mp3 .ogg) → float32 samples
     and ``sample_rate`` (`raypipe.preprocess.samples.audio`), .npy → array, .json → parsed,
     .cls → int, .txt → str, images → numpy; Parquet values as they are
   ▼ the user's transform (seeded per sample, as for images), or the fields as they are
   ▼ a row: numbers stack into blocks, arrays stay one per row (`raypipe.preprocess.userrows`)
     for the rank's padding (a mask in every batch), buckets or packing
```
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from raypipe.config import resolve_callable
from raypipe.preprocess.samples.audio import AUDIO_EXTS, decode_audio
from raypipe.preprocess.usermap import (
    _IMAGE_EXTS,
    SampleMap,
    TransformOutputError,
    _as_row,
    _decode_extra,
    _name,
)

__all__ = ["FieldMap", "decode_member", "sample_map"]
assert __all__ == sorted(__all__)


def sample_map(config) -> SampleMap | None:
    """The actors' map of a `PipelineConfig`: a `FieldMap` for samples with no image, the
    user's transform of images (`SampleMap`), or None for the built-in crop."""
    return FieldMap.of(config) if config.image_column is None else SampleMap.of(config)


def decode_member(ext: str, data: Any, rate: int | None = None,
                  max_pixels: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The fields one member makes: ``{name: value}``, two for audio (the samples under
    the member's name, or ``audio``, and ``sample_rate`` / ``<name>_sample_rate``); an
    image member under ``max_pixels`` (``max_image_pixels``)."""
    if isinstance(data, dict) and isinstance(data.get("path"), str) and data.get("bytes") is None:
        from raypipe.formats.parquet import by_path_only
        from raypipe.skips.records import BadSample

        raise BadSample("null_value", by_path_only(ext, data["path"]))
    if isinstance(data, dict) and (kind := _struct_kind(data)) is not None:
        return decode_member(f"{ext}.{kind}", data["bytes"], rate, max_pixels)
    if not isinstance(data, (bytes, bytearray)):
        return {ext: data}  # a Parquet value, or a label already read
    stem, _, last = ext.rpartition(".")
    if last in AUDIO_EXTS:
        samples, found = decode_audio(bytes(data), rate)
        return {stem or "audio": samples, f"{stem}_sample_rate" if stem else "sample_rate":
                np.int64(found)}  # fmt: skip
    if last == "npy":
        return {stem or "npy": np.load(io.BytesIO(data), allow_pickle=False)}
    if last == "cls":
        return {ext: np.int64(int(data.decode().strip()))}
    return {_name(ext): _decode_extra(ext, bytes(data), max_pixels)}


def _struct_kind(value: dict) -> str | None:
    """The extension of a Hugging Face ``Audio()`` or ``Image()`` value (``{"bytes": ...,
    "path": ...}``): its path's, else one its bytes begin like; None: not one of them."""
    data, path = value.get("bytes"), value.get("path")
    if not isinstance(data, (bytes, bytearray)) or set(value) - {"bytes", "path"}:
        return None
    last = path.rsplit(".", 1)[-1].lower() if isinstance(path, str) and "." in path else ""
    if last in AUDIO_EXTS or last in _IMAGE_EXTS:
        return last
    if data[:4] == b"RIFF":
        return {b"WAVE": "wav", b"WEBP": "webp"}.get(bytes(data[8:12]))
    return next((kind for magic, kind in _MAGIC if data[: len(magic)] == magic), None)


_MAGIC = ((b"fLaC", "flac"), (b"OggS", "ogg"), (b"ID3", "mp3"), (b"\xff\xfb", "mp3"),
          (b"\xff\xf3", "mp3"), (b"\x89PNG", "png"), (b"\xff\xd8\xff", "jpg"))  # fmt: skip


class FieldMap(SampleMap):
    """`SampleMap` for samples with no image: the fields are the sample; with no
    transform they are the row as they are (``key`` added)."""

    def __init__(self, transform, *, seed: int, per_batch: bool, sample_rate: int | None,
                 max_image_pixels: int | None = None):  # fmt: skip
        super().__init__(transform, seed=seed, image_input="numpy", per_batch=per_batch,
                         max_image_pixels=max_image_pixels)  # fmt: skip
        self.sample_rate = sample_rate

    @classmethod
    def of(cls, config) -> FieldMap:
        transform = resolve_callable(config.transform, "transform")
        return cls(transform, seed=config.seed, sample_rate=config.sample_rate,
                   per_batch=config.transform_batch and transform is not None,
                   max_image_pixels=config.max_image_pixels)  # fmt: skip

    def sample(self, raw, image=None) -> dict[str, Any]:
        """The sample's fields, decoded, and its ``key``; a null field is a bad sample
        (``image``: `SampleMap.sample`'s; none here, these samples have no image)."""
        fields: dict[str, Any] = {}
        for ext, value in (raw.extras or {}).items():
            fields.update(decode_member(ext, value, self.sample_rate, self.max_pixels))
        if "key" in fields:  # the sample's key is raypipe's: the data's would be lost
            raise TransformOutputError(f"the samples have a field named 'key' ({raw.where}), "
                                       "which raypipe's sample key replaces: rename it")  # fmt: skip
        nulls = sorted(k for k, v in fields.items() if v is None)
        if nulls:
            from raypipe.skips.records import BadSample

            raise BadSample("null_value", f"field {nulls[0]!r} is null")
        return {**fields, "key": raw.key}

    def __call__(self, raw, epoch: int) -> dict[str, Any]:
        if self.transform is None:
            row = _as_row(self.sample(raw), raw)
            for name, value in (raw.extras or {}).items():  # a Parquet list of strings or of
                if isinstance(value, list) and not value:  # lists (its numbers come as arrays):
                    row[name] = []  # [] stays a list, as its other rows (not a float64 array)
            return row
        return super().__call__(raw, epoch)
