"""Memory on data larger than the object store: peak store use, bytes spilled and the
peak memory of the whole process tree, for epochs of 1×, 4× and 16× a small store.

Each point runs ``tests/memory_driver.py`` in a subprocess (a local Ray of its own with a
``--store-mib`` object store): a warm ``raypipe.Pipeline`` of 2 epochs, 2 ranks that take
``--pause-s`` per batch of 64 (slower than the pool, so backpressure has to hold the
data), 48×48 JPEGs decoded to 224² (147 KiB a sample), every size setting at its default;
and, at 16×, one size setting at a time set to 256 (files per task, rows per block).

    python benchmarks/memory.py

Prints a table, writes ``memory.json`` and ``memory.png`` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = 3 * 224 * 224  # bytes of one decoded sample


# Each variant changes one size setting from the defaults (None: every setting at its default).
sys.path.insert(0, str(ROOT))  # tests.memory_driver runs each point, tests.properties checks it

VARIANTS = {
    "defaults": {},
    "files_per_task=256": {"files_per_task": 256},
    "rows_per_block=256": {"rows_per_block": 256},
}


def exactly_once(keys: list[list[list[list[int]]]], n: int, batch: int = 64) -> bool:
    """Guarantees 1 and 2 in every epoch of ``keys[rank][epoch]`` (batches of keys), as the
    tests check them (`tests.properties.check_exactly_once_and_equal`): equal full batches,
    no key twice, none outside ``range(n)``, fewer left out than one batch a rank."""
    from tests.properties import check_exactly_once_and_equal

    epochs = {len(rank) for rank in keys}
    try:
        assert len(epochs) == 1, "ranks ran different numbers of epochs"
        for e in range(epochs.pop()):
            check_exactly_once_and_equal([rank[e] for rank in keys], batch_size=batch,
                                         good=range(n), left_over=len(keys) * batch - 1)  # fmt: skip
    except AssertionError:
        return False
    return True


def run_point(data: Path, n: int, store_mib: int, settings: dict, pause_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "tests.memory_driver", str(data), str(out), str(store_mib),
             "2", str(pause_s), json.dumps(settings)],
            cwd=ROOT, capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
        if proc.returncode != 0:
            return {"images": n, "settings": settings, "error": proc.stderr.strip()[-400:]}
        report = json.loads(out.read_text())
    return {
        "images": n, "data_x_store": n * SAMPLE / (store_mib << 20), "settings": settings,
        "exactly_once": exactly_once(report["keys"], n),
        "seconds": round(time.perf_counter() - t0, 1), **report["peaks"],
    }  # fmt: skip


def chart(points: list[dict], store_mib: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = [p for p in points if not p["settings"] and "error" not in p]
    x = [p["data_x_store"] for p in base]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(x, [p["store_mib"] for p in base], "o-", label="peak object store use")
    ax.plot(x, [p["spilled_mib"] for p in base], "s-", label="spilled to disk")
    ax.plot(x, [p["pss_mib"] for p in base], "^-", label="peak PSS, whole process tree")
    for p in points:
        if p["settings"] and "error" not in p:
            ax.plot([p["data_x_store"]], [p["spilled_mib"]], "x", ms=9,
                    label=f"spilled, {json.dumps(p['settings'])}")  # fmt: skip
    ax.axhline(store_mib, color="grey", ls=":", label=f"object store ({store_mib} MiB)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("one epoch's decoded data ÷ object store (2 epochs, 2 slow ranks)")
    ax.set_ylabel("MiB")
    ax.set_title("raypipe memory with the defaults: data many times the object store")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store-mib", type=int, default=128)
    p.add_argument("--pause-s", type=float, default=0.15, help="each rank's step per batch")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.preprocess.test_memory import small_jpegs

    args.out.mkdir(parents=True, exist_ok=True)
    per_store = (args.store_mib << 20) // SAMPLE
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for times in (1, 4, 16):
            data = small_jpegs(Path(tmp) / f"x{times}", per_store * times)
            names = VARIANTS if times == 16 else ["defaults"]
            for name in names:
                points.append(run_point(data, per_store * times, args.store_mib,
                                        VARIANTS[name], args.pause_s))  # fmt: skip
                print(json.dumps(points[-1]), flush=True)
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "store_mib": args.store_mib, "pause_s": args.pause_s, "points": points}  # fmt: skip
    print(f"\n{'data/store':>10s} {'settings':>22s} {'store MiB':>9s} {'spilled':>8s} "
          f"{'PSS MiB':>8s} {'s':>6s}  once")  # fmt: skip
    for q in points:
        name = ", ".join(f"{k}={v}" for k, v in q["settings"].items()) or "defaults"
        if "error" in q:
            print(f"{q['images']:10d} {name:>22s}  refused: {q['error'].splitlines()[-1]}")
            continue
        print(f"{q['data_x_store']:10.1f} {name:>22s} {q['store_mib']:9.0f} "
              f"{q['spilled_mib']:8.0f} {q['pss_mib']:8.0f} {q['seconds']:6.1f}  "
              f"{q['exactly_once']}")  # fmt: skip
    (args.out / "memory.json").write_text(json.dumps(result, indent=2))
    chart(points, args.store_mib, args.out / "memory.png")
    print(f"wrote {args.out / 'memory.json'} and {args.out / 'memory.png'}")
    return result


if __name__ == "__main__":
    main()
