"""Samples inside WebDataset tar shards, counted and read (Parquet: `raypipe.formats.parquet`).

Bad data never raises here: a sample that cannot be read is yielded with a ``reason``
(one of ``raypipe.skips.records.REASONS``). A shard that cannot be opened holds one such sample;
a tar that ends early holds its readable samples plus one for the lost tail, so the
count and the reader always agree on the number of keys.
"""

from __future__ import annotations

import functools
import io
import json
import os
import tarfile
from collections.abc import Iterator

import numpy as np

from raypipe.formats.pieces import listing_read
from raypipe.formats.sample import RawSample, os_error
from raypipe.formats.storage import Storage

WDS_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # stored as they are by `raypipe convert`
READ_IMAGE_EXTS = (*WDS_IMAGE_EXTS, "bmp", "gif", "tif", "tiff")  # image members read
DEFAULT_IMAGE = "image"  # `Reader.image_column`'s default: the member is found by type
LABEL_MEMBERS = ("cls", "json", "txt")  # where a sample's label is looked for, in order
INDEXES_KEPT = 16  # tar indexes a process keeps (`_tar_index`)


def _wds_groups(members: list[tarfile.TarInfo]) -> list[tuple[str, dict[str, tarfile.TarInfo]]]:
    """Group tar members into samples, in first-seen order, by webdataset's rule: a
    member's key is its path up to the first dot of its base name, the rest its extension;
    a key met again with an extension its sample already has starts another sample (a tar
    that repeats a key holds a sample for each). Every group is a sample, one without an
    image too: the reader skips it as missing_column, counted, never dropped unseen."""
    groups: list[tuple[str, dict[str, tarfile.TarInfo]]] = []
    latest: dict[str, int] = {}  # key -> its newest group
    for m in members:
        if not m.isfile():
            continue
        base = os.path.basename(m.name)
        if base.startswith(".") or "." not in base:  # a hidden file (macOS's ._000.jpg)
            continue  # is no sample of webdataset's either: its key needs a name before a dot
        stem, ext = base.split(".", 1)
        prefix, ext = os.path.join(os.path.dirname(m.name), stem), ext.lower()
        i = latest.get(prefix)
        if i is None or ext in groups[i][1]:
            latest[prefix] = i = len(groups)
            groups.append((prefix, {}))
        groups[i][1][ext] = m
    return groups


def _image_or_why(parts: dict[str, tarfile.TarInfo], named: str) -> tuple[str | None, str | None]:
    """``(the sample's image member, None)``, or ``(None, why it has none)``: the member
    ``named`` (``image_column``; never another image when the sample lacks it), else, with
    `DEFAULT_IMAGE` or no name, the one whose extension is an image type's alone (``jpg``),
    else the one whose extension ends in one (``left.png``). Two candidates, none of them
    plain (``rgb.jpg`` and ``mask.png``): none (tar order would pick the mask)."""
    if named in parts:
        return named, None
    found = [] if named not in ("", DEFAULT_IMAGE) else _images(parts)
    plain = [e for e in found if e in READ_IMAGE_EXTS]
    if len(plain) == 1 or len(found) == 1:
        return (plain or found)[0], None
    if found:
        names = ", ".join(f".{e}" for e in found)
        return None, f"image members {names}, none plain: set image_column to the one to read"
    want = f".{named}" if named not in ("", DEFAULT_IMAGE) else "image (." + ", .".join(READ_IMAGE_EXTS) + ")"  # fmt: skip
    return None, f"no {want} member; it has " + ", ".join(f".{e}" for e in parts)


def _images(parts: dict[str, tarfile.TarInfo]) -> list[str]:
    """The members whose extension's last part names an image type."""
    return [e for e in parts if e.rsplit(".", 1)[-1] in READ_IMAGE_EXTS]


def _tar_index(storage: Storage, path: str):
    """The samples of a tar, and why it ends early (None when it ends properly).

    Raises ``tarfile.TarError`` / ``OSError`` when not even one member can be listed.
    A tar that stops mid-member, or lacks the two zero blocks that end an archive,
    is truncated: the samples before the cut are kept. Only headers are read, once per
    process for a file of the same size and time (a shard's pieces are tasks of their own:
    `raypipe.plan.rankplan.RankPlan.task_bounds`)."""
    return _indexed(storage, path, storage.stat(path))


@functools.lru_cache(maxsize=INDEXES_KEPT)
def _indexed(storage: Storage, path: str, identity: tuple):
    members: list[tarfile.TarInfo] = []
    with storage.open(path) as f, tarfile.open(fileobj=f, mode="r:") as tar:
        try:
            while (member := tar.next()) is not None:
                members.append(member)
            cut = None
            f.seek(tar.offset)  # where the listing stopped: in the buffer the tar just read
            end = f.read(2 * tarfile.BLOCKSIZE)
            if len(end) < 2 * tarfile.BLOCKSIZE:
                cut = "no end-of-archive marker"
            elif any(end[: tarfile.BLOCKSIZE]):  # not the zero blocks that end an archive:
                # Python's tar ends its listing quietly at a header it cannot read
                cut = f"a member header it cannot read at byte {tar.offset}"
        except tarfile.ReadError as e:
            cut = str(e)
    if cut is not None:
        cut = f"tar ends early after {len(members)} members ({cut})"
    return _wds_groups(members), cut


