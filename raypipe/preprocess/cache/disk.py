"""`DiskStore`: a node's cache entries as files, shared by every process of the node:
under ``cache_dir`` (``cache="disk"``, kept for later runs) or in the node's shared memory
(``cache="memory"``, for the run).

```
 <root>/usage                 bytes and entries held (`raypipe.preprocess.cache.usage`)
 <root>/<ab>/<sha1 of id>     one entry (`raypipe.preprocess.cache.entryfile`)
```

The budget is first-come: the first samples decoded are kept until the next one would
pass it, and nothing is evicted. An epoch reads every sample once, so least-recently-used
eviction would throw out each sample just before it is read again; first-come keeps a
fixed part of the dataset cached in every epoch. Once an entry is refused, this store
sends no more (``full``): the decodes after it are not written only to be refused.

Each entry is written as soon as it is decoded (`put`), to a temporary name, then placed
and counted in one step under the usage file's lock (`_place`): a reader never sees half
of a file, the usage file counts exactly the entries in place, and two processes that
write one entry at once leave one file, counted once. A file being written is not counted
(at most one per writing process); a writer killed mid-write leaves its temporary file,
which a disk cache's `NodeCache` removes when a run starts (`drop_leftovers`).

A file written by another run with the same settings is a hit as long as its source
file's size and modification time are unchanged; otherwise it is a miss and is replaced.
An entry that is truncated, unreadable or fails its CRC is decoded again, never served.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import mmap
import os
import time

import numpy as np

from raypipe.config.validate import CACHE_BLOCK as BLOCK
from raypipe.preprocess.cache import entryfile
from raypipe.preprocess.cache import mapped as mapped_entries
from raypipe.preprocess.cache.store import Entry, Tally
from raypipe.preprocess.cache.usage import Usage

__all__ = ["BLOCK", "DiskStore", "footprint"]
assert __all__ == sorted(__all__)


HEAD_READ = 4096  # bytes of an entry that hold its header (`_same`)
LEFTOVER_S = 600.0  # a temporary file this old is a writer's that died: no write takes this


def footprint(size: int) -> int:
    """What a file of ``size`` bytes takes of the node, counted against the budget: whole
    `BLOCK`s (a small entry, a bad sample's record, takes a page, not its few bytes)."""
    return -(-size // BLOCK) * BLOCK


class DiskStore:
    """Entries of one settings digest under ``directory``, within ``budget`` bytes (the
    files' `footprint`), first-come.

    ``mapped``: raw entries stay memory-mapped in this process once read and checked, or
    written (`raypipe.preprocess.cache.mapped`: the newest `MAPPED` of all its stores), so a
    later epoch's hit neither reads nor checks its file again (the node's processes share
    those pages). For the memory cache only, whose files no one but its own processes
    write, and only by renaming a whole new file into place: a file cut short under a
    mapping would fault.
    """

    def __init__(self, directory: str, budget: int, *, mapped: bool = False):
        self.root, self.budget = directory, budget
        os.makedirs(self.root, exist_ok=True)
        self.mapped = mapped
        self._root_id = mapped_entries.identity(self.root)  # made anew: another cache
        self.tally = Tally()
        self.full = False
        self._usage = Usage(self.root)
        self._dirs: set[str] = set()  # the <ab> directories known to exist

    def path(self, i: str) -> str:
        h = hashlib.sha1(i.encode("utf-8", "surrogateescape")).hexdigest()  # any file name
        return os.path.join(self.root, h[:2], h)

    def get_many(self, ids: list[str], idents: list[tuple[int, int]]) -> list[Entry | None]:
        out: list[Entry | None] = []
        for i, ident in zip(ids, idents, strict=True):
            entry = mapped_entries.PROCESS.get(self._root_id, i) if self.mapped else None
            if entry is not None and tuple(entry.ident) == tuple(ident):
                out.append(entry)
                continue
            try:
                data = self._read(self.path(i))
            except FileNotFoundError:
                out.append(None)
                continue
            except (OSError, ValueError):  # no entry file there (a directory, zero bytes
                self.tally.corrupt += 1  # that cannot be mapped): a miss, counted
                out.append(None)
                continue
            entry = entryfile.parse(data)
            if entry is not None and tuple(entry.ident) != tuple(ident):
                entry = None  # the source changed: a miss, replaced on the next put
            elif entry is None or not entry.sound():
                self.tally.corrupt += 1
                entry = None
            else:
                self.tally.reads += 1
                self._remember(i, entry)
            out.append(entry)
        return out

    def _written(self, f, entry: Entry, offset: int) -> Entry | None:
        """``mapped``: the entry just written to ``f``, kept as a later hit would have it: a
        raw image's pixels served from the file's pages (the ones just checked into it: no
        read and no CRC again); None for what is not kept mapped (a jpeg entry)."""
        if not self.mapped or entry.encoded is not None:
            return None
        if entry.pixels is None:  # a bad sample's record: nothing to map
            return entry
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        pixels = np.frombuffer(view, dtype=np.uint8, offset=offset).reshape(entry.pixels.shape)
        return dataclasses.replace(entry, pixels=pixels)

    def _remember(self, i: str, entry: Entry) -> None:
        """``mapped``: keep a raw entry's mapping (in the process's `PROCESS` table)."""
        if self.mapped and entry.encoded is None:
            mapped_entries.PROCESS.keep(self.root, self._root_id, i, entry)

    def _read(self, path: str):
        """The file's bytes: mapped (``mapped``), else read."""
        with open(path, "rb") as f:
            if not self.mapped:
                return f.read()
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def put(self, i: str, entry: Entry) -> None:
        """Write one entry now, or refuse it (``full``) where the budget has no room.

        The entry is written to a temporary file, then placed and counted in one step
        under the usage file's lock (`_place`)."""
        path = self.path(i)
        head, body = entryfile.parts(entry)  # the body is a view, not a copy
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with self._create(tmp) as f:
                f.write(head)
                f.write(body)  # the pixels' own buffer: no copy of them first
                f.flush()
                written = self._written(f, entry, len(head))
            placed = self._place(tmp, path, entry, footprint(len(head) + len(body)))
        except BaseException:  # a full disk, a cleared cache: nothing placed, nothing counted
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if placed and written is not None:
            self._remember(i, written)

    def _place(self, tmp: str, path: str, entry: Entry, size: int) -> bool:
        """Move the written ``tmp`` (``size`` bytes of the budget) to ``path`` and count
        it, in one step under the usage file's lock; else remove it and return False.

        The same ``entry`` placed there meanwhile by another process of the node (two
        tasks that decode one sample at once: an epoch and the next one's read-ahead) is
        kept, so the node holds and counts one file; any other (its source changed,
        damaged, a record an older version kept) is replaced, its bytes given back; and
        an entry the budget has no room for is refused (``full``)."""
        with self._usage.counting() as usage:
            if os.path.isdir(path):  # not ours to remove: this sample is not kept, the rest are
                os.unlink(tmp)
                return False
            old = _size(path)
            if old is not None and self._same(path, entry):
                os.unlink(tmp)
                return False
            if usage[0] - (old or 0) + size > self.budget:
                os.unlink(tmp)
                self.tally.refused += 1
                self.full = True
                return False
            os.replace(tmp, path)
            usage[0] += size - (old or 0)
            usage[1] += old is None
        return True

    def _same(self, path: str, entry: Entry) -> bool:
        """Whether the file at ``path`` holds ``entry`` (its source, checksum and shape),
        whole and sound: its header looked at first (a few KiB, under the lock), the
        whole file only where that matches."""
        try:
            with open(path, "rb") as f:
                head = entryfile.head_of(f.read(HEAD_READ))
            if head is None or (head.get("ident"), head.get("crc"), head.get("check"),
                                head.get("shape"), head.get("reason")) != (
                    list(entry.ident), entry.crc, entry.check,
                    None if entry.shape is None else list(entry.shape), entry.reason):  # fmt: skip
                return False
            there = entryfile.parse(self._read(path))
        except (OSError, ValueError):
            return False
        return there is not None and there.sound()

    def _create(self, tmp: str):
        """The new file ``tmp``, open to write; its directory made on first use here, never
        the cache's own: once that is gone (a cleared cache), this raises and the store is
        given up (`raypipe.preprocess.cache.reuse.SampleCache`), not half made again."""
        parent = os.path.dirname(tmp)
        if parent not in self._dirs:
            with contextlib.suppress(FileExistsError):
                os.mkdir(parent)
            self._dirs.add(parent)
        return open(tmp, "w+b" if self.mapped else "wb")

    def settle(self) -> None:
        """A task's end: close the usage file until the next count; take entries again
        (``full`` is one task's: the budget may have room for a smaller one)."""
        self.full = False
        self._usage.close()

    def drop_leftovers(self, older_than_s: float = LEFTOVER_S) -> int:
        """Remove the temporary files of writers that died mid-write (older than
        ``older_than_s``; nothing counts them), then `recount`; how many there were."""
        now, removed = time.time(), 0
        for f in _files(self.root, ".tmp"):
            with contextlib.suppress(OSError):
                if now - f.stat(follow_symlinks=False).st_mtime > older_than_s:
                    os.unlink(f.path)
                    removed += 1
        self.recount()
        return removed

    def recount(self) -> bool:
        """Set the usage file to what the entry files take: an entry cut short by a crash
        (its pages not yet on disk) was counted whole, and replacing it gives back only
        what is left of it. Counted without the lock, set under it only where no process
        placed or gave back an entry meanwhile (else left to the next run); True if set."""
        with self._usage.counting() as usage:
            before = list(usage)
        held, entries = 0, 0
        for f in _files(self.root, ""):
            with contextlib.suppress(OSError):
                if not f.name.endswith(".tmp") and f.is_file(follow_symlinks=False):
                    held, entries = (
                        held + footprint(f.stat(follow_symlinks=False).st_size),
                        entries + 1,
                    )
        with self._usage.counting() as usage:
            if usage != before:
                return False
            usage[:] = [held, entries]
        self._usage.close()
        return True

    def held(self) -> tuple[int, int]:
        """Bytes and entries the directory holds (its usage file)."""
        return self._usage.held()


def _files(root: str, suffix: str):
    """The files in ``root``'s ``<ab>`` directories whose names end in ``suffix`` (none
    where a directory cannot be read)."""
    with contextlib.suppress(OSError), os.scandir(root) as subs:
        for sub in subs:
            if sub.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError), os.scandir(sub.path) as files:
                    yield from (f for f in files if f.name.endswith(suffix))


def _size(path: str) -> int | None:
    """The `footprint` of the file at ``path``; None where there is none (gone meanwhile)."""
    try:
        return footprint(os.path.getsize(path))
    except OSError:
        return None
