"""Formats: where samples live and how each kind of shard is listed, read and written.

The bottom of the data path: `raypipe.formats.storage` (local disk or object storage),
and one module per format, `imagefolder`, `webdataset` (tar shards), `parquet`, and the
record formats `tfrecord`, `lmdb` and `hdf5` (large files listed in pieces,
`raypipe.formats.pieces`), each registered once in `FORMATS`. A `Reader` holds one
source's read settings and is what the preprocessing actors get; everything else looks a
format up by name.

Bad data never raises in a reader: a sample that cannot be read is yielded with a
``reason`` (one of ``raypipe.skips.records.REASONS``) for the skip policy to act on.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator

import numpy as np

from raypipe.config import FORMATS as FORMAT_NAMES
from raypipe.formats import hdf5, imagefolder, lmdb, parquet, tfrecord, webdataset
from raypipe.formats.sample import RawSample
from raypipe.formats.storage import Storage

__all__ = ["FORMATS", "Format", "Reader", "get_format", "infer_format"]
assert __all__ == sorted(__all__)


@dataclasses.dataclass(frozen=True)
class Format:
    """One format: its shard files' suffix and how they are counted, read and written.

    ``count(reader, path)`` is None when a file is one sample (image folders);
    ``labels(reader, files)`` gives the class names and how labels are read, in words;
    ``write(path, samples)`` is None when raypipe does not write the format;
    ``names(path)`` accepts shard files the suffix does not (``train-00000-of-01024``);
    ``pieces(reader, path, listed)`` cuts a large file into ``(piece path, count)`` pieces,
    each a shard of its own (`raypipe.formats.pieces`; ``listed``: the source's files).
    """

    name: str
    suffix: str  # of a shard file; "" when every image file is a shard
    read: Callable[..., Iterator[RawSample]]
    count: Callable[[Reader, str], int] | None = None
    labels: Callable[[Reader, list[str]], tuple[tuple[str, ...], str]] | None = None
    write: Callable[[str, list], None] | None = None
    names: Callable[[str], bool] | None = None
    pieces: Callable[[Reader, str, frozenset[str]], list[tuple[str, int]]] | None = None

    @property
    def one_per_file(self) -> bool:
        return self.count is None

    def matches(self, path: str) -> bool:
        """Whether ``path`` is a shard file of this format (image folders: never)."""
        if self.suffix and path.lower().endswith(self.suffix):
            return True
        return self.names is not None and self.names(path)


FORMATS: dict[str, Format] = {
    "imagefolder": Format("imagefolder", "", imagefolder.read),
    "webdataset": Format(
        "webdataset", ".tar", webdataset.read, webdataset.count, webdataset.labels, webdataset.write
    ),  # fmt: skip
    "parquet": Format(
        "parquet", ".parquet", parquet.read, parquet.count, parquet.labels, parquet.write
    ),  # fmt: skip
    "tfrecord": Format(
        "tfrecord",
        ".tfrecord",
        tfrecord.read,
        tfrecord.count,
        tfrecord.labels,
        tfrecord.write,
        names=tfrecord.is_shard,
        pieces=tfrecord.pieces,
    ),
    "lmdb": Format(
        "lmdb",
        ".lmdb",
        lmdb.read,
        lmdb.count,
        lmdb.labels,
        names=lmdb.is_shard,
        pieces=lmdb.pieces,
    ),
    "hdf5": Format(
        "hdf5",
        ".h5",
        hdf5.read,
        hdf5.count,
        hdf5.labels,
        names=hdf5.is_shard,
        pieces=hdf5.pieces,
    ),
}
assert tuple(FORMATS) == FORMAT_NAMES


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"format={name!r} must be one of {tuple(FORMATS)}")
    return FORMATS[name]


@dataclasses.dataclass(frozen=True)
class Reader:
    """How the actors read one source's shards (pickled into each of them).

    ``classes`` maps string labels (Parquet) to their index; the column and member
    settings are `raypipe.PipelineConfig`'s.
    """

    format: str
    storage: Storage = dataclasses.field(default_factory=Storage)
    image_column: str | None = "image"  # None: samples with no image (formats.fields)
    label_column: str = "label"
    label_member: str | None = None
    label_key: str = "label"
    classes: tuple[str, ...] = ()
    extras: bool = False  # samples carry their other members / columns (user transforms)

    def count(self, path: str) -> int:
        count = get_format(self.format).count
        return 1 if count is None else count(self, path)

    def pieces(self, path: str, listed: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
        """``(shard path, samples)`` of one file: itself, or the pieces a large one is cut
        into (TFRecord, LMDB, HDF5); ``listed`` holds the source's other files."""
        pieces = get_format(self.format).pieces
        return [(path, self.count(path))] if pieces is None else pieces(self, path, listed)

    def read(self, path: str, first_key: int, label: int,
             done: np.ndarray | None = None) -> Iterator[RawSample]:  # fmt: skip
        """The raw samples of one shard in key order; members marked in ``done`` (a bool
        per member, for a resumed epoch) are passed over without reading their bytes.

        Where the source names its classes, a label outside them (an index past the names,
        a negative one) is a bad_label sample, never a target the loss would fail on
        mid-run; but -1, "no label" (a Hugging Face ``ClassLabel``'s in an unlabelled test
        split, and the label of samples read without one), which is delivered as it is."""
        samples = get_format(self.format).read(self, path, first_key, label, done)
        if not self.classes:
            return samples
        return (_in_classes(raw, len(self.classes)) for raw in samples)


def _in_classes(raw: RawSample, n: int) -> RawSample:
    if raw.reason is not None or -1 <= raw.label < n:
        return raw
    return RawSample(raw.key, -1, None, raw.where, f"label {raw.label} is outside the {n} named "
                     f"classes (0..{n - 1})", "bad_label")  # fmt: skip


def _tar_metadata(files: list[str]) -> bool:
    """Whether every ``.parquet`` of ``files`` sits beside a ``.tar`` of its name
    (``00000.parquet`` by ``00000.tar``: img2dataset's per-shard metadata, no images)."""
    stems = {f[: -len(".tar")] for f in files if f.lower().endswith(".tar")}
    tables = [f[: -len(".parquet")] for f in files if f.lower().endswith(".parquet")]
    return bool(tables) and all(t in stems for t in tables)


def infer_format(paths: list[str], storage: Storage | None = None) -> str:
    """The format of ``paths`` from the files' suffixes (a folder of images: imagefolder)."""
    storage = storage or Storage()
    files: list[str] = []
    dirs = [p for p in paths if storage.kind(p) == "dir"]
    for p in paths:
        if p in dirs:
            files.extend(storage.first_files(p, 66))
        else:
            files.append(p)
    exts = {os.path.splitext(f)[1].lower() for f in files}
    found: dict[str, str] = {}  # format -> a file of it (each file: the first that takes it)
    for f in files:
        if name := next((fmt.name for fmt in FORMATS.values() if fmt.matches(f)), None):
            found.setdefault(name, f)
    if set(found) == {"webdataset", "parquet"} and _tar_metadata(files):
        del found["parquet"]  # img2dataset's layout: a .parquet of each .tar's metadata
    if len(found) > 1:  # reading one would leave the others' samples out, unsaid
        kinds = ", ".join(f"{name} ({os.path.basename(f)})" for name, f in found.items())
        raise ValueError(f"{paths!r} holds shards of more than one format: {kinds}; set the "
                         f"format to read (format: in the config, --format on raypipe "
                         f"inspect), or name its files")  # fmt: skip
    if found:
        return next(iter(found))
    if exts & set(imagefolder.IMAGE_EXTS) or dirs:
        return "imagefolder"
    raise ValueError(
        f"cannot infer the format of {paths!r}: set it (format: in the config, "
        "PipelineConfig.format, --format on raypipe inspect)"
    )
