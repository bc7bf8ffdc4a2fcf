"""Samples with no image (``PipelineConfig.image_column=None``): a sample is its fields.

A Parquet row is every column's value (a list of numbers as a 1-D numpy array, a number as
a numpy scalar, anything else as Arrow gives it); the ``label_column``, where the file has
one, is the ``label`` field (strings mapped through the listed classes). A WebDataset
sample is every member's bytes by extension (decoded in the actors:
`raypipe.preprocess.samples.fields`); its ``label_member``, when one is named, is the ``label``.

Bad data never raises here, as in the image readers: an unreadable shard, a null label,
a label that is not a class are samples with a ``reason``.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator

import numpy as np

from raypipe.formats.sample import RawSample, os_error
from raypipe.formats.storage import Storage

__all__ = ["column_values", "read_parquet_fields", "read_tar_fields"]
assert __all__ == sorted(__all__)


def read_parquet_fields(storage: Storage, path: str, first_key: int, done: np.ndarray | None, *,
                        label_column: str = "label",
                        classes: tuple[str, ...] = ()) -> Iterator[RawSample]:  # fmt: skip
    """Every row of a Parquet file as fields; a consumed row group is not read."""

    from raypipe.formats.parquet import label_kind, open_file, read_groups

    file, unreadable = open_file(storage, path, first_key)
    if file is None:
        yield unreadable
        return
    schema = file.schema_arrow
    has_label = label_column in schema.names and label_kind(schema.field(label_column).type)
    index = {name: i for i, name in enumerate(classes)}

    def rows(batch, key: int) -> Iterator[RawSample]:
        values = {name: column_values(batch.column(name)) for name in batch.schema.names}
        broken = [name for name, v in values.items() if isinstance(v, PartlyText)]
        for i in range(batch.num_rows):
            if done is None or not done[key + i - first_key]:
                fields = {name: v[i] for name, v in values.items()}
                where = f"{path}:row{key + i - first_key}"
                if bad := next((n for n in broken if isinstance(fields[n], NotText)), None):
                    yield RawSample(key + i, -1, None, where, f"column {bad!r}: {fields[bad]}",
                                    "bad_record")  # fmt: skip
                    continue
                yield _labelled(key + i, where, fields, label_column if has_label else None,
                                index)  # fmt: skip

    yield from read_groups(file, path, first_key, done, None, rows)


def _labelled(key: int, where: str, fields: dict, label_column: str | None, index) -> RawSample:
    if label_column is None:
        return RawSample(key, -1, None, where, extras=fields)
    label = fields.pop(label_column)
    if label is None:
        return RawSample(key, -1, None, where, "label is null", "null_value")
    if isinstance(label, str):
        if label not in index:
            return RawSample(key, -1, None, where, f"label {label!r} not in the listed classes",
                             "bad_label")  # fmt: skip
        label = index[label]
    return RawSample(key, int(label), None, where, extras={**fields, "label": np.int64(label)})


def column_values(column) -> list:
    """One value per row: 1-D numpy arrays for lists of numbers (variable or fixed size: one
    flatten, no Python objects per element), numpy scalars for numbers, Arrow's Python
    values otherwise; None for a null row, and for a list row holding a null. Numbers keep
    the column's dtype whatever the other rows hold (a null among int32 tokens made them
    int64, and the run stopped, blaming a good row)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t, values = column.type, None
    lists = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    holed: np.ndarray = np.zeros(0, np.int64)  # rows with a null element: null rows too
    if lists and _numeric(t.value_type):
        flat = column.flatten()  # without the null rows' values
        if flat.null_count:  # one such row (not the others read with it) is a null_value
            nulls = flat.is_null().to_numpy(zero_copy_only=False)
            holed = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)[nulls]
            flat = flat.fill_null(pa.scalar(0).cast(flat.type))
        lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)
        values = np.split(flat.to_numpy(zero_copy_only=False), np.cumsum(lengths)[:-1])
    elif _numeric(t):
        values = list(column.fill_null(pa.scalar(0).cast(t)).to_numpy(zero_copy_only=False))
    if values is None:
        try:
            return column.to_pylist()
        except UnicodeDecodeError:  # a string that is not UTF-8 (no page CRC): its row alone
            return PartlyText(_value(column, i) for i in range(len(column)))
    if column.null_count or len(holed):
        nulls = column.is_null().to_numpy(zero_copy_only=False)
        nulls[holed] = True
        values = [None if null else v for v, null in zip(values, nulls, strict=True)]
    return values


class NotText(str):
    """A string value that is not UTF-8, in place of its row's value: why, as text."""


class PartlyText(list):
    """A column's values some of which are `NotText` (the others' rows read as they are)."""


def _value(column, i: int):
    try:
        return column[i].as_py()
    except UnicodeDecodeError as e:
        return NotText(f"not UTF-8 text ({e.reason} at byte {e.start})")


def _numeric(t) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def read_tar_fields(storage: Storage, path: str, first_key: int, done: np.ndarray | None, *,
                    label_member: str | None = None,
                    label_key: str = "label") -> Iterator[RawSample]:  # fmt: skip
    """Every sample of a WebDataset tar as its members' bytes, by extension; with
    ``label_member``, that member is the ``label`` (a sample without it: missing_label)."""
    from raypipe.formats.webdataset import _label_of, _tar_index

    try:
        groups, cut = _tar_index(storage, path)
    except (tarfile.TarError, OSError) as e:
        yield RawSample(first_key, -1, None, path, os_error(e), "unreadable_shard")
        return
    with storage.open(path) as f, tarfile.open(fileobj=f, mode="r:") as tar:
        for i, (prefix, parts) in enumerate(groups):
            if done is not None and done[i]:
                continue
            key, where = first_key + i, f"{path}:{prefix}"
            try:
                members = {ext: tar.extractfile(m).read() for ext, m in parts.items()}
            except (tarfile.TarError, OSError) as e:
                reason = "truncated_shard" if cut is not None else "unreadable"
                yield RawSample(key, -1, None, where, os_error(e), reason)
                continue
            label = -1
            if label_member is not None:
                if label_member not in members:
                    yield RawSample(key, -1, None, where, f"no .{label_member} member",
                                    "missing_label")  # fmt: skip
                    continue
                # a .json holds more than the label: it stays a field
                keep = label_member.endswith("json")
                data = members[label_member] if keep else members.pop(label_member)
                text = data.decode(errors="replace").strip()
                label, reason, detail = _label_of(text, label_member, label_key)
                if reason is not None:
                    yield RawSample(key, -1, None, where, detail, reason)
                    continue
                members["label"] = np.int64(label)
            yield RawSample(key, label, None, where, extras=members)
    if cut is not None:
        yield RawSample(first_key + len(groups), -1, None, f"{path}:<end>", cut, "truncated_shard")
