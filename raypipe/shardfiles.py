"""Samples inside shard files: WebDataset tar and Parquet shards, counted and read.

Bad data never raises here: a sample that cannot be read is yielded with a ``reason``
(one of ``raypipe.skips.REASONS``). A shard that cannot be opened holds one such sample;
a tar that ends early holds its readable samples plus one for the lost tail, so the
count and the reader always agree on the number of keys.
"""

from __future__ import annotations

import dataclasses
import os
import tarfile
from collections.abc import Iterator

import numpy as np

WDS_IMAGE_EXTS = ("jpg", "jpeg", "png")


@dataclasses.dataclass(frozen=True)
class RawSample:
    """Undecoded bytes of one sample and where they came from (for error reports)."""

    key: int
    label: int
    data: bytes | None
    where: str
    error: str | None = None  # set when the sample could not even be read: the detail
    reason: str | None = None  # and the reason, one of raypipe.skips.REASONS


def _wds_groups(members: list[tarfile.TarInfo]) -> list[tuple[str, dict[str, tarfile.TarInfo]]]:
    """Group tar members into samples by basename, in first-seen order (WebDataset rules)."""
    groups: dict[str, dict[str, tarfile.TarInfo]] = {}
    for m in members:
        if not m.isfile():
            continue
        base = os.path.basename(m.name)
        if "." not in base:
            continue
        stem, ext = base.split(".", 1)
        prefix = os.path.join(os.path.dirname(m.name), stem)
        groups.setdefault(prefix, {})[ext.lower()] = m
    return [(k, v) for k, v in groups.items() if any(e in v for e in WDS_IMAGE_EXTS)]


def _tar_index(path: str) -> tuple[list[tuple[str, dict[str, tarfile.TarInfo]]], str | None]:
    """The samples of a tar, and why it ends early (None when it ends properly).

    Raises ``tarfile.TarError`` / ``OSError`` when not even one member can be listed.
    A tar that stops mid-member, or lacks the two zero blocks that end an archive,
    is truncated: the samples before the cut are kept.
    """
    members: list[tarfile.TarInfo] = []
    with tarfile.open(path, "r:") as tar:
        try:
            while (member := tar.next()) is not None:
                members.append(member)
            cut = None
            if os.path.getsize(path) - tar.offset < 2 * tarfile.BLOCKSIZE:
                cut = "no end-of-archive marker"
        except tarfile.ReadError as e:
            cut = str(e)
    if cut is not None:
        cut = f"tar ends early after {len(members)} members ({cut})"
    return _wds_groups(members), cut


def count_tar_samples(path: str) -> int:
    try:
        groups, cut = _tar_index(path)
    except (tarfile.TarError, OSError):
        return 1  # the reader yields one unreadable_shard sample for it
    return len(groups) + (cut is not None)


def read_tar(path: str, first_key: int, done: np.ndarray | None) -> Iterator[RawSample]:
    try:
        groups, cut = _tar_index(path)
    except (tarfile.TarError, OSError) as e:
        yield RawSample(first_key, -1, None, path, os_error(e), "unreadable_shard")
        return
    with tarfile.open(path, "r:") as tar:
        for i, (prefix, parts) in enumerate(groups):
            if done is not None and done[i]:
                continue
            key, where = first_key + i, f"{path}:{prefix}"
            image_ext = next(e for e in WDS_IMAGE_EXTS if e in parts)
            try:
                data = tar.extractfile(parts[image_ext]).read()
                if "cls" not in parts:
                    yield RawSample(key, -1, None, where, "no .cls member", "missing_label")
                    continue
                text = tar.extractfile(parts["cls"]).read().decode(errors="replace").strip()
            except (tarfile.TarError, OSError) as e:
                reason = "truncated_shard" if cut is not None else "unreadable"
                yield RawSample(key, -1, None, where, os_error(e), reason)
                continue
            try:
                label = int(text)
            except ValueError:
                yield RawSample(key, -1, None, where, f".cls is {text[:40]!r}", "bad_label")
                continue
            yield RawSample(key, label, data, where)
    if cut is not None:
        yield RawSample(first_key + len(groups), -1, None, f"{path}:<end>", cut, "truncated_shard")


def count_parquet_rows(path: str) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # pyarrow raises several types for a bad footer
        return 1  # the reader yields one unreadable_shard sample for it


def read_parquet(path: str, first_key: int, done: np.ndarray | None) -> Iterator[RawSample]:
    """Rows of ``image`` (binary) and ``label`` (integer); a bad column fails every row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        schema = file.schema_arrow
    except Exception as e:
        yield RawSample(first_key, -1, None, path, f"{type(e).__name__}: {e}", "unreadable_shard")
        return
    columns = {
        "image": (pa.types.is_binary, pa.types.is_large_binary),
        "label": (pa.types.is_integer,),
    }
    for name, checks in columns.items():
        if name not in schema.names:
            why = (f"no {name!r} column (has {schema.names})", "missing_column")
        elif not any(check(schema.field(name).type) for check in checks):
            why = (f"column {name!r} is {schema.field(name).type}", "wrong_type")
        else:
            continue
        for i in range(file.metadata.num_rows):
            yield RawSample(first_key + i, -1, None, f"{path}:row{i}", *why)
        return
    key = first_key
    for g in range(file.num_row_groups):
        size = file.metadata.row_group(g).num_rows
        if done is not None and done[key - first_key : key - first_key + size].all():
            key += size
            continue  # a consumed row group is not read
        for batch in file.iter_batches(batch_size=256, row_groups=[g], columns=["image", "label"]):
            yield from _parquet_rows(batch, path, first_key, key, done)
            key += batch.num_rows


def _parquet_rows(batch, path: str, first_key: int, key: int, done: np.ndarray | None):
    images, labels = batch.column("image"), batch.column("label")
    for i in range(batch.num_rows):
        if done is not None and done[key - first_key]:
            key += 1
            continue  # consumed before a resume: its bytes are not copied out
        where = f"{path}:row{key - first_key}"
        image, label = images[i].as_py(), labels[i].as_py()
        if image is None or label is None:
            null = "image" if image is None else "label"
            yield RawSample(key, -1, None, where, f"{null} is null", "null_value")
        else:
            yield RawSample(key, int(label), image, where)
        key += 1


def os_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"
