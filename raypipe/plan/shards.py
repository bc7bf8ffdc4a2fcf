"""Shards: list them with dense, stable keys, order them per epoch, cut them into the
rows the actors read.

A shard is one file, local or in object storage (`raypipe.formats.storage`), or a piece of
a large record file (`raypipe.formats.pieces`). An image-folder shard holds one sample; a
WebDataset tar, a Parquet file or a piece of a TFRecord, LMDB or HDF5 file holds many.
Keys are dense: shards are sorted by path and sample ``i`` of a shard whose first key is ``k`` gets key
``k + i``, so a key names the same sample in every epoch and run as long as the files do
not change. Counting and reading are the format's (`raypipe.formats`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from raypipe.config import PipelineConfig
from raypipe.formats import Reader, get_format, imagefolder, infer_format
from raypipe.formats.lengths import sequence_lengths
from raypipe.formats.storage import Storage
from raypipe.formats.writer import INDEX
from raypipe.plan.columns import Paths, Shard, Shards

FIELD_FORMATS = ("parquet", "webdataset")  # where samples with no image can be read
SIZED_SHARDS = 8  # shard files `Listing.stored_per_sample` sizes
SHARD_ROW = ("path", "first_key", "num_samples", "label", "done")  # the fields of `shard_row`
PROGRESS_S = 5.0  # a listing longer than this says how far it is, every PROGRESS_S
COUNT_THREADS = 32  # shards counted at once on the driver (`_counted`)


@dataclasses.dataclass(frozen=True)
class Listing:
    """The shards of a source, in key order (`Shards`: columns; a sequence of `Shard` made
    from any sequence of them), with what reads them."""

    format: str
    shards: Shards
    classes: tuple[str, ...] = ()
    reader: Reader | None = None  # None: the format's defaults on local files
    labels: str = ""  # where the labels come from, in words (for ``raypipe inspect``)
    # tokens per key of PipelineConfig.pack's column (packing plans rows from them), or None
    lengths: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", Shards.of(self.shards))
        if self.reader is None:
            object.__setattr__(self, "reader", Reader(self.format))

    def __setstate__(self, state: dict) -> None:
        """One pickled before its shards were columns: a tuple of `Shard`, made columns."""
        self.__dict__.update(state, shards=Shards.of(state["shards"]))

    @functools.cached_property
    def num_samples(self) -> int:
        return int(self.shards.num_samples.sum())

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of the shards (paths relative to their common folder, sample counts):
        computed once, as every checkpoint names it (`benchmarks/listing.py` times it)."""
        paths = list(self.shards.paths)
        text = "".join(f"\0{rel}\0{n}" for rel, n in zip(
            _relative(paths), self.shards.num_samples.tolist(), strict=True))  # fmt: skip
        h = hashlib.sha256(self.format.encode())
        h.update(text.encode(errors="surrogateescape"))
        return h.hexdigest()[:32]

    @functools.cached_property
    def stored_per_sample(self) -> float | None:
        """Mean bytes a sample takes on storage, over the first `SIZED_SHARDS` shard files
        that can be sized (None: none of them): what `raypipe.plan.blocksize` sizes a
        sample with no image from."""
        sized, samples = 0, 0
        for shard in self.shards[:SIZED_SHARDS]:
            try:
                size = self.reader.storage.size(shard.path)
            except (OSError, ValueError):  # a folder (LMDB), a piece, gone since listing
                continue
            if size is not None:  # None: not a file on a remote store
                sized, samples = sized + size, samples + shard.num_samples
        return sized / samples if samples else None


def _relative(paths: list[str]) -> list[str]:
    """Each path relative to the paths' common folder (a lone path's: its folder), as
    ``os.path.relpath(path, os.path.commonpath(paths))`` gives them. Where every path is
    absolute and already normal, from the strings themselves: those two normalise and
    split each path, 7 s for ImageNet's 1.28M files; else through them (URIs, relative)."""
    if len(paths) > 1 and all(map(_normal_absolute, paths)):
        lo = min(paths)
        n = len(os.path.commonprefix([lo, max(paths)]))  # the common prefix of them all
        root = lo[:n]
        if not all(len(p) == n or p[n] == "/" for p in paths):  # ends inside a name
            root = root[: root.rfind("/")]
        cut = len(root) + 1 if root else 1  # "": the root folder, "/"
        return [p[cut:] if len(p) > len(root) else "." for p in paths]
    root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
    return [os.path.relpath(path, root) for path in paths]


