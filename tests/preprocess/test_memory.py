"""Bounded memory with the defaults: epochs many times the object store, read by slow ranks,
stream through a small store without spilling or dying; sizes that cannot fit are refused."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from raypipe import Pipeline, PipelineConfig, build_dataset

ROOT = Path(__file__).resolve().parents[2]
STORE_MIB = 128
BLOCK_MIB = 64 * 3 * 224 * 224 / 2**20  # a default block: one batch of 64 at 224², 9.2 MiB
N_MEMORY = 4608


def small_jpegs(root: Path, n: int, *, seed: int = 0) -> Path:
    """``n`` 48×48 JPEGs in two classes: cheap to decode, 147 KiB each at 224²."""
    rng = np.random.default_rng(seed)
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        img = Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).resize((48, 48))
        img.save(root / ("a" if i % 2 else "b") / f"{i:05d}.jpg", quality=80)
    return root


def test_a_block_larger_than_the_object_store_is_refused_before_work(ray_session, datasets):
    config = PipelineConfig(
        source=str(datasets["imagefolder"]), image_size=512, rows_per_block=2000, batch_size=8
    )  # 1.5 GiB blocks, the session's store is 1 GiB
    for make in (lambda: build_dataset(config), lambda: Pipeline(config, epochs=1)):
        with pytest.raises(ValueError, match=r"rows_per_block=2000 x image_size=512.*MiB"):
            make()


def run_memory_driver(data: Path, out: Path, epochs: int, pause_s: float) -> dict:
    """`tests.memory_driver` with every size setting at its default (batch 64 at 224²)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.memory_driver", str(data), str(out), str(STORE_MIB),
         str(epochs), str(pause_s)],
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
    the store never over its capacity, at most two blocks spilled (none in the runs here),
    and the peak memory of the process tree grows by less than half a store when the data
    doubles (24 MiB here, of the 662 MiB more that the ranks read: a leak of a tenth of
    what they read would show)."""
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
        assert p["spilled_mib"] <= 2 * BLOCK_MIB, p  # blocks of one batch keep it from spilling
    growth = peaks[N_MEMORY]["pss_mib"] - peaks[N_MEMORY // 2]["pss_mib"]
    assert growth <= STORE_MIB / 2, f"peak memory grew {growth:.0f} MiB with the data: {peaks}"


def small_shards(root: Path, n: int, shards: int) -> Path:
    """`small_jpegs` as ``shards`` WebDataset tars of ``n // shards`` samples each."""
    images = sorted(small_jpegs(root / "images", n).rglob("*.jpg"))
    for s, part in enumerate(np.array_split(np.arange(n), shards)):
        with tarfile.open(root / f"shard-{s:03d}.tar", "w") as tar:
            for i in part.tolist():
                tar.add(images[i], f"{i:05d}.jpg")
                label = io.BytesIO(str(i % 2).encode())
                info = tarfile.TarInfo(f"{i:05d}.cls")
                info.size = len(label.getvalue())
                tar.addfile(info, label)
    shutil.rmtree(root / "images")
    return root


@pytest.mark.slow
def test_defaults_stream_shards_larger_than_the_store_through_it(tmp_path):
    """A WebDataset shard is read in pieces of ``files_per_task`` samples, as an image
    folder's files are: two tars of 1,152 images, each 165 MiB decoded at 224² (more than the
    128 MiB store), stream through it with the defaults, every key once, without spilling
    (a task that returned a whole shard spilled 172 MiB of 344 here)."""
    report = run_memory_driver(small_shards(tmp_path / "wds", N_MEMORY // 2, 2),
                               tmp_path / "wds.json", epochs=1, pause_s=0.15)  # fmt: skip
    keys = [k for rank in report["keys"] for batch in rank[0] for k in batch]
    assert len(keys) == len(set(keys)) == N_MEMORY // 2
    p = report["peaks"]
    assert "error" not in p and p["samples"] >= 5, p
    assert p["store_mib"] <= STORE_MIB and p["spilled_mib"] <= 2 * BLOCK_MIB, p


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


def test_a_sample_with_no_image_is_sized_from_its_stored_bytes(ray_session, tmp_path):
    from raypipe.plan.blocksize import NO_IMAGE_EXPANSION, sample_bytes, sized_blocks
    from raypipe.plan.shards import list_shards
    from tests.preprocess.test_samples import make_tokens

    make_tokens(tmp_path, [3000, 1000], max_len=500)  # 250 tokens a document on average
    config = PipelineConfig(source=str(tmp_path), image_column=None, batch_size=64)
    listing = list_shards(config)
    stored = sum(p.stat().st_size for p in tmp_path.glob("*.parquet")) / 4000
    assert listing.stored_per_sample == pytest.approx(stored)
    assert sample_bytes(config, listing) == int(NO_IMAGE_EXPANSION * stored)
    assert sample_bytes(config.replace(image_column="image"), listing) == 3 * 224**2
    sized = sized_blocks(config, listing=listing)  # pieces of a shard: no cap of 256 files
    assert sized.files_per_task > 256 and sized.rows_per_block == 64
    with pytest.raises(ValueError, match=r"^PipelineConfig\.rows_per_block=10000000 samples of "
                       r"about \d+ KiB \(4x their size on storage\) make blocks of [\d.]+ MiB, "
                       r"more than one rank's object store \(1024\.0 MiB\): lower "
                       r"rows_per_block$"):  # fmt: skip
        sized_blocks(config.replace(rows_per_block=10_000_000), listing=listing)
