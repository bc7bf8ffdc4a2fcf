"""A rank's tasks as the preprocessing actors see them: a task id names its epoch and the
shard rows it reads (`raypipe.plan.shards.shard_row`), from the rank's `RankPlan`.

Only task ids cross the object store: every actor holds the `RankTasks` (the plan and the
listing's paths) and turns an id into its rows itself (`RankTasks.rows`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from raypipe.plan.columns import Paths
from raypipe.plan.rankplan import RankPlan
from raypipe.plan.shards import Listing, pack_done

__all__ = ["RankTasks", "task_table"]
assert __all__ == sorted(__all__)


def task_table(plan: RankPlan, epochs: range) -> np.ndarray:
    """``(epoch, lo, hi)`` of every task of the rank, epochs in order."""
    tables = [np.insert(plan.task_bounds(e), 0, e, axis=1) for e in epochs]
    return np.concatenate(tables) if tables else np.zeros((0, 3), dtype=np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class RankTasks:
    """A rank's tasks for the actors: task id → its epoch and its shard rows (`shard_row`).

    Attributes:
        plan: the rank's `RankPlan`; table: its `task_table`.
        paths, labels: every shard's path and label, shards in key order.
        shared_skips: every rank writes to one skip log, so the skip budget counts the
            epoch's samples over all ranks; else this rank's own.
    """

    plan: RankPlan
    table: np.ndarray
    paths: Paths
    labels: np.ndarray
    shared_skips: bool = False
    # epoch → `samples`; not an argument, so that a replace() starts anew
    _samples: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    @classmethod
    def of(cls, listing: Listing, plan: RankPlan, epochs: range, *, shared_skips: bool = False):
        return cls(plan, task_table(plan, epochs), listing.shards.paths, listing.shards.label,
                   shared_skips)  # fmt: skip

    def __len__(self) -> int:
        return len(self.table)

    def samples(self, epoch: int) -> int:
        """The samples of epoch ``epoch`` this rank's skip budget is a share of: the whole
        epoch's, a resumed one's too (a checkpoint consumes good keys only: the bad ones
        met before it are read and skipped again, against the whole epoch's budget).
        Asked at each flush of skips: with packing a rank's share is the weighted split of
        the epoch's keys (~50 ms at 10M documents), found once an epoch."""
        if self.shared_skips:  # every rank's: the whole epoch's samples
            return self.plan.num_samples
        if epoch not in self._samples:
            plan = self.plan
            if epoch == plan.resume_epoch:
                plan = dataclasses.replace(plan, consumed=None)
            self._samples[epoch] = plan.sizes(epoch)[plan.rank]
        return self._samples[epoch]

    def rows(self, task: int) -> tuple[int, dict[str, list]]:
        """The task's epoch and its keys as shard rows: members of a shard that are not the
        task's are marked done, so they are not read."""
        epoch, lo, hi = (int(v) for v in self.table[task])
        plan = self.plan
        keys = plan.keys(epoch)[lo:hi]
        shard = plan.shard_of(keys)
        starts = np.r_[0, np.flatnonzero(np.diff(shard)) + 1]  # one row per run of a shard
        ids = shard[starts]
        lengths = np.diff(np.r_[starts, len(keys)])
        rows = {"path": [self.paths[s] for s in ids.tolist()], "first_key": plan.first[ids].tolist(),
                "num_samples": plan.counts[ids].tolist(), "label": self.labels[ids].tolist(),
                "done": [b""] * len(ids)}  # fmt: skip
        # a shard the task reads part of (a piece, another rank's, resumed): the rest is done
        for i in np.flatnonzero(lengths != plan.counts[ids]).tolist():
            first, count = rows["first_key"][i], rows["num_samples"][i]
            done = np.ones(count, dtype=bool)
            done[keys[starts[i] : starts[i] + lengths[i]] - first] = False
            rows["done"][i] = pack_done(done)
        return epoch, rows
