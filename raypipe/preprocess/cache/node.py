"""`NodeCache`: one actor per node and settings digest, holding that node's cache.

```
 the driver / each rank (build_dataset, Pipeline.start) ── ensure(config) ──► one NodeCache
   per alive node (named, no CPUs, pinned to its node), owned by that process for its run;
   a cache that cannot start, or has no room, fails here, before work
 a preprocessing worker ── lookup(config) by its node id ──► where(): its directory, budget
   then reads and writes the entries itself (`DiskStore`), and note(counters)
 Pipeline.stats(), the progress line ── stats(config) ──► every node's counters, summed
```

Entries are files every process of the node reads and writes without asking the actor
(`raypipe.preprocess.cache.disk`): ``cache="memory"`` in the node's shared memory
(``/dev/shm``), one directory per node and settings, held by each actor's shared ``flock``
on its ``lock`` file (`raypipe.preprocess.cache.shm`), so runs with the same settings on a
node share it; the kernel lets the lock go however the actor ends, and each new `NodeCache`
(and `release`, and at exit the process that called `ensure`) removes the directories no
one holds. ``cache="disk"``: under ``cache_dir``, kept for later runs; the actor only
counts. An actor dies with its node (what it held is decoded again where the samples go
next) and with the process that made it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import threading

from raypipe.config.validate import DISK_BUDGET, cache_block
from raypipe.preprocess.cache import shm
from raypipe.preprocess.cache.disk import DiskStore
from raypipe.preprocess.cache.store import Tally
from raypipe.preprocess.cache.usage import Usage

__all__ = ["NodeCache", "budget", "cache_root", "decoders", "digest", "ensure", "lookup", "release",
           "stats"]  # fmt: skip
assert __all__ == sorted(__all__)

CACHE_VERSION = 2  # changes when the capped pixels of the same bytes would (2: no area resize)
_HELD: dict[tuple[str, str], object] = {}  # (job id, actor name) -> handle: an actor
_HELD_LOCK = threading.Lock()  # dies with its last handle; ranks in threads share this
_BUDGETS: dict[tuple[str, str], int] = {}  # (job id, name prefix) -> its first ensure's budget
START_TIMEOUT_S = 60.0  # ensure waits this long for new caches to be up


def digest(config) -> str:
    """The settings that change a sample's cached pixels (not the crop: it comes after) and
    the `decoders` that make them: a disk cache is not reused across an upgrade of those."""
    text = (f"{CACHE_VERSION}|{config.image_column}|{config.cache_max_side}|"
            f"{config.max_image_pixels}|{config.cache_encoding}|{decoders()}")  # fmt: skip
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@functools.cache
def decoders() -> str:
    """The versions of what decodes, caps and re-encodes a cached image: simplejpeg (its
    libjpeg-turbo), OpenCV and Pillow."""
    import cv2
    import PIL
    import simplejpeg

    return f"simplejpeg {simplejpeg.__version__}, opencv {cv2.__version__}, pillow {PIL.__version__}"  # fmt: skip


def cache_root(config, node_id: str | None = None) -> str | None:
    """The directory of a node's entries: ``cache_dir/<digest>`` (``"disk"``, the same on
    every node), or the node's own under `shm.SHM_DIR` (``"memory"``)."""
    if config.cache == "disk":
        return os.path.join(os.path.expanduser(config.cache_dir), digest(config))
    if config.cache == "memory":
        return os.path.join(shm.SHM_DIR, _name(config, node_id or ""))
    return None


class NodeCache:
    """A node's cache: its directory's lifetime (memory), its budget, and the counters the
    preprocessing workers report (a Ray actor; plain Python, testable)."""

    def __init__(self, mode: str, limit: int, root: str, store_bytes: int = 0):
        self.mode, self.root, self._lock = mode, root, None
        self.asked, self.room = limit, None
        if mode == "memory":
            shm.sweep()
            self._lock = shm.hold(root)
            atexit.register(self.clear)
            # what another run holding the directory keeps there is room this one shares
            self.room = shm.room(store_bytes) + Usage(root).held()[0]
            limit = min(limit, self.room)
        self.budget = limit
        self.store = DiskStore(root, limit)
        if mode == "disk":  # kept across runs: what killed writers left, looked for aside
            threading.Thread(target=self.store.drop_leftovers, daemon=True).start()
        self.tally = Tally()  # what the preprocessing workers report

    def where(self) -> tuple[str, int]:
        """The directory and budget every worker of the node uses."""
        return self.root, self.budget

    def info(self) -> dict:
        return {"asked": self.asked, "budget": self.budget, "room": self.room}

    def note(self, tally: Tally) -> None:
        self.tally.add(tally)

    def stats(self) -> Tally:
        out = Tally().add(self.tally)
        out.bytes, out.entries = self.store.held()
        return out

    def clear(self) -> None:
        """``"memory"``: let the node's entries (the directory) go, removed now unless
        another run's actor holds them too."""
        if self._lock is not None:
            shm.let_go(self.root, self._lock)
            self._lock = None


