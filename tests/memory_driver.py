"""Driver for tests/preprocess/test_memory.py and benchmarks/memory.py, run in a subprocess: a Ray of
its own with a small object store, an epoch whose decoded output is many times the store,
read by ranks slower than the pool.

``python -m tests.memory_driver DATA OUT STORE_MIB EPOCHS PAUSE_S [SETTINGS]``: a warm
`raypipe.Pipeline` of EPOCHS epochs over DATA with 2 ranks (threads), each sleeping PAUSE_S
per batch; the config is ``PipelineConfig(source=DATA, image_size=224, batch_size=64)``,
every other field at its default unless SETTINGS (a JSON object of fields) sets it; a sampler reads the object store's use and the bytes spilled every 0.2 s and
the proportional set size of this process tree. Writes keys per rank and epoch, the stats and
the peaks to OUT (JSON).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import ray

from raypipe import PipelineConfig, SkipLog
from raypipe.cli import localray
from tests.ranks import run_ranks

BATCH, IMAGE = 64, 224


def store_stats() -> tuple[float, float]:
    """(MiB in the object store now, MiB spilled so far) from Ray's memory summary, which
    prints its "Spilled" line only once something was spilled (``spill_time_total_s > 0``)."""
    from ray._private.internal_api import memory_summary

    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    used = re.search(r"Plasma memory usage (\d+) MiB", text)
    if used is None:
        raise RuntimeError(f"no object store usage in Ray's memory summary: {text!r}")
    spilled = re.search(r"Spilled (\d+) MiB", text)
    if spilled is None and "Spilled" in text:
        raise RuntimeError(f"unreadable spill line in Ray's memory summary: {text!r}")
    return float(used.group(1)), float(spilled.group(1)) if spilled else 0.0


def tree_pss_mib() -> float:
    """Proportional set size of this process and all its descendants (Ray's workers and the
    object store's shared pages counted once), from /proc."""
    parents: dict[int, int] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            parents[int(stat.split("/")[2])] = int(fields[1])
    tree, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0
    for pid in tree:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
    return total / 1024


def main(data: str, out: str, store_mib: str, epochs: str, pause_s: str,
         settings: str = "{}") -> None:  # fmt: skip
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=int(store_mib) << 20, configure_logging=False)  # fmt: skip
    ray.data.DataContext.get_current().enable_progress_bars = False
    peaks = {"store_mib": 0.0, "spilled_mib": 0.0, "pss_mib": 0.0, "samples": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            try:
                used, spilled = store_stats()
                pss = tree_pss_mib()
            except Exception as e:  # reported, not fatal: the test checks the count
                peaks["error"] = f"{type(e).__name__}: {e}"
                continue
            peaks["store_mib"] = max(peaks["store_mib"], used)
            peaks["spilled_mib"] = max(peaks["spilled_mib"], spilled)
            peaks["pss_mib"] = max(peaks["pss_mib"], pss)
            peaks["samples"] += 1

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    config = PipelineConfig(source=data, image_size=IMAGE, batch_size=BATCH, **json.loads(settings))
    t0 = time.perf_counter()
    try:
        keys, stats = run_ranks(config, 2, int(epochs), pause_s=(float(pause_s),),
                                skips=SkipLog.create(), normalize=False, keys_only=True)  # fmt: skip
    finally:
        done.set()
        sampler.join()
    seconds = time.perf_counter() - t0
    localray.shutdown()
    report = {"keys": keys, "stats": [[{k: v for k, v in s.items() if k != "stalls"}
                                       for s in rank] for rank in stats],
              "peaks": peaks, "seconds": seconds, "store_mib": int(store_mib),
              "settings": json.loads(settings)}  # fmt: skip
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
