"""`raypipe.train.checkpoint.any_rank`, the OR of the ranks' consumed keys behind
`Loader.state_dict`, in two real gloo processes (a file store; gloo on loopback)."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np


def _rank(rank: int, store: str, world_size, out) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist

    from raypipe.train.checkpoint import any_rank

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mine = np.zeros(20, dtype=bool)
        mine[rank * 3 : rank * 3 + 3] = True  # rank 0: keys 0-2, rank 1: keys 3-5
        out.put((rank, np.flatnonzero(any_rank(mine, world_size=world_size)).tolist()))
    finally:
        dist.destroy_process_group()


def _both(tmp_path, world_size) -> dict[int, list[int]]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    store = str(tmp_path / f"store-{world_size}")
    procs = [ctx.Process(target=_rank, args=(r, store, world_size, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return got


def test_the_ranks_keys_are_joined_over_the_loaders_own_ranks_only(tmp_path):
    """Loaders of two ranks (world_size=2, or None: the group's) hold the keys of both; a
    Loader of its own on each rank (world_size=1) holds its own: it took the other's, and a
    rank calling it alone waited forever for the other."""
    both = list(range(6))
    assert _both(tmp_path, 2) == {0: both, 1: both}
    assert _both(tmp_path, None) == {0: both, 1: both}
    assert _both(tmp_path, 1) == {0: [0, 1, 2], 1: [3, 4, 5]}
