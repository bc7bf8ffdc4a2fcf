"""The pool follows the trainer: what a slow trainer costs in preprocessing CPU and what a
fast one gets, from a fixed pool at its max and from the following pool, side by side;
and a run that is slow and then fast, drawn as actors over time against the trainer's wait.

Each run is ``tests/follow_driver.py`` in a subprocess (a local Ray of its own: 4 CPUs, a
100 MiB object store), one rank, 1024² PNGs decoded to 256², batches of 8:

  slow   the trainer takes ``--pause-s`` per batch       fixed (3, 3) vs following (1, 3)
  fast   the trainer takes no time                        fixed (3, 3) vs following (1, 3)

Per run: trained samples/s; *reserved* preprocessing CPU-s per trained sample (the pool's
actor-seconds × ``actor_cpus``, from a `raypipe.PoolWatch`: what the pool holds of a
cluster, what an autoscaler bills); *consumed* CPU-s per sample (the CPU of the whole
process tree, ``nodecpu.CpuMeter``). Medians over ``--repeats``, the kinds interleaved.

Settings: the pool is the actor pool (``compute="actors"``: the default plain tasks hold
no CPU between tasks and have no pool to watch). `BASE` sets ``follow_shrink_s=3``
(default 5) and ``files_per_task=8`` (default: sized from the object store) for a short
run; ``--defaults`` leaves both (`TUNED`) at raypipe's defaults, so that the tuned and
the default figures can stand side by side.

    python benchmarks/follow.py

Prints a table, writes ``follow.json`` and ``follow.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from nodecpu import CpuMeter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.pool.test_elastic import slow_images  # noqa: E402

# compute="actors": what this measures is the pool's actors, which hold their CPUs between
# tasks (a `PoolWatch` counts them); with the default plain tasks there is no pool to watch
# and the follower sets the tasks in flight instead
BASE = {"image_size": 256, "batch_size": 8, "files_per_task": 8, "actor_cpus": 1.0,
        "shuffle_files": False, "follow_shrink_s": 3.0, "compute": "actors"}  # fmt: skip
TUNED = ("files_per_task", "follow_shrink_s")  # BASE's settings that differ from the defaults
KINDS = {"fixed": {"actors": (3, 3), "follow": False}, "following": {"actors": (1, 3)}}


def run(data: Path, config: dict, slow_s: float, pause_s: float, base: dict = BASE) -> dict:
    with tempfile.TemporaryDirectory() as tmp, CpuMeter() as cpu:
        out = Path(tmp) / "r.json"
        proc = subprocess.run(
            [sys.executable, "-m", "tests.follow_driver", "local", str(data), str(out),
             json.dumps({**base, **config}), "1", str(slow_s), str(pause_s)],
            cwd=ROOT, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"driver failed:\n{proc.stderr[-4000:]}")
        report = json.loads(out.read_text())
    samples = sum(len(b) for b in report["keys"][0])  # rank 0's batches
    start = report["first"]["0"]
    elapsed = report["ended"] - start
    series = [(t, a) for t, a, _ in report["series"]]
    held = sum(a * (t1 - t0) for (t0, a), (t1, _) in zip(series, series[1:], strict=False))
    return {
        "samples": samples,
        "samples_s": round(samples / elapsed, 1),
        "reserved_cpu_s_per_sample": round(held * BASE["actor_cpus"] / samples, 4),
        "consumed_cpu_s_per_sample": round(cpu.seconds / samples, 4),
        "actors_max": max(a for _, a in series),
        "report": report,
    }


def median_of(runs: list[dict]) -> dict:
    keys = ("samples_s", "reserved_cpu_s_per_sample", "consumed_cpu_s_per_sample")
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in keys} | {
        "runs": [{k: r[k] for k in (*keys, "actors_max")} for r in runs]
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["stats"][0]["pool"]
    pool, shift = summary["series"], summary["started"] - report["watch_t0"]
    t = [p[0] + shift for p in pool]  # on the watch's clock
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.step([s[0] for s in report["series"]], [s[1] for s in report["series"]], where="post",
            label="actors alive (PoolWatch)", color="C0")  # fmt: skip
    ax.step(t, [p[2] for p in pool], where="post", label="follower's target", color="C1",
            linestyle="--")  # fmt: skip
    ax.set_xlabel("seconds")
    ax.set_ylabel("actors")
    ax.set_ylim(0, 4)
    wait = ax.twinx()
    wait.plot(t, [p[3] for p in pool], color="C2", alpha=0.6, label="trainer wait share")
    wait.set_ylabel("trainer wait share")
    wait.set_ylim(0, 1)
    fast = report["fast"]["0"]
    ax.axvline(fast, color="grey", linestyle=":")
    ax.text(fast, 3.7, " trainer speeds up", color="grey")
    lines = ax.get_legend_handles_labels()
    more = wait.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    ax.set_title("the pool follows a trainer that is slow (0.5 s a batch), then fast")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=720, help="images per slow/fast run")
    p.add_argument("--pause-s", type=float, default=0.5, help="slow trainer: s per batch of 8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--defaults", action="store_true",
                   help=f"leave {', '.join(TUNED)} at raypipe's defaults")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in BASE.items() if not (args.defaults and k in TUNED)}
    with tempfile.TemporaryDirectory() as tmp:
        data = slow_images(Path(tmp) / "small", args.images, side=1024)
        runs: dict[str, list[dict]] = {}
        for i in range(args.repeats):
            for phase, slow_s in (("slow", 1e9), ("fast", 0.0)):
                kinds = list(KINDS.items())
                for kind, config in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:  # rotated
                    r = run(data, config, slow_s, args.pause_s, base)
                    runs.setdefault(f"{phase}/{kind}", []).append(r)
                    print(f"repeat {i} {phase:<4} {kind:<9} {r['samples_s']:7.1f} samples/s  "
                          f"reserved {r['reserved_cpu_s_per_sample']:.4f}  consumed "
                          f"{r['consumed_cpu_s_per_sample']:.4f} CPU-s/sample  "
                          f"actors max {r['actors_max']}", flush=True)  # fmt: skip
        big = slow_images(Path(tmp) / "big", 1200, side=1024)
        both = run(big, KINDS["following"], 20.0, args.pause_s, base)
    results = {k: median_of(v) for k, v in runs.items()}
    results["settings"] = {"base": base, "kinds": KINDS, "defaults": args.defaults}
    fixed, follow = results["slow/fixed"], results["slow/following"]
    results["slow_reserved_ratio"] = round(
        follow["reserved_cpu_s_per_sample"] / fixed["reserved_cpu_s_per_sample"], 3
    )
    results["fast_samples_s_ratio"] = round(
        results["fast/following"]["samples_s"] / results["fast/fixed"]["samples_s"], 3
    )
    results["slow_then_fast"] = {"series": both["report"]["series"],
                                 "pool": both["report"]["stats"][0]["pool"],
                                 "fast_at": both["report"]["fast"]["0"]}  # fmt: skip
    results["machine"] = {"cpus": __import__("os").cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()}  # fmt: skip
    print("\n| trainer | pool | samples/s | reserved CPU-s/sample | consumed CPU-s/sample |")
    print("|---|---|---:|---:|---:|")
    for name in ("slow/fixed", "slow/following", "fast/fixed", "fast/following"):
        r = results[name]
        phase, kind = name.split("/")
        print(f"| {phase} | {kind} | {r['samples_s']} | {r['reserved_cpu_s_per_sample']} | "
              f"{r['consumed_cpu_s_per_sample']} |")  # fmt: skip
    print(
        f"slow: following reserves {results['slow_reserved_ratio']}x the fixed pool's CPU; "
        f"fast: following trains at {results['fast_samples_s_ratio']}x the fixed pool"
    )
    (out / "follow.json").write_text(json.dumps(results, indent=1))
    plot(both["report"], out / "follow.png")
    print(f"wrote {out / 'follow.json'} and {out / 'follow.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
