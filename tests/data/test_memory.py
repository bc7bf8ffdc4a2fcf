"""Bounded memory: an epoch many times the object store, read by slow ranks, streams
through a small store without spilling or dying; a block that cannot fit is refused."""

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
        source=str(datasets["imagefolder"]), image_size=512, rows_per_block=2000
    )  # 1.5 GiB blocks, the session's store is 1 GiB
    for make in (lambda: build_dataset(config), lambda: Pipeline(config, epochs=1)):
        with pytest.raises(ValueError, match=r"rows_per_block=2000 x image_size=512.*MiB"):
            make()


@pytest.mark.slow
def test_ten_stores_of_data_stream_through_a_small_store(tmp_path):
    """2 epochs of 4,608 images at 224² (662 MiB each, 10.3× a 128 MiB store over the
    run), 2 ranks that take 0.15 s per batch of 64 (slower than the pool): every epoch
    exactly once, the store never over its capacity, nothing spilled, nothing killed."""
    data = small_jpegs(tmp_path / "data", N_MEMORY)
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.memory_driver", str(data), str(out), str(STORE_MIB),
         "2", "0.15"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    for epoch in range(2):
        keys = [k for rank in report["keys"] for batch in rank[epoch] for k in batch]
        assert len(keys) == len(set(keys)) == N_MEMORY  # 2 ranks × 36 batches of 64
        assert all(s[epoch]["batches"] == 36 for s in report["stats"])
    peaks = report["peaks"]
    print(json.dumps(peaks))
    assert peaks["samples"] >= 20, f"the sampler should have run through the epochs: {peaks}"
    assert peaks["store_mib"] <= STORE_MIB  # backpressure held it, no fallback allocation
    assert peaks["spilled_mib"] <= STORE_MIB / 4  # 2.5% of the data at most, 0 when seen
    # Ray's memory monitor says one of these when it kills a worker
    assert "OutOfMemory" not in proc.stderr and "low on memory" not in proc.stderr


def test_default_blocks_are_one_batch_unless_the_store_is_too_small(ray_session, datasets):
    from raypipe.data.blocksize import sized_blocks

    store = min(n["Resources"]["object_store_memory"] for n in ray_session.nodes() if n["Alive"])
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=224, batch_size=64)
    assert config.rows_per_block is None
    assert sized_blocks(config).rows_per_block == 64  # 9 MiB: under 5 % of the 1 GiB store
    big = sized_blocks(config.replace(batch_size=4096))  # 588 MiB batches
    assert (
        big.rows_per_block * 3 * 224 * 224 <= 0.02 * store < (big.rows_per_block + 1) * 3 * 224**2
    )
    assert sized_blocks(config.replace(rows_per_block=7)).rows_per_block == 7  # set: kept
