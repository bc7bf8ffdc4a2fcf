"""Image folders: one image per file, its class the name of its sub-folder.

```
 root/
   cat/0001.jpg    key 0, label 0     (classes sorted by name, files by path)
   dog/0002.png    key 1, label 1
```
"""

from __future__ import annotations

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
        raise ValueError(f"an image folder source is one directory, got {paths!r}")
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
    return files, classes


def read(reader, path: str, first_key: int, label: int,
         done: np.ndarray | None = None) -> Iterator[RawSample]:  # fmt: skip
    """The one sample of an image file (``reader``: a `raypipe.formats.Reader`)."""
    try:
        data = reader.storage.read_bytes(path)
    except OSError as e:
        yield RawSample(first_key, label, None, path, os_error(e), "unreadable")
        return
    yield RawSample(first_key, label, data, path)
