"""Samples inside Parquet shards: raypipe's own, and what Hugging Face ``datasets`` writes.

An image column is ``binary``, or a struct with a ``bytes`` field (a ``datasets`` ``Image()``
column: ``struct<bytes: binary, path: string>``). A label column holds integers (a
``ClassLabel`` column is one; its names, from the file's ``huggingface`` metadata, become
the classes), or strings, mapped through the sorted set of every file's labels, which the
listing records. Row groups are read one at a time with ranged reads; a consumed row group
(a resumed epoch) is not read at all.

Bad data never raises here: a wrong column fails every row of its shard with one reason
(``missing_column``, ``wrong_type``), a null image or label fails its row (``null_value``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator

import numpy as np

from raypipe.formats.pieces import listing_read
from raypipe.formats.sample import RawSample
from raypipe.formats.storage import Storage, StorageError

__all__ = ["count", "count_parquet_rows", "is_image_type", "label_kind", "labels", "open_file",
           "parquet_labels", "read", "read_groups", "read_parquet", "write"]  # fmt: skip
assert __all__ == sorted(__all__)

ROWS_PER_READ = 256


def count_parquet_rows(storage: Storage, path: str) -> int:
    import pyarrow.parquet as pq

    try:
        return listing_read(
            storage, path, lambda: pq.ParquetFile(storage.open_arrow(path)).metadata.num_rows
        )
    except StorageError:  # object storage that kept failing: the listing fails
        raise
    except Exception:  # pyarrow raises several types for a bad footer
        return 1  # the reader yields one unreadable_shard sample for it


def open_file(storage: Storage, path: str, first_key: int):
    """``(the ParquetFile, None)``, or ``(None, its one unreadable_shard sample)``."""
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(storage.open_arrow(path))
        file.schema_arrow  # noqa: B018  (a footer that parses, with a schema)
    except Exception as e:  # pyarrow raises several types for a bad footer
        return None, RawSample(first_key, -1, None, path, f"{type(e).__name__}: {e}",
                               "unreadable_shard")  # fmt: skip
    return file, None


def parquet_labels(storage: Storage, paths: list[str], column: str,
                   fields: bool = False) -> tuple[tuple[str, ...], str]:  # fmt: skip
    """The class names of ``column`` over all ``paths`` and how labels are read from it.

    Integers: the ``ClassLabel`` names of the first file that has them, else none.
    Strings: every file's distinct values, sorted (the column read a row group at a time).
    ``fields`` (samples with no image, whose label is their field ``label``): a column
    ``label`` beside another ``column``, or ``key`` (raypipe's sample key), is refused
    (ValueError), never overwritten.
    """
    import pyarrow.parquet as pq

    for path in paths:
        try:
            schema = pq.ParquetFile(storage.open_arrow(path)).schema_arrow
        except Exception:
            continue  # an unreadable shard: its samples are skipped by the reader
        if fields and "key" in schema.names:
            raise ValueError(f"{path} has a column 'key', which raypipe's sample key would "
                             "replace in each sample's fields: rename it")  # fmt: skip
        if column not in schema.names:
            return (), f"column {column!r} missing (the files have {schema.names})"
        if fields and column != "label" and "label" in schema.names:
            raise ValueError(f"PipelineConfig.label_column={column!r}: {path} also has a column "
                             "'label', which the label would replace in each sample's fields: "
                             "rename one of them")  # fmt: skip
        kind = label_kind(schema.field(column).type)
        if kind == "int":
            names = _class_label_names(schema, column)
            what = f"ClassLabel, {len(names)} names" if names else "integers"
            return names, f"column {column!r} ({what})"
        if kind != "str":
            return (), f"column {column!r} is {schema.field(column).type}, not integers or strings"
        classes = tuple(sorted(set().union(*(_strings(storage, p, column) for p in paths))))
        return classes, f"column {column!r} (strings → {len(classes)} sorted classes)"
    return (), "no readable Parquet file"


def _strings(storage: Storage, path: str, column: str) -> set[str]:
    """The distinct strings of ``column`` in ``path``, a row group at a time: an unreadable
    file or a damaged group (invalid UTF-8) adds none; its rows say so when read."""
    import pyarrow as pa
    import pyarrow.compute as pc

    file, seen = open_file(storage, path, 0)[0], set()
    for g in range(file.num_row_groups if file is not None else 0):
        with contextlib.suppress(Exception):
            values = file.read_row_group(g, columns=[column]).column(column)
            values = values.cast(pa.string()) if pa.types.is_dictionary(values.type) else values
            seen.update(v for v in pc.unique(values).to_pylist() if v is not None)
    return seen


def read_parquet(storage: Storage, path: str, first_key: int, done: np.ndarray | None, *,
                 image_column: str = "image", label_column: str = "label",
                 classes: tuple[str, ...] = (), extras: bool = False) -> Iterator[RawSample]:  # fmt: skip
    """Rows of ``image_column`` (bytes) and ``label_column``; a bad column fails every row.
    ``extras``: each row also carries the values of the file's other columns."""

    file, unreadable = open_file(storage, path, first_key)
    if file is None:
        yield unreadable
        return
    schema = file.schema_arrow
    why = _check_columns(schema, image_column, label_column)
    if why is not None:
        for i in range(file.metadata.num_rows):
            yield RawSample(first_key + i, -1, None, f"{path}:row{i}", *why)
        return
    index = {name: i for i, name in enumerate(classes)}
    others = [n for n in schema.names if n not in (image_column, label_column)] if extras else []

    def rows(batch, key: int) -> Iterator[RawSample]:
        images, labels = _image_bytes(batch.column(0)), batch.column(1).to_pylist()
        paths = _image_paths(batch.column(0))
        more = {n: batch.column(n).to_pylist() for n in others}
        for i in range(batch.num_rows):
            if done is None or not done[key + i - first_key]:
                where = f"{path}:row{key + i - first_key}"
                row = _row(key + i, where, images[i].as_py(), labels[i], index)
                if row.reason == "null_value" and paths is not None and paths[i] is not None:
                    row = dataclasses.replace(row, error=by_path_only(image_column, paths[i]))
                if others and row.reason is None:
                    row = dataclasses.replace(row, extras={n: v[i] for n, v in more.items()})
                yield row

    yield from read_groups(file, path, first_key, done, [image_column, label_column, *others],
                           rows)  # fmt: skip


def read_groups(file, path: str, first_key: int, done: np.ndarray | None,
                columns: list[str] | None, rows) -> Iterator[RawSample]:  # fmt: skip
    """The samples of every row group not wholly consumed, ``ROWS_PER_READ`` rows at a time:
    ``rows(batch, key)`` yields a batch's (its first row's key ``key``), leaving out the
    consumed ones. A page that cannot be read loses the rest of its row group only, each
    row an ``unreadable`` skip naming it; the groups after it are read."""
    import pyarrow as pa

    key = first_key
    for g in range(file.num_row_groups):
        end = key + file.metadata.row_group(g).num_rows
        if done is not None and done[key - first_key : end - first_key].all():
            key = end
            continue
        try:
            batches = file.iter_batches(batch_size=ROWS_PER_READ, row_groups=[g], columns=columns)
            for batch in batches:
                samples = list(rows(batch, key))  # a whole batch, or none of it, is yielded
                yield from samples
                key += batch.num_rows
        except (OSError, ValueError, pa.ArrowException) as e:  # a damaged page (or string)
            detail = f"row group {g}: {type(e).__name__}: {e}"
            yield from (RawSample(k, -1, None, f"{path}:row{k - first_key}", detail, "unreadable")
                        for k in range(key, end) if done is None or not done[k - first_key])  # fmt: skip
        key = end


def _row(key: int, where: str, image, label, index: dict[str, int]) -> RawSample:
    if image is None or label is None:
        null = "image" if image is None else "label"
        return RawSample(key, -1, None, where, f"{null} is null", "null_value")
    if isinstance(label, str):
        if label not in index:
            return RawSample(
                key, -1, None, where, f"label {label!r} not in the listed classes", "bad_label"
            )
        label = index[label]
    return RawSample(key, int(label), image, where)


def _check_columns(schema, image_column: str, label_column: str) -> tuple[str, str] | None:
    for name, ok in ((image_column, is_image_type), (label_column, label_kind)):
        if name not in schema.names:
            return f"no {name!r} column (has {schema.names})", "missing_column"
        if not ok(schema.field(name).type):
            return f"column {name!r} is {schema.field(name).type}", "wrong_type"
    return None


def is_image_type(t) -> bool:
    """An Arrow type an image column may have: binary, or a struct with such a ``bytes``."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        i = t.get_field_index("bytes")
        return i >= 0 and is_image_type(t.field(i).type)
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)


def label_kind(t) -> str | None:
    """``"int"`` or ``"str"``: the labels an Arrow type holds (a dictionary's values
    counted); None for a type that cannot be a label column."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "str"
    return None


def _image_bytes(column):
    """The bytes of an image column: itself, or the ``bytes`` field of a struct."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.struct_field(column, "bytes") if pa.types.is_struct(column.type) else column


def _image_paths(column) -> list | None:
    """The ``path`` field of a Hugging Face ``Image()`` struct column, per row; None without."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_struct(column.type) or column.type.get_field_index("path") < 0:
        return None
    return pc.struct_field(column, "path").to_pylist()


def by_path_only(column: str, path: str) -> str:
    """Why a Hugging Face ``Image()`` / ``Audio()`` value with a path and no bytes is a skip."""
    return (f"{column!r} holds only the path {path!r}, not the bytes (datasets' to_parquet of "
            "files loaded from disk): write the Parquet with the bytes embedded")  # fmt: skip


def _class_label_names(schema, column: str) -> tuple[str, ...]:
    meta = (schema.metadata or {}).get(b"huggingface")
    try:
        feature = json.loads(meta)["info"]["features"][column]
    except (TypeError, ValueError, KeyError):
        return ()
    names = feature.get("names") if isinstance(feature, dict) else None
    return tuple(str(n) for n in names) if isinstance(names, list) else ()


def labels(reader, paths: list[str]) -> tuple[tuple[str, ...], str]:
    """`parquet_labels` of ``reader``'s label column: (class names, how labels are read)."""
    return parquet_labels(reader.storage, paths, reader.label_column, reader.image_column is None)


def count(reader, path: str) -> int:
    """`count_parquet_rows` with ``reader``'s storage (a `raypipe.formats.Reader`)."""
    return count_parquet_rows(reader.storage, path)


def read(reader, path: str, first_key: int, label: int,
         done: np.ndarray | None = None) -> Iterator[RawSample]:  # fmt: skip
    """`read_parquet` with ``reader``'s columns and classes (every column as a field, by
    `raypipe.formats.fields.read_parquet_fields`, with no image); ``label`` is unused."""
    if reader.image_column is None:
        from raypipe.formats.fields import read_parquet_fields

        return read_parquet_fields(reader.storage, path, first_key, done,
                                   label_column=reader.label_column, classes=reader.classes)  # fmt: skip
    return read_parquet(reader.storage, path, first_key, done, image_column=reader.image_column,
                        label_column=reader.label_column, classes=reader.classes,
                        extras=reader.extras)  # fmt: skip


def write(path: str, kept: list) -> None:
    """A Parquet file of ``kept``: ``image``, ``label``, ``key``, ``name`` columns."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "image": pa.array([d for _, d, _ in kept], pa.binary()),
            "label": pa.array([s.label for s, _, _ in kept], pa.int64()),
            "key": pa.array([s.key for s, _, _ in kept], pa.int64()),
            "name": pa.array([s.name for s, _, _ in kept], pa.string()),
        }
    )
    pq.write_table(table, path, row_group_size=256)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
