"""`NodeCache`: one actor per node and settings digest, holding that node's cache.

```
 the driver / each rank (build_dataset, Pipeline.start) ── ensure(config) ──► one NodeCache
   per alive node (named, no CPUs, pinned to its node), owned by that process for its run
 a preprocessing actor ── lookup(config) by its node id ──► get_many / put_many (memory)
                                                           note(counters) (both modes)
 Pipeline.stats(), the progress line ── stats(config) ──► every node's counters, summed
```

``cache="memory"``: the actor keeps the entries (`MemoryStore`), their pixels in the node's
object store (shared memory, owned by the actor), so that every preprocessing actor of the
node, of every rank there, maps them without a copy. ``cache="disk"``: the pool actors
read and write the node's files themselves (`DiskStore`); the actor only counts. An actor
dies with its node (what it held is decoded again where the samples go next) and with the
process that made it, at the end of its run.
"""

from __future__ import annotations

import hashlib
import os
import threading

from raypipe.plan.blocksize import memory_cache_bytes
from raypipe.preprocess.cache.disk import DiskStore
from raypipe.preprocess.cache.store import Entry, MemoryStore, Tally

__all__ = ["NodeCache", "budget", "cache_root", "digest", "ensure", "lookup", "release", "stats"]
assert __all__ == sorted(__all__)

DISK_BUDGET = 2 << 30  # bytes per node under cache_dir, by default
CACHE_VERSION = 1  # changes when the capped pixels of the same bytes would change
_HELD: dict[tuple[str, str], object] = {}  # (job id, actor name) -> handle: an actor
_HELD_LOCK = threading.Lock()  # dies with its last handle; ranks in threads share this
_BUDGETS: dict[tuple[str, str], int] = {}  # (job id, name prefix) -> its first ensure's budget


def digest(config) -> str:
    """The settings that change a sample's cached pixels (not the crop: it comes after)."""
    text = (
        f"{CACHE_VERSION}|{config.image_column}|{config.cache_max_side}|{config.max_image_pixels}"
    )
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def cache_root(config) -> str | None:
    """``cache="disk"``: this settings digest's directory under ``cache_dir``."""
    return None if config.cache != "disk" else os.path.join(config.cache_dir, digest(config))


class NodeCache:
    """A node's memory cache or disk-cache counters (a Ray actor; plain Python, testable)."""

    def __init__(self, mode: str, budget: int, root: str | None):
        self.memory = MemoryStore(budget) if mode == "memory" else None
        self.disk = DiskStore(root, budget) if mode == "disk" else None
        self.tally = Tally()  # what the preprocessing actors report

    def get_many(self, ids: list[str], idents: list[tuple[int, int]]) -> list[Entry | None]:
        return self.memory.get_many(ids, idents)

    def put_many(self, items: list[tuple[str, Entry]]) -> bool:
        """Keep ``items``; the pixels of those within the budget move into the object store
        (this actor owns them), from where the node's preprocessing actors read them
        without a copy. False once the budget refused one: the cache is full."""
        import ray

        refused = self.memory.tally.refused
        for _, entry in items:
            if entry.pixels is not None and self.memory.fits(entry):
                entry.ref, entry.pixels = ray.put(entry.pixels), None
        self.memory.put_many(items)
        return self.memory.tally.refused == refused

    def note(self, tally: Tally) -> None:
        self.tally.add(tally)

    def stats(self) -> Tally:
        out = Tally().add(self.tally)
        if self.memory is not None:
            held = self.memory.tally
            out.entries, out.bytes = held.entries, held.bytes
            out.corrupt += held.corrupt
            out.refused += held.refused
        else:
            out.bytes = self.disk.held()
        return out


def budget(config, store_bytes: int | None = None) -> int:
    """``config.cache_budget``, or its default: for ``cache="memory"``, a quarter of
    ``store_bytes`` (the smallest object store: `raypipe.plan.blocksize.memory_cache_bytes`,
    the rule the block sizes leave that room by; a budget over half of it raises
    ValueError), `DISK_BUDGET` for ``"disk"``."""
    if config.cache == "memory":
        return memory_cache_bytes(config, store_bytes)
    return DISK_BUDGET if config.cache_budget is None else config.cache_budget


def _smallest_store() -> int:
    import ray

    stores = [n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n.get("Alive")]
    return int(min(stores)) if stores else 0


def _name(config, node_id: str) -> str:
    """One cache per node, pixel settings, mode, budget and directory."""
    where = f"{config.cache}|{config.cache_budget}|{config.cache_dir}"
    return (
        f"raypipe-cache-{digest(config)}-{hashlib.sha1(where.encode()).hexdigest()[:8]}-{node_id}"
    )


def ensure(config) -> None:
    """Start (or find) the `NodeCache` of every alive node for ``config``; no-op without
    a cache. The handles are kept in this process, so the actors live as long as it.

    Called again (a `Pipeline` does at each epoch), it starts the caches of the nodes that
    joined since, and again those whose actor died (empty), with the budget the first call
    set (a smaller node joining later does not change it); a lost node's actor is gone with
    it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if config.cache is None:
        return
    job = ray.get_runtime_context().get_job_id()
    with _HELD_LOCK:
        limit = _BUDGETS.get((job, _name(config, "")))
        if limit is None:  # refuses an over-large memory budget
            limit = _BUDGETS[(job, _name(config, ""))] = budget(config, _smallest_store())
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            name = _name(config, node["NodeID"])
            if (job, name) in _HELD and _alive(name):
                continue
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            _HELD[(job, name)] = ray.remote(NodeCache).options(
                name=name, get_if_exists=True, num_cpus=0, max_restarts=0,
                scheduling_strategy=strategy,
            ).remote(config.cache, limit, cache_root(config))  # fmt: skip


def _alive(name: str) -> bool:
    """Whether the named actor lives (a dead one's name is free again)."""
    import ray

    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def release(config) -> None:
    """End this process's `NodeCache` actors of ``config``: their memory entries and
    counters go (a disk cache's files stay)."""
    import ray

    job = ray.get_runtime_context().get_job_id()
    prefix = _name(config, "")
    with _HELD_LOCK:
        _BUDGETS.pop((job, prefix), None)
        for held in [k for k in _HELD if k[0] == job and k[1].startswith(prefix)]:
            ray.kill(_HELD.pop(held))  # a lost node's actor: nothing to do, no error


def lookup(config):
    """This node's `NodeCache` handle, or None where none was started (a node that joined
    after the run started, until the run's next `ensure`: its samples are decoded, capped,
    and not kept)."""
    import ray

    try:
        return ray.get_actor(_name(config, ray.get_runtime_context().get_node_id()))
    except ValueError:
        return None


def stats(config, timeout_s: float = 5.0, *,
          node_id: str | None = None) -> dict[str, float | int] | None:  # fmt: skip
    """Every alive node's cache counters for ``config``, summed (``node_id``: that node's
    alone); None without a cache. A node lost meanwhile counts nothing: its counters went
    with it, and a node whose actor does not answer within ``timeout_s`` is left out."""
    import ray

    if config.cache is None:
        return None
    handles = []
    for node in ray.nodes():
        if node.get("Alive") and node_id in (None, node["NodeID"]):
            try:
                handles.append(ray.get_actor(_name(config, node["NodeID"])))
            except ValueError:
                continue
    total = Tally()
    refs = [h.stats.remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        try:
            total.add(ray.get(ref))
        except Exception:  # a node lost meanwhile: its counters are gone with it
            continue
    return {"mode": config.cache, **total.as_dict()}