def budget(config, store_bytes: int | None = None) -> int:
    """``config.cache_budget``, or its default: a quarter of ``store_bytes`` (the smallest
    object store) for ``cache="memory"``, `DISK_BUDGET` for ``"disk"``."""
    if config.cache_budget is not None:
        return config.cache_budget
    return DISK_BUDGET if config.cache == "disk" else max(1, (store_bytes or 0) // 4)


def _stores() -> dict[str, int]:
    import ray

    return {n["NodeID"]: int(n["Resources"].get("object_store_memory", 0))
            for n in ray.nodes() if n.get("Alive")}  # fmt: skip


def _name(config, node_id: str) -> str:
    """One cache per node, pixel settings, mode, budget and directory."""
    where = f"{config.cache}|{config.cache_budget}|{config.cache_dir}"
    return f"{shm.PREFIX}{digest(config)}-{hashlib.sha1(where.encode()).hexdigest()[:8]}-{node_id}"


def ensure(config) -> None:
    """Start (or find) the `NodeCache` of every alive node for ``config``, and wait until
    the new ones are up (their workers then find them at once); no-op without a cache. The
    handles are kept in this process, so the actors live as long as it (or until
    `release`); a cache that cannot start, or has no room, is refused (`_check_started`).

    Called again (a `Pipeline` does at each epoch), it starts the caches of the nodes that
    joined since, and again those whose actor died (empty), with the budget the first call
    set (a smaller node joining later does not change it); a lost node's actor is gone with
    it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if config.cache is None:
        return
    stores = _stores()
    job = ray.get_runtime_context().get_job_id()
    started = []
    with _HELD_LOCK:
        if not _HELD:
            atexit.register(_release_all)
        limit = _BUDGETS.get((job, _name(config, "")))
        if limit is None:
            limit = _BUDGETS[(job, _name(config, ""))] = budget(config, min(stores.values(),
                                                                              default=0))  # fmt: skip
        for node_id, store in stores.items():
            name = _name(config, node_id)
            if (job, name) in _HELD and _alive(name):
                continue
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            handle = ray.remote(NodeCache).options(
                name=name, get_if_exists=True, num_cpus=0, max_restarts=0,
                scheduling_strategy=strategy,
            ).remote(config.cache, limit, cache_root(config, node_id), store)  # fmt: skip
            _HELD[(job, name)] = handle
            started.append(handle)
    if started:
        _check_started(config, started)


def _check_started(config, handles: list) -> None:
    """Wait for new caches; one that could not start (a ``cache_dir`` it cannot write), or
    a memory cache a node has no room for (an explicit budget, or less than one block), is
    refused in one line. A node lost meanwhile, or slow: its workers ask it themselves."""
    import ray

    try:
        infos = ray.get([h.info.remote() for h in handles], timeout=START_TIMEOUT_S)
    except ray.exceptions.RayActorError as e:  # made, then dead: its creation, or its node
        if not e.actor_init_failed:
            return
        release(config)
        lines = [t.strip() for t in str(e).splitlines() if "Error" in t] or [str(e)]
        raise ValueError(f"cache={config.cache!r}: a node's cache could not start: "
                         f"{lines[-1][:300]}") from None  # fmt: skip
    except Exception:  # slow (a timeout), or gone meanwhile
        return
    room = min((i["room"] for i in infos if i["budget"] < i["asked"]), default=None)
    block, asked = cache_block(config), config.cache_budget
    if config.cache == "memory" and room is not None and (asked is not None or room < block):
        release(config)
        what = f"PipelineConfig.cache_budget={asked!r}" if asked else f"cache='memory' (one block: {block} bytes)"  # fmt: skip
        raise ValueError(f"{what}: a node's shared memory ({shm.SHM_DIR}) has room for {room} "
                         "bytes beside its object store; lower it or use cache='disk'")  # fmt: skip


def _alive(name: str) -> bool:
    """Whether the named actor lives (a dead one's name is free again)."""
    import ray

    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def release(config) -> None:
    """End this process's `NodeCache` actors of ``config``: a memory cache's entries go
    with them (a disk cache's files stay), and so do the counters."""
    import ray

    job = ray.get_runtime_context().get_job_id()
    prefix = _name(config, "")
    with _HELD_LOCK:
        handles = [
            _HELD.pop(k) for k in [k for k in _HELD if k[0] == job and k[1].startswith(prefix)]
        ]
    _end(handles)
    if config.cache == "memory":
        shm.sweep()  # a lost node's directory, where it shared this machine


def _end(handles: list, timeout_s: float = 10.0) -> None:
    import ray

    refs = []
    for h in handles:
        with contextlib.suppress(Exception):
            refs.append(h.clear.remote())
    with contextlib.suppress(Exception):
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for h in handles:
        with contextlib.suppress(Exception):
            ray.kill(h)


def _release_all() -> None:
    """At exit: this process's memory caches go now, not at the next run's sweep (with
    Ray shut down already, their actors are gone and the sweep finds their locks free)."""
    import ray

    with _HELD_LOCK:
        handles = list(_HELD.values())
        _HELD.clear()
    if ray.is_initialized():
        _end(handles, timeout_s=5.0)
    with contextlib.suppress(OSError):
        shm.sweep()


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
