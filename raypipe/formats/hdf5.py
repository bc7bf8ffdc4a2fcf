"""HDF5 files (``.h5``, ``.hdf5``) with an images dataset and a labels dataset of one row per
sample, as ``h5py`` writes them; several files are several shards.

```
 images: variable-length uint8 (each row an encoded JPEG / PNG / ...)
         or uint8 N×H×W×C (C = 1 or 3) / N×H×W raw pixels
 labels: integers, N or N×1
```

The datasets are ``image_column`` / ``label_column``; while those keep their defaults
(``image``, ``label``), ``images`` / ``labels`` are used, the usual names. Rows are read in
runs aligned to the images dataset's chunks; a large file is listed as pieces of whole
chunks (`raypipe.formats.pieces`). Raw pixels reach the decoder as a binary PPM / PGM (a
header before the same bytes), so it crops and resizes them as it does any image.
Needs ``pip install 'raypipe[hdf5]'``.

Bad data never raises here: a file that is not HDF5 is one ``unreadable_shard`` sample
naming it; a row that cannot be read is ``unreadable``, a wrong label ``bad_label`` (every row
of a file whose labels outnumber its images: which is whose cannot be told), a row past a
shorter labels dataset ``missing_label``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from raypipe.formats.pieces import counted, piece_path, rows_per_piece, split_piece
from raypipe.formats.records import as_label, pick, pixels_to_pnm, unknown_fields
from raypipe.formats.sample import RawSample, os_error

__all__ = ["CONVENTIONS", "count", "is_shard", "labels", "pieces", "read"]
assert __all__ == sorted(__all__)

CONVENTIONS = (("images", "labels", "h5py datasets"),)
ROWS_PER_READ = 64  # at least; rounded up to whole chunks
MISSING = "format='hdf5' needs the h5py package: pip install 'raypipe[hdf5]'"


def is_shard(path: str) -> bool:
    return path.lower().endswith((".h5", ".hdf5"))


def _open(storage, path: str):
    try:
        import h5py
    except ImportError:
        raise ImportError(MISSING) from None
    return h5py.File(storage.open(path) if storage.remote else path, "r")


_DAMAGED = (OSError, RuntimeError, KeyError, ValueError)  # what h5py raises on a damaged file


def _datasets(f) -> list[str]:
    names: list[str] = []
    f.visititems(lambda name, obj: names.append(name) if hasattr(obj, "shape") else None)
    return names


def _pair(f, reader):
    """``(images, labels)`` datasets of an open file, or None (a scalar is no rows either)."""
    names = pick(_datasets(f), reader.image_column, reader.label_column, CONVENTIONS)
    pair = None if names is None else (f[names[0]], f[names[1]])
    return None if pair is None or min(pair[0].ndim, pair[1].ndim) == 0 else pair


def pieces(reader, path: str, listed: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
    """The file's rows cut into pieces of whole chunks, about ``PIECE_BYTES`` each."""
    try:
        with _open(reader.storage, path) as f:
            pair = _pair(f, reader)
            if pair is None:
                return [(path, 1)]  # one missing_column sample, named by the reader
            images = pair[0]
            n, chunk = images.shape[0], images.chunks[0] if images.chunks else 1
            per = rows_per_piece(reader.storage.size(path) // max(1, n), chunk)
    except _DAMAGED:  # not HDF5, or damaged metadata
        return [(path, 1)]  # the reader yields one unreadable_shard sample for it
    if n <= per:
        return [(path, n)]
    return [(piece_path(path, lo, min(per, n - lo)), min(per, n - lo)) for lo in range(0, n, per)]


count = counted(pieces)


def read(reader, path: str, first_key: int, label: int,
         done: np.ndarray | None = None) -> Iterator[RawSample]:  # fmt: skip
    """The rows of a file or piece, in order, read a run of chunks at a time."""
    file, start, n = split_piece(path)
    try:
        f = _open(reader.storage, file)
    except (OSError, ImportError) as e:
        yield RawSample(first_key, -1, None, file, os_error(e), "unreadable_shard")
        return
    with f:
        try:
            pair = _pair(f, reader)
        except _DAMAGED as e:  # damaged metadata: the file's (or piece's) keys are unreadable
            yield RawSample(first_key, -1, None, file, os_error(e), "unreadable_shard")
            return
        if pair is None:
            detail = unknown_fields(file, _datasets(f), reader.image_column,
                                    reader.label_column, CONVENTIONS)  # fmt: skip
            yield RawSample(first_key, -1, None, file, detail, "missing_column")
            return
        images, labels = pair
        lo = int(start) if start else 0
        hi = min(images.shape[0], lo + n) if n is not None else images.shape[0]
        yield from _rows(images, labels, lo, hi, first_key, file, done)


def _rows(images, labels, lo: int, hi: int, first_key: int, file: str, done):
    """Rows ``lo..hi`` in runs of whole chunks (runs of ``step`` rows from row 0)."""
    chunk = images.chunks[0] if images.chunks else 1
    step = -(-ROWS_PER_READ // chunk) * chunk
    a = lo
    while a < hi:
        b = min(hi, (a // step + 1) * step)
        if done is None or not done[a - lo : b - lo].all():  # a consumed run is not read
            yield from _run(images, labels, a, b, lo, first_key, file, done)
        a = b


def _run(images, labels, a: int, b: int, lo: int, first_key: int, file: str, done):
    if labels.shape[0] > images.shape[0]:  # which label is whose cannot be told
        detail = f"the labels hold {labels.shape[0]} rows for {images.shape[0]} images"
        for r in range(a, b):
            if done is None or not done[r - lo]:
                yield RawSample(first_key + r - lo, -1, None, f"{file}:row{r}", detail, "bad_label")
        return
    labelled = max(a, min(b, labels.shape[0]))  # a label dataset shorter than the images'
    try:
        block, marks = images[a:b], np.asarray(labels[a:labelled])
        marks = marks.reshape(labelled - a, -1) if labelled > a else marks  # a run past them
    except (OSError, ValueError) as e:
        for r in range(a, b):
            yield RawSample(
                first_key + r - lo, -1, None, f"{file}:row{r}", os_error(e), "unreadable"
            )
        return
    for r in range(a, b):
        if done is not None and done[r - lo]:
            continue
        if r >= labelled:
            yield RawSample(first_key + r - lo, -1, None, f"{file}:row{r}",
                            f"no label: the labels hold {labels.shape[0]} rows", "missing_label")  # fmt: skip
        else:
            yield _row(block[r - a], marks[r - a], first_key + r - lo, f"{file}:row{r}")


def _row(image, mark, key: int, where: str) -> RawSample:
    number = as_label(mark)
    if number is None:
        return RawSample(key, -1, None, where, f"label {mark!r:.40} is not an integer", "bad_label")
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:  # strings come as bytes
        what = image.dtype if isinstance(image, np.ndarray) else type(image).__name__
        return RawSample(key, -1, None, where, f"images of {what}, not uint8", "wrong_type")
    try:
        data = image.tobytes() if image.ndim == 1 else pixels_to_pnm(image)
    except ValueError as e:
        return RawSample(key, -1, None, where, str(e), "wrong_type")
    return RawSample(key, number, data, where)


def labels(reader, paths: list[str]) -> tuple[tuple[str, ...], str]:
    """No class names; which datasets hold images and labels, and how images are stored.
    Raises ValueError (one line, the first file's datasets) when the names are unknown."""
    for path in paths:
        try:
            with _open(reader.storage, path) as f:
                datasets = _datasets(f)
                names = pick(datasets, reader.image_column, reader.label_column, CONVENTIONS)
                images = f[names[0]] if names is not None else None
                kind = None if images is None else (
                    "encoded bytes" if images.ndim == 1 else f"raw pixels {images.shape[1:]}")  # fmt: skip
        except _DAMAGED:
            continue  # not HDF5, or damaged: skipped by the reader
        if names is None:
            raise ValueError(unknown_fields(f"{path}", datasets, reader.image_column,
                                            reader.label_column, CONVENTIONS))  # fmt: skip
        return (), f"dataset {names[1]!r}, images {names[0]!r} ({kind})"
    return (), "no readable HDF5 file"