def _normal_absolute(path: str) -> bool:
    """Whether ``os.path.normpath(path) == path`` for an absolute POSIX path."""
    return (path.startswith("/") and "//" not in path and "/./" not in path
            and "/../" not in path and not path.endswith(("/", "/.", "/..")))  # fmt: skip


def list_shards(config: PipelineConfig) -> Listing:
    """Resolve ``config.source`` into sorted shards with dense keys (on the driver: a
    source that cannot be listed fails here, before any Ray work, naming the URI)."""
    storage = Storage.for_source(config.source, config.storage_options)
    paths = storage.expand(config.source)
    fmt = config.format or infer_format(paths, storage)
    if config.image_column is None and fmt not in FIELD_FORMATS:
        raise ValueError(f"PipelineConfig.image_column=None: samples with no image are read "
                         f"from {' and '.join(FIELD_FORMATS)} shards; the source is {fmt}")  # fmt: skip
    reader = Reader(fmt, storage, config.image_column, config.label_column,
                    config.label_member, config.label_key,
                    extras=config.transform is not None or config.image_column is None)  # fmt: skip
    if get_format(fmt).one_per_file:
        return _list_imagefolder(paths, reader)
    listed = frozenset(_files_under(paths, storage))
    files = sorted(f for f in listed if get_format(fmt).matches(f))
    if storage.remote and fmt == "tfrecord" and (named := {p for p in paths if p in listed}):
        listed |= _beside(named, storage)  # the index a reader finds beside a glob's match
    if not files:
        raise ValueError(f"no {fmt} shards found in source {config.source!r}")
    shards, key, shown = [], 0, time.monotonic()
    for i, pieces in enumerate(_counted(reader, files, listed)):
        if time.monotonic() - shown > PROGRESS_S:  # a remote listing reads every header
            print(f"raypipe: listing {config.source}: {i}/{len(files)} shards counted, "
                  f"{key} samples so far", file=sys.stderr, flush=True)  # fmt: skip
            shown = time.monotonic()
        for piece, n in pieces:  # a large record file: several pieces
            shards.append(Shard(piece, key, n))
            key += n
    if key == 0:
        raise ValueError(f"the {fmt} shards in {config.source!r} hold no samples")
    classes, labels = get_format(fmt).labels(reader, files)
    if not classes and (named := _converted_classes(storage, files)):
        classes, labels = named, f"{labels}; class names from raypipe convert's index.json"
    reader = dataclasses.replace(reader, classes=classes)
    return Listing(fmt, tuple(shards), classes, reader, labels, _lengths(config, reader, shards))


def _converted_classes(storage: Storage, files: list[str]) -> tuple[str, ...]:
    """The class names `raypipe convert` kept in ``index.json`` beside ``files``, when every
    file is one of the shards it wrote (the shards hold labels as numbers only); else ()."""
    folder = files[0].rpartition("/")[0]
    if any(f.rpartition("/")[0] != folder for f in files):
        return ()
    try:
        index = json.loads(storage.read_bytes(storage.join(folder, INDEX)))
        names = {entry["name"] for entry in index["shards"]}
        classes = tuple(str(c) for c in index["classes"])
    except (OSError, ValueError, KeyError, TypeError):
        return ()  # none, or not convert's
    return (
        classes if index.get("complete") and {f.rpartition("/")[2] for f in files} <= names else ()
    )


