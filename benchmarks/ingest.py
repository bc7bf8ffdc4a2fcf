"""Ingest throughput: raypipe against a tuned torch DataLoader, same files, same node.

One run measures, on one generated corpus of ~400×300 photo JPEGs
(``raypipe.cli.demo.photo_crops``), random-resized-crop(224) + flip to uint8:

  (a) each transform in one process (the node's per-core limit);
  (b) torch DataLoader, winner of a small sweep (workers, persistent workers, prefetch
      factor, pin_memory where CUDA exists), with the standard Pillow transform and
      with raypipe's fast transform;
  (c) raypipe's warm run-long ``Pipeline`` (one actor pool for every epoch; also with
      ``compute="tasks"``) and, for comparison, the previous shape: a ``build_dataset``
      per epoch (a new pool per epoch): first epoch with start-up, then the median of
      the later epochs; the stall view of every warm epoch; and the per-batch cost of
      the rank iterator over blocks already in the object store;
  (d) the sweeps' finalists (the two fastest settings of each loader's sweep: the Pillow
      DataLoader, the fast-transform DataLoader and the warm Pipeline's pool size, the
      same number for each) again, interleaved over --rounds rounds, each round's ratios
      taken within the round, the finalist with the best median leading for each loader
      (``ingest_rounds``).

Every path yields uint8 N×3×224×224 batches of 256 on the host (normalisation belongs
on the device). Prints a table, writes ``ingest.json``, ``ingest.png`` and the warm
path's stall view ``stalls.png`` under --out.

    python benchmarks/ingest.py --size small
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from ingest_report import chart, print_table, stall_chart
from ingest_rounds import entrants, leaders, rounds, winner
from nodecpu import CpuMeter

from raypipe.cli import localray
from raypipe.cli.demo import write_photos
from raypipe.config import PipelineConfig
from raypipe.plan.shards import list_shards
from raypipe.preprocess import decode
from raypipe.preprocess.augment import sample_plan
from raypipe.preprocess.pillow import pillow_decode_crop

SIZES = {"small": (2048, 5), "medium": (6144, 5), "large": (16384, 5)}  # images, epochs
BATCH, IMAGE, SEED = 256, 224, 0
TRANSFORMS = {"pillow": pillow_decode_crop, "fast": decode.decode_crop}


def chooser(key: int, epoch: int):
    """The crop plan of ``key`` in ``epoch``, drawn as raypipe's workers draw it (one
    compiled call where `_draws` was built, the same plan as NumPy's): a DataLoader drew it
    through NumPy, about 19 µs a sample more than raypipe's workers."""
    return lambda w, h: sample_plan(SEED, epoch, key, w, h, train=True, scale=(0.08, 1.0),
                                    ratio=(3 / 4, 4 / 3), flip=True)  # fmt: skip


def make_corpus(root: Path, n: int) -> Path:
    folder = root / f"corpus-{n}"
    if not (folder / "photos").is_dir():
        write_photos(folder, n, seed=SEED)
    return folder / "photos"


def one_thread(worker_id: int | None = None) -> None:
    """OpenCV and torch on one thread per process, as raypipe's actors run them (torch's
    DataLoader already sets torch's threads to one in its workers, not OpenCV's)."""
    import cv2
    import torch

    cv2.setNumThreads(1)
    torch.set_num_threads(1)


def single_process(files: list[str], limit: int) -> dict:
    """(a) img/s of each transform in this process, and how far apart their pixels are."""
    out, sample = {}, files[:limit]
    one_thread()
    for name, fn in TRANSFORMS.items():
        for key, f in enumerate(sample[:16]):  # imports (torch's resize too) + warm-up
            fn(Path(f).read_bytes(), IMAGE, chooser(key, 0))
        t0, c0 = time.perf_counter(), time.process_time()
        for key, f in enumerate(sample):
            np.ascontiguousarray(fn(Path(f).read_bytes(), IMAGE, chooser(key, 0)))
        out[name] = len(sample) / (time.perf_counter() - t0)
        out[f"{name}_img_per_cpu_s"] = len(sample) / (time.process_time() - c0)
    diffs = [
        np.abs(
            pillow_decode_crop(d, IMAGE, chooser(k, 0)).astype(np.int16)
            - decode.decode_crop(d, IMAGE, chooser(k, 0)).astype(np.int16)
        ).mean()
        for k, d in enumerate(Path(f).read_bytes() for f in sample[:64])
    ]
    out["fast_vs_pillow_mean_abs_diff"] = float(np.mean(diffs))
    return out


