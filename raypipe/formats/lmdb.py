"""LMDB environments as the common PyTorch LMDB recipes write them: a directory holding
``data.mdb`` (or a single ``*.lmdb`` file, ``subdir=False``), one sample per key, each value
a pickled (or msgpack) ``(image_bytes, label)`` tuple or ``{"image": ..., "label": ...}`` dict
(the image encoded bytes, or a uint8 H×W×3 pixel array: it reaches the decoder as a PPM).

```
 driver: keys in LMDB's order (metadata keys like ``__keys__`` / ``__len__`` left out)
   ▼ cut into pieces of about PIECE_BYTES of values: ``train/data.mdb#<hex first key>+<n>``
 actor: open read-only without locks, seek to the piece's first key, read n values
```

Key ``i`` of the environment (in LMDB's byte order) is sample ``i``. Dict fields are
``image_column`` / ``label_column``. Memory-mapped, so local or shared file systems only:
object storage is refused when the source is listed. Needs ``pip install 'raypipe[lmdb]'``.

Bad data never raises here: a value that is neither pickle nor msgpack is a ``bad_record``
sample, a dict without the fields ``missing_column``; an environment that cannot be opened
is one ``unreadable_shard`` sample naming it.
"""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Iterator

import numpy as np

from raypipe.formats.pieces import counted, cut, piece_path, split_piece
from raypipe.formats.records import as_label, pixels_to_pnm, unknown_fields
from raypipe.formats.sample import RawSample

__all__ = ["count", "is_shard", "labels", "pieces", "read"]
assert __all__ == sorted(__all__)

MISSING = "format='lmdb' needs the lmdb package: pip install 'raypipe[lmdb]'"


def is_shard(path: str) -> bool:
    base = os.path.basename(path)
    return base == "data.mdb" or base.lower().endswith(".lmdb")


def _lmdb():
    try:
        import lmdb
    except ImportError:
        raise ImportError(MISSING) from None
    return lmdb


