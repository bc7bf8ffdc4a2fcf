"""Pipeline checkpoint cost: its size and write time, and a resumed epoch's first batch.

(1) a `PipelineState` of ImageNet's 1,281,167 training samples, half of them consumed
    (a mid-epoch checkpoint): bytes on disk, and the median time of ``save()`` (temp
    file + rename) and ``load()``; plus `merge_states` of 8 ranks' delivered keys.
(2) time to first batch of an epoch on a local Ray (started before timing): fresh, and
    resumed from a checkpoint with the epoch's first half consumed (load the state file,
    ``build_dataset(consumed=...)``, ``iter_torch_batches``); medians over repeats.

  python benchmarks/checkpoint.py
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from raypipe.config import PipelineConfig
from raypipe.resume import PipelineState, merge_states
from raypipe.sources import epoch_order, list_shards

IMAGENET = 1_281_167


def checkpoint_cost(n: int, repeats: int) -> dict:
    """(1) bytes, and median save / load / merge seconds for ``n`` samples."""
    rng = np.random.default_rng(0)
    consumed = rng.random(n) < 0.5
    state = PipelineState(3, 0, n, "0" * 32, consumed)
    keys = np.flatnonzero(consumed)
    rng.shuffle(keys)
    ranks = [{"keys": part} for part in np.array_split(keys, 8)]
    saves, loads, merges = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "raypipe_state.bin")
        for _ in range(repeats):
            t0 = time.perf_counter()
            size = state.save(path)
            t1 = time.perf_counter()
            back = PipelineState.load(path)
            t2 = time.perf_counter()
            merged = merge_states(ranks, n)
            t3 = time.perf_counter()
            saves.append(t1 - t0)
            loads.append(t2 - t1)
            merges.append(t3 - t2)
        assert np.array_equal(back.consumed, consumed) and np.array_equal(merged, consumed)
    return {
        "samples": n,
        "bytes": size,
        "bits_per_sample": 8 * size / n,
        "save_ms": 1e3 * statistics.median(saves),
        "load_ms": 1e3 * statistics.median(loads),
        "merge_8_ranks_ms": 1e3 * statistics.median(merges),
        "repeats": repeats,
    }


def make_shards(root: Path, shards: int, per_shard: int) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with tarfile.open(root / f"train-{s:05d}.tar", "w") as tar:
            for i in range(per_shard):
                small = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
                buf = io.BytesIO()
                Image.fromarray(small).resize((256, 192)).save(buf, format="JPEG")
                for ext, data in (("jpg", buf.getvalue()), ("cls", str(i % 10).encode())):
                    info = tarfile.TarInfo(f"s{s:04d}_{i:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return root


def first_batch(config: PipelineConfig, state_path: str | None) -> float:
    """Seconds from nothing (or a state file) to the first batch in hand."""
    from raypipe import build_dataset, iter_torch_batches

    t0 = time.perf_counter()
    consumed = PipelineState.load(state_path).consumed if state_path else None
    ds = build_dataset(config, epoch=1, consumed=consumed)
    it = iter_torch_batches(ds, batch_size=config.batch_size, device="cpu")
    next(iter(it))
    seconds = time.perf_counter() - t0
    it.close()
    return seconds


def resume_cost(root: Path, repeats: int) -> dict:
    """(2) time to first batch, fresh and resumed halfway through the epoch."""
    import ray

    config = PipelineConfig(source=str(root), image_size=64, batch_size=64, actors=(1, 2))
    listing = list_shards(config)
    order = epoch_order(listing.shards, seed=config.seed, epoch=1, shuffle=True)
    consumed = np.zeros(listing.num_samples, bool)
    for shard in order[: len(order) // 2]:
        consumed[shard.first_key : shard.first_key + shard.num_samples] = True
    half = order[len(order) // 2]  # and half of the next shard: a partially read one
    consumed[half.first_key : half.first_key + half.num_samples // 2] = True
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "raypipe_state.bin")
        PipelineState(1, config.seed, listing.num_samples, "0" * 32, consumed).save(path)
        first_batch(config, None)  # warm-up: worker processes, imports
        fresh, resumed = [], []
        for _ in range(repeats):
            fresh.append(first_batch(config, None))
            resumed.append(first_batch(config, path))
    ray.shutdown()
    return {
        "samples": listing.num_samples,
        "shards": len(listing.shards),
        "consumed": int(consumed.sum()),
        "fresh_first_batch_s": statistics.median(fresh),
        "resumed_first_batch_s": statistics.median(resumed),
        "repeats": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=IMAGENET)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--resume-repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    machine = {"cpus": os.cpu_count(), "platform": platform.platform()}
    cost = checkpoint_cost(args.samples, args.repeats)
    print(
        f"(1) checkpoint of {cost['samples']} samples: {cost['bytes']} bytes "
        f"({cost['bits_per_sample']:.4f} bits/sample); median save {cost['save_ms']:.2f} ms, "
        f"load {cost['load_ms']:.2f} ms, merge of 8 ranks {cost['merge_8_ranks_ms']:.2f} ms "
        f"({cost['repeats']} repeats)"
    )
    root = args.out / "checkpoint-wds"
    if not root.is_dir():
        make_shards(root, shards=32, per_shard=64)
    resume = resume_cost(root, args.resume_repeats)
    print(
        f"(2) first batch of an epoch ({resume['samples']} samples, {resume['shards']} shards): "
        f"fresh {resume['fresh_first_batch_s']:.2f} s, resumed with {resume['consumed']} "
        f"consumed {resume['resumed_first_batch_s']:.2f} s (median of {resume['repeats']})"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine, "checkpoint": cost, "resume": resume}
    (args.out / "checkpoint.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
