"""Where a stream of blocks lands in Ray's object store, at two settings of how often Ray
frees the objects no one holds (``free_objects_period_milliseconds``).

Each run starts a local Ray of its own (raypipe's, `raypipe.cli.localray.start`, with the
period set), then asks ``--blocks`` tasks for one block each (``--rows`` rows of 3×224×224
uint8, the size of a 256-row block by default), ``--in-flight`` at a time, and fetches and
copies each block out (as a rank copies it into a batch) and drops it before it asks for the
next: what a rank does with a stream of blocks.
Reported per period: the places the blocks took (distinct addresses in the driver's mapping
of the store), the span they cover, the run's seconds, and the page faults of this process
and of Ray's workers (each 4 KiB page a process meets in a new place costs one).

    python benchmarks/store_places.py --free-ms 1000 10

1000 ms is Ray's own default; the local Ray raypipe starts frees every 10 ms.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _faults(match: bytes) -> int:
    """Minor page faults of the processes whose command line holds ``match``."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if match in Path(f"/proc/{pid}/cmdline").read_bytes():
                total += int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
        except (OSError, ValueError, IndexError):
            continue
    return total


def one_run(free_ms: int, blocks: int, rows: int, in_flight: int, store: int) -> dict:
    import numpy as np
    import ray

    from raypipe.cli import localray

    localray.start("local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                   object_store_memory=store, configure_logging=False,
                   system_config={"free_objects_period_milliseconds": free_ms})  # fmt: skip

    @ray.remote
    def block(i: int):
        return [{"image": np.full((rows, 3, 224, 224), i % 251, dtype=np.uint8)}]

    try:
        ray.get([block.remote(i) for i in range(2)])  # the workers up before the clock
        places, window = [], collections.deque()
        batch = np.zeros((rows, 3, 224, 224), dtype=np.uint8)  # the rank's own buffer
        me, workers = _faults(b"store_places"), _faults(b"ray::")
        t0, submitted = time.perf_counter(), 0
        while submitted < blocks or window:
            while submitted < blocks and len(window) < in_flight:
                window.append(block.remote(submitted))
                submitted += 1
            got = ray.get(window.popleft())
            places.append(got[0]["image"].__array_interface__["data"][0])
            np.copyto(batch, got[0]["image"])
            del got
        seconds = time.perf_counter() - t0
        me, workers = _faults(b"store_places") - me, _faults(b"ray::") - workers
    finally:
        localray.shutdown()
    return {"free_ms": free_ms, "places": len(set(places)),
            "span_mib": (max(places) - min(places)) / (1 << 20) + rows * 3 * 224 * 224 / (1 << 20),
            "seconds": seconds, "driver_faults": me, "worker_faults": workers}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--free-ms", type=int, nargs="+", default=[1000, 10],
                   help="the periods to run, ms (default: 1000 10)")  # fmt: skip
    p.add_argument("--blocks", type=int, default=200)
    p.add_argument("--rows", type=int, default=256, help="rows of 3x224x224 uint8 a block")
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--store-gib", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = p.parse_args(argv)
    if min(args.free_ms) < 0 or args.blocks < 1 or args.rows < 1 or args.in_flight < 1:
        p.error("--free-ms >= 0, --blocks, --rows and --in-flight >= 1")
    runs = []
    for ms in args.free_ms:
        r = one_run(ms, args.blocks, args.rows, args.in_flight, args.store_gib << 30)
        print(f"free every {ms:>5} ms: {args.blocks} blocks at {r['places']:>4} places over "
              f"{r['span_mib']:,.0f} MiB in {r['seconds']:.2f} s; page faults: driver "
              f"{r['driver_faults']:,}, workers {r['worker_faults']:,}", flush=True)  # fmt: skip
        runs.append(r)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": platform.platform(), "cpus": os.cpu_count(), "args": vars(args)
              | {"out": str(args.out)}, "runs": runs}  # fmt: skip
    (args.out / "store_places.json").write_text(json.dumps(result, indent=1))
    return runs


if __name__ == "__main__":
    main()
