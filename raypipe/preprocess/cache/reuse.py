"""`SampleCache`: a preprocessing actor's side of the decoded cache.

```
 shard rows of a task, in chunks of about ``CHUNK`` samples
   ▼ stat each source file: (size, mtime) is part of every entry's identity
   ▼ one lookup per chunk on this node's cache (NodeCache actor, or the node's files)
   ▼ rows whose samples are all cached: their samples, without reading the file
     others: read as usual, cached samples among them not decoded
 image(raw) ── a hit: the cached pixels, or the remembered reason it is bad
           └─ a miss: read + decode to the capped size (`decode_capped`), kept (first-come
              within the budget) with what it cost; a bad sample is kept as bad
```

A read error (``unreadable``, ``unreadable_shard``) may pass: it is never remembered.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from raypipe.formats.sample import RawSample
from raypipe.preprocess.cache import node
from raypipe.preprocess.cache.capped import decode_capped
from raypipe.preprocess.cache.disk import DiskStore
from raypipe.preprocess.cache.store import Entry, Tally
from raypipe.skips.records import BadSample, detail_of, reason_of

__all__ = ["SampleCache"]
assert __all__ == sorted(__all__)

CHUNK = 32  # samples looked up at once
PUT_EVERY = 32  # new entries sent at once
TRANSIENT = ("unreadable", "unreadable_shard")  # read errors: never remembered as bad

Row = tuple[str, int, int, int, "np.ndarray | None"]  # path, first_key, samples, label, done


class _Remote:
    """A node's memory cache through its `NodeCache` actor. An entry's pixels are mapped
    from the object store once per actor and the mapping kept (shared memory, no copy), so
    a later epoch's hit asks the node's actor nothing."""

    def __init__(self, handle):
        self.handle, self.corrupt = handle, 0
        self.mapped: dict[str, Entry] = {}
        self.sent, self.full = None, False  # the put in flight; the cache said it is full
        self.refused = 0  # samples not sent since: the cache is full

    def get_many(self, ids, idents):
        """The entries, mapped here or fetched and mapped; one that fails its check is a
        miss (counted in ``corrupt``)."""
        import ray

        out: list[Entry | None] = [None] * len(ids)
        ask = []
        for n, (i, ident) in enumerate(zip(ids, idents, strict=True)):
            e = self.mapped.get(i)
            if e is not None and tuple(e.ident) == tuple(ident):
                out[n] = e
            else:
                self.mapped.pop(i, None)  # the source changed: let the node's cache say
                ask.append(n)
        self.corrupt = 0
        if ask:
            entries = ray.get(self.handle.get_many.remote([ids[n] for n in ask],
                                                          [idents[n] for n in ask]))  # fmt: skip
            held = [e for e in entries if e is not None and e.ref is not None]
            for e, pixels in zip(held, ray.get([e.ref for e in held]), strict=True):
                e.pixels, e.ref = pixels, None
            for n, e in zip(ask, entries, strict=True):
                if e is not None and e.sound():
                    out[n] = self.mapped[ids[n]] = e
                elif e is not None:
                    self.corrupt += 1
        return out

    def put_many(self, items) -> None:
        """Send ``items``, one put in flight at a time: their pixels cross the object store
        as its argument. Once the cache is full (first-come: nothing is evicted), only
        bad samples' records, which carry no pixels, are sent."""
        import ray

        if self.sent is not None:
            self.full, self.sent = not ray.get(self.sent), None
        if self.full:
            kept = [(i, e) for i, e in items if e.pixels is None]
            self.refused += len(items) - len(kept)
            items = kept
        if items:
            self.sent = self.handle.put_many.remote(items)


