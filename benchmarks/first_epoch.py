"""The first epoch: how long a new `raypipe.Pipeline` takes to its first batch, and epoch 0's
rate against the later epochs', with Ray already up.

On the ingest benchmark's small corpus (2,048 photo JPEGs, random-resized-crop 224 + flip,
batches of 256) and raypipe's defaults otherwise, each of --repeats runs (one local Ray for
all of them) times, for one rank:

  list     listing the source (the driver)
  init     the rest of ``Pipeline(...)``: skip log actor, block sizes, the rank's plan
  setup    --setup-s seconds of a trainer getting ready (its model built and wrapped)
           inside ``with pipeline:``, which starts the pool (0: none)
  first    from ``pipeline.epochs()`` to the first batch (pool start, first task)
  epoch 0  images/s from ``epochs()`` to epoch 0's last batch
  steady   images/s of epochs 1.. (median), each from asking for it to its last batch
  run      images/s of the whole run, from ``epochs()`` to the last batch

and reports the median and range of each over the runs. ``--compute tasks,actors`` runs
both settings in each of the --repeats rounds, the order alternating from round to round,
and reports each one's figures and the median of the rounds' own ratios (actors over
tasks) of the first batch and of epoch 0, and the first round's apart: there each setting
runs its first `Pipeline` of the Ray session, as a user's first one does (the later rounds'
tasks run on pooled workers that imported raypipe in an earlier round, where an actor pool
starts new processes every run).

    python benchmarks/first_epoch.py [--repeats 5] [--epochs 4] [--setup-s 0] [--compute tasks]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ingest import BATCH, IMAGE, SEED, SIZES, make_corpus, start_ray

from raypipe.cli import localray
from raypipe.config import PipelineConfig
from raypipe.plan.shards import list_shards


def one_run(corpus: Path, epochs: int, setup_s: float = 0.0, compute: str = "tasks") -> dict:
    """One Pipeline from nothing to the end of ``epochs`` epochs, timed by phase."""
    from raypipe import Pipeline

    config = PipelineConfig(source=str(corpus), batch_size=BATCH, image_size=IMAGE, seed=SEED,
                            compute=compute)  # fmt: skip
    t0 = time.perf_counter()
    listing = list_shards(config)
    t_list = time.perf_counter()
    pipe = Pipeline(config, epochs=epochs, listing=listing, device="cpu", normalize=False)
    t_init = time.perf_counter()
    rates, first, total = [], None, 0
    with pipe:
        time.sleep(setup_s)
        run, t_run = pipe.epochs(), time.perf_counter()
        for _ in range(epochs):
            t_ask = time.perf_counter()
            _, batches = next(run)
            rows = 0
            for batch in batches:
                rows += len(batch["key"])
                if first is None:
                    first = time.perf_counter() - t_run
            rates.append(rows / (time.perf_counter() - t_ask))
            total += rows
        run_img_s = total / (time.perf_counter() - t_run)
    return {
        "list_s": t_list - t0, "init_s": t_init - t_list, "first_batch_s": first,
        "run_img_s": run_img_s, "setup_s": setup_s,
        "epoch0_img_s": rates[0], "steady_img_s": statistics.median(rates[1:]),
        "epoch0_over_steady": rates[0] / statistics.median(rates[1:]), "epoch_img_s": rates,
        "rows_per_block": pipe.config.rows_per_block, "files_per_task": pipe.config.files_per_task,
    }  # fmt: skip


def summary(runs: list[dict]) -> dict:
    keys = ("list_s", "init_s", "first_batch_s", "epoch0_img_s", "steady_img_s",
            "epoch0_over_steady", "run_img_s")  # fmt: skip
    return {k: {"median": statistics.median(r[k] for r in runs),
                "min": min(r[k] for r in runs), "max": max(r[k] for r in runs)}
            for k in keys}  # fmt: skip


def ratios(runs: dict[str, list[dict]]) -> dict:
    """Actors over tasks: the median of the rounds' own ratios, and the first round's."""
    keys = ("first_batch_s", "epoch0_img_s", "steady_img_s")
    pairs = list(zip(runs["actors"], runs["tasks"], strict=True))
    return {"actors_over_tasks": {k: statistics.median(a[k] / t[k] for a, t in pairs)
                                  for k in keys},
            "first_round_actors_over_tasks": {k: pairs[0][0][k] / pairs[0][1][k]
                                              for k in keys}}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="runs (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=4, help="epochs per run (default: %(default)s)")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--setup-s", type=float, default=0.0,
                   help="a trainer's set-up inside `with pipeline:` before epochs() "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--compute", default=PipelineConfig.compute,
                   help="PipelineConfig.compute: tasks, actors, or both as tasks,actors, "
                   "interleaved (default: %(default)s, the config's)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = p.parse_args(argv)
    computes = args.compute.split(",")
    if args.epochs < 2 or args.repeats < 1:
        p.error(f"{args.epochs=} must be >= 2 and {args.repeats=} >= 1")
    if not computes or set(computes) - {"tasks", "actors"} or len(set(computes)) < len(computes):
        p.error(f"--compute: tasks, actors or tasks,actors, not {args.compute!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {c: [] for c in computes}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = make_corpus(Path(tmp), SIZES[args.size][0])
        start_ray()
        try:
            for r in range(args.repeats):
                for compute in computes if r % 2 == 0 else computes[::-1]:
                    runs[compute].append(one_run(corpus, args.epochs, args.setup_s, compute))
                    print(f"run {r} {compute}: " + json.dumps(
                        {k: round(v, 3) for k, v in runs[compute][-1].items()
                         if isinstance(v, float)}), flush=True)  # fmt: skip
        finally:
            localray.shutdown()
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0]},
              "size": args.size, "epochs": args.epochs, "setup_s": args.setup_s,
              "compute": args.compute, "runs": runs,
              "summary": {c: summary(runs[c]) for c in computes}}  # fmt: skip
    if len(computes) == 2:
        result.update(ratios(runs))
    for compute in computes:
        print(f"\n{compute:20s} {'median':>9s} {'min':>9s} {'max':>9s}   ({args.repeats} runs)")
        for k, v in result["summary"][compute].items():
            print(f"{k:20s} {v['median']:9.3f} {v['min']:9.3f} {v['max']:9.3f}")
    if "actors_over_tasks" in result:
        for key, what in (
            ("actors_over_tasks", "the rounds' median"),
            ("first_round_actors_over_tasks", "the first round (cold)"),
        ):
            print(f"actors over tasks, {what}: " + json.dumps(
                {k: round(v, 3) for k, v in result[key].items()}))  # fmt: skip
    name = f"first_epoch-setup{args.setup_s:g}-{'-'.join(computes)}.json"
    (args.out / name).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / name}")
    return result


if __name__ == "__main__":
    main()
