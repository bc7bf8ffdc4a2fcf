"""Pipeline checkpoint cost: its size and write time, and a resumed epoch's first batch.

(1) a `PipelineState` of ImageNet's 1,281,167 training samples, half of them consumed
    (a mid-epoch checkpoint): bytes on disk, and the median time of ``save()`` (temp
    file + rename) and ``load()``; plus `merge_states` of 8 ranks' delivered keys.
(2) time to first batch of an epoch on a local Ray (started before timing): fresh, and
    resumed from a checkpoint with the epoch's first half consumed (load the state file,
    ``build_dataset(consumed=...)``, ``iter_torch_batches``); medians over repeats.
(3) the same through ``train_ddp`` (2 workers): seconds from the call to rank 0's first
    batch, fresh and with ``resume_from`` that checkpoint, after an untimed warm-up run;
    ``--train-repeats`` runs of each, fresh and resumed alternating (which goes first
    swaps every repeat): the median and the range of each figure.

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

from raypipe.cli import localray
from raypipe.config import PipelineConfig
from raypipe.plan.shards import epoch_order, list_shards
from raypipe.train.state import PipelineState, merge_states

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


def half_consumed(config: PipelineConfig, epoch: int) -> PipelineState:
    """A mid-epoch checkpoint: the first half of the epoch's shards read, and half of one more."""
    listing = list_shards(config)
    order = epoch_order(listing.shards, seed=config.seed, epoch=epoch, shuffle=True)
    consumed = np.zeros(listing.num_samples, bool)
    for shard in order[: len(order) // 2]:
        consumed[shard.first_key : shard.first_key + shard.num_samples] = True
    half = order[len(order) // 2]  # a partially read shard
    consumed[half.first_key : half.first_key + half.num_samples // 2] = True
    return PipelineState(epoch, config.seed, listing.num_samples, listing.fingerprint, consumed)


def resume_cost(config: PipelineConfig, repeats: int, tmp: str) -> dict:
    """(2) time to first batch, fresh and resumed halfway through the epoch."""
    state = half_consumed(config, epoch=1)
    path = os.path.join(tmp, "raypipe_state.bin")
    state.save(path)
    first_batch(config, None)  # warm-up: worker processes, imports
    fresh, resumed = [], []
    runs = [(fresh, None), (resumed, path)]
    for i in range(repeats):  # the order alternating, as in `train_cost`
        for times, state in runs if i % 2 == 0 else runs[::-1]:
            times.append(first_batch(config, state))
    return {
        "samples": state.num_samples,
        "shards": len(list_shards(config).shards),
        "consumed": int(state.consumed.sum()),
        "fresh_first_batch_s": statistics.median(fresh),
        "resumed_first_batch_s": statistics.median(resumed),
        "repeats": repeats,
    }


def _first_batch_loop(ctx) -> None:
    if ctx.rank == 0:  # Ray Train's part ends here: controller, workers, process group
        Path(ctx.loop_config["out"] + ".start").write_text(repr(time.time()))
    for _, batches in ctx.epochs():
        for _ in batches:
            if ctx.rank == 0:
                Path(ctx.loop_config["out"]).write_text(repr(time.time()))
            break


def train_cost(config: PipelineConfig, tmp: str, repeats: int) -> dict:
    """(3) seconds from the ``train_ddp`` call to rank 0's first batch, fresh and resumed:
    medians over ``repeats`` runs of each, with every run's value."""
    from raypipe import train_ddp

    folder = os.path.join(tmp, "checkpoint")
    os.makedirs(folder)
    half_consumed(config, epoch=0).save(os.path.join(folder, "raypipe_state.bin"))
    out = os.path.join(tmp, "first")
    runs: dict[str, list[float]] = {}
    kinds = [("fresh", None), ("resumed", folder)]
    order = [("warm_up", None)]  # Ray Train's first start, not timed
    for i in range(repeats):
        order += kinds if i % 2 == 0 else kinds[::-1]
    for label, resume_from in order:
        t0 = time.time()
        result = train_ddp(config, _first_batch_loop, num_workers=2, cpus_per_worker=0.5,
                           storage_path=os.path.join(tmp, "runs"), resume_from=resume_from,
                           loop_config={"out": out})  # fmt: skip
        assert result.error is None, result.error
        if label != "warm_up":
            runs.setdefault(f"{label}_first_batch_s", []).append(float(Path(out).read_text()) - t0)
            runs.setdefault(f"{label}_loop_start_s", []).append(
                float(Path(out + ".start").read_text()) - t0
            )
    found = {key: statistics.median(v) for key, v in runs.items()}
    spread = {key: [min(v), max(v)] for key, v in runs.items()}
    return {"workers": 2, "repeats": repeats, **found, "range": spread, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=IMAGENET)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--resume-repeats", type=int, default=5)
    parser.add_argument("--train-repeats", type=int, default=3)
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
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)  # fmt: skip
    ray.data.DataContext.get_current().enable_progress_bars = False
    config = PipelineConfig(
        source=str(root), image_size=64, batch_size=64, actors=(1, 1), actor_cpus=0.5
    )  # two rank pools + two workers fit 2 CPUs
    with tempfile.TemporaryDirectory() as tmp:
        resume = resume_cost(config, args.resume_repeats, tmp)
        print(
            f"(2) first batch of an epoch ({resume['samples']} samples, {resume['shards']} "
            f"shards): fresh {resume['fresh_first_batch_s']:.2f} s, resumed with "
            f"{resume['consumed']} consumed {resume['resumed_first_batch_s']:.2f} s "
            f"(median of {resume['repeats']})"
        )
        train = train_cost(config, tmp, args.train_repeats)
        r = train["range"]
        print(
            f"(3) train_ddp, 2 workers, call to first batch (median of {train['repeats']}, "
            f"range): fresh {train['fresh_first_batch_s']:.2f} s "
            f"({r['fresh_first_batch_s'][0]:.2f}-{r['fresh_first_batch_s'][1]:.2f}), resumed "
            f"{train['resumed_first_batch_s']:.2f} s ({r['resumed_first_batch_s'][0]:.2f}-"
            f"{r['resumed_first_batch_s'][1]:.2f}); the train loop started after "
            f"{train['fresh_loop_start_s']:.2f} s ({r['fresh_loop_start_s'][0]:.2f}-"
            f"{r['fresh_loop_start_s'][1]:.2f}) / {train['resumed_loop_start_s']:.2f} s "
            f"({r['resumed_loop_start_s'][0]:.2f}-{r['resumed_loop_start_s'][1]:.2f}) "
            f"(Ray Train's start-up)"
        )
    localray.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine, "checkpoint": cost, "resume": resume, "train_ddp": train}
    (args.out / "checkpoint.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
