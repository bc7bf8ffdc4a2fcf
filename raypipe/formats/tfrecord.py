"""TFRecord shards of ``tf.train.Example`` records (`raypipe.formats.tfexample`), as tf.data,
TFDS and TF's ImageNet build script write them: ``*.tfrecord``, ``*.tfrecords``,
``*.tfrecord.gz`` (GZIP) or names like ``train-00000-of-01024``.

```
 driver: record offsets from a ``.index`` beside the shard ("offset length" lines, as the
         tfrecord package writes them) that covers the whole file, else every record's header
   ▼ cut into pieces of about PIECE_BYTES: ``train-00000-of-01024#33555012+287``
 actor: seek to the piece's offset, read its records, check both CRCs, parse each Example
```

The image and label are features ``image_column`` / ``label_column``; at their defaults,
TF's ImageNet names (``image/encoded``, ``image/class/label``) or TFDS's (``image``,
``label``), whichever the records have. A GZIP file is one piece. A transform gets the
other features as 1-D float32 / int64 arrays or lists of bytes, however many values.

Bad data never raises here: a record whose data CRC fails is one ``bad_checksum`` sample
(file and byte offset) and the next record is read; a length CRC that fails or a file that
ends inside a record loses the rest of the file as one sample (``bad_checksum``,
``truncated_shard``), as counted on the driver (with an index, `raypipe.formats.tfindex`,
a bad length, the first record's too, is one ``bad_checksum`` sample and the records after
it are read); a file that is not TFRecord at all is one ``unreadable_shard`` sample.
"""

from __future__ import annotations

import gzip
import os
import re
import struct
import zlib
from collections.abc import Iterator

import numpy as np

from raypipe.formats import tfindex
from raypipe.formats.pieces import counted, cut, listing_read, piece_path, split_piece
from raypipe.formats.records import pick, unknown_fields
from raypipe.formats.sample import RawSample, os_error
from raypipe.formats.storage import Storage
from raypipe.formats.tfexample import HEADER, encode_example, frame, masked_crc, parse_example
from raypipe.formats.tfexample import values as feature_values

__all__ = ["CONVENTIONS", "count", "is_shard", "labels", "pieces", "read", "scan", "write"]
assert __all__ == sorted(__all__)

CONVENTIONS = (
    ("image/encoded", "image/class/label", "TF's ImageNet build script"),
    ("image", "label", "TFDS"),
)
SUFFIXES = (".tfrecord", ".tfrecords", ".tfrecord.gz", ".tfrecords.gz")
_SHARDED = re.compile(r"-\d+-of-\d+$")
READ_ERRORS = (OSError, EOFError, zlib.error)  # zlib.error: a damaged GZIP stream


def _stem(path: str) -> str:
    """``path`` without its shard suffix (an index may be named either way)."""
    return path[: -len(next((s for s in SUFFIXES if path.lower().endswith(s)), ""))] or path


def is_shard(path: str) -> bool:
    base = os.path.basename(path).lower()
    return base.endswith(SUFFIXES) or bool(_SHARDED.search(base))


def _open(storage: Storage, path: str):
    f = storage.open(path)
    return _Gzip(f) if path.lower().endswith(".gz") else f


class _Gzip(gzip.GzipFile):
    """A GZIP shard that closes its file with itself (``GzipFile`` leaves ``fileobj`` open)."""

    def __init__(self, raw):
        super().__init__(fileobj=raw, mode="rb")
        self.raw = raw

    def close(self) -> None:
        super().close()
        self.raw.close()


# --- the driver: record offsets -------------------------------------------------------


