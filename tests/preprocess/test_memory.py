"""Bounded memory with the defaults: epochs many times the object store, read by slow ranks,
stream through a small store without spilling or dying; sizes that cannot fit are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from raypipe import Pipeline, PipelineConfig, build_dataset

ROOT = Path(__file__).resolve().parents[2]
STORE_MIB = 128
N_MEMORY = 4608


def small_jpegs(root: Path, n: int, *, seed: int = 0, side: int = 48) -> Path:
    """``n`` side×side JPEGs (48 by default) in two classes: cheap to decode, 147 KiB each
    at 224²."""
    rng = np.random.default_rng(seed)
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        img = Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).resize(
            (side, side)
        )
        img.save(root / ("a" if i % 2 else "b") / f"{i:05d}.jpg", quality=80)
    return root


def test_a_block_larger_than_the_object_store_is_refused_before_work(ray_session, datasets):
    config = PipelineConfig(
        source=str(datasets["imagefolder"]), image_size=512, rows_per_block=2000
    )  # 1.5 GiB blocks, the session's store is 1 GiB
    for make in (lambda: build_dataset(config), lambda: Pipeline(config, epochs=1)):
        with pytest.raises(ValueError, match=r"rows_per_block=2000 x image_size=512.*MiB"):
            make()


def run_memory_driver(data: Path, out: Path, epochs: int, pause_s: float,
                      settings: dict | None = None) -> dict:  # fmt: skip
    """`tests.memory_driver` with every size setting at its default (batch 64 at 224²),
    and ``settings`` (other config fields)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.memory_driver", str(data), str(out), str(STORE_MIB),
         str(epochs), str(pause_s), json.dumps(settings or {})],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # Ray's memory monitor says one of these when it kills a worker
    assert "OutOfMemory" not in proc.stderr and "low on memory" not in proc.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
def test_defaults_stream_ten_stores_of_data_through_a_small_store(tmp_path):
    """With every size setting at its default, 2 ranks that take 0.15 s per batch of 64
    (slower than the pool) read 2 epochs of N images at 224² through a 128 MiB store, at
    N = 2,304 (5.2x the store over the run) and 4,608 (10.3x): every epoch exactly once,
    the store never over its capacity, at most one store spilled, and the peak memory of
    the process tree grows by less than two stores when the data doubles."""
    peaks = {}
    for n in (N_MEMORY // 2, N_MEMORY):
        report = run_memory_driver(small_jpegs(tmp_path / f"data{n}", n), tmp_path / f"{n}.json",
                                   epochs=2, pause_s=0.15)  # fmt: skip
        batches = n // (2 * 64)  # per rank and epoch
        for epoch in range(2):
            keys = [k for rank in report["keys"] for batch in rank[epoch] for k in batch]
            assert len(keys) == len(set(keys)) == 2 * 64 * batches
            assert all(s[epoch]["batches"] == batches for s in report["stats"])
        peaks[n] = p = report["peaks"]
        print(n, json.dumps(p))
        assert "error" not in p, p
        assert p["samples"] >= 10, f"the sampler should have run through the epochs: {p}"
        assert p["store_mib"] <= STORE_MIB  # backpressure held it, no fallback allocation
        assert p["spilled_mib"] <= STORE_MIB  # the guarantee's bound: one store
    growth = peaks[N_MEMORY]["pss_mib"] - peaks[N_MEMORY // 2]["pss_mib"]
    assert growth <= 2 * STORE_MIB, f"peak memory grew {growth:.0f} MiB with the data: {peaks}"


def test_default_blocks_are_one_batch_unless_the_store_is_too_small(ray_session, datasets):
    from raypipe.plan.blocksize import sized_blocks

    store = min(n["Resources"]["object_store_memory"] for n in ray_session.nodes() if n["Alive"])
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=224, batch_size=64)
    assert config.rows_per_block is None
    assert sized_blocks(config).rows_per_block == 64  # 9 MiB: under 5 % of the 1 GiB store
    big = sized_blocks(config.replace(batch_size=4096))  # 588 MiB batches
    assert (
        big.rows_per_block * 3 * 224 * 224 <= 0.02 * store < (big.rows_per_block + 1) * 3 * 224**2
    )
    assert sized_blocks(config.replace(rows_per_block=7)).rows_per_block == 7  # set: kept


def test_default_tasks_fit_the_ranks_share_of_the_store_and_set_ones_that_cannot_are_refused(
    ray_session, datasets
):
    from raypipe.plan.blocksize import TASK_SHARE, TASKS_IN_FLIGHT, sized_blocks, store_share

    sample = 3 * 224 * 224
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=224, batch_size=64)
    assert config.files_per_task is None
    assert sized_blocks(config).files_per_task == 256  # 2 actors x 2 x 37 MiB: under 1/4 GiB
    for world, actors in ((2, 1), (8, 4), (64, 2)):
        sized = sized_blocks(config, world_size=world, actors=actors)
        share, in_flight = store_share(world), actors * TASKS_IN_FLIGHT
        assert share == store_share(1) / min(world, 8)  # at most a node's 8 GPUs share it
        files = sized.files_per_task
        assert in_flight * files * sample <= TASK_SHARE * share  # fits ...
        assert files == 256 or TASK_SHARE * share < in_flight * (files + 1) * sample  # ... tightly
        assert sized.rows_per_block * sample <= 0.05 * share
    with pytest.raises(ValueError, match=r"^PipelineConfig\.files_per_task=256: 8 tasks in flight"
                       r".* need 294 MiB, more than one rank's object store \(128 MiB\): set "
                       r"files_per_task <= 111"):  # fmt: skip
        sized_blocks(config.replace(files_per_task=256), world_size=8, actors=4)
    with pytest.raises(ValueError, match=r"rows_per_block=1000 .* with 8 ranks \(128\.0 MiB\)"):
        sized_blocks(config.replace(rows_per_block=1000), world_size=8)  # 144 MiB blocks


