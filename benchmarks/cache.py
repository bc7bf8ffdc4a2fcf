"""The decoded cache against decoding every epoch, on ingest.py's small corpus.

Each of ``--rounds`` interleaved rounds runs, in an order that rotates from round to round:

  (a) the warm `Pipeline`, uncached (today's default);
  (b) the warm `Pipeline` with ``cache="memory"`` (a fresh cache every round);
  (c) the warm `Pipeline` with ``cache="disk"`` (a fresh directory every round);
  (c') the warm `Pipeline` with ``cache="memory", cache_encoding="jpeg"`` (fresh too);
  (d) a tuned Pillow DataLoader (as many workers as the pool has, ``--actors``: 2 was
      ingest.py's sweep winner on the 2-core machine; persistent workers; prefetch 2 and
      4, the better of the two in each round, as ingest.py pairs them), the same seeded
      crop, with Ray shut down while it runs (as its users run it: not beside an idle
      Ray's workers and preallocated store), and started again after;
  (e) the same DataLoader running raypipe's own decoder and crop (``fast``; its two
      settings likewise): what the cache gains over decoding every epoch with the same
      decoder, without Ray;

each for ``--epochs`` epochs of random-resized-crop 224 + flip, batches of 256, uint8 on the
host. Reported: the later epochs' rate (median of epochs 1+ within a run, then the median
over rounds, with the range), epoch 0's rate, the ratios taken within each round (their
median over rounds: the one statistic RESULTS quotes), each
later epoch of the memory cache over its round's uncached later rate (the first epochs
after the first pay a worker's first reads of the entries another one wrote), and the
cache's hits and misses; the raw file also has each run's CPU per epoch by process. Then
the bytes a cached image takes at several ``cache_max_side`` values (decoded, capped, not
timed), and what capping changes in the pixels: the mean absolute difference in grey levels
between a crop from the capped image and the same crop from the full image; the same for
``cache_encoding="jpeg"`` (the re-encoded bytes, and the crop from the pixels they decode
to).

    python benchmarks/cache.py --size small --rounds 5 --epochs 5

``--photo WxH`` (e.g. 1600x1200) swaps the corpus for --images photos of that size (crops
of the same sample photos, quality 90, as ``decode.py`` makes them): where the photos are
larger than the cap, the cache keeps a downscaled image and every later epoch skips a
large decode.

raypipe's paths run in one local Ray whose object store is ``--store-gib`` (4 GiB; the memory
cache's files live beside it in /dev/shm, its default budget a quarter of the store, or
``--budget-gib``). ``--runs uncached,cached`` runs only those of the six each round.
``--step-ms`` plays a trainer whose step takes that long: the consumer sleeps after each
batch, so a path whose workers keep ahead of the step runs at the trainer's rate.
``--compute actors`` runs raypipe's paths on a pool of ``--actors`` actors instead of
plain tasks. ``--path dataset`` times `build_dataset` + `iter_torch_batches`, a dataset
per epoch, in place of the run-long `Pipeline`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
from pathlib import Path

import ingest
import numpy as np

from raypipe.config import COMPUTE, PipelineConfig
from raypipe.plan.shards import list_shards
from raypipe.preprocess.cache import node
from raypipe.preprocess.cache.capped import decode_capped, encode_stored
from raypipe.preprocess.decode import crop_chw, decode_crop

PILLOW = {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 2}
PREFETCHES = (2, 4)  # each DataLoader's settings: the better of them in each round
SIDES = (128, 160, 224, 256, 320, 512)


def start_ray(store: int, *, warm_store: bool = True, free_ms: int | None = None) -> None:
    """ingest.py's local Ray, with an object store of ``store`` bytes, its pages taken
    at start (``warm_store``) as a long run's are once its blocks have been through them.

    A page of the store that no block has used yet is zeroed by the kernel when the first
    block is copied into it. Left to the runs, the first ``store`` bytes of blocks pay
    that, spread over as many epochs as it takes (14 of the small corpus, in a 4 GiB
    store), and the runs of a round pay it unequally: the first pays all, the cached paths,
    whose workers do least else, lose most. Warm, every run measures the steady state.

    ``free_ms``: how often Ray frees the objects no one holds (None: raypipe's local Ray's
    10 ms, `raypipe.cli.localray.LOCAL_SYSTEM_CONFIG`; 1000 is Ray's own default)."""
    import os

    import ray.data

    ingest.localray.start("local", num_cpus=os.cpu_count(), include_dashboard=False,
                          log_to_driver=False, object_store_memory=store,
                          configure_logging=False,
                          system_config={"preallocate_plasma_memory": warm_store}
                          | ({} if free_ms is None else
                             {"free_objects_period_milliseconds": free_ms}))  # fmt: skip
    ray.data.DataContext.get_current().enable_progress_bars = False


PATHS = {"pipeline": ingest.warm_epochs, "dataset": ingest.per_epoch_datasets}


def without_ray(store: int, warm_store: bool, config: PipelineConfig, listing,
                free_ms: int | None = None):  # fmt: skip
    """A context with Ray shut down, for the DataLoader; Ray starts again after it, its
    workers warmed by one untimed epoch as at the start (`main`)."""

    @contextlib.contextmanager
    def down():
        ingest.localray.shutdown()
        try:
            yield
        finally:
            start_ray(store, warm_store=warm_store, free_ms=free_ms)
            ingest.warm_epochs(config, listing, 1)

    return down


def cached_run(config: PipelineConfig, listing, epochs: int, pause_s: float = 0.0,
               run=ingest.warm_epochs) -> dict:  # fmt: skip
    """One cached ``run`` (one of `PATHS`) with a cache of its own; its counters after."""
    try:
        r = run(config, listing, epochs, pause_s)
        r["cache"] = node.stats(config)
    finally:
        node.release(config)
    return r


def disk_run(config: PipelineConfig, listing, epochs: int, root: Path, pause_s: float = 0.0,
             run=ingest.warm_epochs) -> dict:  # fmt: skip
    """One run with ``cache="disk"`` in a fresh directory under ``root`` (removed after)."""
    import shutil

    directory = root / "disk-cache"
    shutil.rmtree(directory, ignore_errors=True)
    try:
        disk = config.replace(cache="disk", cache_dir=str(directory))
        return cached_run(disk, listing, epochs, pause_s, run)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


RUNS = ("uncached", "cached", "jpeg", "pillow", "fast", "disk")
KEPT = ("epoch_img_s", "steady_img_s", "steady_run_img_s", "first_epoch_img_s", "cpu_s_per_epoch",
        "img_per_cpu_s", "cpu_s_by_process")  # of each run, in the raw file  # fmt: skip


def one_round(i: int, config, listing, shards, epochs: int, root: Path, only=RUNS,
              pillow_workers: int = 2, pause_s: float = 0.0, run=ingest.warm_epochs,
              down=contextlib.nullcontext) -> dict:  # fmt: skip
    memory = config.replace(cache="memory")
    jpeg = memory.replace(cache_encoding="jpeg")

    def loader(transform: str):
        with down():
            settings = [PILLOW | {"num_workers": pillow_workers, "prefetch_factor": p}
                        for p in PREFETCHES]  # fmt: skip
            return ingest.dataloader(shards, transform, epochs, settings)["best"]

    runs = {
        "uncached": lambda: run(config, listing, epochs, pause_s),
        "cached": lambda: cached_run(memory, listing, epochs, pause_s, run),
        "jpeg": lambda: cached_run(jpeg, listing, epochs, pause_s, run),
        "pillow": lambda: loader("pillow"),
        "fast": lambda: loader("fast"),
        "disk": lambda: disk_run(config, listing, epochs, root, pause_s, run),
    }
    names = [n for n in runs if n in only]
    order = names[i % len(names) :] + names[: i % len(names)]
    out = {"order": order}
    for name in order:
        r = runs[name]()
        out[name] = {k: r[k] for k in KEPT}
        out[name]["cache"] = r.get("cache")
        print(f"  round {i} {name}: epoch 0 {r['first_epoch_img_s']:.0f} img/s, later "
              f"{r['steady_img_s']:.0f} img/s", flush=True)  # fmt: skip
    return out


def capped_sizes(files: list[str], image: int) -> dict:
    """Bytes per cached image by cap, and the capped crop's pixel difference from the full
    image's (the same plans, mean and 99th percentile of |difference| in grey levels)."""
    out = {}
    for side in SIDES:
        nbytes, diffs, jpeg_bytes, jpeg_diffs = [], [], [], []
        for k, f in enumerate(files):
            data = Path(f).read_bytes()
            rgb = decode_capped(data, side, None)
            nbytes.append(rgb.nbytes)
            stored = encode_stored(rgb)
            served = stored.pixels()
            jpeg_bytes.append(len(stored.data))
            h, w = rgb.shape[:2]
            # one plan drawn on the full image's size, scaled to the capped one
            full = decode_crop(data, image, ingest.chooser(k, 1))
            plan = ingest.chooser(k, 1)(*_size(data))
            sx, sy = w / _size(data)[0], h / _size(data)[1]
            box = type(plan.box)(plan.box.left * sx, plan.box.top * sy, plan.box.width * sx,
                                 plan.box.height * sy)  # fmt: skip
            capped = crop_chw(rgb, plan._replace(box=box), image)
            diffs.append(np.abs(full.astype(np.int16) - capped.astype(np.int16)).ravel())
            capped = crop_chw(served, plan._replace(box=box), image)
            jpeg_diffs.append(np.abs(full.astype(np.int16) - capped.astype(np.int16)).ravel())
        d, j = np.concatenate(diffs), np.concatenate(jpeg_diffs)
        out[side] = {"bytes_per_image": float(np.mean(nbytes)), "mean_abs_diff": float(d.mean()),
                     "p99_abs_diff": float(np.percentile(d, 99)),
                     "jpeg_bytes_per_image": float(np.mean(jpeg_bytes)),
                     "jpeg_mean_abs_diff": float(j.mean()),
                     "jpeg_p99_abs_diff": float(np.percentile(j, 99))}  # fmt: skip
    return out


def sized_corpus(root: Path, photo: str, n: int) -> Path:
    """An image folder of ``n`` JPEGs of ``photo`` (``WxH``), in 8 classes (made once)."""
    import decode

    width, height = (int(v) for v in photo.lower().split("x"))
    folder = root / f"corpus-{n}-{width}x{height}" / "photos"
    if not folder.is_dir():
        tmp = folder.with_name("photos.tmp")
        for i, data in enumerate(decode.photos(width, height, n)):
            (tmp / f"c{i % 8}").mkdir(parents=True, exist_ok=True)
            (tmp / f"c{i % 8}" / f"{i:06d}.jpg").write_bytes(data)
        tmp.rename(folder)
    return folder


def _size(data: bytes) -> tuple[int, int]:
    from raypipe.preprocess.decode import jpeg_size

    h, w = jpeg_size(data)
    return w, h


def summary(rounds: list[dict]) -> dict:
    def med(name, key):
        values = [r[name][key] for r in rounds]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    ratio = lambda a, b, key: statistics.median(r[a][key] / r[b][key] for r in rounds)  # noqa: E731
    names = [n for n in ("uncached", "cached", "jpeg", "disk", "pillow", "fast") if n in rounds[0]]
    out = {
        "later_img_s": {n: med(n, "steady_img_s") for n in names},
        "epoch0_img_s": {n: med(n, "first_epoch_img_s") for n in names},
        "later_img_per_cpu_s": {n: med(n, "img_per_cpu_s") for n in names},
    }
    pairs = [("later", "disk", "uncached"), ("later", "disk", "pillow"),
             ("later", "jpeg", "uncached"), ("epoch0", "jpeg", "uncached"),
             ("epoch0", "disk", "uncached"), ("later", "cached", "pillow"),
             ("later", "cached", "uncached"), ("epoch0", "cached", "uncached"),
             ("later", "cached", "fast"), ("later", "uncached", "fast")]  # fmt: skip
    for when, a, b in pairs:
        if a in names and b in names:
            key = "steady_img_s" if when == "later" else "first_epoch_img_s"
            out[f"{when}_{a}_vs_{b}"] = ratio(a, b, key)
    if {"cached", "uncached"} <= set(names):  # each later epoch of the memory cache alone
        epochs = len(rounds[0]["cached"]["epoch_img_s"])
        out["by_epoch_cached_vs_uncached"] = [
            statistics.median(r["cached"]["epoch_img_s"][e] / r["uncached"]["steady_img_s"]
                              for r in rounds)
            for e in range(1, epochs)
        ]  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=list(ingest.SIZES), default="small")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--actors", type=int, default=2,
                   help="the pool's workers, and the Pillow DataLoader's")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    p.add_argument("--store-gib", type=int, default=4, help="the object store, GiB")
    p.add_argument("--cold-store", action="store_true",
                   help="leave the object store's pages to the runs (see start_ray)")  # fmt: skip
    p.add_argument("--free-ms", type=int,
                   help="how often Ray frees unheld objects, ms (default: raypipe's local "
                   "Ray's 10; 1000 is Ray's own default)")  # fmt: skip
    p.add_argument(
        "--photo",
        help="WxH: a corpus of photos of this size instead of ingest.py's (e.g. 1600x1200)",
    )
    p.add_argument("--images", type=int, default=1024, help="photos with --photo")
    p.add_argument("--cap", type=int, help="cache_max_side (default: the config's, 320)")
    p.add_argument(
        "--runs",
        default=",".join(RUNS),
        help=f"the runs of each round, comma-separated (default: all of {','.join(RUNS)})",
    )
    p.add_argument("--budget-gib", type=float, help="cache_budget per node, GiB (default: "
                   "a quarter of the store for memory, 2 GiB for disk)")  # fmt: skip
    p.add_argument("--compute", choices=COMPUTE, default="tasks",
                   help="raypipe's workers: plain Ray tasks (the default) or an actor "
                   "pool of --actors")  # fmt: skip
    p.add_argument("--path", choices=list(PATHS), default="pipeline",
                   help="raypipe's public path: a run-long `Pipeline` (the default), or "
                   "`build_dataset` + `iter_torch_batches`, one dataset an epoch")  # fmt: skip
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="a trainer's step: the consumer sleeps this long after each batch "
                   "(raypipe's paths only; default 0, as fast as batches come)")  # fmt: skip
    args = p.parse_args(argv)
    only = tuple(args.runs.split(","))
    if not only or set(only) - set(RUNS):
        p.error(f"--runs: a comma-separated choice of {', '.join(RUNS)}, not {args.runs!r}")
    if args.step_ms < 0 or (args.step_ms and {"pillow", "fast"} & set(only)):
        p.error("--step-ms: a duration >= 0, with --runs naming raypipe's paths only")
    args.out.mkdir(parents=True, exist_ok=True)
    # one OpenCV and torch thread here before anything decodes: a DataLoader worker forked
    # from a process whose thread pools started hangs in them
    ingest.one_thread()
    if args.photo:
        corpus = sized_corpus(args.out, args.photo, args.images)
    else:
        corpus = ingest.make_corpus(args.out, ingest.SIZES[args.size][0])
    config = ingest.pool_config(corpus, args.actors).replace(compute=args.compute)
    if args.cap:
        config = config.replace(cache_max_side=args.cap)
    if args.budget_gib:
        config = config.replace(cache_budget=int(args.budget_gib * (1 << 30)))
    listing = list_shards(config)
    files = [s.path for s in listing.shards]
    result = {"machine": platform.platform(), "cpus": __import__("os").cpu_count(),
              "args": {k: str(v) for k, v in vars(args).items()},
              "capped": capped_sizes(files[:64], ingest.IMAGE)}  # fmt: skip
    print(json.dumps(result["capped"], indent=1), flush=True)
    start_ray(args.store_gib << 30, warm_store=not args.cold_store, free_ms=args.free_ms)
    down = without_ray(args.store_gib << 30, not args.cold_store, config, listing,
                       args.free_ms)  # fmt: skip
    try:
        # one untimed epoch first: the pooled workers start and import raypipe here, not
        # in the first round's first run (whose epoch 0 it once slowed 2x, as its run's)
        ingest.warm_epochs(config, listing, 1)
        result["rounds"] = [one_round(i, config, listing, list(listing.shards), args.epochs,
                                      args.out, only, args.actors, args.step_ms / 1e3,
                                      PATHS[args.path], down)
                            for i in range(args.rounds)]  # fmt: skip
    finally:
        ingest.localray.shutdown()
    result["summary"] = summary(result["rounds"])
    print(json.dumps(result["summary"], indent=1))
    (args.out / "cache.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
