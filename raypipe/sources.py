"""Shards: list them with dense, stable keys; order them per epoch; read raw samples.

A shard is one file. An image-folder shard holds one sample; a WebDataset tar or a
Parquet file holds many. Keys are dense: shards are sorted by path and sample ``i``
of a shard whose first key is ``k`` gets key ``k + i``, so a key names the same
sample in every epoch and run as long as the files do not change.

Bad data never raises here: a sample that cannot be read is yielded with a ``reason``
(one of ``raypipe.skips.REASONS``) for the policy to act on. A shard that cannot be
opened holds one such sample; a tar that ends early holds its readable samples plus
one for the lost tail, so the listing and the reader always agree on the key count.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from raypipe.config import PipelineConfig

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
WDS_IMAGE_EXTS = ("jpg", "jpeg", "png")


@dataclasses.dataclass(frozen=True)
class Shard:
    path: str
    first_key: int
    num_samples: int
    label: int = -1  # image folders only: the class index from the parent directory


@dataclasses.dataclass(frozen=True)
class RawSample:
    """Undecoded bytes of one sample and where they came from (for error reports)."""

    key: int
    label: int
    data: bytes | None
    where: str
    error: str | None = None  # set when the sample could not even be read: the detail
    reason: str | None = None  # and the reason, one of raypipe.skips.REASONS


@dataclasses.dataclass(frozen=True)
class Listing:
    format: str
    shards: tuple[Shard, ...]
    classes: tuple[str, ...] = ()

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)


def list_shards(config: PipelineConfig) -> Listing:
    """Resolve ``config.source`` into sorted shards with dense keys."""
    paths = _expand(config.source)
    fmt = config.format or infer_format(paths)
    if fmt == "imagefolder":
        return _list_imagefolder(paths)
    files = sorted({p for p in _files_with(paths, _SHARD_EXT[fmt])})
    if not files:
        raise ValueError(f"no {_SHARD_EXT[fmt]} shards found in source {config.source!r}")
    counter = _count_tar_samples if fmt == "webdataset" else _count_parquet_rows
    shards, key = [], 0
    for f in files:
        n = counter(f)
        shards.append(Shard(f, key, n))
        key += n
    if key == 0:
        raise ValueError(f"the {fmt} shards in {config.source!r} hold no samples")
    return Listing(fmt, tuple(shards))


def epoch_order(shards: tuple[Shard, ...], *, seed: int, epoch: int, shuffle: bool) -> list[Shard]:
    """The shards in the order this epoch reads them: a permutation seeded by (seed, epoch)."""
    if not shuffle:
        return list(shards)
    perm = np.random.default_rng([seed, epoch, 0x5EED]).permutation(len(shards))
    return [shards[i] for i in perm]


def read_shard(
    path: str, fmt: str, first_key: int, label: int, done: np.ndarray | None = None
) -> Iterator[RawSample]:
    """Yield the raw samples of one shard in key order; members marked in ``done`` (a bool
    per member, for a resumed epoch) are passed over without reading their bytes."""
    if fmt == "imagefolder":
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            yield RawSample(first_key, label, None, path, _os_error(e), "unreadable")
            return
        yield RawSample(first_key, label, data, path)
    elif fmt == "webdataset":
        yield from _read_tar(path, first_key, done)
    elif fmt == "parquet":
        yield from _read_parquet(path, first_key, done)
    else:
        raise ValueError(f"unknown format {fmt!r}")


def infer_format(paths: list[str]) -> str:
    files = [p for p in paths if os.path.isfile(p)]
    dirs = [p for p in paths if os.path.isdir(p)]
    for d in dirs:
        for _, _, names in os.walk(d):
            files.extend(names)
            if len(files) > 64:
                break
    exts = {os.path.splitext(f)[1].lower() for f in files}
    if ".tar" in exts:
        return "webdataset"
    if ".parquet" in exts:
        return "parquet"
    if exts & set(IMAGE_EXTS) or dirs:
        return "imagefolder"
    raise ValueError(f"cannot infer the format of {paths!r}: set PipelineConfig.format")


_SHARD_EXT = {"webdataset": ".tar", "parquet": ".parquet"}


def _expand(source: str | tuple[str, ...]) -> list[str]:
    items = [source] if isinstance(source, str) else list(source)
    out: list[str] = []
    for item in items:
        if glob.has_magic(item):
            matched = sorted(glob.glob(item, recursive=True))
            if not matched:
                raise ValueError(f"PipelineConfig.source: glob {item!r} matches nothing")
            out.extend(matched)
        elif os.path.exists(item):
            out.append(item)
        else:
            raise ValueError(f"PipelineConfig.source: path {item!r} does not exist")
    return out


def _files_with(paths: list[str], ext: str) -> Iterator[str]:
    for p in paths:
        if os.path.isdir(p):
            for root, _, names in os.walk(p):
                yield from (os.path.join(root, n) for n in names if n.endswith(ext))
        elif p.endswith(ext):
            yield p


def _list_imagefolder(paths: list[str]) -> Listing:
    """Class sub-folders become labels, by sorted class name; one shard per image."""
    if len(paths) != 1 or not os.path.isdir(paths[0]):
        raise ValueError(f"an image folder source is one directory, got {paths!r}")
    root = paths[0]
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(f"image folder {root!r} has no class sub-folders")
    files: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        for dirpath, dirnames, names in os.walk(os.path.join(root, name)):
            dirnames.sort()
            files.extend(
                (os.path.join(dirpath, n), label)
                for n in sorted(names)
                if n.lower().endswith(IMAGE_EXTS)
            )
    if not files:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTS)}) found under {root!r}")
    shards = tuple(Shard(p, key, 1, label) for key, (p, label) in enumerate(files))
    return Listing("imagefolder", shards, tuple(classes))


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


def _count_tar_samples(path: str) -> int:
    try:
        groups, cut = _tar_index(path)
    except (tarfile.TarError, OSError):
        return 1  # the reader yields one unreadable_shard sample for it
    return len(groups) + (cut is not None)


def _read_tar(path: str, first_key: int, done: np.ndarray | None) -> Iterator[RawSample]:
    try:
        groups, cut = _tar_index(path)
    except (tarfile.TarError, OSError) as e:
        yield RawSample(first_key, -1, None, path, _os_error(e), "unreadable_shard")
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
                yield RawSample(key, -1, None, where, _os_error(e), reason)
                continue
            try:
                label = int(text)
            except ValueError:
                yield RawSample(key, -1, None, where, f".cls is {text[:40]!r}", "bad_label")
                continue
            yield RawSample(key, label, data, where)
    if cut is not None:
        yield RawSample(first_key + len(groups), -1, None, f"{path}:<end>", cut, "truncated_shard")


def _count_parquet_rows(path: str) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # pyarrow raises several types for a bad footer
        return 1  # the reader yields one unreadable_shard sample for it


def _read_parquet(path: str, first_key: int, done: np.ndarray | None) -> Iterator[RawSample]:
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


def _os_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"