class SampleCache:
    """The cache as one preprocessing actor (or task) uses it; made once per actor, its
    node's store found on first use."""

    def __init__(self, config, storage):
        self.config, self.storage = config, storage
        self.store, self.counter, self._started = None, None, False
        self.tally = Tally()
        self._found: dict[int, Entry] = {}  # key -> its entry, for the raw yielded next
        self._missed: dict[int, tuple[str, tuple[int, int] | None, float]] = {}
        self._new: list[tuple[str, Entry]] = []

    def _start(self) -> None:
        self._started = True
        if self.config.cache == "disk":
            self.store = DiskStore(node.cache_root(self.config), node.budget(self.config))
        self._find()

    def _find(self) -> None:
        """This node's `NodeCache`, if it has one (a node that joined mid-run, or whose
        actor died, gets one at the run's next `node.ensure`: asked again on every call of
        `raws` until then)."""
        self.counter = node.lookup(self.config)
        if self.counter is not None and self.config.cache == "memory":
            self.store = _Remote(self.counter)

    def raws(self, rows: Iterable[Row], read: Callable[..., Iterator[RawSample]]):
        """The rows' samples in order, as ``read(path, first_key, samples, label, done)``
        yields them, with the cached ones found (whole rows of them not read)."""
        if not self._started:
            self._start()
        elif self.counter is None:
            self._find()
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
        todo = [[k for k in range(first, first + n) if done is None or not done[k - first]]
                for _, first, n, _, done in rows]  # fmt: skip
        found: dict[int, Entry] = {}
        asks = [(f"{r[0]}\0{k - r[1]}", ident, k)
                for r, ident, keys in zip(rows, idents, todo, strict=True)
                if ident is not None for k in keys]  # fmt: skip
        if asks and self.store is not None:
            t0 = time.perf_counter()
            try:
                entries = self.store.get_many([a[0] for a in asks], [a[1] for a in asks])
            except Exception:  # the node's cache actor is gone: decode, and look for
                self.store, self.counter = None, None  # the one `node.ensure` starts next
                entries = [None] * len(asks)
            self.tally.saved_s -= time.perf_counter() - t0
            found = {a[2]: e for a, e in zip(asks, entries, strict=True) if e is not None}
            self.tally.corrupt += getattr(self.store, "corrupt", 0)
        for (path, first, n, label, done), ident, keys in zip(rows, idents, todo, strict=True):
            if keys and all(k in found for k in keys):  # nothing to read
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
        try:
            return self.storage.stat(path)
        except (OSError, ValueError):
            return None  # read will say what is wrong; nothing is cached for it

    def image(self, raw: RawSample) -> np.ndarray:
        """The capped H×W×3 image of ``raw``; raises `BadSample` for a bad one (cached or not)."""
        entry = self._found.pop(raw.key, None)
        if entry is not None:
            self.tally.hits += 1
            self.tally.saved_s += entry.seconds
            if entry.pixels is None:
                self.tally.bad_hits += 1
                raise BadSample(entry.reason, entry.detail)
            return entry.pixels
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
            if i is not None and reason not in TRANSIENT:
                seconds = read_s + time.perf_counter() - t0
                self._keep(
                    i, Entry(ident, raw.where, seconds, None, reason, detail_of(e, raw.data))
                )
            raise
        if i is not None:
            self._keep(i, Entry.image(ident, raw.where, read_s + time.perf_counter() - t0, pixels))
        return pixels

    def _keep(self, i: str, entry: Entry) -> None:
        self._new.append((i, entry))
        if len(self._new) >= PUT_EVERY:
            self._put()

    def _put(self) -> None:
        if self._new and self.store is not None:
            try:
                self.store.put_many(self._new)
            except Exception:  # a full or failing disk, or the node's cache actor gone:
                self.store, self.counter = None, None  # on without, until `node.ensure`
        self._new = []

    def flush(self) -> None:
        """Send the new entries, and the counters to the node's `NodeCache`."""
        self._put()
        if isinstance(self.store, DiskStore):
            self.tally.corrupt += self.store.tally.corrupt
            self.tally.refused += self.store.tally.refused
            self.store.tally = Tally()
        elif isinstance(self.store, _Remote):
            self.tally.refused, self.store.refused = self.tally.refused + self.store.refused, 0
        if self.counter is not None and (self.tally.hits or self.tally.misses):
            try:
                self.counter.note.remote(self.tally)
            except Exception:  # the node's actor is gone: the counts with it
                self.counter = None
        self.tally = Tally()
        self._found.clear()
        self._missed.clear()