def scan(storage: Storage, path: str, listed: frozenset[str] = frozenset()):
    """``(offsets, sizes, tail)`` of a shard's records; ``tail`` (None, or a ``(reason,
    detail)`` at the end) is a lost rest counted as one more sample. Raises `READ_ERRORS`."""
    index = tfindex.read(storage, path, _stem(path), listed)
    if index is not None:
        return index[0], index[1], None
    offsets, sizes = [], []
    gz = path.lower().endswith(".gz")
    size = None if gz else storage.size(path)
    with _open(storage, path) as f:
        offset = 0
        while True:
            try:
                head = f.read(HEADER)
                if not head:
                    return offsets, sizes, None
                length, why = _length(head, offset)
                end = offset + HEADER + (length or 0) + 4
                if why is None and (len(f.read(length + 4)) < length + 4 if gz else end > size):
                    why = ("truncated_shard", f"the file ends inside the record at byte {offset}")
            except READ_ERRORS as e:  # a GZIP stream cut or damaged after its first records
                if not offsets:
                    raise
                why = ("truncated_shard", f"the stream breaks in the record at byte {offset}: {e}")
            if why is not None:
                return offsets, sizes, why
            offsets.append(offset)
            sizes.append(end - offset)
            if not gz:
                f.seek(end)
            offset = end


def _length(head: bytes, offset: int) -> tuple[int | None, tuple[str, str] | None]:
    """A record's data length from its header, or why the header is bad."""
    if len(head) < HEADER:
        return None, ("truncated_shard", f"the file ends inside the header at byte {offset}")
    length, crc = struct.unpack("<QI", head)
    if masked_crc(head[:8]) != crc:
        if offset == 0:
            return None, ("unreadable_shard", "not a TFRecord file (the first length CRC fails)")
        return None, ("bad_checksum", f"length CRC fails at byte {offset}; the rest is lost")
    return length, None


