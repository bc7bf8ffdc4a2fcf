"""Epoch plans: every rank's keys are a pure function of listing, seed, epoch and world."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from raypipe.plan.rankplan import RankPlan, epoch_keys
from raypipe.plan.shards import Listing, Shard, epoch_order

ROOT = Path(__file__).resolve().parents[2]


def listing(sizes: list[int], fmt: str = "webdataset") -> Listing:
    shards, key = [], 0
    for i, n in enumerate(sizes):
        shards.append(Shard(f"/data/shard-{i:03d}", key, n))
        key += n
    return Listing(fmt, tuple(shards))


def plans(lst: Listing, world: int, **kw) -> list[RankPlan]:
    kw = {"seed": 7, "shuffle": True, "per_task": 1, **kw}
    return [RankPlan.of(lst, rank=r, world_size=world, **kw) for r in range(world)]


SIZES = [[5, 1, 9, 3, 12, 7], [1] * 203, [61], [17, 23, 9, 12]]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_ranks_partition_the_epoch_in_equal_slices(sizes, world):
    lst = listing(sizes)
    for epoch in range(3):
        ranks = [p.keys(epoch) for p in plans(lst, world)]
        joined = np.concatenate(ranks)
        assert np.array_equal(joined, plans(lst, 1)[0].keys(epoch))  # slices, in order
        assert sorted(joined.tolist()) == list(range(sum(sizes)))  # every key once
        assert max(map(len, ranks)) - min(map(len, ranks)) <= 1
        assert [len(r) for r in ranks] == plans(lst, world)[0].sizes(epoch)


def test_order_follows_the_seeded_shard_order_and_changes_per_epoch():
    lst = listing([5, 1, 9, 3, 12, 7])
    first = np.array([s.first_key for s in lst.shards])
    counts = np.array([s.num_samples for s in lst.shards])
    for epoch in range(4):
        keys = epoch_keys(first, counts, seed=7, epoch=epoch, shuffle=True)
        expect = [k for s in epoch_order(lst.shards, seed=7, epoch=epoch, shuffle=True)
                  for k in range(s.first_key, s.first_key + s.num_samples)]  # fmt: skip
        assert keys.tolist() == expect
    orders = {tuple(plans(lst, 1)[0].keys(e)) for e in range(4)}
    assert len(orders) == 4
    assert plans(lst, 1, shuffle=False)[0].keys(3).tolist() == list(range(37))


PLAN_APART = """
import json, sys
from tests.plan.test_rankplan import listing, plans
lst = listing([1] * 203, fmt="imagefolder")
out = [[p.keys(e).tolist() for e in range(3)] + [[list(p.tasks(e)) for e in range(3)]]
       for p in plans(lst, 2, per_task=16)]
print(json.dumps(out))
"""


def test_plans_made_apart_agree():
    """Driver, ranks and actors each build the plan, each in its own process: they must give
    the same keys and tasks whatever the process's string hashing (PYTHONHASHSEED)."""
    made = []
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        proc = subprocess.run([sys.executable, "-c", PLAN_APART], cwd=ROOT, env=env,
                              capture_output=True, text=True, check=True)  # fmt: skip
        made.append(json.loads(proc.stdout))
    lst = listing([1] * 203, fmt="imagefolder")
    here = [[p.keys(e).tolist() for e in range(3)] + [[list(p.tasks(e)) for e in range(3)]]
            for p in plans(lst, 2, per_task=16)]  # fmt: skip
    assert made[0] == made[1] == json.loads(json.dumps(here))


def test_consumed_keys_leave_the_resumed_epoch_only():
    lst = listing([5, 1, 9, 3, 12, 7])
    consumed = np.zeros(37, bool)
    consumed[np.random.default_rng(0).choice(37, 20, replace=False)] = True
    ranks = plans(lst, 3, resume_epoch=2, consumed=consumed)
    resumed = np.concatenate([p.keys(2) for p in ranks])
    assert sorted(resumed.tolist()) == np.flatnonzero(~consumed).tolist()
    assert sorted(np.concatenate([p.keys(3) for p in ranks]).tolist()) == list(range(37))
    with pytest.raises(ValueError, match="consumed has shape"):
        plans(lst, 1, resume_epoch=0, consumed=np.zeros(36, bool))