def _counted(reader: Reader, files: list[str],
             listed: frozenset[str]) -> Iterator[list[tuple[str, int]]]:  # fmt: skip
    """``reader.pieces`` of each file, in order, `COUNT_THREADS` files counted at once: a
    remote file's headers cost a round trip or more, which threads overlap."""
    if len(files) < 2:
        yield from (reader.pieces(f, listed) for f in files)
        return
    pool = ThreadPoolExecutor(min(COUNT_THREADS, len(files)), thread_name_prefix="raypipe-count")
    try:
        yield from pool.map(lambda f: reader.pieces(f, listed), files)
    finally:
        pool.shutdown(cancel_futures=True)


def _lengths(config: PipelineConfig, reader: Reader, shards: list[Shard]) -> np.ndarray | None:
    """Each key's document length in ``config.pack``'s column (Parquet only), else None."""
    if config.pack is None:
        return None
    if reader.format != "parquet":
        raise ValueError(f"PipelineConfig.pack={config.pack!r}: packing reads document lengths "
                         f"from a Parquet list column; the source is {reader.format}")  # fmt: skip
    return sequence_lengths(reader.storage, [(s.path, s.first_key, s.num_samples) for s in shards],
                            config.pack)  # fmt: skip


def shard_permutation(count: int, *, seed: int, epoch: int) -> np.ndarray:
    """The order an epoch reads ``count`` shards in, seeded by (seed, epoch): the one rule
    every plan of an epoch (the driver's, each rank's, each actor's) follows."""
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(count)


def epoch_order(shards: Sequence[Shard], *, seed: int, epoch: int, shuffle: bool) -> list[Shard]:
    """The shards in the order this epoch reads them: `shard_permutation`."""
    if not shuffle:
        return list(shards)
    return [shards[i] for i in shard_permutation(len(shards), seed=seed, epoch=epoch)]


def _files_under(paths: list[str], storage: Storage) -> Iterator[str]:
    for p in paths:
        if storage.kind(p) == "dir":
            yield from storage.walk(p)
        else:
            yield p


def _beside(files: set[str], storage: Storage) -> frozenset[str]:
    """What the folders of remote ``files`` (a glob's matches, a list's items) hold: the
    `raypipe.formats.tfindex` names the listing may count by are only the ones it saw, and
    the reader, going on past a damaged record, finds its index by name."""
    return frozenset(f for d in {f.rpartition("/")[0] for f in files} for f in storage.walk(d))


def _list_imagefolder(paths: list[str], reader: Reader) -> Listing:
    """Class sub-folders become labels, by sorted class name; one shard per image."""
    files, classes = imagefolder.list_images(paths, reader.storage)
    n = len(files)
    shards = Shards(Paths.of(p for p, _ in files), np.arange(n, dtype=np.int64),
                    np.ones(n, dtype=np.int64), np.fromiter((lb for _, lb in files), np.int64, n))  # fmt: skip
    return Listing("imagefolder", shards, tuple(classes), reader, "class sub-folders")


def shard_row(shard: Shard, done: np.ndarray | None) -> dict:
    """The row an actor reads ``shard`` from: ``done`` (bool per member, None: none) as
    `pack_done` packs it; `unpack_done` reads it back."""
    return {"path": shard.path, "first_key": shard.first_key, "num_samples": shard.num_samples,
            "label": shard.label, "done": pack_done(done)}  # fmt: skip


def pack_done(done: np.ndarray | None) -> bytes:
    """A shard's done mask (bool per member, None: none) packed into bits, ``b""`` when no
    member is done."""
    return np.packbits(done).tobytes() if done is not None and done.any() else b""


def pending_keys(first_key: int, num_samples: int, done: np.ndarray | None):
    """The keys of a row that are not ``done`` (`unpack_done`'s mask), in order."""
    if done is None:
        return range(first_key, first_key + num_samples)
    return (first_key + np.flatnonzero(~done)).tolist()


def unpack_done(done: bytes, num_samples: int) -> np.ndarray | None:
    """The per-member done mask of a row made by `shard_row` (None: nothing done)."""
    if not done:
        return None
    return np.unpackbits(np.frombuffer(done, dtype=np.uint8), count=num_samples).astype(bool)
