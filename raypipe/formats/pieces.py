"""Pieces of one large shard file, so that several tasks read it at once.

A TFRecord, LMDB or HDF5 file is listed as runs of its records, each a shard of its own
(its own first key and count) that one actor task reads::

    train-00000-of-01024.tfrecord  (140 MB)
      ├─ train-00000-of-01024.tfrecord#0+290          keys k .. k+289
      ├─ train-00000-of-01024.tfrecord#33555012+287    keys k+290 .. k+576
      └─ ...

A piece's path is the file's with ``#<start>+<count>`` appended: ``start`` is a byte offset
(TFRecord), a row (HDF5) or a hex key (LMDB); the format's reader parses it back with
`split_piece`. A file listed whole keeps its plain path.
"""

from __future__ import annotations

import gzip
import re
import time
from collections.abc import Sequence

from raypipe.formats.sample import os_error

__all__ = ["LIST_ATTEMPTS", "PIECE_BYTES", "counted", "cut", "listing_read", "piece_path",
           "rows_per_piece", "split_piece"]  # fmt: skip
assert __all__ == sorted(__all__)

PIECE_BYTES = 32 << 20  # about how many bytes of records one piece (one task) reads
LIST_ATTEMPTS, LIST_RETRY_S = 3, 1.0  # a remote shard's count: reads, the first wait between
_PIECE = re.compile(r"#([0-9a-f]*)\+(\d+)$")


def counted(pieces):
    """A format's ``count(reader, path)``: the samples of the file's ``pieces``."""

    def count(reader, path: str) -> int:
        return sum(n for _, n in pieces(reader, path))

    return count


def piece_path(path: str, start: int | str, count: int) -> str:
    """The path of the ``count`` records from ``start`` (an int, or a hex string) of ``path``."""
    return f"{path}#{start}+{count}"


def split_piece(path: str) -> tuple[str, str | None, int | None]:
    """``(file, start, count)`` of a piece path; ``(path, None, None)`` for a whole file."""
    m = _PIECE.search(path)
    if m is None:
        return path, None, None
    return path[: m.start()], m.group(1), int(m.group(2))


def cut(sizes: Sequence[int], budget: int | None = None) -> list[tuple[int, int]]:
    """``(first, count)`` runs of consecutive items of ``sizes`` bytes, each run ending at the
    first item that brings it to ``budget`` (`PIECE_BYTES`) bytes; at least one item a run."""
    budget = PIECE_BYTES if budget is None else budget
    runs: list[tuple[int, int]] = []
    first, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total >= budget:
            runs.append((first, i + 1 - first))
            first, total = i + 1, 0
    if first < len(sizes):
        runs.append((first, len(sizes) - first))
    return runs


def rows_per_piece(bytes_per_row: int, chunk: int) -> int:
    """Rows of about `PIECE_BYTES`, a whole number of ``chunk``-row chunks (at least one)."""
    return max(chunk, PIECE_BYTES // max(1, bytes_per_row) // chunk * chunk)


def listing_read(storage, path: str, count):
    """``count()``: the driver's read of the shard ``path`` to count its samples. On object
    storage an I/O error (a reset connection, a timeout: the store's own retries spent) is
    tried again, `LIST_ATTEMPTS` reads in all, then fails the listing naming the shard (a
    `raypipe.formats.storage.StorageError`): counted as one unreadable sample, the rest of
    a shard that reads fine later was dropped, unsaid, and every key after it moved. A
    missing file and a damaged GZIP stream raise as they are: the format's to count."""
    from raypipe.formats.storage import StorageError

    attempts = 0
    while True:
        try:
            return count()
        except OSError as e:
            if not storage.remote or isinstance(e, (FileNotFoundError, gzip.BadGzipFile)):
                raise
            attempts += 1
            if attempts == LIST_ATTEMPTS:
                raise StorageError(f"{path}: {os_error(e)} on each of {LIST_ATTEMPTS} reads to "
                                   "count its samples: the source cannot be listed") from e  # fmt: skip
            time.sleep(LIST_RETRY_S * 2 ** (attempts - 1))