@pytest.mark.parametrize("shared", [False, True])
def test_a_resumed_epochs_skip_budget_is_a_share_of_the_whole_epoch(shared):
    """A checkpoint consumes good keys only, so a resumed epoch reads its bad keys again:
    its budget is a share of the whole epoch, as the uninterrupted one's (it was of the
    keys left, and a run resumed near an epoch's end broke it on data that passes)."""
    from raypipe.plan.ranktasks import RankTasks

    lst = listing([5, 1, 9, 3, 12, 7])
    consumed = np.zeros(37, bool)
    consumed[:33] = True
    for world in (1, 2, 3):
        fresh, resumed = plans(lst, world), plans(lst, world, resume_epoch=0, consumed=consumed)
        for a, b in zip(fresh, resumed, strict=True):
            ta = RankTasks.of(lst, a, range(2), shared_skips=shared)
            tb = RankTasks.of(lst, b, range(2), shared_skips=shared)
            assert tb.samples(0) == ta.samples(0) and tb.samples(1) == ta.samples(1)
            assert sum(b.sizes(0)) == 4  # what the resumed epoch reads: the keys left


@pytest.mark.parametrize("per_task", [1, 4, 5, 100])
@pytest.mark.parametrize("sizes", [[5, 1, 9, 3, 12, 7], [1] * 30])
def test_tasks_cover_the_rank_keys_and_hold_at_most_per_task_samples(sizes, per_task):
    """A task reads ``per_task`` image files, or one piece of at most ``per_task`` samples
    of one shard: what a task returns is bounded by ``files_per_task`` whatever a tar or
    Parquet shard holds (a shard of 12 with per_task 5: pieces of 4)."""
    lst = listing(sizes)
    for plan in plans(lst, 2, per_task=per_task):
        keys, tasks = plan.keys(1), plan.tasks(1)
        assert tasks[0][0] == 0 and tasks[-1][1] == len(keys)
        assert all(a[1] == b[0] for a, b in zip(tasks[:-1], tasks[1:], strict=True))
        for lo, hi in tasks:
            assert 0 < hi - lo <= per_task
            if not plan.one_per_shard:
                assert len(np.unique(plan.shard_of(keys[lo:hi]))) == 1
        if not plan.one_per_shard:  # the fewest pieces: whole runs where they fit
            runs = np.unique(plan.shard_of(keys), return_counts=True)[1]
            assert len(tasks) == int(np.ceil(runs / per_task).sum())


