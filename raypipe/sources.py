"""Shards: list them with dense, stable keys; order them per epoch; read raw samples.

A shard is one file. An image-folder shard holds one sample; a WebDataset tar or a
Parquet file holds many. Keys are dense: shards are sorted by path and sample ``i``
of a shard whose first key is ``k`` gets key ``k + i``, so a key names the same
sample in every epoch and run as long as the files do not change.

Bad data never raises here: a sample that cannot be read is yielded with a ``reason``
(one of ``raypipe.skips.REASONS``) for the policy to act on. Tar and Parquet shards are
counted and read by `raypipe.shardfiles`.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from raypipe.config import PipelineConfig
from raypipe.shardfiles import (
    RawSample,
    count_parquet_rows,
    count_tar_samples,
    os_error,
    read_parquet,
    read_tar,
)

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


@dataclasses.dataclass(frozen=True)
class Shard:
    path: str
    first_key: int
    num_samples: int
    label: int = -1  # image folders only: the class index from the parent directory


@dataclasses.dataclass(frozen=True)
class Listing:
    format: str
    shards: tuple[Shard, ...]
    classes: tuple[str, ...] = ()

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)


def list_shards(config: PipelineConfig) -> Listing:
    """Resolve ``config.source`` into sorted shards with dense keys."""
    paths = _expand(config.source)
    fmt = config.format or infer_format(paths)
    if fmt == "imagefolder":
        return _list_imagefolder(paths)
    files = sorted({p for p in _files_with(paths, _SHARD_EXT[fmt])})
    if not files:
        raise ValueError(f"no {_SHARD_EXT[fmt]} shards found in source {config.source!r}")
    counter = count_tar_samples if fmt == "webdataset" else count_parquet_rows
    shards, key = [], 0
    for f in files:
        n = counter(f)
        shards.append(Shard(f, key, n))
        key += n
    if key == 0:
        raise ValueError(f"the {fmt} shards in {config.source!r} hold no samples")
    return Listing(fmt, tuple(shards))


def epoch_order(shards: tuple[Shard, ...], *, seed: int, epoch: int, shuffle: bool) -> list[Shard]:
    """The shards in the order this epoch reads them: a permutation seeded by (seed, epoch)."""
    if not shuffle:
        return list(shards)
    perm = np.random.default_rng([seed, epoch, 0x5EED]).permutation(len(shards))
    return [shards[i] for i in perm]


def read_shard(
    path: str, fmt: str, first_key: int, label: int, done: np.ndarray | None = None
) -> Iterator[RawSample]:
    """Yield the raw samples of one shard in key order; members marked in ``done`` (a bool
    per member, for a resumed epoch) are passed over without reading their bytes."""
    if fmt == "imagefolder":
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            yield RawSample(first_key, label, None, path, os_error(e), "unreadable")
            return
        yield RawSample(first_key, label, data, path)
    elif fmt == "webdataset":
        yield from read_tar(path, first_key, done)
    elif fmt == "parquet":
        yield from read_parquet(path, first_key, done)
    else:
        raise ValueError(f"unknown format {fmt!r}")


def infer_format(paths: list[str]) -> str:
    files = [p for p in paths if os.path.isfile(p)]
    dirs = [p for p in paths if os.path.isdir(p)]
    for d in dirs:
        for _, _, names in os.walk(d):
            files.extend(names)
            if len(files) > 64:
                break
    exts = {os.path.splitext(f)[1].lower() for f in files}
    if ".tar" in exts:
        return "webdataset"
    if ".parquet" in exts:
        return "parquet"
    if exts & set(IMAGE_EXTS) or dirs:
        return "imagefolder"
    raise ValueError(f"cannot infer the format of {paths!r}: set PipelineConfig.format")


_SHARD_EXT = {"webdataset": ".tar", "parquet": ".parquet"}


def _expand(source: str | tuple[str, ...]) -> list[str]:
    items = [source] if isinstance(source, str) else list(source)
    out: list[str] = []
    for item in items:
        if glob.has_magic(item):
            matched = sorted(glob.glob(item, recursive=True))
            if not matched:
                raise ValueError(f"PipelineConfig.source: glob {item!r} matches nothing")
            out.extend(matched)
        elif os.path.exists(item):
            out.append(item)
        else:
            raise ValueError(f"PipelineConfig.source: path {item!r} does not exist")
    return out


def _files_with(paths: list[str], ext: str) -> Iterator[str]:
    for p in paths:
        if os.path.isdir(p):
            for root, _, names in os.walk(p):
                yield from (os.path.join(root, n) for n in names if n.endswith(ext))
        elif p.endswith(ext):
            yield p


def _list_imagefolder(paths: list[str]) -> Listing:
    """Class sub-folders become labels, by sorted class name; one shard per image."""
    if len(paths) != 1 or not os.path.isdir(paths[0]):
        raise ValueError(f"an image folder source is one directory, got {paths!r}")
    root = paths[0]
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(f"image folder {root!r} has no class sub-folders")
    files: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        for dirpath, dirnames, names in os.walk(os.path.join(root, name)):
            dirnames.sort()
            files.extend(
                (os.path.join(dirpath, n), label)
                for n in sorted(names)
                if n.lower().endswith(IMAGE_EXTS)
            )
    if not files:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTS)}) found under {root!r}")
    shards = tuple(Shard(p, key, 1, label) for key, (p, label) in enumerate(files))
    return Listing("imagefolder", shards, tuple(classes))
