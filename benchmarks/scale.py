"""raypipe's coordination at simulated scale, on one machine: what breaks first at 1,024 ranks.

No decoding and no trainers: the parts every rank and the driver run for coordination,
each at the size of a large run (10⁹ samples in 10⁵ shards by default), each beside the
way it was done before so that a change shows as a pair of numbers.

  plan    one rank's plan of an epoch (its keys and tasks), seconds and peak traced
          memory, for N ranks: today's (`RankPlan.keys`: the shards the rank's slice
          touches) and before (every key of the epoch, then the rank's slice). "before"
          runs at --before-samples (it needs 16 bytes per sample of the epoch).
  state   the resume state of N ranks each about 40 % into their slice of an epoch:
          bytes on disk and seconds to save and load; before: the raw bits (N/8 bytes).
  ledger  the equal-batches ledger (`raypipe.loader.ledger`, a real actor on a local
          Ray) and N simulated ranks on clean data, one block and one batch per 100 ms
          step: messages per rank per second and the wait on the ledger per step. The
          ranks are driven round-robin from one thread: every rank's block of a step is
          reported before any rank asks for its batch. With --ledger-steps steps.
          Then the reports per second one ledger actor serves, sent as fast as one
          driver can: the ranks it can serve at that many messages each.

    python benchmarks/scale.py [--ranks 8 64 256 1024] [--samples 1e9] [--shards 1e5]

Prints tables and writes ``scale.json`` and ``scale.png`` (messages and wait against N)
under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from raypipe.plan.rankplan import RankPlan
from raypipe.train.state import PipelineState

STEP_S = 0.1  # a train step of the simulated ranks
BATCH = 256


def shards(samples: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``first``, ``counts`` of ``count`` shards of about equal size holding ``samples``."""
    counts = np.full(count, samples // count, np.int64)
    counts[: samples % count] += 1
    return np.cumsum(counts) - counts, counts


def traced(fn) -> tuple[float, int]:
    """(seconds, peak bytes numpy and Python allocated) of ``fn()``."""
    tracemalloc.start()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak


def plan_point(first, counts, world: int, before: bool) -> dict:
    """One rank's plan of epoch 1 (the middle rank), now or as it was built before."""
    plan = RankPlan(first, counts, 7, True, world // 2, world, 1)

    def now():
        plan.tasks(1)

    def old():
        keys = np.array_split(plan.all_keys(1), world)[plan.rank]
        shard = plan.shard_of(keys)
        np.concatenate(([0], np.flatnonzero(np.diff(shard)) + 1))

    seconds, peak = traced(old if before else now)
    return {
        "ranks": world,
        "samples": int(counts.sum()),
        "seconds": seconds,
        "peak_mib": peak / 2**20,
    }


def state_point(first, counts, world: int, out: Path) -> dict:
    """The merged resume state of ``world`` ranks, each ~40 % into its slice of epoch 2."""
    n = int(counts.sum())
    consumed = np.zeros(n, bool)
    for rank in range(world):
        keys = RankPlan(first, counts, 7, True, rank, world, 1).keys(2)
        consumed[keys[: len(keys) * 2 // 5 + rank % 7]] = True  # ranks a few samples apart
    state = PipelineState(2, 7, n, "0" * 32, consumed)
    path = out / "scale-state.bin"
    t0 = time.perf_counter()
    size = state.save(path)
    t1 = time.perf_counter()
    back = PipelineState.load(path)
    t2 = time.perf_counter()
    assert np.array_equal(back.consumed, consumed)
    path.unlink()
    return {"ranks": world, "samples": n, "bytes": size, "raw_bits_bytes": (n + 7) // 8 + 100,
            "save_s": t1 - t0, "load_s": t2 - t1}  # fmt: skip


def ledger_point(world: int, steps: int) -> dict:
    """Messages and waits of ``world`` simulated ranks over ``steps`` clean steps."""
    import ray

    from raypipe.loader.ledger import Gate, create_ledger

    ledger = create_ledger(world)
    sent = [0] * world

    class Counted(Gate):
        def _send(self) -> None:
            sent[self.rank] += 1
            super()._send()

    gates = [Counted(ledger, "scale", r, BATCH) for r in range(world)]
    planned = (steps + 2) * BATCH
    for gate in gates:
        gate.start(0, planned)
    t0 = time.perf_counter()
    for k in range(steps):
        for gate in gates:  # each rank's block of this step arrives
            gate.add(BATCH, done=k == steps - 1)
        for gate in gates:  # then each rank asks for its batch
            assert gate.allows(k)
    wall = time.perf_counter() - t0
    ray.kill(ledger)
    waits = np.array([g.waited_s for g in gates]) / steps
    return {"ranks": world, "steps": steps, "wall_s": wall,
            "messages_per_rank_s": sum(sent) / world / (steps * STEP_S),
            "wait_per_step_ms": float(np.median(waits)) * 1e3,
            "wait_per_step_max_ms": float(waits.max()) * 1e3,
            "wait_share_of_step": float(np.median(waits)) / STEP_S,
            "simulated_s_per_wall_s": steps * STEP_S / wall}  # fmt: skip


def ledger_capacity(reports: int) -> dict:
    """Reports one `EpochLedger` actor serves per second, sent as fast as one driver can."""
    import ray

    from raypipe.loader.ledger import create_ledger

    ledger = create_ledger(1024)
    ray.get(ledger.report.remote("warm", 0, 0, 0, False))
    t0 = time.perf_counter()
    refs = [ledger.report.remote("full", 0, i % 1024, i, False) for i in range(reports)]
    ray.get(refs)
    wall = time.perf_counter() - t0
    ray.kill(ledger)
    return {"reports": reports, "served_per_s": reports / wall}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["ledger"]
    n = [r["ranks"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(n, [r["messages_per_rank_s"] for r in rows], "o-", label="now")
    a.axhline(1, color="grey", ls="--", label="goal: 1")
    a.set(xscale="log", yscale="log", xlabel="ranks", ylabel="messages per rank per second")
    b.plot(n, [100 * r["wait_share_of_step"] for r in rows], "o-", label="median rank")
    b.axhline(1, color="grey", ls="--", label="goal: 1 %")
    b.set(xscale="log", xlabel="ranks", ylabel="wait on the ledger, % of a 100 ms step")
    for ax in (a, b):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--samples", type=float, default=1e9, help="samples (default: %(default)g)")
    p.add_argument("--shards", type=float, default=1e5, help="shards (default: %(default)g)")
    p.add_argument("--before-samples", type=float, default=1e8,
                   help="samples for the 'before' plans (default: %(default)g)")  # fmt: skip
    p.add_argument("--ledger-steps", type=int, default=20, help="(default: %(default)s)")
    p.add_argument("--parts", nargs="+", choices=("plan", "state", "ledger"),
                   default=["plan", "state", "ledger"])  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = p.parse_args(argv)
    if min(args.ranks) < 1 or args.samples < max(args.ranks) or args.shards < 1:
        p.error(f"{args.ranks=} must be >= 1 and at most {args.samples=:g}; {args.shards=:g} >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    first, counts = shards(int(args.samples), int(args.shards))
    result: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                "python": sys.version.split()[0]},
                    "samples": int(args.samples), "shards": int(args.shards)}  # fmt: skip
    if "plan" in args.parts:
        small = shards(int(args.before_samples), int(args.shards))
        result["plan"] = [plan_point(first, counts, w, before=False) for w in args.ranks]
        result["plan_before"] = [plan_point(*small, w, before=True) for w in args.ranks]
        print(f"\none rank's plan of an epoch ({args.shards:g} shards)")
        print(f"{'ranks':>6s} {'samples':>9s} {'now s':>8s} {'now MiB':>9s} "
              f"{'samples':>9s} {'before s':>9s} {'before MiB':>11s}")  # fmt: skip
        for a, b in zip(result["plan"], result["plan_before"], strict=True):
            print(f"{a['ranks']:6d} {a['samples']:9.0e} {a['seconds']:8.3f} {a['peak_mib']:9.1f} "
                  f"{b['samples']:9.0e} {b['seconds']:9.3f} {b['peak_mib']:11.1f}")  # fmt: skip
    if "state" in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            result["state"] = [state_point(first, counts, max(args.ranks), Path(tmp))]
        s = result["state"][0]
        print(f"\nresume state, {s['ranks']} ranks ~40 % into epoch 2 of {s['samples']:.0e} samples:"
              f" {s['bytes'] / 2**20:.2f} MiB (raw bits: {s['raw_bits_bytes'] / 2**20:.1f} MiB),"
              f" save {s['save_s']:.2f} s, load {s['load_s']:.2f} s")  # fmt: skip
    if "ledger" in args.parts:
        sys.path.insert(0, str(Path(__file__).parent))
        from ingest import start_ray

        from raypipe.cli import localray

        start_ray()
        try:
            result["ledger"] = [ledger_point(w, args.ledger_steps) for w in args.ranks]
            result["ledger_capacity"] = ledger_capacity(20_000)
        finally:
            localray.shutdown()
        print(f"\nthe ledger on clean data, {args.ledger_steps} steps of {STEP_S * 1e3:.0f} ms")
        print(f"{'ranks':>6s} {'msgs/rank/s':>12s} {'wait ms/step':>13s} {'max ms':>8s} "
              f"{'% of step':>10s} {'sim s / wall s':>15s}")  # fmt: skip
        for r in result["ledger"]:
            print(f"{r['ranks']:6d} {r['messages_per_rank_s']:12.1f} {r['wait_per_step_ms']:13.3f} "
                  f"{r['wait_per_step_max_ms']:8.2f} {100 * r['wait_share_of_step']:10.2f} "
                  f"{r['simulated_s_per_wall_s']:15.2f}")  # fmt: skip
        cap = result["ledger_capacity"]["served_per_s"]
        print(f"one ledger actor serves {cap:,.0f} reports/s: at "
              f"{result['ledger'][-1]['messages_per_rank_s']:.0f} per rank per second, "
              f"{cap / result['ledger'][-1]['messages_per_rank_s']:,.0f} ranks")  # fmt: skip
        plot(result, args.out / "scale.png")
    (args.out / "scale.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'scale.json'}")
    return result


if __name__ == "__main__":
    main()