@pytest.mark.parametrize("sizes", [*SIZES, [1] * 7, [1, 1, 2, 1], [3, 0, 4, 0, 2]])
@pytest.mark.parametrize("world, per_task", [(1, 1), (3, 1), (2, 4), (8, 32), (4, 64)])
def test_tasks_are_the_runs_of_shards_in_the_rank_keys(sizes, world, per_task):
    """Tasks are planned from the shards (from the rank's key count alone where each
    holds one sample), not from the keys: the same bounds as the runs of shards in the
    rank's keys give, fresh and resumed."""
    lst = listing(sizes)
    consumed = np.random.default_rng(world).random(sum(sizes)) < 0.3
    for kw in ({}, {"resume_epoch": 1, "consumed": consumed}, {"shuffle": False}):
        for plan in plans(lst, world, per_task=per_task, **kw):
            assert plan.one_per_shard == (set(sizes) == {1})
            for epoch in range(3):
                keys = plan.keys(epoch)
                runs = np.flatnonzero(np.diff(plan.shard_of(keys), prepend=-1))
                if plan.one_per_shard:
                    runs = runs[::per_task]
                else:  # each run of a shard in near-equal pieces of at most per_task keys
                    ends = [*runs[1:].tolist(), len(keys)][: len(runs)]
                    runs = np.array([piece[0] for a, b in zip(runs, ends, strict=True)
                                     for piece in np.array_split(np.arange(a, b),
                                                                 -(-(b - a) // per_task))],
                                    dtype=np.int64)  # fmt: skip
                ends = [*runs[1:].tolist(), len(keys)] if len(keys) else []
                expect = list(zip(runs.tolist(), ends, strict=True))
                assert plan.tasks(epoch) == expect


def test_the_task_table_lists_every_epochs_tasks_in_order():
    from raypipe.plan.ranktasks import task_table

    for sizes in ([1] * 50, [5, 1, 9, 3]):
        plan = plans(listing(sizes), 2, per_task=4)[1]
        table = task_table(plan, range(2, 5))
        expect = [(e, lo, hi) for e in range(2, 5) for lo, hi in plan.tasks(e)]
        assert table.dtype == np.int64 and table.tolist() == [list(r) for r in expect]
    assert task_table(plan, range(0)).shape == (0, 3)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("world, per_task", [(1, 1), (3, 1), (2, 4), (8, 32)])
def test_task_rows_read_exactly_the_task_keys(sizes, world, per_task):
    """The shard rows of a task (`RankTasks.rows`) name its keys and no other: members of a
    shard that are another task's or rank's, or consumed before a resume, are done."""
    from raypipe.plan.ranktasks import RankTasks
    from raypipe.plan.shards import SHARD_ROW, unpack_done

    lst = listing(sizes)
    consumed = np.random.default_rng(world).random(sum(sizes)) < 0.2
    for kw in ({}, {"resume_epoch": 1, "consumed": consumed}):
        for plan in plans(lst, world, per_task=per_task, **kw):
            tasks = RankTasks.of(lst, plan, range(3))
            for t in range(len(tasks)):
                epoch, rows = tasks.rows(t)
                assert list(rows) == list(SHARD_ROW)
                lo, hi = plan.tasks(epoch)[t - sum(len(plan.tasks(e)) for e in range(epoch))]
                read = []
                for row in zip(*rows.values(), strict=True):
                    path, first, n, label, done = row
                    shard = lst.shards[int(plan.shard_of(np.array([first]))[0])]
                    assert row[:4] == (shard.path, shard.first_key, shard.num_samples, shard.label)
                    mask = np.zeros(n, bool) if done == b"" else unpack_done(done, n)
                    read += (first + np.flatnonzero(~mask)).tolist()
                assert sorted(read) == sorted(plan.keys(epoch)[lo:hi].tolist())


def test_bad_rank_is_refused():
    with pytest.raises(ValueError, match="rank=2"):
        RankPlan.of(listing([3]), seed=0, shuffle=True, rank=2, world_size=2, per_task=1)


def split_of_all_keys(plan: RankPlan, epoch: int) -> np.ndarray:
    """What a rank's keys are by definition: its slice of every key of the epoch."""
    return np.array_split(plan.all_keys(epoch), plan.world_size)[plan.rank]


@pytest.mark.parametrize("trial", range(40))
def test_a_rank_builds_its_slice_alone_as_the_split_of_the_whole_epoch(trial):
    rng = np.random.default_rng(trial)
    sizes = rng.integers(0, 9, rng.integers(1, 30)).tolist()  # empty shards too
    sizes[rng.integers(len(sizes))] += 1  # at least one sample
    world = int(rng.integers(1, 12))
    kw = {"shuffle": bool(rng.integers(2)), "resume_epoch": -1, "consumed": None}
    if rng.integers(2):  # a resumed epoch: any keys consumed, even all of them
        kw["resume_epoch"] = 1
        kw["consumed"] = rng.random(sum(sizes)) < rng.choice([0.0, 0.3, 0.9, 1.0])
    for plan in plans(listing(sizes), world, **kw):
        for epoch in range(3):
            assert np.array_equal(plan.keys(epoch), split_of_all_keys(plan, epoch)), (sizes, world)
            assert plan.keys(epoch).dtype == np.int64 and not plan.keys(epoch).flags.writeable


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_weights_even_out_the_slices_weight(world):
    lst = listing([40, 37, 24])
    weights = np.random.default_rng(0).integers(1, 100, lst.num_samples)
    ranks = plans(lst, world, weights=weights)
    for epoch in (0, 1):
        order = ranks[0].all_keys(epoch)
        np.testing.assert_array_equal(np.sort(order), np.arange(lst.num_samples))
        parts = [plan.keys(epoch) for plan in ranks]  # each rank's plan, made on its own
        np.testing.assert_array_equal(np.concatenate(parts), order)  # runs of it, in rank order
        assert all(len(p) > 0 for p in parts)
        assert all(plan.sizes(epoch) == [len(p) for p in parts] for plan in ranks)
        sums = [int(weights[p].sum()) for p in parts]
        assert max(sums) - min(sums) <= 2 * weights.max(), sums
    with pytest.raises(ValueError, match="weights has shape"):
        plans(lst, world, weights=weights[:-1])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("actors", [(1, 1), (2, 2), (8, 8), (6, 6), (1, 8), (3, 10), (5, 16)])
def test_the_ranks_pools_add_up_to_the_runs_and_a_fixed_pool_stays_fixed(actors, world_size):
    from raypipe.plan.rankplan import rank_pool

    shares = [rank_pool(actors, world_size, r) for r in range(world_size)]
    lo, hi = actors
    assert all(1 <= a <= b for a, b in shares)
    assert sum(a for a, _ in shares) == max(lo, world_size)  # at least one a rank
    assert sum(b for _, b in shares) == max(hi, sum(a for a, _ in shares))
    if lo == hi:  # min = max: no rank's pool follows (Ray Data keeps it there)
        assert all(a == b for a, b in shares), shares
    assert max(b for _, b in shares) - min(b for _, b in shares) <= 1  # even, in whole actors


def test_a_resumed_plan_crosses_the_store_with_its_consumed_keys_as_bits():
    """Every rank's tasks carry its plan to the workers (a pickle each): a resumed plan's
    consumed keys went as one byte per sample of the whole dataset (1 GB at 10⁹), and now
    go as one bit; the plan that arrives reads the same keys."""
    import pickle

    from raypipe.plan.rankplan import RankPlan

    counts = np.full(100, 800, dtype=np.int64)
    first = np.r_[0, np.cumsum(counts)[:-1]]
    consumed = np.random.default_rng(4).random(80_000) < 0.4
    plan = RankPlan(first, counts, 0, True, 3, 8, 256, resume_epoch=1, consumed=consumed)
    data = pickle.dumps(plan)
    assert len(data) < 80_000 // 8 + 4096
    back = pickle.loads(data)
    assert np.array_equal(back.consumed, consumed) and back.consumed.dtype == bool
    assert np.array_equal(back.keys(1), plan.keys(1))


def test_a_workers_cache_of_rank_keys_keeps_to_its_bytes():
    """A pooled worker kept the keys of its last 32 (plan, epoch): 313 MiB for a 1.28M-file
    folder at world size 1. Here 40 epochs of 2M keys (16 MB each): at most 64 MiB of them
    stay, the newest four always, and a hit is the keys themselves."""
    import gc
    import weakref

    plan = plans(listing([100_000] * 20), 1)[0]
    seen = []
    for epoch in range(40):
        keys = plan.keys(epoch)
        assert plan.keys(epoch) is keys  # a hit
        if epoch % 13 == 0:
            assert np.array_equal(keys, plan.all_keys(epoch))
        seen.append(weakref.ref(keys))
    del keys
    gc.collect()
    alive = [ref() for ref in seen if ref() is not None]
    assert sum(a.nbytes for a in alive) <= 64 << 20 and all(r() is not None for r in seen[-4:])
    big = plans(listing([1_000_000] * 10), 2)  # two ranks' 40 MB epochs, on one worker
    turn = [(p, e) for e in (0, 1) for p in big]  # both ranks at an epoch's turn
    newest = [p.keys(e) for p, e in turn]
    assert all(p.keys(e) is k for (p, e), k in zip(turn, newest, strict=True))  # all kept


def test_the_skip_budget_splits_a_packed_epoch_once(monkeypatch):
    """With packing a rank's share is the weighted split of the epoch's keys, and the
    skip budget asked for it at every flush of skips (~50 ms each at 10M documents)."""
    from raypipe.plan.ranktasks import RankTasks

    lst = listing([1] * 500)
    rng = np.random.default_rng(0)
    weights = rng.integers(1, 100, size=500)
    calls = []
    split = RankPlan.split

    def counted(self, epoch):
        calls.append(epoch)
        return split(self, epoch)

    plan = plans(lst, 4, weights=weights)[1]
    own, shared = (RankTasks.of(lst, plan, range(2), shared_skips=s) for s in (False, True))
    expect = [len(split(plan, e)[1]) for e in range(2)]
    monkeypatch.setattr(RankPlan, "split", counted)
    for _ in range(50):
        assert [own.samples(e) for e in range(2)] == expect
        assert [shared.samples(e) for e in range(2)] == [500, 500]
    assert sorted(calls) == [0, 1]
