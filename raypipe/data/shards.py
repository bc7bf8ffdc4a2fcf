"""Shards: list them with dense, stable keys; order them per epoch; read raw samples.

A shard is one file, local or in object storage (`raypipe.formats.storage`). An image-folder
shard holds one sample; a WebDataset tar or a Parquet file holds many. Keys are dense:
shards are sorted by path and sample ``i`` of a shard whose first key is ``k`` gets key
``k + i``, so a key names the same sample in every epoch and run as long as the files do
not change.

Bad data never raises here: a sample that cannot be read is yielded with a ``reason``
(one of ``raypipe.data.skips.REASONS``) for the policy to act on. Tar shards are counted and
read by `raypipe.formats.webdataset`, Parquet shards by `raypipe.formats.parquet`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterator, Sequence

import numpy as np

from raypipe.config import PipelineConfig
from raypipe.formats.parquet import count_parquet_rows, parquet_labels, read_parquet
from raypipe.formats.storage import Storage
from raypipe.formats.webdataset import RawSample, count_tar_samples, os_error, read_tar

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
_SHARD_EXT = {"webdataset": ".tar", "parquet": ".parquet"}
PROGRESS_S = 5.0  # a listing longer than this says how far it is, every PROGRESS_S


@dataclasses.dataclass(frozen=True)
class Shard:
    path: str
    first_key: int
    num_samples: int
    label: int = -1  # image folders only: the class index from the parent directory


@dataclasses.dataclass(frozen=True)
class Reader:
    """How the actors read one source's shards (pickled into each of them).

    ``classes`` maps string labels (Parquet) to their index; the column and member
    settings are `PipelineConfig`'s.
    """

    format: str
    storage: Storage = dataclasses.field(default_factory=Storage)
    image_column: str = "image"
    label_column: str = "label"
    label_member: str | None = None
    label_key: str = "label"
    classes: tuple[str, ...] = ()
    extras: bool = False  # samples carry their other members / columns (user transforms)

    def count(self, path: str) -> int:
        if self.format == "webdataset":
            return count_tar_samples(self.storage, path)
        return count_parquet_rows(self.storage, path)

    def read(self, path: str, first_key: int, label: int,
             done: np.ndarray | None = None) -> Iterator[RawSample]:  # fmt: skip
        """The raw samples of one shard in key order; members marked in ``done`` (a bool
        per member, for a resumed epoch) are passed over without reading their bytes."""
        if self.format == "imagefolder":
            try:
                data = self.storage.read_bytes(path)
            except OSError as e:
                yield RawSample(first_key, label, None, path, os_error(e), "unreadable")
                return
            yield RawSample(first_key, label, data, path)
        elif self.format == "webdataset":
            yield from read_tar(self.storage, path, first_key, done,
                                label_member=self.label_member, label_key=self.label_key,
                                extras=self.extras)  # fmt: skip
        elif self.format == "parquet":
            yield from read_parquet(self.storage, path, first_key, done,
                                    image_column=self.image_column,
                                    label_column=self.label_column, classes=self.classes,
                                    extras=self.extras)  # fmt: skip
        else:
            raise ValueError(f"unknown format {self.format!r}")


@dataclasses.dataclass(frozen=True)
class Listing:
    format: str
    shards: tuple[Shard, ...]
    classes: tuple[str, ...] = ()
    reader: Reader | None = None  # None: the format's defaults on local files
    labels: str = ""  # where the labels come from, in words (for ``raypipe inspect``)

    def __post_init__(self) -> None:
        if self.reader is None:
            object.__setattr__(self, "reader", Reader(self.format))

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)


def list_shards(config: PipelineConfig) -> Listing:
    """Resolve ``config.source`` into sorted shards with dense keys (on the driver: a
    source that cannot be listed fails here, before any Ray work, naming the URI)."""
    storage = Storage.for_source(config.source, config.storage_options)
    paths = storage.expand(config.source)
    fmt = config.format or infer_format(paths, storage)
    reader = Reader(fmt, storage, config.image_column, config.label_column,
                    config.label_member, config.label_key, extras=config.transform is not None)  # fmt: skip
    if fmt == "imagefolder":
        return _list_imagefolder(paths, reader)
    files = sorted(set(_files_with(paths, _SHARD_EXT[fmt], storage)))
    if not files:
        raise ValueError(f"no {_SHARD_EXT[fmt]} shards found in source {config.source!r}")
    shards, key, shown = [], 0, time.monotonic()
    for i, f in enumerate(files):
        if time.monotonic() - shown > PROGRESS_S:  # a remote listing reads every header
            print(f"raypipe: listing {config.source}: {i}/{len(files)} shards counted, "
                  f"{key} samples so far", file=sys.stderr, flush=True)  # fmt: skip
            shown = time.monotonic()
        n = reader.count(f)
        shards.append(Shard(f, key, n))
        key += n
    if key == 0:
        raise ValueError(f"the {fmt} shards in {config.source!r} hold no samples")
    if fmt == "parquet":
        classes, labels = parquet_labels(storage, files, config.label_column)
        reader = dataclasses.replace(reader, classes=classes)
    else:
        member = config.label_member
        labels = f".{member} member" if member else "the first of .cls, .json, .txt members"
        labels += f" (key {config.label_key!r} of .json)" if member in (None, "json") else ""
        classes = ()
    return Listing(fmt, tuple(shards), classes, reader, labels)


def read_shard(path: str, fmt: str | Reader, first_key: int, label: int,
               done: np.ndarray | None = None) -> Iterator[RawSample]:  # fmt: skip
    """`Reader.read` with a format name meaning that format's defaults on local files."""
    reader = fmt if isinstance(fmt, Reader) else Reader(fmt)
    return reader.read(path, first_key, label, done)