def _env(path: str):
    """The environment of a shard file, opened once per process (LMDB's rule) and again
    when the file is another (rebuilt: a new inode or modification time)."""
    st = os.stat(path)
    return _opened(path, st.st_ino, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _opened(path: str, inode: int, mtime_ns: int):
    lmdb = _lmdb()
    subdir = os.path.basename(path) == "data.mdb"
    where = os.path.dirname(path) if subdir else path
    env = lmdb.open(where, subdir=subdir, readonly=True, lock=False, readahead=False,
                    meminit=False, max_readers=2048)  # fmt: skip
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    if os.path.getsize(path) < need:  # cut short: a read past its end would kill the process
        env.close()  # (SIGBUS on the mapping), where this is one unreadable shard
        raise ValueError(f"the file is cut short: {os.path.getsize(path)} bytes of the {need} "
                         "its pages need")  # fmt: skip
    return env


def _is_meta(key: bytes) -> bool:
    return key.startswith(b"__") and key.endswith(b"__")


def _check_local(reader) -> None:
    if reader.storage.remote:
        raise ValueError(
            "format='lmdb' reads local or shared file systems only: LMDB memory-maps its "
            f"file, which {reader.storage.scheme}:// storage cannot; copy the environment there"
        )


def pieces(reader, path: str, listed: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
    """The environment's keys cut into pieces of about ``PIECE_BYTES`` of values."""
    _check_local(reader)
    _lmdb()  # a missing library fails the listing, naming the extra
    try:
        with _env(path).begin(buffers=True) as txn:
            items = [(bytes(k), len(v)) for k, v in txn.cursor() if not _is_meta(bytes(k))]
    except Exception:  # lmdb.Error for a file that is not an environment
        return [(path, 1)]  # the reader yields one unreadable_shard sample for it
    runs = cut([size for _, size in items])
    if len(runs) <= 1:
        return [(path, len(items))]
    return [(piece_path(path, items[first][0].hex(), n), n) for first, n in runs]


count = counted(pieces)


def read(reader, path: str, first_key: int, label: int,
         done: np.ndarray | None = None) -> Iterator[RawSample]:  # fmt: skip
    """The samples of an environment or piece, in key order; ``label`` is unused."""
    file, start, n = split_piece(path)
    try:
        txn = _env(file).begin()
        cursor = txn.cursor()
        found = cursor.set_range(bytes.fromhex(start)) if start else cursor.first()
    except Exception as e:
        yield RawSample(first_key, -1, None, file, f"{type(e).__name__}: {e}", "unreadable_shard")
        return
    i = 0
    with txn:
        while found and (n is None or i < n):
            key = cursor.key()
            if not _is_meta(key):
                if done is None or not done[i]:
                    where = f"{file}:{key.decode(errors='backslashreplace')}"
                    yield _sample(cursor.value(), first_key + i, where, reader)
                i += 1
            found = cursor.next()


def _load(value: bytes):
    """A value as the recipes store it: pickle (protocol 2+ starts with 0x80 and the
    protocol), else msgpack where installed, else pickle's older protocols."""
    if len(value) > 2 and value[0] == 0x80 and 2 <= value[1] <= 5:
        return pickle.loads(value)
    try:
        import msgpack
    except ImportError:
        return pickle.loads(value)
    try:
        return msgpack.unpackb(value, raw=False, strict_map_key=False)
    except UnicodeDecodeError:  # packed without use_bin_type (msgpack < 1.0): bytes as str
        loaded = msgpack.unpackb(value, raw=True, strict_map_key=False)
        if isinstance(loaded, dict):
            return {k.decode() if isinstance(k, bytes) else k: v for k, v in loaded.items()}
        return loaded
    except Exception as e:
        try:
            return pickle.loads(value)
        except Exception:
            raise ValueError(f"msgpack: {e}") from None  # the reason, not pickle's guess


def _image_label(value, reader) -> tuple[object, object, str | None]:
    """``(image, label, None)`` of a loaded value: a tuple's first two items, or a dict's
    ``image_column`` / ``label_column``; ``(None, None, why)`` when it has neither."""
    if isinstance(value, (tuple, list)) and len(value) >= 2:
        return value[0], value[1], None
    if isinstance(value, dict):
        if reader.image_column in value and reader.label_column in value:
            return value[reader.image_column], value[reader.label_column], None
        names = [str(k) for k in value]
        return (
            None,
            None,
            unknown_fields("the value", names, reader.image_column, reader.label_column),
        )
    return None, None, f"a {type(value).__name__} value, not an (image, label) tuple or a dict"


def _image_bytes(image) -> bytes:
    """Encoded bytes as they are; a uint8 pixel array (H×W, H×W×1, H×W×3) as a PPM / PGM."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, np.ndarray):
        return image.tobytes() if image.ndim == 1 else pixels_to_pnm(image)
    raise ValueError(f"the image is {type(image).__name__}, not bytes or a uint8 array")


def _sample(raw: bytes, key: int, where: str, reader) -> RawSample:
    try:
        value = _load(raw)
    except Exception as e:
        return RawSample(key, -1, None, where, f"not pickle or msgpack: {type(e).__name__}: {e}",
                         "bad_record")  # fmt: skip
    image, label, why = _image_label(value, reader)
    if why is not None:
        return RawSample(key, -1, None, where, why, "missing_column")
    try:
        image = _image_bytes(image)
    except ValueError as e:
        return RawSample(key, -1, None, where, str(e), "wrong_type")
    number = as_label(label)
    if number is None:
        return RawSample(
            key, -1, None, where, f"label {label!r:.40} is not an integer", "bad_label"
        )
    extras = None
    if reader.extras and isinstance(value, dict):
        extras = {k: v for k, v in value.items() if k not in (reader.image_column, reader.label_column)}  # fmt: skip
    return RawSample(key, number, image, where, extras=extras)


def labels(reader, paths: list[str]) -> tuple[tuple[str, ...], str]:
    """No class names; where the label is, from the first value. Raises ValueError (one
    line, the first value's fields) when a dict lacks ``image_column`` / ``label_column``."""
    for path in paths:
        try:
            with _env(path).begin() as txn:
                first = next(((k, v) for k, v in txn.cursor() if not _is_meta(k)), None)
            value = _load(first[1]) if first else None
        except Exception:
            continue  # an unreadable environment or value: skipped by the reader
        if isinstance(value, dict):
            if reader.image_column not in value or reader.label_column not in value:
                raise ValueError(unknown_fields(f"the first value of {path}", list(map(str, value)),
                                                reader.image_column, reader.label_column))  # fmt: skip
            return (), f"dict key {reader.label_column!r}, image {reader.image_column!r}"
        if isinstance(value, (tuple, list)):
            return (), "(image, label) tuples: the label second"
    return (), "no readable LMDB value"
