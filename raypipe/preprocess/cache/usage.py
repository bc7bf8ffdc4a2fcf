"""`Usage`: the bytes and entries a cache directory holds, in its ``usage`` file, which every
process of the node counts into under an ``flock``
(`raypipe.preprocess.cache.disk.DiskStore`'s budget).

```
 <root>/usage    "<bytes> <entries>\n", each right-aligned in 20 columns
```

A record is rewritten in place: at a fixed width it covers the whole of the one before
(and of any shorter one an older version wrote), so no truncation is needed, which costs a
journal write on ext4. A file of one number is bytes, its entries unknown (0).
"""

from __future__ import annotations

import contextlib
import fcntl
import os

__all__ = ["Usage"]
assert __all__ == sorted(__all__)


class Usage:
    """One process's handle on a directory's usage file: opened at the first count and kept
    open until `close` (a disk cache counts every entry it writes: one open a task)."""

    def __init__(self, root: str):
        self.path = os.path.join(root, "usage")
        self._file = None  # unbuffered; closed with this object if not before

    @contextlib.contextmanager
    def counting(self):
        """``[bytes, entries]`` held, under an exclusive lock; written back after."""
        if self._file is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self._file = os.fdopen(fd, "r+b", buffering=0)
        fd = self._file.fileno()
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            usage = list(_counts(os.pread(fd, 64, 0)))
            yield usage
            os.pwrite(fd, _record(usage), 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def held(self) -> tuple[int, int]:
        """Bytes and entries as last counted (0, 0 without a file)."""
        try:
            with open(self.path, "rb") as f:
                return _counts(f.read())
        except OSError:
            return 0, 0

    def close(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            f.close()


def _record(usage: list[int]) -> bytes:
    return f"{max(0, usage[0]):>20} {max(0, usage[1]):>20}\n".encode()


def _counts(raw: bytes) -> tuple[int, int]:
    parts = raw.split()
    if not parts or not all(p.isdigit() for p in parts[:2]):
        return 0, 0
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
