"""The index beside a TFRecord shard: "offset length" lines, one a record, as the
`tfrecord` package's ``tfrecord2idx`` writes them (``train.tfrecord.index``, or the name
without the shard's suffix: ``train.index``, ``.tfindex``, ``.idx``).

One that covers the file record after record spares the driver reading every record's
header (`raypipe.formats.tfrecord.scan`), and lets the reader go on past a record whose
length cannot be trusted (`after`), where without it the rest of the file is lost.
"""

from __future__ import annotations

import os

from raypipe.formats.storage import Storage

__all__ = ["INDEX_SUFFIXES", "after", "past", "read"]
assert __all__ == sorted(__all__)

INDEX_SUFFIXES = (".index", ".tfindex", ".idx")  # beside the shard, with or without its suffix


def read(storage: Storage, path: str, stem: str, listed: frozenset[str]):
    """``(offsets, sizes)`` from an index beside ``path`` (or ``stem``, its name without the
    shard suffix) that covers it record after record; None where there is none. On remote
    storage only the names in ``listed`` are tried."""
    for base in dict.fromkeys((path, stem)):
        for suffix in INDEX_SUFFIXES:
            candidate = base + suffix
            if candidate in listed or (not storage.remote and os.path.isfile(candidate)):
                try:
                    lines = storage.read_bytes(candidate).decode().splitlines()
                    rows = [line.split() for line in lines if line.split()]
                    offsets, sizes = [int(r[0]) for r in rows], [int(r[1]) for r in rows]
                    ends = [o + n for o, n in zip(offsets, sizes, strict=True)]
                    whole = ends[-1:] == [storage.size(path)]
                except (OSError, ValueError, IndexError, UnicodeDecodeError):
                    continue  # not an index after all: the records' headers are read
                if offsets[:1] == [0] and offsets[1:] == ends[:-1] and whole:
                    return offsets, sizes
    return None


def after(storage: Storage, path: str, stem: str, offset: int) -> int | None:
    """Where the record after the one at ``offset`` starts, by the index beside ``path``
    (every name tried, remote ones too: a damaged record is rare); None without an index
    that has a record there, or when it is the last."""
    names = frozenset(b + s for b in (path, stem) for s in INDEX_SUFFIXES)
    index = read(storage, path, stem, names)
    if index is None or offset not in index[0]:
        return None
    j = index[0].index(offset)
    return offset + index[1][j] if j + 1 < len(index[0]) else None


def past(storage: Storage, path: str, stem: str, offset: int, why: tuple[str, str]):
    """``(why, after)`` for the record at ``offset`` whose header is bad (``why``: reason,
    detail): where its length CRC failed in a file with an index, which the listing counted
    by, that record alone as ``bad_checksum`` and the next record's offset; else ``why``
    as it is and None (the rest of the file is lost)."""
    if why[0] == "truncated_shard" or path.lower().endswith(".gz"):
        return why, None
    nxt = after(storage, path, stem, offset)
    if nxt is None:
        return why, None
    return ("bad_checksum", f"length CRC fails at byte {offset}"), nxt
