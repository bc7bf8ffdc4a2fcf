"""The rank's feeder alone (no Ray): blocks in, each epoch's batches out."""

from __future__ import annotations

import time

import numpy as np

from raypipe.loader.demand import Demand
from raypipe.loader.feeder import Feeder
from raypipe.loader.ledger import Gate
from raypipe.plan.rankplan import RankPlan
from raypipe.plan.shards import Listing, Shard


def test_a_block_holding_rows_of_two_epochs_is_cut_between_them():
    """Ray Data may merge the outputs of consecutive tasks into one block (a long run's
    task ids come several to a block): rows of the next epoch in it go to that epoch."""
    listing = Listing("imagefolder", tuple(Shard(f"/d/{i}.jpg", i, 1) for i in range(8)))
    plan = RankPlan.of(listing, seed=0, shuffle=False, rank=0, world_size=1, per_task=4)
    keys = np.r_[plan.keys(0), plan.keys(1)]
    epochs = np.repeat([0, 1], 8)
    blocks = [
        {"key": keys[lo:hi], "epoch": epochs[lo:hi]} for lo, hi in ((0, 6), (6, 12), (12, 16))
    ]  # the middle block: rows 6-7 of epoch 0, 0-3 of epoch 1

    feeder = Feeder(lambda: (iter(blocks), None), plan, Gate(None, "run", 0, 2), range(2),
                    batch_size=2, prefetch=2)  # fmt: skip
    try:
        got = [[b["key"].tolist() for b in feeder.epoch(e)] for e in range(2)]
    finally:
        feeder.close()
    for e in range(2):
        assert sorted(k for b in got[e] for k in b) == list(range(8)), got
        assert feeder.counts(e)["good"] == 8


def test_data_waiting_on_a_long_step_reads_as_held_while_it_waits():
    """The follower reads ``held_s`` every ``follow_period_s`` (1 s): a trainer whose step
    is longer than that must read as one the data waits on, not only when the step ends."""
    listing = Listing("imagefolder", tuple(Shard(f"/d/{i}.jpg", i, 1) for i in range(64)))
    plan = RankPlan.of(listing, seed=0, shuffle=False, rank=0, world_size=1, per_task=8)
    keys = plan.keys(0)
    blocks = [{"key": keys[i : i + 8], "epoch": np.zeros(8, int)} for i in range(0, 64, 8)]
    demand = Demand()
    feeder = Feeder(lambda: (iter(blocks), None), plan, Gate(None, "run", 0, 1), range(1),
                    batch_size=2, prefetch=1, demand=demand)  # fmt: skip
    try:
        batches = feeder.epoch(0)
        next(batches)
        time.sleep(0.8)  # one long step: the queue is full, the next batch waits on it
        assert demand.held_s > 0.5, demand.held_s  # counted while it waits
    finally:
        feeder.close()


def test_an_epoch_left_early_is_drained_without_counting_as_handed_out():
    """The rows drained after a trainer leaves an epoch were counted as handed out: the
    progress line's rate and its count of the epoch's samples. (The drain's time is the
    loop's wait: it asked for the next epoch, which comes after it.)"""
    listing = Listing("imagefolder", tuple(Shard(f"/d/{i}.jpg", i, 1) for i in range(16)))
    plan = RankPlan.of(listing, seed=0, shuffle=False, rank=0, world_size=1, per_task=4)
    blocks = [{"key": plan.keys(e)[i : i + 4], "epoch": np.full(4, e)}
              for e in range(2) for i in range(0, 16, 4)]  # fmt: skip

    def slow():
        for block in blocks:
            time.sleep(0.02)
            yield block

    demand = Demand()
    feeder = Feeder(lambda: (slow(), None), plan, Gate(None, "run", 0, 2), range(2),
                    batch_size=2, prefetch=1, demand=demand)  # fmt: skip
    try:
        next(feeder.epoch(0))  # the trainer takes one batch of epoch 0, then leaves it
        epoch1 = [b["key"].tolist() for b in feeder.epoch(1)]  # epoch 0's rest drained first
    finally:
        feeder.close()
    assert sum(map(len, epoch1)) == 16 and demand.rows == 2 + 16 and demand.epoch_rows == 16
    assert feeder.counts(0)["good"] == 16  # read whole, as before


def test_an_execution_started_after_close_gave_up_waiting_is_stopped(monkeypatch):
    """A pool still starting when `close` stopped waiting for the thread (a cold cluster
    with RAY_DATA_DEFAULT_WAIT_FOR_MIN_ACTORS_S set) was never stopped: its actors and its
    resource request stayed for as long as the driver lived."""
    import threading

    from raypipe.loader import feeder as feeder_module

    monkeypatch.setattr(feeder_module, "JOIN_S", 0.2)
    listing = Listing("imagefolder", tuple(Shard(f"/d/{i}.jpg", i, 1) for i in range(8)))
    plan = RankPlan.of(listing, seed=0, shuffle=False, rank=0, world_size=1, per_task=4)
    up, first_block, stopped = threading.Event(), threading.Event(), []

    def blocks():
        first_block.wait(10)
        yield {"key": plan.keys(0), "epoch": np.zeros(8, int)}

    def start():
        up.wait(10)  # the pool comes up after close returned
        return blocks(), lambda: stopped.append(time.monotonic())

    feeder = Feeder(start, plan, Gate(None, "run", 0, 2), range(1), batch_size=2, prefetch=2)
    feeder.close()
    assert feeder._thread.is_alive() and not stopped
    up.set()
    deadline = time.monotonic() + 5
    while not stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    first_block.set()
    feeder._thread.join(5)
    assert len(stopped) == 1 and not feeder._thread.is_alive()  # stopped once, by the thread
