"""Image folders: one image per file, its class the name of its sub-folder.

```
 root/
   cat/0001.jpg    key 0, label 0     (classes sorted by name, files by path)
   dog/0002.png    key 1, label 1
```
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from raypipe.formats.sample import RawSample, os_error
from raypipe.formats.storage import Storage

__all__ = ["IMAGE_EXTS", "list_images", "read"]
assert __all__ == sorted(__all__)

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


def list_images(paths: list[str], storage: Storage) -> tuple[list[tuple[str, int]], list[str]]:
    """``([(file, label), ...], classes)`` of one image folder, in key order."""
    if len(paths) != 1 or storage.kind(paths[0]) != "dir":
        shown = ", ".join(repr(p) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
        raise ValueError(f"an image folder source is one directory (the folder of the class "
                         f"folders), got {len(paths)} path(s): {shown}")  # fmt: skip
    root = paths[0]
    classes = storage.dirs(root)
    if not classes:
        loose = [f for f in storage.walk(root) if f.lower().endswith(IMAGE_EXTS)]
        if not loose:
            raise ValueError(f"image folder {root!r} has no class sub-folders and no images")
        raise ValueError(f"image folder {root!r} holds {len(loose)} images but no class "
                         f"sub-folders: move them into {root}/<class>/ (e.g. {root}/cat/)")  # fmt: skip
    files: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        files.extend(
            (f, label)
            for f in storage.walk(storage.join(root, name))
            if f.lower().endswith(IMAGE_EXTS)
        )
    if not files:
        raise ValueError(f"no images ({', '.join(IMAGE_EXTS)}) found under {root!r}")
    _refuse_split_folders(root, classes, storage)
    return files, classes


def _refuse_split_folders(root: str, classes: list[str], storage: Storage) -> None:
    """Refuse a root one level above its image folders (``data/`` holding ``train/`` and
    ``val/``, ``train2017/`` and ``val2017/``, one of them at least with class folders): it
    would train on every split as one class each."""
    if len(classes) < 2 or not all(_SPLIT.match(name.lower()) for name in classes):
        return
    nested = [name for name in classes if storage.dirs(storage.join(root, name))]
    if nested:
        pick = next((n for n in nested if n.lower().startswith("train")), nested[0])
        inner = storage.dirs(storage.join(root, pick))
        raise ValueError(
            f"image folder {root!r} reads its splits ({', '.join(classes)}) as classes: "
            f"{pick}/ holds class folders of its own ({pick}/{inner[0]}/, ...); point "
            f"source at one split, e.g. {storage.join(root, pick)!r}"
        )


_SPLIT = re.compile(r"(train|training|val|valid|validation|test|testing|dev|eval)[-_]?\d*$")


def read(reader, path: str, first_key: int, label: int,
         done: np.ndarray | None = None) -> Iterator[RawSample]:  # fmt: skip
    """The one sample of an image file (``reader``: a `raypipe.formats.Reader`)."""
    try:
        data = reader.storage.read_bytes(path)
    except OSError as e:
        yield RawSample(first_key, label, None, path, os_error(e), "unreadable")
        return
    yield RawSample(first_key, label, data, path)