def pieces(reader, path: str, listed: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
    """The shard cut into pieces of about `raypipe.formats.pieces.PIECE_BYTES` of records
    (a GZIP file, or a file that fits one piece, stays whole)."""
    try:
        offsets, sizes, tail = listing_read(reader.storage, path,
                                                lambda: scan(reader.storage, path, listed))  # fmt: skip
    except READ_ERRORS:
        return [(path, 1)]  # the reader yields one unreadable_shard sample for it
    total = len(offsets) + (tail is not None)
    runs = cut(sizes + ([0] if tail is not None else []))
    if path.lower().endswith(".gz") or len(runs) <= 1:
        return [(path, total)]
    starts = [*offsets, _tail_offset(offsets, sizes)]
    return [(piece_path(path, starts[first], n), n) for first, n in runs]


def _tail_offset(offsets: list[int], sizes: list[int]) -> int:
    return offsets[-1] + sizes[-1] if offsets else 0


count = counted(pieces)


# --- the actors: records --------------------------------------------------------------


def read(reader, path: str, first_key: int, label: int,
         done: np.ndarray | None = None) -> Iterator[RawSample]:  # fmt: skip
    """The samples of a shard or piece, in order; ``label`` is unused (labels are features)."""
    file, start, n = split_piece(path)
    offset = int(start) if start else 0
    try:
        f = _open(reader.storage, file)
        if offset:
            f.seek(offset)
    except READ_ERRORS as e:
        yield RawSample(first_key, -1, None, file, os_error(e), "unreadable_shard")
        return
    with f:
        i = 0
        while n is None or i < n:
            key, where = first_key + i, f"{file}@{offset}" if offset else file
            try:
                head = f.read(HEADER)
            except READ_ERRORS as e:  # after a record: a stream cut there (as `scan` says)
                yield RawSample(key, -1, None, where, os_error(e),
                                "truncated_shard" if i or offset else "unreadable_shard")  # fmt: skip
                return
            if not head and n is None:
                return
            length, why = _length(head, offset)
            if why is not None:
                why, after = tfindex.past(reader.storage, file, _stem(file), offset, why)
                yield RawSample(key, -1, None, where, why[1], why[0])
                if after is None:
                    return
                f.seek(after)
                offset, i = after, i + 1
                continue
            skip = done is not None and done[i]
            sample = _record(f, key, offset, file, length, skip, reader)
            if sample is not None:
                yield sample
                if sample.reason == "truncated_shard":
                    return
            offset += HEADER + length + 4
            i += 1


def _record(f, key: int, offset: int, file: str, length: int, skip: bool,
            reader) -> RawSample | None:  # fmt: skip
    """The sample of the record at ``offset`` whose header was read; None when ``skip``."""
    where = f"{file}@{offset}"
    if skip and not isinstance(f, gzip.GzipFile):
        f.seek(length + 4, os.SEEK_CUR)  # a consumed record's bytes are not read
        return None
    try:
        body = f.read(length + 4)
    except READ_ERRORS as e:
        return RawSample(key, -1, None, where, os_error(e), "truncated_shard")
    if len(body) < length + 4:
        detail = f"the file ends inside the record at byte {offset}"
        return RawSample(key, -1, None, where, detail, "truncated_shard")
    if skip:
        return None
    data = body[:length]
    if masked_crc(data) != struct.unpack("<I", body[length:])[0]:
        detail = f"data CRC fails for the record at byte {offset}"
        return RawSample(key, -1, None, where, detail, "bad_checksum")
    return _sample(data, key, where, reader)


def _sample(data: bytes, key: int, where: str, reader) -> RawSample:
    try:  # a damaged message, or a feature's list inside it: this record alone is bad
        return _fields(parse_example(data), key, where, reader)
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        return RawSample(key, -1, None, where, f"not a tf.train.Example: {e}", "bad_record")


def _fields(features: dict, key: int, where: str, reader) -> RawSample:
    names = pick(features, reader.image_column, reader.label_column, CONVENTIONS)
    if names is None:
        detail = unknown_fields("the record", features, reader.image_column,
                                reader.label_column, CONVENTIONS)  # fmt: skip
        return RawSample(key, -1, None, where, detail, "missing_column")
    image_name, label_name, _ = names
    (ikind, image), (lkind, label) = features[image_name], features[label_name]
    images = feature_values(ikind, image) if ikind == 1 else []
    if not images:
        detail = f"feature {image_name!r} holds no bytes"
        return RawSample(key, -1, None, where, detail, "wrong_type")
    labels = feature_values(lkind, label) if lkind == 3 else []
    if len(labels) != 1:
        what = "no int64" if not labels else f"{len(labels)} int64s"
        return RawSample(key, -1, None, where, f"feature {label_name!r} holds {what}, not one",
                         "bad_label")  # fmt: skip
    extras = {k: _typed(kind, feature_values(kind, v)) for k, (kind, v) in features.items()
              if reader.extras and k not in (image_name, label_name)}  # fmt: skip
    return RawSample(key, labels[0], images[0], where, extras=extras)


def _typed(kind: int, values: list):
    """A feature's values, however many (a record's boxes): 1-D float32 / int64, or bytes."""
    return values if kind == 1 else np.asarray(values, np.float32 if kind == 2 else np.int64)


def labels(reader, paths: list[str]) -> tuple[tuple[str, ...], str]:
    """No class names; which features hold the label and image, from the first record.
    Raises ValueError (one line, the first record's features) when the names are unknown."""
    for path in paths:
        try:
            with _open(reader.storage, path) as f:
                length, why = _length(f.read(HEADER), 0)
                body = f.read(length + 4) if why is None else b""
            sound = len(body) > 4 and masked_crc(body[:-4]) == struct.unpack("<I", body[-4:])[0]
            features = parse_example(body[:-4]) if sound else None  # damaged: the next file's
        except (*READ_ERRORS, ValueError, IndexError, UnicodeDecodeError):
            continue  # an unreadable shard: its samples are skipped by the reader
        if not features:
            continue
        names = pick(features, reader.image_column, reader.label_column, CONVENTIONS)
        if names is None:
            raise ValueError(unknown_fields(f"the first record of {path}", features,
                             reader.image_column, reader.label_column, CONVENTIONS))  # fmt: skip
        image, label, convention = names
        how = f", {convention}'s names" if convention else ""
        return (), f"feature {label!r} (int64), image {image!r}{how}"
    return (), "no readable TFRecord record"


def write(path: str, kept: list) -> None:
    """A TFRecord of ``kept`` ``(sample, image bytes, extension)``: an Example per sample with
    TFDS's ``image`` and ``label``, and ``key``, ``name``, ``format``."""
    with open(path, "wb") as f:
        for sample, data, ext in kept:
            example = {"image": data, "label": sample.label, "key": sample.key,
                       "name": sample.name.encode(), "format": ext.encode()}  # fmt: skip
            f.write(frame(encode_example(example)))
        f.flush()
        os.fsync(f.fileno())
