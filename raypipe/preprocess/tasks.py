"""``compute="tasks"``: a rank's tasks as plain Ray tasks on Ray's pooled workers, in order.

```
 feeder thread (the rank)                              pooled workers (warm once used)
   submit task ids in order, <= window in flight ──────► `_preprocess(run, [kwargs], id)`:
     window = slots × TASKS_IN_FLIGHT; slots: the         the worker's `Preprocessor` of
     pool's max, or the follower's target                  ``run``, built once per process
   ray.get the oldest task's blocks ◄────────────────── [{image, label, key, epoch}, ...]
   ▼ blocks in task order, epoch e's tasks before e+1's: the stream the actor pool's
     execution gives (`raypipe.preprocess.datasets.rank_dataset`), the same rows
```

No Ray Data on the way: the workers Ray starts with its node run the first task without
importing it, and a worker an earlier run used already holds raypipe's modules, so the
first block comes in a fraction of a second, where a new actor pool starts new processes
(benchmarks/RESULTS.md, "The first epoch"). The window bounds the object store as the
actor pool's tasks in flight do (`raypipe.plan.blocksize`), and the run's arguments (the
plan and the listing's paths) cross the store once: a worker fetches them on its first
task of the run only.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import uuid

import numpy as np

from raypipe.plan.blocksize import TASKS_IN_FLIGHT
from raypipe.plan.rankplan import rank_pool
from raypipe.plan.ranktasks import RankTasks
from raypipe.preprocess.actor import Preprocessor
from raypipe.preprocess.cache import mapped
from raypipe.preprocess.cache import node as node_cache
from raypipe.preprocess.imageblocks import Reused

__all__ = ["TaskStream", "rank_tasks"]
assert __all__ == sorted(__all__)

Columns = dict[str, np.ndarray]
STOP_POLL_S = 0.2  # how soon a stopped stream stops waiting for the task it waits on
DRAIN_S = 5.0  # at most, for the tasks in flight behind a failed one (`TaskStream._drain`)
RUNS_PER_WORKER = 16  # runs whose Preprocessor a pooled worker keeps (a node's ranks, train
# and held-out: a run past them rebuilt its Preprocessor on every task, fetching its listing)
_PREPROCESSORS: collections.OrderedDict = collections.OrderedDict()  # run id → Preprocessor


_REUSED = Reused()  # the image arrays of this worker's blocks, lent again each task


def _preprocess(run: str, kwargs: list, task: int) -> list[Columns]:
    """One task of ``run`` on a pooled worker: its blocks, from this process's
    `Preprocessor` of the run (built on the run's first task here).

    The blocks' image arrays are lent again at the worker's next task (`Reused`): Ray has
    copied them by then. A caller in the same process keeps the blocks of one call only
    until its next."""
    pre = _PREPROCESSORS.get(run)
    if pre is None:
        import ray

        kw = _sharing(ray.get(kwargs[0]))
        pre = _PREPROCESSORS[run] = Preprocessor(**kw, reused=_REUSED)
        while len(_PREPROCESSORS) > RUNS_PER_WORKER:
            _PREPROCESSORS.popitem(last=False)
    _PREPROCESSORS.move_to_end(run)
    _REUSED.next_task()
    mapped.PROCESS.drop_cleared()  # released memory caches: this worker lets go of them
    return [_numpy(b) for b in pre({"id": np.array([task], dtype=np.int64)}) if len(b["key"])]


def _sharing(kw: dict) -> dict:
    """``kw`` with its listing (paths, labels, shard sizes, and a resume's consumed keys)
    that of a run this worker keeps already where the two are the same (a node's ranks
    read one listing): each run kept adds its plan, not another copy of the listing (97 MiB
    for an ImageNet folder)."""
    new = kw["tasks"]
    for pre in _PREPROCESSORS.values():
        old = pre.tasks
        if old is not None and old.paths == new.paths:
            plan = dataclasses.replace(
                new.plan, **_same(old.plan, new.plan, "first", "counts", "consumed", "weights")
            )
            tasks = dataclasses.replace(new, plan=plan, paths=old.paths,
                                        **_same(old, new, "labels"))  # fmt: skip
            return {**kw, "tasks": tasks}
    return kw


def _same(old, new, *names: str) -> dict:
    """``old``'s arrays among ``names`` that ``new`` holds the same of (the shards' sizes
    and labels, a resume's consumed keys, packing's weights: alike on every rank)."""
    same = {}
    for name in names:
        a, b = getattr(old, name), getattr(new, name)
        if a is not None and b is not None and np.array_equal(a, b):
            same[name] = a
    return same


def _numpy(block: dict) -> Columns:
    """``block`` as the rank gets an actor's: numpy columns. A block of arrays as it is;
    one with other values (a transform's lists, ragged fields) through Ray Data's own
    conversion, the one the actors' blocks take (`raypipe.loader.blocks`)."""
    if all(isinstance(v, np.ndarray) and v.dtype != object for v in block.values()):
        return block
    from ray.data.block import BlockAccessor

    table = BlockAccessor.batch_to_block(block)
    return BlockAccessor.for_block(table).to_batch_format("numpy")


def _label_selector() -> dict | None:
    """The driver's Ray Data ``execution_options.label_selector``, which places the actor
    pool's actors: the tasks go to the same nodes."""
    import ray.data

    return ray.data.DataContext.get_current().execution_options.label_selector


class TaskStream:
    """The rank's blocks of every epoch from plain Ray tasks; called on the feeder thread,
    it returns ``(blocks, stop)`` as `raypipe.loader.blocks.execute` does for an actor pool.

    Args:
        config, reader, skips, tasks: the `Preprocessor`'s arguments (``tasks``: the
            rank's `RankTasks`, every epoch).
        world_size: the ranks sharing ``config.actors`` (the rank's slots: its share).
        follower: a `raypipe.pool.follow.Follower` that sets the slots, or None (the max).
    """

    def __init__(self, config, reader, skips, tasks: RankTasks, *, world_size: int,
                 follower=None):  # fmt: skip
        self._kwargs = {"config": config, "reader": reader, "skips": skips, "tasks": tasks}
        self._count, self._cpus = len(tasks), config.actor_cpus
        self._slots = rank_pool(config.actors, world_size, tasks.plan.rank)[1]
        self._follower = follower
        self._stopped = False
        self._in_flight: collections.deque = collections.deque()
        self._lock = threading.Lock()  # the feeder thread submits, `stop` ends

    def __call__(self):
        return self._blocks(), self.stop

    def _blocks(self):
        import ray

        run, kwargs = uuid.uuid4().hex, [ray.put(self._kwargs)]  # nested: fetched on a miss
        options = {"num_cpus": self._cpus, "name": "RankTask"}
        if labels := _label_selector():  # where Ray Data places its tasks and actors (scale.md)
            options["label_selector"] = labels
        remote = ray.remote(_preprocess).options(**options)  # options() once: it wraps
        submitted = 0
        while submitted < self._count or self._in_flight:
            with self._lock:
                while (not self._stopped and submitted < self._count
                       and len(self._in_flight) < self._window()):  # fmt: skip
                    self._in_flight.append(remote.remote(run, kwargs, submitted))
                    submitted += 1
                if self._stopped:
                    return
                oldest = self._in_flight[0]
            while not ray.wait([oldest], timeout=STOP_POLL_S)[0]:
                if self._stopped:  # `stop` came while the task ran: the stream ends quietly
                    return
            try:
                blocks = ray.get(oldest)
            except Exception:  # a bad sample, the skip budget spent: the run stops
                self._drain()
                raise
            with self._lock:
                if self._stopped:  # `stop` came during the get: the rest is not wanted
                    return
                self._in_flight.popleft()
            yield from blocks

    def _drain(self) -> None:
        """Read the tasks in flight behind a failed one that are done within `DRAIN_S`:
        those that failed too (the same budget spent) were each printed as Ray's "Unhandled
        error", traceback and all, when their refs were dropped unread. Here, not on a
        thread: a driver may shut Ray down as soon as the error reaches it."""
        import ray

        with self._lock:
            rest = list(self._in_flight)[1:]
        done = ray.wait(rest, num_returns=len(rest), timeout=DRAIN_S)[0] if rest else []
        for ref in done:  # read to mark it handled: the first error is the one raised
            with contextlib.suppress(Exception):
                ray.get(ref)

    def _window(self) -> int:
        """Tasks in flight: ``TASKS_IN_FLIGHT`` per slot, as an actor pool keeps."""
        if self._follower is not None:
            self._slots = self._follower.decide(self._slots)
        return max(1, self._slots) * TASKS_IN_FLIGHT

    def stop(self) -> None:
        """End the stream within ``STOP_POLL_S``; the tasks in flight (at most the window)
        finish on their workers and their blocks are dropped with their refs.

        Never ``ray.cancel``: in Ray 2.60 a cancel that meets the task's reply on the way
        aborts the whole driver process (``task_manager.cc: Check failed: it !=
        submissible_tasks_.end() Tried to complete task that was not pending``: the race of
        ray-project/ray#54798), which is how leaving an epoch early once killed a test run.
        """
        with self._lock:
            self._stopped = True
            self._in_flight.clear()


def rank_tasks(config, listing, plan, epochs: range, skips, *, world_size: int,
               shared_skips: bool = False, follower=None) -> TaskStream | None:  # fmt: skip
    """The `TaskStream` of ``plan``'s rank over ``epochs``; None if it has no task
    (`raypipe.preprocess.datasets.rank_dataset`'s counterpart for ``compute="tasks"``)."""
    tasks = RankTasks.of(listing, plan, epochs, shared_skips=shared_skips)
    if len(tasks) == 0:
        return None
    node_cache.ensure(config)  # the decoded cache's actors, one per node, if it is on
    return TaskStream(config, listing.reader, skips, tasks, world_size=world_size,
                      follower=follower)  # fmt: skip