class FileDataset:
    """torch map-style dataset: file → the same seeded crop + flip as raypipe."""

    def __init__(self, shards, transform: str):
        self.shards, self.fn, self.epoch = shards, TRANSFORMS[transform], 0

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, item):
        """``item``: ``(epoch, index)`` from `EpochOrder` (a persistent worker's copy of
        the dataset never sees the main process's later epochs), or an index."""
        import torch

        epoch, i = item if isinstance(item, tuple) else (self.epoch, item)
        s = self.shards[i]
        data = Path(s.path).read_bytes()
        image = np.ascontiguousarray(self.fn(data, IMAGE, chooser(s.first_key, epoch)))
        return {"image": torch.from_numpy(image), "label": s.label, "key": s.first_key}


class EpochOrder:
    """A DataLoader sampler: a seeded shuffle of ``n`` indices per epoch, each item
    ``(epoch, index)``, so that workers crop with the epoch's plan, as raypipe does."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        return ((self.epoch, int(i)) for i in order)


def run_epochs(make_iter, epochs: int, pause_s: float = 0.0) -> dict:
    """Wall time per epoch from asking for the iterator to the last batch, and node CPU;
    the consumer sleeps ``pause_s`` after each batch (0: as fast as batches come)."""
    rates, firsts, flowing, cpus, by_name, waits, rows = [], [], [], [], [], [], 0
    for epoch in range(epochs):
        rows, t_first, waited = 0, None, 0.0
        with CpuMeter() as cpu:
            t0 = time.perf_counter()
            batches = make_iter(epoch)
            while True:
                t_ask = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    break
                waited += time.perf_counter() - t_ask
                rows += len(batch["key"])
                if t_first is None:
                    t_first, first_rows = time.perf_counter(), rows
                if pause_s:
                    time.sleep(pause_s)
            t_end = time.perf_counter()
        cpus.append(cpu.seconds)
        by_name.append({k: round(v, 2) for k, v in cpu.by_name.items() if v >= 0.01})
        rates.append(rows / (t_end - t0))
        firsts.append(t_first - t0)
        flowing.append((rows - first_rows) / max(t_end - t_first, 1e-9))
        waits.append(waited / (t_end - t0))
    steady = rates[1:] or rates
    # Every later epoch as one stretch: a warm pipeline decodes epoch e+1 during epoch e,
    # so its per-epoch times trade work between neighbours; their sum does not.
    span = [rows / r for r in steady]
    return {
        "steady_run_img_s": rows * len(span) / sum(span),
        "epoch_img_s": rates,
        "first_epoch_img_s": rates[0],
        "steady_img_s": statistics.median(steady),
        "flowing_img_s": statistics.median(flowing[1:] or flowing),
        "first_batch_s": firsts,
        "wait_fraction": waits,
        "cpu_s_per_epoch": cpus,
        "cpu_s_by_process": by_name,
        "img_per_cpu_s": statistics.median(rows / max(c, 1e-9) for c in cpus[1:] or cpus),
        "rows_per_epoch": rows,
    }


def dataloader(shards, transform: str, epochs: int, settings: list[dict]) -> dict:
    """(b) the sweep's winner (`ingest_rounds.winner`); every setting's numbers kept."""
    import torch
    from torch.utils.data import DataLoader

    results = []
    for s in settings:
        ds, order = FileDataset(shards, transform), EpochOrder(len(shards), SEED)
        loader = DataLoader(ds, batch_size=BATCH, sampler=order, drop_last=True,
                            pin_memory=torch.cuda.is_available(),
                            worker_init_fn=one_thread, **s)  # fmt: skip

        def epoch_iter(epoch, order=order, loader=loader):
            order.epoch = epoch  # the sampler runs here: its items carry the epoch
            return iter(loader)

        r = run_epochs(epoch_iter, epochs)
        results.append({"settings": s, **r})
        del loader
        print(f"  dataloader {transform:6s} {s}: steady {r['steady_img_s']:.0f} img/s")
    return {"best": results[winner(results)], "sweep": results}


PATHS = ("warm", "warm_tasks", "per_epoch")  # keys of result["raypipe"]
# A trainer slower than the pipeline: seconds of "compute" per batch, so that the next
# epoch can be ready before it is asked for (the DataLoader's persistent workers + prefetch).
PACE_S = 0.25


def raypipe_run(corpus: Path, epochs: int, actors: int) -> dict:
    """(c) raypipe's paths in one Ray session, and the rank iterator's cost per batch."""
    from raypipe import build_dataset

    t0 = time.perf_counter()
    start_ray()
    out = {"ray_init_s": time.perf_counter() - t0}
    config = pool_config(corpus, actors)
    listing = list_shards(config)
    sweep = {}  # the DataLoader gets the winner of its sweep; the warm pool of two sizes
    for n in (actors, actors + 1):
        sweep[n] = warm_epochs(config.replace(actors=(n, n)), listing, epochs)
        print(f"  raypipe warm, {n} actors: steady {sweep[n]['steady_img_s']:.0f} img/s")
    sizes = list(sweep)
    best = sizes[winner([sweep[n] for n in sizes])]
    out["warm"] = {**sweep[best], "actors": best, "sweep": sweep}
    config = config.replace(actors=(best, best))
    out["warm_tasks"] = warm_epochs(config.replace(compute="tasks"), listing, epochs)
    out["per_epoch"] = per_epoch_datasets(config, listing, epochs)
    out["pace_s"] = PACE_S
    out["paced"] = {
        "warm": warm_epochs(config, listing, epochs, pause_s=PACE_S),
        "per_epoch": per_epoch_datasets(config, listing, epochs, pause_s=PACE_S),
    }
    for path in PATHS:
        print(f"  raypipe {path}: steady {out[path]['steady_img_s']:.0f} img/s")
    ready = build_dataset(config.replace(compute="tasks"), epoch=0, listing=listing)
    out["iterator_ms_per_batch"] = iterator_cost(ready)
    localray.shutdown()
    return out


def pool_config(corpus: Path, actors: int) -> PipelineConfig:
    """raypipe's config for the corpus: the same crop, batch and seed as every path, a
    fixed pool of ``actors``."""
    return PipelineConfig(source=str(corpus), batch_size=BATCH, image_size=IMAGE, seed=SEED,
                          actors=(actors, actors))  # fmt: skip


def start_ray() -> None:
    import ray.data

    # raypipe's local Ray (`raypipe run` starts the same), without the dashboard
    localray.start("local", num_cpus=os.cpu_count(), include_dashboard=False,
                   log_to_driver=False, object_store_memory=1 << 30,
                   configure_logging=False)  # fmt: skip
    ray.data.DataContext.get_current().enable_progress_bars = False


def warm_alone(corpus: Path, listing, epochs: int, actors: int) -> dict:
    """The warm Pipeline in a Ray session of its own, so no other path shares the node
    with an idle Ray."""
    start_ray()
    try:
        return warm_epochs(pool_config(corpus, actors), listing, epochs)
    finally:
        localray.shutdown()


def head_to_head(result: dict, corpus: Path, listing, epochs: int, n: int) -> dict:
    """(d) The sweeps' finalists again, interleaved over ``n`` rounds (`ingest_rounds`): the
    same number of settings from every loader's sweep (`ingest_rounds.entrants`: the two
    fastest DataLoader settings with each transform, the warm Pipeline's two pool sizes);
    per loader, the finalist with the best median leads, and the ratios between leaders
    are the headline. Every pairing's ratios are kept too."""
    warm = result["raypipe"]["warm"]["sweep"]
    sizes = list(warm)
    sweeps = {t: result["dataloader"][t]["sweep"] for t in TRANSFORMS}
    picked = entrants({**sweeps, "raypipe_warm": [warm[k] for k in sizes]})
    chosen = {t: [sweeps[t][i]["settings"] for i in picked[t]] for t in TRANSFORMS}
    pools = [sizes[i] for i in picked["raypipe_warm"]]

    def loader(transform: str, settings: dict) -> dict:
        return dataloader(listing.shards, transform, epochs, [settings])["best"]

    paths, families, settings = {}, {}, {}
    for t, options in chosen.items():
        for s in options:
            name = f"dataloader_{t}_w{s['num_workers']}_p{s['prefetch_factor']}"
            paths[name] = functools.partial(loader, t, s)
            families.setdefault(f"dataloader_{t}", []).append(name)
            settings[name] = s
    for actors in pools:
        name = f"raypipe_warm_{actors}"
        paths[name] = functools.partial(warm_alone, corpus, listing, epochs, int(actors))
        families.setdefault("raypipe_warm", []).append(name)
        settings[name] = {"actors": int(actors)}
    versus = [(a, b) for a in families["raypipe_warm"]
              for t in TRANSFORMS for b in families[f"dataloader_{t}"]]  # fmt: skip
    out = {"settings": settings, **rounds(paths, n, versus)}
    out["leaders"] = lead = leaders(out, families)
    out["headline"] = {
        f"raypipe_warm_vs_dataloader_{t}": out["ratios"][
            f"{lead['raypipe_warm']}_vs_{lead[f'dataloader_{t}']}"
        ]
        for t in TRANSFORMS
    }
    return out


