"""What a listing costs each rank: a source of ``--shards`` image files (ImageNet's training
set has 1,281,167), pickled as the driver sends it to every rank, and unpickled there.

Reported (medians of ``--rounds``): the pickled bytes, the seconds to pickle and to
unpickle, the seconds to compute its fingerprint (the dataset's name in every checkpoint,
once a run), and the heap the unpickled listing holds (``tracemalloc``, in one more pass).
No files are made: the listing is built from ImageNet-like paths
(``/data/imagenet/train/n01440764/n01440764_10026.JPEG``), 1,000 classes.

    python benchmarks/listing.py [--shards 1281167] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import platform
import statistics
import time
import tracemalloc
from pathlib import Path

from raypipe.plan.shards import Listing, Shard


def imagenet_like(n: int) -> Listing:
    per_class = -(-n // 1000)
    shards = tuple(
        Shard(f"/data/imagenet/train/n{c:08d}/n{c:08d}_{i}.JPEG", i, 1, c)
        for i, c in ((i, i // per_class) for i in range(n))
    )
    return Listing("imagefolder", shards, tuple(f"n{c:08d}" for c in range(1000)))


def one_round(listing: Listing) -> dict:
    t0 = time.perf_counter()
    blob = pickle.dumps(listing, protocol=5)
    t1 = time.perf_counter()
    again = pickle.loads(blob)
    t2 = time.perf_counter()
    again.fingerprint  # noqa: B018  (what every checkpoint names: computed once a run)
    t3 = time.perf_counter()
    del again
    gc.collect()
    return {"pickled_mib": len(blob) / 2**20, "dump_s": t1 - t0, "load_s": t2 - t1,
            "fingerprint_s": t3 - t2}  # fmt: skip


def held_mib(blob: bytes) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        again = pickle.loads(blob)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del again
    return held / 2**20


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=1_281_167)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = p.parse_args(argv)
    if args.shards < 1 or args.rounds < 1:
        p.error("--shards and --rounds: at least 1")
    listing = imagenet_like(args.shards)
    rounds = [one_round(listing) for _ in range(args.rounds)]
    result = {
        "machine": platform.platform(),
        "args": vars(args) | {"out": str(args.out)},
        "rounds": rounds,
        "median": {k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
        "held_mib": held_mib(pickle.dumps(listing, protocol=5)),
    }
    m = result["median"]
    print(f"{args.shards:,} shards: pickled {m['pickled_mib']:.1f} MiB in {m['dump_s']:.3f} s, "
          f"unpickled in {m['load_s']:.3f} s, holding {result['held_mib']:.1f} MiB; "
          f"fingerprint in {m['fingerprint_s']:.2f} s")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "listing.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
