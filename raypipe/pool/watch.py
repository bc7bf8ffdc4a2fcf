"""`PoolWatch`: preprocessing actors and Ray nodes alive over time, for elastic runs.

```
 PoolWatch thread ── every interval_s ──► GCS actor table (this job's Preprocessor
   │                                      actors: alive, restarts) + node table
   ▼ bounded ring of PoolSample(t, actors, nodes, restarts)
 summary(): min / max / now of actors and nodes, nodes lost, actor restarts, series
```

Ray Data grows a `build_dataset` pool from ``actors[0]`` toward ``actors[1]`` while its
actors have queued work and releases idle ones; the Ray autoscaler adds CPU nodes for
actors that do not fit and removes idle nodes. The watch makes both visible (pass it
to ``iter_torch_batches(watch=...)`` and ``stats()["pool"]`` reports it), and it
counts the nodes that went while it looked: removed by plan (an idle node the autoscaler
ended) or lost (killed, crashed, unreachable), so a lost node shows in the stats.
It reads Ray's GCS directly (no dashboard needed) and owns one daemon thread, stopped
by ``close()``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

from raypipe import rayapi
from raypipe.preprocess.actor import Preprocessor

__all__ = ["PoolSample", "PoolWatch"]
assert __all__ == sorted(__all__)

# Ray's NodeDeathInfo reasons of a planned removal: EXPECTED_TERMINATION (e.g. the
# autoscaler ended an idle node), AUTOSCALER_DRAIN_IDLE. Any other death is a lost node.
PLANNED = (1, 4)


@dataclasses.dataclass(frozen=True)
class PoolSample:
    """One look: seconds since the watch started, alive actors and nodes, restarts so far."""

    t: float
    actors: int
    nodes: int
    restarts: int


class PoolWatch:
    """Samples this job's alive preprocessing actors and the cluster's alive nodes.

    Args:
        interval_s: seconds between samples.
        match: counted actors have this in their class name; None: raypipe's
            preprocessing actors (Ray Data names them ``MapWorker(MapBatches(Preprocessor))``,
            ``...(RankPreprocessor)`` for a `raypipe.Pipeline`'s pool).
        max_samples: samples kept (the oldest go first).
        new_only: count only actors that were not alive at ``start()`` (leave out the pools
            of datasets already running, e.g. one an earlier consumer abandoned).
    """

    def __init__(
        self,
        *,
        interval_s: float = 0.5,
        match: str | None = None,
        max_samples: int = 4096,
        new_only: bool = False,
    ):
        if not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"{interval_s=} must be a number > 0")
        if not isinstance(max_samples, int) or max_samples < 1:
            raise ValueError(f"{max_samples=} must be an integer >= 1")
        self.interval_s = float(interval_s)
        self.match = match if match is not None else Preprocessor.__name__
        self._samples: collections.deque[PoolSample] = collections.deque(maxlen=max_samples)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._seen_nodes: set[str] = set()
        self._gone_nodes: dict[str, bool] = {}  # node id -> lost (not a planned removal)
        self._restarts: dict[str, int] = {}  # actor id -> NumRestarts, of restarted actors
        self._errors = 0
        self._new_only = new_only
        self._old: set[str] = set()  # actor ids alive at start(), with new_only

    def start(self) -> PoolWatch:
        """Take a first sample now, then one every ``interval_s`` on a daemon thread."""
        import ray

        if self._thread is not None:
            raise RuntimeError("this PoolWatch is already started")
        if not ray.is_initialized():
            raise RuntimeError("PoolWatch needs a connected Ray (ray.init() first)")
        self._t0 = time.monotonic()
        if self._new_only:
            self._old = {a["ActorID"] for a in self.alive()}
        self.sample()
        self._thread = threading.Thread(target=self._run, name="raypipe-poolwatch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        import ray

        while not self._stop.wait(self.interval_s):
            if not ray.is_initialized():  # Ray went first: never start a new one from here
                return
            try:
                self.sample()
            except Exception:  # a GCS hiccup (e.g. while a node goes) costs one sample
                self._errors += 1

    def alive(self) -> list[dict[str, Any]]:
        """This job's alive preprocessing actors, as Ray's actor table has them."""
        import ray

        job = ray.get_runtime_context().get_job_id()
        return [
            a
            for a in rayapi.actor_table("ALIVE").values()
            if a.get("JobID") == job and self.match in _name(a) and a["ActorID"] not in self._old
        ]

    def sample(self) -> PoolSample:
        """Look once and keep the sample."""
        actors = self.alive()
        nodes = rayapi.node_table()
        alive = {n["NodeID"] for n in nodes if n.get("Alive")}
        with self._lock:
            for n in nodes:
                if n["NodeID"] in self._seen_nodes and n["NodeID"] not in alive:
                    self._gone_nodes[n["NodeID"]] = n.get("DeathReason") not in PLANNED
            self._seen_nodes |= alive
            for a in actors:
                if int(a.get("NumRestarts", 0)) > 0:
                    self._restarts[a["ActorID"]] = int(a["NumRestarts"])
            s = PoolSample(
                round(time.monotonic() - self._t0, 3),
                len(actors),
                len(alive),
                sum(self._restarts.values()),
            )
            self._samples.append(s)
        return s

    def samples(self) -> list[PoolSample]:
        with self._lock:
            return list(self._samples)

    def summary(self) -> dict[str, Any]:
        """Min, max and last of actors and nodes; nodes removed (planned) and lost; actor
        restarts; the series of ``(t, actors, nodes)``."""
        with self._lock:
            series = list(self._samples)
            gone = list(self._gone_nodes.values())
        if not series:
            return {"samples": 0}
        actors = [s.actors for s in series]
        nodes = [s.nodes for s in series]
        return {
            "samples": len(series),
            "actors_min": min(actors),
            "actors_max": max(actors),
            "actors_now": actors[-1],
            "nodes_min": min(nodes),
            "nodes_max": max(nodes),
            "nodes_now": nodes[-1],
            "nodes_removed": gone.count(False),
            "nodes_lost": gone.count(True),
            "actor_restarts": series[-1].restarts,
            "errors": self._errors,
            "series": [(s.t, s.actors, s.nodes) for s in series],
        }

    def close(self) -> None:
        """Stop sampling (the samples stay readable)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> PoolWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _name(actor: dict[str, Any]) -> str:
    return actor.get("ReprName") or actor.get("Name") or actor.get("ActorClassName") or ""
