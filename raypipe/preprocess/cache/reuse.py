"""`SampleCache`: a preprocessing actor's side of the decoded cache.

```
 shard rows of a task, in chunks of about ``CHUNK`` samples
   ▼ stat each source file: (size, mtime) is part of every entry's identity
   ▼ one lookup per chunk in this node's cache files (`DiskStore`: shared memory or disk)
   ▼ image folders: rows whose samples are all cached, without reading the file (the row
     holds the label); other rows, and every row of a shard format (whose reader gives
     each sample its label and fields): read as usual, cached samples not decoded
 image(raw) ── a hit: the cached pixels (or JPEG), or the remembered reason it is bad
           └─ a miss: read + decode to the capped size (`decode_capped`), kept (first-come
              within the budget) with what it cost; a bad sample is kept as bad
```

Only what decoding found is remembered as bad (`DECODE_REASONS`; an entry an older version
kept with a reader's reason is a miss, and is replaced); what a reader reports (a read
error, a missing label) is its to say again, and wins over what was kept of that sample.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from raypipe.formats.pieces import split_piece
from raypipe.formats.sample import RawSample
from raypipe.plan.shards import pending_keys
from raypipe.preprocess.augment import Plan
from raypipe.preprocess.cache import node
from raypipe.preprocess.cache.capped import Stored, decode_capped, encode_stored, region_of
from raypipe.preprocess.cache.disk import DiskStore
from raypipe.preprocess.cache.store import Entry, Tally
from raypipe.skips.records import (
    DECODE_REASONS,
    BadSample,
    detail_of,
    out_of_memory,
    reason_of,
)

__all__ = ["SampleCache"]
assert __all__ == sorted(__all__)

log = logging.getLogger(__name__)

CHUNK = 32  # samples looked up at once
WHERE_WAIT_S = 2.0  # how long a worker waits for its node's actor's answer

Row = tuple[str, int, int, int, "np.ndarray | None"]  # path, first_key, samples, label, done


class SampleCache:
    """The cache as one preprocessing actor (or task) uses it; made once per actor, its
    node's store found on first use.

    ``whole_rows``: a row whose samples are all cached is served without reading its file,
    which is right only where the row holds everything else a sample has (image folders:
    one sample a file, labelled by its directory); a shard format's reader gives each
    sample its own label and fields, so its files are read."""

    def __init__(self, config, storage, *, whole_rows: bool = False):
        self.config, self.storage, self.whole_rows = config, storage, whole_rows
        self.store, self.counter = None, None
        self.tally = Tally()
        self._found: dict[int, Entry] = {}  # key -> its entry, for the raw yielded next
        self._missed: dict[int, tuple[str, tuple[int, int] | None, float]] = {}
        self._undated = False  # a file without a modification time was met (logged once)
        self._warned = False  # a write failed (logged once)

    def _start(self) -> None:
        """A disk cache: the node's files at once. A memory cache: the directory and budget
        of this node's `NodeCache` (up already: `node.ensure` waited for it); a node with
        none keeps nothing. Called on every task while there is no store (none yet, or given
        up on)."""
        self._find()
        if self.config.cache == "disk":  # the same directory and budget on every node
            with contextlib.suppress(OSError):  # a directory this node cannot make: none
                self.store = DiskStore(node.cache_root(self.config), node.budget(self.config))

    def _find(self) -> None:
        """This node's `NodeCache`, and for a memory cache its store (a node that joined
        mid-run, or whose actor died, gets one at the run's next `node.ensure`: looked for
        again on every call of `raws` until then)."""
        import ray

        self.counter = node.lookup(self.config)
        if self.counter is None or self.config.cache != "memory":
            return
        try:
            root, limit = ray.get(self.counter.where.remote(), timeout=WHERE_WAIT_S)
        except Exception:  # gone, or not answering: decode, and look again next call
            self.counter = None
            return
        if os.path.isdir(root):  # a memory cache cleared meanwhile: none
            mapped = self.config.cache_encoding == "raw"
            self.store = DiskStore(root, limit, mapped=mapped)

    def raws(self, rows: Iterable[Row], read: Callable[..., Iterator[RawSample]]):
        """The rows' samples in order, as ``read(path, first_key, samples, label, done)``
        yields them, with the cached ones found (whole rows of them not read)."""
        if self.store is None:
            self._start()
        chunk: list[Row] = []
        samples = 0
        for row in rows:
            chunk.append(row)
            samples += row[2]
            if samples >= CHUNK:
                yield from self._chunk(chunk, read)
                chunk, samples = [], 0
        if chunk:
            yield from self._chunk(chunk, read)

    def _chunk(self, rows: list[Row], read) -> Iterator[RawSample]:
        idents = [self._ident(r[0]) for r in rows]
        todo = [pending_keys(first, n, done) for _, first, n, _, done in rows]
        found: dict[int, Entry] = {}
        asks = [(f"{r[0]}\0{k - r[1]}", ident, k)
                for r, ident, keys in zip(rows, idents, todo, strict=True)
                if ident is not None for k in keys]  # fmt: skip
        if asks and self.store is not None:
            t0 = time.perf_counter()
            try:
                entries = self.store.get_many([a[0] for a in asks], [a[1] for a in asks])
            except Exception:  # its files are gone (a cleared cache): decode, and look
                self._drop_store()  # again next task (for the one `node.ensure` starts)
                entries = [None] * len(asks)
            self.tally.saved_s -= time.perf_counter() - t0
            found = {a[2]: e for a, e in zip(asks, entries, strict=True)
                     if e is not None and (e.shape is not None or e.reason in DECODE_REASONS)}  # fmt: skip
        for (path, first, n, label, done), ident, keys in zip(rows, idents, todo, strict=True):
            if self.whole_rows and keys and all(k in found for k in keys):  # nothing to read
                for k in keys:
                    self._found[k] = found[k]
                    yield RawSample(k, label, None, found[k].where)
                continue
            it, t0 = read(path, first, n, label, done), time.perf_counter()
            for raw in it:
                if raw.key in found:
                    self._found[raw.key] = found[raw.key]
                elif ident is not None:
                    self._missed[raw.key] = (f"{path}\0{raw.key - first}", ident,
                                             time.perf_counter() - t0)  # fmt: skip
                yield raw
                t0 = time.perf_counter()

    def _ident(self, path: str) -> tuple[int, int] | None:
        """The source file's (size, mtime in ns); None: its samples are not cached."""
        try:
            size, mtime = self.storage.stat(split_piece(path)[0])  # a piece: its file's
        except (OSError, ValueError):
            return None  # read will say what is wrong; nothing is cached for it
        if mtime is not None:
            return size, mtime
        if self.config.cache == "disk":  # a later run could not tell the file rewritten
            if not self._undated:
                log.warning("%s has no modification time: a disk cache could not tell it "
                            "changed, so its samples are not cached (cache='memory' can)", path)  # fmt: skip
            self._undated = True
            return None
        return size, 0  # a memory cache dies with its runs

    def image(self, raw: RawSample) -> np.ndarray | Stored:
        """The capped H×W×3 image of ``raw``, or its JPEG (``cache_encoding="jpeg"``:
        `Stored`, the crop decodes what it needs); raises `BadSample` for a bad one (cached
        or not). What the reader reports about ``raw`` wins over what was kept of it."""
        entry = self._found.pop(raw.key, None)
        if entry is None or raw.reason is not None:
            return self._decoded(raw)
        self.tally.hits += 1
        self.tally.saved_s += entry.seconds
        if entry.shape is None:
            self.tally.bad_hits += 1
            raise BadSample(entry.reason, entry.detail)
        if entry.pixels is None:
            return Stored(entry.encoded, entry.shape[0], entry.shape[1], hit=True)
        return entry.pixels

    def region(self, stored: Stored, p: Plan) -> tuple[np.ndarray, Plan]:
        """What of a JPEG from `image` a crop with plan ``p`` reads, and ``p`` in it
        (`region_of`). A hit's decode counts against what it saved, as a raw entry's
        lookup does."""
        return self._decode_timed(stored, region_of, stored, p)

    def whole(self, image: np.ndarray | Stored) -> np.ndarray:
        """The whole capped image from `image` (a user transform gets all of it): the pixels
        themselves, or what a JPEG decodes to (a hit's decode counted as in `region`)."""
        if not isinstance(image, Stored):
            return image
        return self._decode_timed(image, Stored.pixels, image)

    def _decode_timed(self, stored: Stored, decode, *args):
        t0 = time.perf_counter()
        out = decode(*args)
        if stored.hit:
            self.tally.saved_s -= time.perf_counter() - t0
        return out

    def _decoded(self, raw: RawSample) -> np.ndarray | Stored:
        """A miss: decoded to the cap (and re-encoded, for ``jpeg``), kept if the store
        takes it; a bad sample is kept as bad."""
        self.tally.misses += 1
        i, ident, read_s = self._missed.pop(raw.key, (None, None, 0.0))
        t0 = time.perf_counter()
        try:
            if raw.reason is not None:
                raise BadSample(raw.reason, raw.error or raw.reason)
            if not raw.data:
                raise BadSample("empty_file", "zero bytes")
            pixels = decode_capped(raw.data, self.config.cache_max_side,
                                   self.config.max_image_pixels)  # fmt: skip
        except Exception as e:
            reason = reason_of(e, raw.data)
            # only decoding's verdict on the data is kept: a reader's reasons are others, and
            # it says them again; a worker out of memory says nothing about the sample
            if (i is not None and reason in DECODE_REASONS and not out_of_memory(e)
                    and self._keeping()):  # fmt: skip
                seconds = read_s + time.perf_counter() - t0
                self._keep(
                    i, Entry(ident, raw.where, seconds, None, reason, detail_of(e, raw.data))
                )
            raise
        served = pixels
        if self.config.cache_encoding == "jpeg":  # crops come from what the cache serves
            served = encode_stored(pixels)
        if i is not None and self._keeping():  # the entry (its CRC) only if it is written
            seconds = read_s + time.perf_counter() - t0
            if isinstance(served, Stored):
                entry = Entry.stored(ident, raw.where, seconds, served.data, pixels.shape)
            else:
                entry = Entry.image(ident, raw.where, seconds, pixels)
            self._keep(i, entry)
        return served

    def _keeping(self) -> bool:
        """Whether a new entry would be written: not without a store, nor once it is full
        (then it counts as refused)."""
        if self.store is None:
            return False
        self.tally.refused += self.store.full
        return not self.store.full

    def _keep(self, i: str, entry: Entry) -> None:
        """Write the entry now: its pixels are freed (or reused) once the crop is done, so
        a worker never holds a queue of decoded images."""
        try:
            self.store.put(i, entry)
        except Exception as e:  # a full or failing disk, or a memory cache cleared: on
            if not self._warned:  # without it until the next task looks again (`raws`)
                log.warning("the decoded cache keeps nothing more in this task: %s: %s",
                            type(e).__name__, e)  # fmt: skip
                self._warned = True
            self._drop_store()

    def _drop_store(self) -> None:
        """Give the store up: what it took of the budget given back where it still can be,
        its counts kept for `flush`."""
        store, self.store = self.store, None
        if store is not None:
            with contextlib.suppress(Exception):
                store.settle()
            self.tally.add(store.tally)

    def flush(self) -> None:
        """Settle the store's use of the budget; send the counters to the node's
        `NodeCache`."""
        store = self.store
        if store is not None:
            try:
                store.settle()
            except Exception:  # as in _keep: given up on until the next task
                self.store = None
            self.tally.add(store.tally)  # what it counts: corrupt, refused, reads
            store.tally = Tally()
        if self.counter is not None and (self.tally.hits or self.tally.misses):
            try:
                self.counter.note.remote(self.tally)
            except Exception:  # the node's actor is gone: the counts with it
                self.counter = None
        self.tally = Tally()
        self._found.clear()
        self._missed.clear()