def epoch_order(shards: tuple[Shard, ...], *, seed: int, epoch: int, shuffle: bool) -> list[Shard]:
    """The shards in the order this epoch reads them: a permutation seeded by (seed, epoch)."""
    if not shuffle:
        return list(shards)
    perm = np.random.default_rng([seed, epoch, 0x5EED]).permutation(len(shards))
    return [shards[i] for i in perm]


def infer_format(paths: list[str], storage: Storage | None = None) -> str:
    storage = storage or Storage()
    files: list[str] = []
    dirs = [p for p in paths if storage.kind(p) == "dir"]
    for p in paths:
        if p in dirs:
            for i, f in enumerate(storage.walk(p)):
                files.append(f)
                if i > 64:
                    break
        else:
            files.append(p)
    exts = {os.path.splitext(f)[1].lower() for f in files}
    if ".tar" in exts:
        return "webdataset"
    if ".parquet" in exts:
        return "parquet"
    if exts & set(IMAGE_EXTS) or dirs:
        return "imagefolder"
    raise ValueError(f"cannot infer the format of {paths!r}: set PipelineConfig.format")


def _files_with(paths: list[str], ext: str, storage: Storage) -> Iterator[str]:
    for p in paths:
        if storage.kind(p) == "dir":
            yield from (f for f in storage.walk(p) if f.endswith(ext))
        elif p.endswith(ext):
            yield p


def _list_imagefolder(paths: list[str], reader: Reader) -> Listing:
    """Class sub-folders become labels, by sorted class name; one shard per image."""
    storage = reader.storage
    if len(paths) != 1 or storage.kind(paths[0]) != "dir":
        raise ValueError(f"an image folder source is one directory, got {paths!r}")
    root = paths[0]
    classes = storage.dirs(root)
    if not classes:
        raise ValueError(f"image folder {root!r} has no class sub-folders")
    files: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        files.extend(
            (f, label)
            for f in storage.walk(storage.join(root, name))
            if f.lower().endswith(IMAGE_EXTS)
        )
    if not files:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTS)}) found under {root!r}")
    shards = tuple(Shard(p, key, 1, label) for key, (p, label) in enumerate(files))
    return Listing("imagefolder", shards, tuple(classes), reader, "class sub-folders")


def pending_rows(shards: Sequence[Shard], consumed: np.ndarray | None) -> list[dict]:
    """Rows of the shards still to read; ``done`` packs the shard's consumed members.

    A shard whose keys are all consumed is left out, so it is neither read nor decoded.
    """
    rows = []
    for s in shards:
        done = b""
        if consumed is not None:
            mask = consumed[s.first_key : s.first_key + s.num_samples]
            if mask.all():
                continue
            done = np.packbits(mask).tobytes() if mask.any() else b""
        rows.append(
            {"path": s.path, "first_key": s.first_key, "num_samples": s.num_samples,
             "label": s.label, "done": done}
        )  # fmt: skip
    return rows


def unpack_done(done: bytes, num_samples: int) -> np.ndarray | None:
    """The per-member consumed mask of a row made by `pending_rows` (None: nothing done)."""
    if not done:
        return None
    return np.unpackbits(np.frombuffer(done, dtype=np.uint8), count=num_samples).astype(bool)
