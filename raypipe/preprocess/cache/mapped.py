"""The raw cache entries this process keeps memory-mapped (`PROCESS`), shared by all its
`raypipe.preprocess.cache.disk.DiskStore` objects: a worker serving several runs or ranks
maps each entry once, and never holds more mappings than `MAPPED` between them.

Each entry is one mapping and one open file (Python's `mmap` keeps a duplicate of its
descriptor), and Linux allows a process ``vm.max_map_count`` mappings (65,530 by default)
and its ``RLIMIT_NOFILE`` open files (Ray raises a worker's to 65,536 where the hard limit
allows): `MAPPED` is half the mappings, the other half left to the process's libraries,
allocators and Ray's store, and at most the open files less 1,024 left to its sockets,
logs and shard files. A hit on a mapped entry costs about a microsecond; one past `MAPPED` is
opened, mapped and checked again (`benchmarks/cache_parts.py`'s ``first_read``).

A memory cache removed (its run released it) or made anew in its place is another cache:
`Mappings.drop_cleared` closes what this process maps of it, so that its pages go back to
the node. A pooled worker outlives its runs, so it calls that at each task
(`raypipe.preprocess.tasks`); an actor's table goes with its process.
"""

from __future__ import annotations

import collections
import os
import threading

__all__ = ["MAPPED", "Mappings", "PROCESS", "identity"]
assert __all__ == sorted(__all__)


SPARE_FILES = 1024  # open files left to the worker's own: sockets, logs, shard files


def _limit() -> int:
    """Half of what the process may map, and at most the files it may hold open less
    `SPARE_FILES` (half, for a low limit): each mapping keeps its file's descriptor
    (Python's `mmap` duplicates it)."""
    import resource

    try:
        with open("/proc/sys/vm/max_map_count") as f:
            maps = int(f.read())
    except (OSError, ValueError):
        maps = 16384
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if files == resource.RLIM_INFINITY:
        files = maps
    return max(64, min(maps // 2, max(files // 2, files - SPARE_FILES)))


MAPPED = _limit()


def identity(path: str) -> tuple[int, int] | None:
    """A directory's (device, inode): a cache removed and made again is another one."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class Mappings:
    """Mapped entries by (their directory's `identity`, id), the newest `MAPPED` kept."""

    def __init__(self):
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._roots: dict[tuple[int, int] | None, str] = {}  # identity -> the path it had
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, root: tuple[int, int] | None, i: str):
        with self._lock:
            entry = self._lru.get((root, i))
            if entry is not None:
                self._lru.move_to_end((root, i))
            return entry

    def keep(self, path: str, root: tuple[int, int] | None, i: str, entry) -> None:
        with self._lock:
            self._roots[root] = path
            self._lru[(root, i)] = entry
            self._lru.move_to_end((root, i))
            while len(self._lru) > MAPPED:
                self._lru.popitem(last=False)

    def drop_cleared(self) -> None:
        """Close the mappings of every cache directory that is gone or made anew."""
        with self._lock:
            gone = {r for r, path in self._roots.items() if identity(path) != r}
            if not gone:
                return
            for key in [k for k in self._lru if k[0] in gone]:
                del self._lru[key]
            for r in gone:
                del self._roots[r]


PROCESS = Mappings()