def warm_epochs(config: PipelineConfig, listing, epochs: int, pause_s: float = 0.0) -> dict:
    """The run-long Pipeline: each epoch timed from asking for it to its last batch;
    ``pause_s`` per batch plays a trainer's step."""
    from raypipe import Pipeline

    cpu0, stalls = resource.getrusage(resource.RUSAGE_SELF), []
    with Pipeline(config, epochs=epochs, listing=listing, device="cpu", normalize=False) as pipe:
        run = pipe.epochs()
        last = []

        def epoch_iter(epoch):
            if last:
                stalls.append(_stall_row(last.pop().stats()))
            _, batches = next(run)
            last.append(batches)
            return iter(batches)

        r = run_epochs(epoch_iter, epochs, pause_s)
        stalls.append(_stall_row(last.pop().stats()))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    driver = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    return {**r, "driver_cpu_s_per_epoch": driver / epochs, "stalls": stalls}


def _stall_row(stats: dict) -> dict:
    return {"wait_s": stats["wait_s"], "elapsed_s": stats["elapsed_s"],
            "bound": stats["bound"], **stats["stalls"]}  # fmt: skip


def per_epoch_datasets(config: PipelineConfig, listing, epochs: int, pause_s: float = 0.0) -> dict:
    """The previous shape: one dataset, and so one new actor pool, per epoch."""
    from raypipe import build_dataset, iter_torch_batches

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)

    def epoch_iter(epoch):
        ds = build_dataset(config, epoch=epoch, listing=listing)
        return iter(iter_torch_batches(ds, batch_size=BATCH, device="cpu", normalize=False))

    r = run_epochs(epoch_iter, epochs, pause_s)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    driver = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    return {**r, "driver_cpu_s_per_epoch": driver / epochs}


