"""`DiskStore`: a node's cache entries as files under ``cache_dir``, shared by every
process of the node and kept for later runs.

```
 cache_dir/<settings digest>/usage                 bytes held (under an flock)
 cache_dir/<settings digest>/<ab>/<sha1 of id>     MAGIC, header length, JSON header
                                                   (ident, where, seconds, shape or reason,
                                                   CRC32), then the raw pixels
```

A file written by another run with the same settings is a hit as long as its source
file's size and modification time are unchanged; otherwise it is a miss and is replaced.
An entry that is truncated, unreadable or fails its CRC is decoded again, never served.
Files are written to a temporary name and renamed, so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import struct

import numpy as np

from raypipe.preprocess.cache.store import Entry, Tally

__all__ = ["DiskStore"]
assert __all__ == sorted(__all__)

MAGIC = b"RPCACHE1"


class DiskStore:
    """Entries of one settings digest under ``directory``, within ``budget`` bytes (the
    files' sizes), first-come as `raypipe.preprocess.cache.store.MemoryStore`."""

    def __init__(self, directory: str, budget: int):
        self.root, self.budget = directory, budget
        os.makedirs(self.root, exist_ok=True)
        self.tally = Tally()

    def path(self, i: str) -> str:
        h = hashlib.sha1(i.encode()).hexdigest()
        return os.path.join(self.root, h[:2], h)

    def get_many(self, ids: list[str], idents: list[tuple[int, int]]) -> list[Entry | None]:
        out: list[Entry | None] = []
        for i, ident in zip(ids, idents, strict=True):
            try:
                with open(self.path(i), "rb") as f:
                    data = f.read()
            except OSError:
                out.append(None)
                continue
            entry = _parse(data)
            if entry is not None and tuple(entry.ident) != tuple(ident):
                entry = None  # the source changed: a miss, replaced on the next put
            elif entry is None or not entry.sound():
                self.tally.corrupt += 1
                entry = None
            out.append(entry)
        return out

    def put_many(self, items: list[tuple[str, Entry]]) -> None:
        if not items:
            return
        with self._usage() as usage:
            for i, entry in items:
                path = self.path(i)
                with contextlib.suppress(OSError):
                    usage[0] -= os.path.getsize(path)
                    os.unlink(path)
                data = _serialize(entry)
                if usage[0] + len(data) > self.budget:
                    self.tally.refused += 1
                    continue
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
                usage[0] += len(data)

    def held(self) -> int:
        """Bytes the directory's entries hold (the usage file)."""
        try:
            with open(os.path.join(self.root, "usage")) as f:
                return int(f.read() or 0)
        except (OSError, ValueError):
            return 0

    @contextlib.contextmanager
    def _usage(self):
        """``[bytes held]`` under an exclusive lock on the usage file; written back after."""
        fd = os.open(os.path.join(self.root, "usage"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 64, 0)
            usage = [max(0, int(raw or 0))] if raw.strip().isdigit() else [0]
            yield usage
            text = str(max(0, usage[0])).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, text, 0)
        finally:
            os.close(fd)  # releases the lock


def _serialize(entry: Entry) -> bytes:
    head = {"ident": list(entry.ident), "where": entry.where, "seconds": entry.seconds,
            "reason": entry.reason, "detail": entry.detail, "crc": entry.crc,
            "shape": None if entry.pixels is None else list(entry.pixels.shape)}  # fmt: skip
    text = json.dumps(head).encode()
    pixels = b"" if entry.pixels is None else entry.pixels.tobytes()
    return MAGIC + struct.pack("<I", len(text)) + text + pixels


def _parse(data: bytes) -> Entry | None:
    """The entry in ``data``; None when it is not a whole, well-formed entry."""
    try:
        if data[:8] != MAGIC:
            return None
        (n,) = struct.unpack("<I", data[8:12])
        head = json.loads(data[12 : 12 + n])
        body = memoryview(data)[12 + n :]
        pixels = None
        if head["shape"] is not None:
            shape = tuple(int(s) for s in head["shape"])
            if len(shape) != 3 or len(body) != int(np.prod(shape)):
                return None
            pixels = np.frombuffer(body, dtype=np.uint8).reshape(shape)
        elif len(body):
            return None
        return Entry((int(head["ident"][0]), int(head["ident"][1])), str(head["where"]),
                     float(head["seconds"]), pixels, head["reason"], head["detail"],
                     int(head["crc"]), None if pixels is None else pixels.shape)  # fmt: skip
    except (ValueError, KeyError, TypeError, IndexError, struct.error):
        return None
