"""The index beside a TFRecord shard: "offset length" lines, one a record, as the
`tfrecord` package's ``tfrecord2idx`` writes them (``train.tfrecord.index``, or the name
without the shard's suffix: ``train.index``, ``.tfindex``, ``.idx``).

One that covers the file record after record spares the driver reading every record's
header (`raypipe.formats.tfrecord.scan`), and lets the reader go on past a record whose
length cannot be trusted (`past`), where without it the rest of the file is lost.
"""

from __future__ import annotations

import os

from raypipe.formats.storage import Storage

__all__ = ["INDEX_SUFFIXES", "past", "read"]
assert __all__ == sorted(__all__)

INDEX_SUFFIXES = (".index", ".tfindex", ".idx")  # beside the shard, with or without its suffix


def read(storage: Storage, path: str, stem: str, listed: frozenset[str]):
    """``(offsets, sizes)`` from an index beside ``path`` (or ``stem``, its name without the
    shard suffix) that covers it record after record; None where there is none, and for a
    GZIP file (one piece, read from its start). On remote storage only the names in
    ``listed`` are tried."""
    if path.lower().endswith(".gz"):
        return None
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


def past(storage: Storage, path: str, stem: str, offset: int, why: tuple[str, str]):
    """``(why, after)`` for the record at ``offset`` whose header is bad (``why``: reason,
    detail): where its length CRC failed in a file with an index, which the listing counted
    by (every name tried, remote ones too: a damaged record is rare), that record alone as
    ``bad_checksum`` and the next record's offset; else ``why`` as it is and None (the rest
    of the file is lost)."""
    if why[0] == "truncated_shard":
        return why, None
    names = frozenset(b + s for b in (path, stem) for s in INDEX_SUFFIXES)
    index = read(storage, path, stem, names)
    if index is None or offset not in index[0] or offset == index[0][-1]:
        return why, None
    after = offset + index[1][index[0].index(offset)]
    return ("bad_checksum", f"length CRC fails at byte {offset}"), after