def iterator_cost(ds, repeats: int = 10) -> float:
    """Per-batch time of the rank iterator over blocks already in the object store: the
    best of ``repeats`` whole passes, start of the pass included (blocks are one batch)."""
    from raypipe import iter_torch_batches

    ready = ds.materialize()
    best = float("inf")
    for _ in range(repeats):
        t0, n = time.perf_counter(), 0
        for _ in iter_torch_batches(ready, batch_size=BATCH, device="cpu", normalize=False):
            n += 1
        best = min(best, (time.perf_counter() - t0) / max(n, 1))
    return best * 1e3


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    p.add_argument("--actors", type=int, default=os.cpu_count())
    p.add_argument("--epochs", type=int, help="epochs per path (default: the size's, 5)")
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="interleaved rounds of the sweeps' finalists after the sweeps (default 5; 0: none)",
    )
    args = p.parse_args(argv)
    n, epochs = SIZES[args.size]
    epochs = args.epochs or epochs
    if epochs < 2:
        p.error(f"--epochs {epochs}: at least 2 (epoch 0 starts the pool; steady is the rest)")
    if args.rounds < 0:
        p.error(f"--rounds {args.rounds}: 0 or more")
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(args.out, n)
    listing = list_shards(PipelineConfig(source=str(corpus)))
    files = [s.path for s in listing.shards]
    cpus = os.cpu_count()
    sweep = [{"num_workers": w, "persistent_workers": True, "prefetch_factor": f}
             for w in sorted({cpus, cpus + 1}) for f in (2, 4)]  # fmt: skip
    load = os.getloadavg()
    result = {
        "size": args.size, "images": n, "epochs": epochs, "batch_size": BATCH,
        "machine": {"cpus": cpus, "platform": platform.platform(), "python": sys.version.split()[0],
                    "loadavg_at_start": load},
        "single_process": single_process(files, min(n, 512)),
    }  # fmt: skip
    print(f"single process: {result['single_process']}")
    result["dataloader"] = {t: dataloader(listing.shards, t, epochs, sweep) for t in TRANSFORMS}
    result["raypipe"] = raypipe_run(corpus, epochs, args.actors)
    dl = {t: result["dataloader"][t]["best"] for t in TRANSFORMS}
    result["ratios"] = {
        f"{compute}_vs_dataloader_{t}": {
            "epoch": result["raypipe"][compute]["steady_img_s"] / dl[t]["steady_img_s"],
            "run": result["raypipe"][compute]["steady_run_img_s"] / dl[t]["steady_run_img_s"],
            "first_epoch": result["raypipe"][compute]["first_epoch_img_s"]
            / dl[t]["first_epoch_img_s"],
            "in_epoch_flow": result["raypipe"][compute]["flowing_img_s"] / dl[t]["steady_img_s"],
            "per_cpu_s": result["raypipe"][compute]["img_per_cpu_s"] / dl[t]["img_per_cpu_s"],
        }
        for compute in PATHS
        for t in TRANSFORMS
    }
    if args.rounds:
        print(f"interleaved rounds ({args.rounds}) of the sweeps' finalists:")
        result["rounds"] = head_to_head(result, corpus, listing, epochs, args.rounds)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    print_table(result)
    (args.out / "ingest.json").write_text(json.dumps(result, indent=2, default=str))
    chart(result, args.out / "ingest.png")
    stall_chart(result, args.out / "stalls.png")
    print(f"wrote {args.out / 'ingest.json'}, {args.out / 'ingest.png'}, {args.out / 'stalls.png'}")
    return result


if __name__ == "__main__":
    main()