def count_tar_samples(storage: Storage, path: str) -> int:
    try:
        groups, cut = listing_read(storage, path, lambda: _tar_index(storage, path))
    except (tarfile.TarError, OSError):
        return 1  # the reader yields one unreadable_shard sample for it
    return len(groups) + (cut is not None)


def read_tar(storage: Storage, path: str, first_key: int, done: np.ndarray | None, *,
             label_member: str | None = None, label_key: str = "label",
             extras: bool = False, image_member: str = "") -> Iterator[RawSample]:  # fmt: skip
    """The samples of a WebDataset tar; the label from ``label_member`` (``.cls``, ``.txt``
    holding an integer, or key ``label_key`` of a ``.json``), or the first of those present.
    ``extras``: each sample also carries its other members' bytes, by extension."""
    try:
        groups, cut = _tar_index(storage, path)
    except (tarfile.TarError, OSError) as e:
        yield RawSample(first_key, -1, None, path, os_error(e), "unreadable_shard")
        return
    wanted = (label_member,) if label_member else LABEL_MEMBERS
    with storage.open(path) as f, tarfile.open(fileobj=f, mode="r:") as tar:
        for i, (prefix, parts) in enumerate(groups):
            if done is not None and done[i]:
                continue
            key, where = first_key + i, f"{path}:{prefix}"
            image_ext, why = _image_or_why(parts, image_member)
            if why is not None:
                yield RawSample(key, -1, None, where, why, "missing_column")
                continue
            member = next((m for m in wanted if m in parts), None)
            try:
                data = tar.extractfile(parts[image_ext]).read()
                if member is None:
                    looked = ", ".join(f".{m}" for m in wanted)
                    yield RawSample(key, -1, None, where, f"no {looked} member", "missing_label")
                    continue
                text = tar.extractfile(parts[member]).read().decode(errors="replace").strip()
            except (tarfile.TarError, OSError) as e:
                reason = "truncated_shard" if cut is not None else "unreadable"
                yield RawSample(key, -1, None, where, os_error(e), reason)
                continue
            label, reason, detail = _label_of(text, member, label_key)
            more = None
            if extras and reason is None:
                try:
                    more = {e: tar.extractfile(m).read() for e, m in parts.items()
                            if e not in (image_ext, member)}  # fmt: skip
                except (tarfile.TarError, OSError) as e:
                    yield RawSample(key, -1, None, where, os_error(e), "unreadable")
                    continue
            yield RawSample(
                key, label, data if reason is None else None, where, detail, reason, more
            )
    if cut is not None:
        yield RawSample(first_key + len(groups), -1, None, f"{path}:<end>", cut, "truncated_shard")


def _label_of(text: str, member: str, label_key: str) -> tuple[int, str | None, str | None]:
    """``(label, None, None)`` from a member's text, or ``(-1, reason, detail)``."""
    value: object = text
    if member.endswith("json"):
        try:
            doc = json.loads(text)
        except ValueError:
            return -1, "bad_label", f".{member} is not JSON: {text[:40]!r}"
        if not isinstance(doc, dict) or label_key not in doc:
            return -1, "missing_label", f".{member} has no key {label_key!r} (label_key)"
        value = doc[label_key]
    if isinstance(value, int) and not isinstance(value, bool):
        return value, None, None
    try:
        return int(str(value).strip()), None, None
    except ValueError:
        return -1, "bad_label", f".{member} label is {str(value)[:40]!r}, not an integer"


def labels(reader, paths: list[str]) -> tuple[tuple[str, ...], str]:
    """No class names (labels are integers in the members) and where they are read from."""
    member = reader.label_member
    text = f".{member} member" if member else "the first of .cls, .json, .txt members"
    text += f" (key {reader.label_key!r} of .json)" if member in (None, "json") else ""
    return (), text


def count(reader, path: str) -> int:
    """`count_tar_samples` with ``reader``'s storage (a `raypipe.formats.Reader`)."""
    return count_tar_samples(reader.storage, path)


def read(reader, path: str, first_key: int, label: int,
         done: np.ndarray | None = None) -> Iterator[RawSample]:  # fmt: skip
    """`read_tar` with ``reader``'s settings (`raypipe.formats.fields.read_tar_fields` for
    samples with no image); ``label`` is unused (labels are members)."""
    if reader.image_column is None:
        from raypipe.formats.fields import read_tar_fields

        return read_tar_fields(reader.storage, path, first_key, done,
                               label_member=reader.label_member, label_key=reader.label_key)  # fmt: skip
    return read_tar(reader.storage, path, first_key, done, label_member=reader.label_member,
                    label_key=reader.label_key, extras=reader.extras,
                    image_member=reader.image_column)  # fmt: skip


def write(path: str, kept: list) -> None:
    """A tar of ``kept`` ``(sample, image bytes, extension)``: image, ``.cls``, ``.txt``."""
    with open(path, "wb") as f, tarfile.open(fileobj=f, mode="w") as tar:
        for sample, data, ext in kept:
            stem = f"{sample.key:010d}"
            for member, payload in (
                (f"{stem}.{ext}", data),
                (f"{stem}.cls", str(sample.label).encode()),
                (f"{stem}.txt", sample.name.encode()),
            ):
                info = tarfile.TarInfo(member)
                info.size, info.mode = len(payload), 0o644
                tar.addfile(info, io.BytesIO(payload))
        tar.close()
        f.flush()
        os.fsync(f.fileno())