def test_the_memory_cache_budget_comes_out_of_each_ranks_share_of_the_store(ray_session,
                                                                            datasets):  # fmt: skip
    """``cache="memory"`` keeps its pixels in the node's object store: blocks, tasks,
    read-ahead and lead are sized from the store less its budget (a quarter of the smallest
    store by default), never from the whole store."""
    from raypipe.plan import blocksize
    from raypipe.plan.blocksize import sized_blocks, store_share

    store = int(min(n["Resources"]["object_store_memory"] for n in ray_session.nodes()
                    if n["Alive"]))  # fmt: skip
    sample = 3 * 224 * 224
    plain = PipelineConfig(source=str(datasets["imagefolder"]), image_size=224, batch_size=64)
    cached = plain.replace(cache="memory")
    assert plain.cache_budget is None and cached.cache_budget is None  # the defaults
    for world in (1, 2, 8):
        ranks = min(world, 8)
        assert store_share(world, config=plain) == store_share(world) == store / ranks
        assert store_share(world, config=cached) == (store - store // 4) / ranks
        assert store_share(world, here=True, config=cached) == (store - store // 4) / ranks
        assert (
            blocksize.rank_store_limit(world, cached)
            == blocksize.READ_AHEAD_SHARE * (store - store // 4) / ranks
        )
    # 8 ranks, 4 actors each: the tasks in flight fit the reduced share, tightly
    share = (store - store // 4) / 8
    for config in (cached, cached.replace(cache_budget=store // 3)):
        if config.cache_budget is not None:
            share = (store - store // 3) / 8
        sized = sized_blocks(config, world_size=8, actors=4)
        files, in_flight = sized.files_per_task, 4 * blocksize.TASKS_IN_FLIGHT
        assert (
            in_flight * files * sample
            <= blocksize.TASK_SHARE * share
            < in_flight * (files + 1) * sample
        )
        assert files < sized_blocks(plain, world_size=8, actors=4).files_per_task
    # 2 ranks: the lead holds LEAD_SHARE of the reduced share, fewer batches than without
    lead = sized_blocks(cached, world_size=2).lead_batches
    batch = 64 * sample
    assert lead == int(blocksize.LEAD_SHARE * (store - store // 4) / 2 // batch)
    assert lead < sized_blocks(plain, world_size=2).lead_batches
    # an automatic block size aims at 2 % of the reduced share
    rows = sized_blocks(cached.replace(batch_size=4096)).rows_per_block
    assert rows == int((store - store // 4) * 0.02) // sample
    assert rows < sized_blocks(plain.replace(batch_size=4096)).rows_per_block
    # a disk cache is not in the store
    disk = plain.replace(cache="disk", cache_dir=str(datasets["imagefolder"].parent / "c"))
    assert sized_blocks(disk, world_size=8, actors=4) == sized_blocks(
        plain, world_size=8, actors=4
    ).replace(cache="disk", cache_dir=disk.cache_dir)
    with pytest.raises(ValueError, match=r"^PipelineConfig\.cache_budget=\d+: over half the "
                       r"smallest node's object store"):  # fmt: skip
        sized_blocks(cached.replace(cache_budget=store // 2 + 1))


def test_a_memory_cache_and_the_blocks_share_a_small_store_without_spilling(tmp_path):
    """``cache="memory"`` with its default budget (a quarter of a 128 MiB store, filled in
    epoch 0 by 320² images) and every size setting at its default: 2 slow ranks read 2
    epochs exactly once, with the cache serving epoch 1, and the blocks sized from the
    store less the cache's budget leave the store below its capacity, nothing spilled."""
    n = 640
    data = small_jpegs(tmp_path / "data", n, side=320)
    report = run_memory_driver(data, tmp_path / "out.json", epochs=2, pause_s=0.1,
                               settings={"cache": "memory"})  # fmt: skip
    batches = n // (2 * 64)
    for epoch in range(2):
        keys = [k for rank in report["keys"] for batch in rank[epoch] for k in batch]
        assert len(keys) == len(set(keys)) == 2 * 64 * batches
        assert all(s[epoch]["batches"] == batches for s in report["stats"])
    cache = report["stats"][0][1]["cache"]
    p = report["peaks"]
    print(json.dumps(p), json.dumps(cache))
    assert cache["entries"] > 0 and cache["refused"] > 0 and cache["hits"] > 0, cache
    assert cache["bytes"] <= STORE_MIB / 4 * 2**20  # the default budget
    assert "error" not in p and p["samples"] >= 5, p
    assert p["store_mib"] <= STORE_MIB and p["spilled_mib"] == 0, p
