"""Ray Data's own actor pool, sized by a `raypipe.pool.follow.Follower`.

```
 on Ray Data's scheduling thread, every step of the executor:
 FollowingAutoscaler (wraps the executor's actor autoscaler): the pool's max is the
   target, so Ray Data grows it up to there as its utilization asks; actors over the
   target get no new task (drained: on worker nodes before the head, the node with the
   fewest of the pool's actors first, so that a node empties) and go once idle
 FollowingCluster (wraps the cluster autoscaler): while the pool is under its max,
   Ray Data's standing request for nodes is withdrawn
```
Ray internals used, all through `raypipe.rayapi` (its ``autoscale`` group), checked against
the running Ray by `check_ray` and pinned by ``tests/pool/test_follow.py``: the executor's
actor autoscaler (with the operators it looks after) and cluster autoscaler; on an actor
pool its config, its running actors, releasing one of them, and the two scheduling heaps
``select_actors`` reads. Public on the pool: ``get_autoscaling_actor_pools()``,
``select_actors``, ``scale``, ``current_size``, ``num_pending_actors``. Where they differ
the pool keeps Ray Data's own policy.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from raypipe import rayapi
from raypipe.pool.follow import Follower
from raypipe.rayapi import RAY_VERSION  # the Ray whose executor internals it drives

__all__ = ["FollowingAutoscaler", "FollowingCluster", "RAY_VERSION", "check_ray", "follow"]
assert __all__ == sorted(__all__)

log = logging.getLogger(__name__)


def check_ray() -> str | None:
    """Why the follower cannot drive this Ray (None: it can)."""
    import ray

    if ray.__version__ != RAY_VERSION:
        return f"Ray {ray.__version__} is not {RAY_VERSION}, whose executor it drives"
    missing = rayapi.check_names(("autoscale",))
    return f"Ray's executor internals changed: {missing}" if missing else None


class FollowingAutoscaler:
    """Ray Data's actor autoscaler for one execution, with the `Follower`'s target as
    each pool's max and the pool's actors over it drained and released."""

    def __init__(self, inner, follower: Follower, head_nodes=frozenset()):
        self.inner, self.follower, self.head_nodes = inner, follower, head_nodes
        self.topology = rayapi.autoscaler_topology(inner)
        self._draining: set = set()
        self._wrapped: set[int] = set()

    def try_trigger_scaling(self) -> None:
        for op in list(self.topology):
            for pool in op.get_autoscaling_actor_pools():
                self._follow(pool)
        self.inner.try_trigger_scaling()

    def __getattr__(self, name):  # anything else the executor asks of its autoscaler
        return getattr(self.inner, name)

    def _follow(self, pool) -> None:
        if id(pool) not in self._wrapped:
            self._wrapped.add(id(pool))
            _skip_draining(pool, self._draining)
        target = self.follower.decide(pool.current_size())  # in [lo, hi]
        excess = pool.current_size() - target
        pending = min(excess, pool.num_pending_actors())
        if pending > 0:  # actors not started yet go first (Ray's pool picks pending first)
            pool.scale(
                rayapi.downscale_request(-pending, "raypipe: the trainer is slower than the pool")
            )
            excess = pool.current_size() - target
        running = rayapi.running_actors(pool)
        self._draining.intersection_update(running)
        if excess <= 0:
            self._draining.clear()
        else:  # a node the autoscaler can remove, with the fewest actors, first
            per_node = collections.Counter(s.actor_location for s in running.values())
            order = sorted((a for a in running if a not in self._draining),
                           key=lambda a: (running[a].actor_location in self.head_nodes,
                                          per_node[running[a].actor_location],
                                          running[a].num_tasks_in_flight))  # fmt: skip
            while len(self._draining) > excess:
                self._draining.pop()
            self._draining.update(order[: excess - len(self._draining)])
            for actor in [a for a in self._draining if running[a].num_tasks_in_flight == 0]:
                self._draining.discard(actor)
                rayapi.release_actor(pool, actor)  # the one chosen, not any idle one
        # Ray Data's own autoscaler may grow the pool up to the target (as its utilization
        # asks) and restore lost actors, never shrink it: which actor goes is chosen here
        size = pool.current_size()
        low, high = max(self.follower.lo, size), max(target, size)
        config = rayapi.pool_config(pool)
        if (config.min_size, config.max_size) != (low, high):
            rayapi.set_pool_config(pool, dataclasses.replace(
                config, min_size=low, max_size=high,
                initial_size=min(max(config.initial_size, low), high),
            ))  # fmt: skip


class FollowingCluster:
    """Ray Data's cluster autoscaler, silent while the pool is under its max: its standing
    request for nodes is withdrawn, so the Ray autoscaler can remove the nodes the shed
    actors left idle. (Ray Data re-sends its last request while the cluster looks idle,
    and a store full of held-back blocks makes it ask for more.) Actors the pool starts
    still bring nodes: the Ray autoscaler follows their own resource demand."""

    def __init__(self, inner, follower: Follower):
        self.inner, self.follower = inner, follower
        self._last = 0.0

    def try_trigger_scaling(self) -> None:
        f = self.follower
        if f.target >= f.hi:
            self.inner.try_trigger_scaling()
            return
        now = time.monotonic()
        if now - self._last >= f.period_s:
            self._last = now
            rayapi.withdraw_resource_request(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _skip_draining(pool, draining: set) -> None:
    """``pool.select_actors`` that never picks a draining actor: they are taken out of
    the scheduling heaps for the call and put back (ranks unchanged) after it."""
    select = pool.select_actors

    def select_actors(bundle=None, actor_locality_enabled=False):
        if not draining:
            return select(bundle, actor_locality_enabled)
        heaps = rayapi.scheduling_heaps(pool)
        taken = [(h, a, h[a]) for h in heaps for a in list(draining) if a in h]
        for h, a, _ in taken:
            del h[a]
        try:
            return select(bundle, actor_locality_enabled)
        finally:
            for h, a, rank in taken:
                h[a] = rank

    pool.select_actors = select_actors


def follow(executor, follower: Follower | None) -> bool:
    """Put ``follower`` in charge of ``executor``'s actor pools; False (and a warning, and
    ``follower.in_charge`` False) where this Ray cannot be driven, leaving Ray Data's own
    autoscaler."""
    if follower is None or executor is None:
        return False
    why = check_ray()
    if why is None and rayapi.actor_autoscaler(executor) is None:
        why = "the executor has no actor autoscaler"
    if why is not None:
        log.warning("raypipe: the pool cannot follow the trainer (%s); Ray Data's own "
                    "autoscaler sizes it", why)  # fmt: skip
        follower.in_charge = False  # stats and the progress line show no target of its
        return False
    import ray

    heads = frozenset(n["NodeID"] for n in ray.nodes()
                      if n["Alive"] and "node:__internal_head__" in n["Resources"])  # fmt: skip
    inner = rayapi.actor_autoscaler(executor)
    rayapi.set_actor_autoscaler(executor, FollowingAutoscaler(inner, follower, heads))
    cluster = rayapi.cluster_autoscaler(executor)
    if cluster is not None:  # never the placement-group one (`rayapi.cluster_autoscaler`)
        rayapi.set_cluster_autoscaler(executor, FollowingCluster(cluster, follower))
    return True
