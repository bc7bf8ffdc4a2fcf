"""raypipe's coordination at simulated scale, on one machine: what breaks first at 1,024 ranks.

No decoding and no trainers: the parts every rank and the driver run for coordination,
each at the size of a large run (10⁹ samples in 10⁵ shards by default), each beside the
way it was done before so that a change shows as a pair of numbers.

  plan    one rank's plan of an epoch (its keys and tasks), seconds and peak traced
          memory, for N ranks: today's (`RankPlan.keys`: the shards the rank's slice
          touches) and before (every key of the epoch, then the rank's slice). "before"
          runs at --before-samples (it needs 16 bytes per sample of the epoch).
  table   the task table a rank builds at the start of a run of --epochs epochs
          (every epoch's tasks), for an image folder of ImageNet's 1,281,167 files and
          at 1 and 8 ranks, and for the --samples in --shards at 8 and 64; before: each epoch's tasks
          from the rank's keys, timed over --table-before-epochs and scaled to the run.
  state   the resume state of N ranks each about 40 % into their slice of an epoch:
          bytes on disk and seconds to save and load; before: the raw bits (N/8 bytes).
  ledger  the equal-batches ledger (`raypipe.loader.ledger`, a real actor on a local
          Ray) and N simulated ranks on clean data, one block and one batch per 100 ms
          step, each rank holding --leads batches of rows pulled ahead of the batch it
          asks for (0: a feeder that asks for a batch as soon as its rows are in), and
          the lead ``lead_batches=None`` gives on a node of --store-gib of object store
          shared by 8 ranks (the default): messages per rank per second in mid-epoch
          (the report each rank sends at an epoch's start and end left out) and the
          wait on the ledger per step after the first (the epoch's first batch waits
          for every rank's first report; its wait is apart). The ranks are driven
          round-robin from one thread, no faster than real time (slower at 1,024 ranks
          at lead 0): every rank's block of a step is pulled before any rank asks for
          its batch. With --ledger-steps steps at lead 0, --lead-steps above.
          Then the reports per second one ledger actor serves, sent as fast as one
          driver can: the ranks it can serve at that many messages each.
  pipeline  two ranks of a real `raypipe.Pipeline` (threads of this process, one ledger) over
          the demo digits image folder, batch 8, one epoch, a 10 ms step: the ledger reports each rank
          sends per batch with ``lead_batches`` 0 and --pipeline-lead (the default: sized
          from the store); a check that the feeder's lead does what the simulated lead
          does, not a timing.
  listing the driver's listing of a source (`raypipe.plan.shards.list_shards`) on moto's S3
          server on 127.0.0.1 (`loopback_s3.py`): an image folder of --objects one-byte
          images in 100 class folders, and --tars one-sample WebDataset shards (each one
          is opened to count its samples, `raypipe.plan.shards.COUNT_THREADS` at once).

    python benchmarks/scale.py [--ranks 8 64 256 1024] [--samples 1e9] [--shards 1e5]

Prints tables and writes ``scale.json`` (updated with the parts run) and ``scale.png``
(messages and wait against N) under --out.
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
from raypipe.plan.ranktasks import task_table
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

    def now():  # a worker's keys of the epoch, then its tasks
        plan.keys(1)
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


def table_point(first, counts, world: int, epochs: int, before: bool) -> dict:
    """The task table a rank builds at the start of a run (`task_table`: every epoch's
    tasks), for the middle rank; before: each epoch's tasks from its keys, as they were
    planned until the table came from the shards, epochs timed up to ``epochs``."""
    plan = RankPlan(first, counts, 7, True, world // 2, world, 1 if counts.max() > 1 else 256)

    def old():
        rows = []
        for e in range(epochs):
            shard = plan.shard_of(plan.keys(e))
            starts = np.concatenate(([0], np.flatnonzero(np.diff(shard)) + 1))[:: plan.per_task]
            bounds = [*starts.tolist(), len(shard)]
            rows += [(e, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    seconds, peak = traced(old if before else lambda: task_table(plan, range(epochs)))
    return {"ranks": world, "samples": int(counts.sum()), "shards": len(counts),
            "epochs": epochs, "seconds": seconds, "peak_mib": peak / 2**20}  # fmt: skip


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


def default_lead(store_gib: float) -> int:
    """The lead ``lead_batches=None`` gives a rank of a batch of 256 224×224 images on a
    node of ``store_gib`` GiB of object store shared by 8 ranks (`raypipe.plan.blocksize`)."""
    from raypipe.plan.blocksize import RANKS_PER_NODE, lead_for

    return lead_for(BATCH * 3 * 224 * 224, store_gib * 2**30 / RANKS_PER_NODE)


def ledger_point(world: int, steps: int, lead: int, ahead: int | None = None) -> dict:
    """Messages and waits of ``world`` simulated ranks over ``steps`` clean steps, each
    rank holding ``lead`` batches of rows pulled ahead of the batch it asks for; ``ahead``:
    the gates' threshold in batches (None: the default)."""
    import ray

    from raypipe.loader.ledger import Gate, create_ledger

    ledger = create_ledger(world)
    options = {} if ahead is None else {"ahead": ahead}
    gates = [Gate(ledger, "scale", r, BATCH, **options) for r in range(world)]
    planned = (steps + lead + 2) * BATCH
    for gate in gates:
        gate.start(0, planned)
        gate.add(lead * BATCH)  # the rows pulled ahead before the first step
    start = sum(g.reports for g in gates)  # one report per rank at the epoch's start
    t0 = time.perf_counter()
    for k in range(steps):
        for gate in gates:  # each rank's block of this step arrives (mid-epoch: not done)
            gate.add(BATCH)
        for gate in gates:  # then each rank asks for its batch
            assert gate.allows(k)
        if k == 0:  # the first batch waits for every rank's first report: apart
            first = np.array([g.waited_s for g in gates])
        if (ahead := t0 + (k + 1) * STEP_S - time.perf_counter()) > 0:
            time.sleep(ahead)  # no faster than real time: the actor sees a real load
    wall = time.perf_counter() - t0
    ray.kill(ledger)
    waits = (np.array([g.waited_s for g in gates]) - first) / (steps - 1)
    worst = int(np.argmax(waits))
    return {"ranks": world, "steps": steps, "lead_batches": lead, "before": False,
            "wall_s": wall,
            "messages_per_rank_s": (sum(g.reports for g in gates) - start) / world
                                   / (steps * STEP_S),
            "wait_per_step_ms": float(np.median(waits)) * 1e3,
            "wait_per_step_max_ms": float(waits.max()) * 1e3,
            "wait_share_of_step": float(np.median(waits)) / STEP_S,
            "wait_share_max": float(waits.max()) / STEP_S,
            "worst_rank": worst, "ranks_waiting": int((waits > 0.001 * STEP_S).sum()),
            "first_batch_wait_max_ms": float(first.max()) * 1e3,
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


def listing_points(objects: list[int], tars: int, latency_ms: float = 0) -> list[dict]:
    """Seconds `list_shards` takes over an image folder of each of ``objects`` sizes, and
    over ``tars`` WebDataset shards, on a filled moto S3 server on loopback answering each
    request ``latency_ms`` late."""
    sys.path.insert(0, str(Path(__file__).parent))
    from loopback_s3 import BUCKET, moto_server, storage_options

    from raypipe import PipelineConfig
    from raypipe.plan import shards as shards_module
    from raypipe.plan.shards import list_shards

    rows = []
    for n in objects:
        t0 = time.perf_counter()
        with moto_server(images=n, tars=tars if n == objects[-1] else 0,
                         latency_ms=latency_ms) as url:  # fmt: skip
            fill = time.perf_counter() - t0
            for what, count in (("images", n), ("tars", tars if n == objects[-1] else 0)):
                if not count:
                    continue
                config = PipelineConfig(source=f"s3://{BUCKET}/{what}",
                                        storage_options=storage_options(url))  # fmt: skip
                t0 = time.perf_counter()
                listing = list_shards(config)
                seconds = time.perf_counter() - t0
                assert len(listing.shards) == count, (len(listing.shards), count)
                rows.append({"source": what, "objects": count, "seconds": seconds,
                             "server_fill_s": fill, "latency_ms": latency_ms,
                             "count_threads": shards_module.COUNT_THREADS})  # fmt: skip
    print("\nlist_shards on the loopback S3 server (moto)")
    print(f"{'source':>8s} {'objects':>9s} {'seconds':>9s} {'latency ms':>11s} {'threads':>8s}")
    for r in rows:
        print(f"{r['source']:>8s} {r['objects']:9d} {r['seconds']:9.2f} {latency_ms:11g} "
              f"{r['count_threads']:8d}")  # fmt: skip
    return rows


def pipeline_points(leads: list[int]) -> list[dict]:
    """Reports per batch of two real Pipeline ranks over the demo digits, per lead (None:
    the default, sized from the store)."""
    import threading

    from raypipe import Pipeline, PipelineConfig
    from raypipe.cli.demo import write_digits

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_digits(Path(tmp))
        for lead in leads:
            config = PipelineConfig(source=str(Path(tmp) / "digits" / "train"), image_size=8,
                                    batch_size=8,
                                    actors=(1, 1), rows_per_block=8, lead_batches=lead)  # fmt: skip
            ledger = Pipeline.ledger(2)
            got: dict[int, tuple[int, int]] = {}

            def rank(r: int, config=config, ledger=ledger, got=got) -> None:
                with Pipeline(config, epochs=1, rank=r, world_size=2, ledger=ledger,
                              device="cpu", normalize=False) as pipe:  # fmt: skip
                    batches = 0
                    for _, epoch in pipe.epochs():
                        for _ in epoch:
                            time.sleep(STEP_S / 10)  # a train step of 10 ms
                            batches += 1
                    got[r] = (batches, pipe._gate.reports, pipe.config.lead_batches)

            threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert got[0][0] == got[1][0], got  # equal batch counts
            rows.extend({"lead_set": lead, "lead_batches": x, "rank": r, "batches": b,
                         "reports": n, "reports_per_batch": n / b}
                        for r, (b, n, x) in sorted(got.items()))  # fmt: skip
    return rows


def run_pipeline(lead: int | None) -> list[dict]:
    """The pipeline part on its own local Ray, printed."""
    sys.path.insert(0, str(Path(__file__).parent))
    from ingest import start_ray

    from raypipe.cli import localray

    start_ray()
    try:
        rows = pipeline_points([0, lead])
    finally:
        localray.shutdown()
    print("\ntwo Pipeline ranks over the demo digits, batch 8: ledger reports per batch")
    for r in rows:
        print(f"lead_batches={r['lead_set']} ({r['lead_batches']}) rank {r['rank']}: "
              f"{r['batches']} batches, "
              f"{r['reports']} reports, {r['reports_per_batch']:.2f} per batch")  # fmt: skip
    return rows


def run_listing(args) -> list[dict]:
    """The listing part, with ``--count-threads`` shards counted at once if given."""
    from raypipe.plan import shards as shards_module

    if args.count_threads is not None:
        shards_module.COUNT_THREADS = args.count_threads
    return listing_points([int(n) for n in args.objects], args.tars, args.latency_ms)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for label, rows in _ledger_series(result["ledger"]).items():
        n = [r["ranks"] for r in rows]
        a.plot(n, [r["messages_per_rank_s"] for r in rows], "o-", label=label)
        (line,) = b.plot(n, [100 * r["wait_share_of_step"] for r in rows], "o-", label=label)
        b.plot(n, [100 * r.get("wait_share_max", np.nan) for r in rows], "x:",
               color=line.get_color())  # fmt: skip
    a.axhline(1, color="grey", ls="--", label="goal: 1")
    a.set(xscale="log", yscale="log", xlabel="ranks", ylabel="messages per rank per second")
    b.axhline(1, color="grey", ls="--", label="goal: 1 %")
    b.set_yscale("symlog", linthresh=0.01)
    b.set_ylim(bottom=0)
    b.set(xscale="log", xlabel="ranks",
          ylabel="wait on the ledger, % of a step")  # fmt: skip
    b.set_title("median rank (o), worst rank (x)", fontsize=9)
    for ax in (a, b):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _ledger_series(rows: list[dict]) -> dict[str, list[dict]]:
    series: dict[str, list[dict]] = {}
    for r in rows:
        gate = r.get("gate", "before" if r.get("before") else "now")
        label = f"{gate}, {r['lead_batches']} batches ahead"
        series.setdefault(label, []).append(r)
    return series


def run_plan(args, first, counts) -> dict:
    """The ``plan`` part: one rank's plan of an epoch, now and before; prints the table."""
    small = shards(int(args.before_samples), int(args.shards))
    now = [plan_point(first, counts, w, before=False) for w in args.ranks]
    before = [plan_point(*small, w, before=True) for w in args.ranks]
    print(f"\none rank's plan of an epoch ({args.shards:g} shards)")
    print(f"{'ranks':>6s} {'samples':>9s} {'now s':>8s} {'now MiB':>9s} "
          f"{'samples':>9s} {'before s':>9s} {'before MiB':>11s}")  # fmt: skip
    for a, b in zip(now, before, strict=True):
        print(f"{a['ranks']:6d} {a['samples']:9.0e} {a['seconds']:8.3f} {a['peak_mib']:9.1f} "
              f"{b['samples']:9.0e} {b['seconds']:9.3f} {b['peak_mib']:11.1f}")  # fmt: skip
    return {"plan": now, "plan_before": before}


def run_table(args, first, counts) -> list[dict]:
    """The ``table`` part: now and before for an ImageNet-sized image folder and for
    ``first``, ``counts``; prints the table, returns its rows."""
    rows = []
    imagenet = np.arange(1_281_167, dtype=np.int64), np.ones(1_281_167, np.int64)
    for data, worlds in ((imagenet, (1, 8)), ((first, counts), (8, 64))):
        for w in worlds:
            rows.append({**table_point(*data, w, args.epochs, before=False), "before": False})
            old = table_point(*data, w, args.table_before_epochs, before=True)
            rows.append({**old, "before": True, "per_epoch_s": old["seconds"] / old["epochs"]})
    print(f"\na rank's task table at the start of a run of {args.epochs} epochs")
    print(f"{'samples':>9s} {'shards':>9s} {'ranks':>6s} {'now s':>8s} {'now MiB':>9s} "
          f"{'before s/epoch':>15s} {'before s, whole run':>20s}")  # fmt: skip
    for now, old in zip(rows[::2], rows[1::2], strict=True):
        print(f"{now['samples']:9.2e} {now['shards']:9.2e} {now['ranks']:6d} "
              f"{now['seconds']:8.3f} {now['peak_mib']:9.1f} {old['per_epoch_s']:15.3f} "
              f"{old['per_epoch_s'] * args.epochs:20.1f}")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--samples", type=float, default=1e9, help="samples (default: %(default)g)")
    p.add_argument("--shards", type=float, default=1e5, help="shards (default: %(default)g)")
    p.add_argument("--before-samples", type=float, default=1e8,
                   help="samples for the 'before' plans (default: %(default)g)")  # fmt: skip
    p.add_argument("--ledger-steps", type=int, default=40, help="(default: %(default)s)")
    p.add_argument("--lead-steps", type=int, default=100,
                   help="steps with a lead above 0 (default: %(default)s)")  # fmt: skip
    p.add_argument("--leads", type=int, nargs="+", default=[0, 8, 16],
                   help="batches of rows each simulated rank holds ahead of the batch it "
                   "asks for, besides the default's (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--ahead",
        type=int,
        default=None,
        help="the gates' reporting threshold in batches (default: the Gate's)",
    )
    p.add_argument("--store-gib", type=float, default=57.6,
                   help="object store of the simulated ranks' node, 8 ranks to a node, which "
                   "sizes the default lead (default: %(default)s, Ray's 30 %% of a "
                   "192 GiB GPU node)")  # fmt: skip
    p.add_argument("--objects", type=float, nargs="+", default=[1e4, 1e5],
                   help="image-folder sizes listed (default: %(default)s)")  # fmt: skip
    p.add_argument("--tars", type=int, default=1000, help="WebDataset shards listed "
                   "(counted one by one; default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--latency-ms",
        type=float,
        default=0,
        help="the S3 server answers each request this late (default: %(default)s)",
    )
    p.add_argument(
        "--count-threads",
        type=int,
        default=None,
        help="shards counted at once (default: raypipe's COUNT_THREADS)",
    )
    p.add_argument("--pipeline-lead", type=int, default=None,
                   help="besides 0 (default: the default lead, sized from the store)")  # fmt: skip
    p.add_argument(
        "--epochs",
        type=int,
        default=90,
        help="epochs of the run whose task table is built (default: %(default)s)",
    )
    p.add_argument("--table-before-epochs", type=int, default=5,
                   help="epochs the 'before' task table is timed over, per epoch (default: "
                   "%(default)s)")  # fmt: skip
    p.add_argument("--parts", nargs="+",
                   choices=("plan", "table", "state", "ledger", "pipeline", "listing"),
                   default=["plan", "table", "state", "ledger", "pipeline", "listing"])  # fmt: skip
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
        result.update(run_plan(args, first, counts))
    if "table" in args.parts:
        result["table"] = run_table(args, first, counts)
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
        lead = default_lead(args.store_gib)
        leads = sorted(set(args.leads) | {lead})
        try:
            result["ledger"] = [
                ledger_point(w, args.ledger_steps if x == 0 else args.lead_steps, x, args.ahead)
                for x in leads
                for w in args.ranks
            ]
            result["ledger_default_lead"] = {"store_gib": args.store_gib, "lead_batches": lead}
            result["ledger_capacity"] = ledger_capacity(20_000)
        finally:
            localray.shutdown()
        print(f"\nthe ledger on clean data, {args.ledger_steps} steps of {STEP_S * 1e3:.0f} ms")
        print(f"{'gate':>25s} {'ranks':>6s} {'msgs/rank/s':>12s} {'wait ms/step':>13s} "
              f"{'max ms':>8s} {'% of step':>10s} {'max %':>7s} {'1st batch max ms':>17s} "
              f"{'sim s / wall s':>15s}")  # fmt: skip
        for label, rows in _ledger_series(result["ledger"]).items():
            for r in rows:
                print(f"{label:>25s} {r['ranks']:6d} {r['messages_per_rank_s']:12.2f} "
                      f"{r['wait_per_step_ms']:13.3f} {r['wait_per_step_max_ms']:8.2f} "
                      f"{100 * r['wait_share_of_step']:10.3f} {100 * r['wait_share_max']:7.2f} "
                      f"{r['first_batch_wait_max_ms']:17.1f} "
                      f"{r['simulated_s_per_wall_s']:15.2f}")  # fmt: skip
        cap = result["ledger_capacity"]["served_per_s"]
        print(f"one ledger actor serves {cap:,.0f} reports/s: at 1 per rank per second, "
              f"{cap:,.0f} ranks")  # fmt: skip
        plot(result, args.out / "scale.png")
    if "pipeline" in args.parts:
        result["pipeline"] = run_pipeline(args.pipeline_lead)
    if "listing" in args.parts:
        result["listing"] = run_listing(args)
    path = args.out / "scale.json"  # a run of some parts keeps the others' figures
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **result}, indent=2))
    print(f"wrote {args.out / 'scale.json'}")
    return result


if __name__ == "__main__":
    main()
