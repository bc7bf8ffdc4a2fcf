"""Driver for tests/preprocess/test_seeds.py, run in a subprocess: a Ray of its own whose workers
sleep a random time before every decode, so that blocks finish in a different order on
every run.

``python -m tests.seed_driver SOURCE OUT [defaults]``: for each run in RUNS (world size,
actors, a slow rank), every epoch of every rank through `raypipe.Pipeline`, with small tasks
and blocks (many of them to finish out of order), or with ``defaults`` every size setting
at its default and the two-rank runs only; writes
``{run name: {"keys": [[keys of rank r in epoch e, in order] ...], "crcs": the same shape,
each key's image's CRC-32, "stats": ...}}`` as JSON to OUT.
"""

from __future__ import annotations

import json
import sys
import time
import zlib

import numpy as np
import ray

from raypipe import PipelineConfig, SkipLog
from raypipe.cli import localray
from tests.ranks import run_ranks

EPOCHS, BATCH = 2, 16
# name: (world size, PipelineConfig.actors, seconds each rank sleeps per batch)
RUNS = {
    "w1-a": (1, (1, 1), (0.0,)),
    "w1-b": (1, (2, 2), (0.01,)),
    "w2-a": (2, (2, 2), (0.0, 0.0)),
    "w2-c": (2, (2, 4), (0.015, 0.0)),
}


def jitter() -> None:
    """Worker setup: every decode waits 0-12 ms, drawn from the OS's randomness."""
    import random

    import raypipe.preprocess.actor as pipeline

    rng, decode = random.SystemRandom(), pipeline.decode_crop

    def slow_decode(*args, **kwargs):
        time.sleep(rng.random() * 0.012)
        return decode(*args, **kwargs)

    pipeline.decode_crop = slow_decode


def run(config: PipelineConfig, world: int, pauses: tuple[float, ...]) -> dict:
    out, stats = run_ranks(config, world, EPOCHS, pause_s=pauses, skips=SkipLog.create(),
                           normalize=False)  # fmt: skip
    keys = [[[b["key"].tolist() for b in epoch] for epoch in rank] for rank in out]
    crcs = [[[[zlib.crc32(np.asarray(image).tobytes()) for image in b["image"]] for b in epoch]
             for epoch in rank] for rank in out]  # fmt: skip
    stats = [[{k: v for k, v in s.items() if k != "stalls"} for s in rank] for rank in stats]
    return {"keys": keys, "crcs": crcs, "stats": stats}


def main(source: str, out: str, sizes: str = "small") -> None:
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 << 20, configure_logging=False,
             runtime_env={"worker_process_setup_hook": jitter})  # fmt: skip
    ray.data.DataContext.get_current().enable_progress_bars = False
    config = PipelineConfig(source=source, image_size=8, batch_size=BATCH, seed=7)
    runs = {n: r for n, r in RUNS.items() if r[0] == 2}
    if sizes != "defaults":
        config, runs = config.replace(files_per_task=6, rows_per_block=4, actor_cpus=0.5), RUNS
    report = {}
    try:
        for name, (world, actors, pauses) in runs.items():
            t0 = time.perf_counter()
            report[name] = run(config.replace(actors=actors), world, pauses)
            print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        localray.shutdown()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
