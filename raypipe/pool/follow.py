"""The pool follows the trainer: a rank's preprocessing pool grows while the trainer waits
for data and shrinks while the trainer never waits and finished data is held back.

```
 consumer ── blocked on the feeder's queue ──► Demand.waited_s    (the trainer waits)
 feeder  ─── blocked on a full queue ────────► Demand.held_s      (the data waits)
             (`raypipe.loader.demand`, kept by the rank)
                                   ▼ every period_s
 Follower.decide(actors): a target in [min, max]
   grow    the trainer waited more than `wait` of the period  → serving + 1
   shrink  it waited under wait/5 while the data was held back over half
           of the time, for shrink_s in a row (2 × shrink_s after a grow;
           doubled by each grow that undid a shrink, up to 16 ×),
           once the trainer has taken a batch                  → serving - 1
   (serving: the pool's actors, at most the target: those over it are draining)
                                   ▼ on Ray Data's scheduling thread
 raypipe.pool.autoscale: Ray Data's own pool, sized to the target
```

Ray Data's own autoscaler cannot shrink a pool its consumer throttles: a task paused by
backpressure counts as in flight, so the pool never looks idle. The trainer's wait is the
signal it lacks. This module is the policy, plain Python on
its own clock; `raypipe.pool.autoscale` drives Ray Data's pool by it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any

from raypipe.plan.rankplan import rank_pool

__all__ = ["Follower", "follower_for"]
assert __all__ == sorted(__all__)

log = logging.getLogger(__name__)
SERIES = 600  # (t, actors, target, wait share) points kept
MAX_BACKOFF = 16  # a shrink a grow undid doubles the next one's wait, up to this many times


@dataclasses.dataclass
class _Window:
    t: float
    waited_s: float
    held_s: float


class Follower:
    """The policy: a target pool size in ``[lo, hi]`` from a rank's demand (its
    ``waited_s`` and ``held_s``, `raypipe.loader.demand.Demand`).

    Args:
        lo, hi: the rank's pool bounds. The target starts at ``hi``, where the pool
            starts (`raypipe.preprocess.datasets.rank_dataset`), as a fixed pool would.
        wait: trainer-wait share of a period above which the pool grows.
        shrink_s: seconds of a held-back, never-waiting trainer before one actor goes.
        period_s: seconds between decisions.
    """

    def __init__(self, lo: int, hi: int, demand, *, wait: float, shrink_s: float,
                 period_s: float, clock=time.monotonic):  # fmt: skip
        self.lo, self.hi, self.target = lo, hi, hi
        self.demand, self.wait, self.shrink_s, self.period_s = demand, wait, shrink_s, period_s
        self._clock = clock
        self._t0 = clock()
        self._last = _Window(self._t0, demand.waited_s, demand.held_s)
        self._calm_since: float | None = None
        self._grew = False
        self._backoff, self._shrunk_from = 1, None  # a shrink's wait, the size it left
        self.actors = 0
        self.changes = 0
        self.in_charge = True  # False where `raypipe.pool.autoscale.follow` could not take over
        self.series: collections.deque = collections.deque(maxlen=SERIES)
        self._lock = threading.Lock()

    def decide(self, actors: int) -> int:
        """The target after this call; decides at most once per ``period_s``."""
        now = self._clock()
        if now - self._last.t < self.period_s:
            return self.target
        with self._lock:
            start, dt = self._last.t, now - self._last.t
            d = self.demand
            waited = (d.waited_s - self._last.waited_s) / dt
            held = (d.held_s - self._last.held_s) / dt
            self._last = _Window(now, d.waited_s, d.held_s)
            self.actors = actors
            target = self.target
            serving = min(target, actors)  # those over the target are draining
            if waited > self.wait:
                target = min(self.hi, max(target, serving + 1))
                self._undid(target)
                self._calm_since, self._grew = None, target > self.target or self._grew
            elif waited < self.wait / 5 and held > 0.5 and d.rows > 0:
                # held back before the trainer's first batch is its set-up, not its pace
                self._calm_since = self._calm_since if self._calm_since is not None else start
                # no grow since the last shrink: it held, and this one waits half as long
                backoff = self._backoff if self._shrunk_from is None else max(1, self._backoff // 2)
                need = self.shrink_s * max(2 if self._grew else 1, backoff)
                if now - self._calm_since >= need and serving > self.lo:
                    target, self._backoff = serving - 1, backoff
                    self._shrunk_from, self._calm_since, self._grew = serving, now, False
            else:
                self._calm_since = None
            self.changes += target != self.target
            self.target = target
            # a wait that began before this period is counted whole at its end: cap it
            self.series.append((round(now - self._t0, 2), actors, target,
                                round(min(waited, 1.0), 4), round(min(held, 1.0), 4)))  # fmt: skip
            return target

    def _undid(self, target: int) -> None:
        """A grow to ``target`` back to the size the last shrink left: that shrink was one
        too many (the trainer needs a pool between two sizes), and the next one waits twice
        as long, so that the pool does not flap between them for the whole run."""
        if self._shrunk_from is not None and target > self.target and target >= self._shrunk_from:
            self._backoff = min(self._backoff * 2, MAX_BACKOFF)
            self._shrunk_from = None

    def summary(self) -> dict[str, Any]:
        """``actors``, ``target``, ``changes`` and the ``series`` of ``(seconds, actors,
        target, trainer wait share, held-back share)``, one point per decision; the
        seconds count from ``started`` (the clock's time when the follower began)."""
        with self._lock:
            return {"actors": self.actors, "target": self.target, "min": self.lo,
                    "max": self.hi, "changes": self.changes, "started": self._t0,
                    "series": list(self.series)}  # fmt: skip


def follower_for(config, world_size: int, demand, rank: int = 0) -> Follower | None:
    """The rank's `Follower` under ``config`` (``follow_*`` fields); None for a fixed pool
    or ``follow=False``. With ``compute="tasks"`` it sets the rank's task slots (tasks in
    flight over `raypipe.plan.blocksize.TASKS_IN_FLIGHT`) instead of its actors."""
    lo, hi = rank_pool(config.actors, world_size, rank)
    if not config.follow or lo == hi:
        return None
    return Follower(lo, hi, demand, wait=config.follow_wait, shrink_s=config.follow_shrink_s,
                    period_s=config.follow_period_s)  # fmt: skip
