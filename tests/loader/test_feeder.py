"""The rank's feeder alone (no Ray): blocks in, each epoch's batches out."""

from __future__ import annotations

import numpy as np

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
