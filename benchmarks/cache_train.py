"""Accuracy with the decoded cache against without it: the same model, data and seeds.

With ``cache="memory"`` every random-resized crop comes from the image kept with its short
side capped at ``cache_max_side``; where a photo's short side is above the cap, the crops
are made from fewer pixels than without the cache. This measures what that costs a short
training run. For each seed, in an order that rotates from seed to seed, it trains the
demo job's small CNN (`raypipe.cli.classify.small_cnn`; Adam, the learning rate annealed
to zero over the run by a cosine) from the same initial weights on the same samples:

  uncached   the warm `Pipeline` as shipped, no cache;
  cap N      the same `Pipeline` with ``cache="memory"`` and ``cache_max_side=N`` (a fresh
             cache every run), for each N of ``--caps``. A cap at or above ``--side``
             (the default cap, 320) keeps the whole image: the control, whose crops
             differ from the uncached ones only because the uncached path decodes at a
             1/2 or 1/4 DCT scale where the crop allows it;

each for ``--epochs`` epochs of random-resized-crop ``--image-size`` + flip, a plain torch
loop in this process on CPU. After every epoch the model is scored on a held-out split
decoded once, without augmentation (resize + center crop), the same tensors for every run.

The data is made here from what scikit-learn ships (nothing is downloaded), as JPEGs
(quality 90) of ``--side`` pixels square, so a cap below ``--side`` changes pixels:

  photos   the two sample photos (china, flower) cut into a 3 × 4 grid of cells each:
           24 classes, 60 training and 20 held-out samples each; a sample is a
           jittered crop of about one cell (142-170 source pixels) resized to ``--side``;
  digits   ``load_digits``' 8×8 glyphs (10 classes, a fifth held out) resized to
           ``--side``, with a little noise so the JPEGs carry detail at full size.

Reported per run: each epoch's mean training loss, wall time (asking for the epoch to its
last step; evaluation not included) and held-out accuracy, the cache's hits and misses,
and a digest of each epoch's sample order (equal digests: the runs saw the same samples in
the same order, and differ only in the crops' pixels). Then per variant the medians over
seeds, and each seed's accuracy less its uncached run's. Before training, how far the
cached crops are from the uncached ones (epoch 0's plans on 64 training images; mean and
99th percentile of |difference| in grey levels).

    flock /tmp/raypipe-cpu.lock .venv/bin/python benchmarks/cache_train.py \\
        --json benchmarks/results/cpu2-cache-train.json

The data and one local Ray (loopback only, no dashboard) are started here; the Ray stops
at the end. About 5 minutes on a 2-core VM with the defaults.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from raypipe.cli import localray
from raypipe.config import PipelineConfig
from raypipe.preprocess.augment import plan, sample_rng
from raypipe.preprocess.cache import node
from raypipe.preprocess.cache.capped import decode_capped
from raypipe.preprocess.decode import crop_chw, decode_crop

GRID = (3, 4)  # photos: rows × columns of cells per sample photo
QUALITY = 90


def make_photos(root: Path, side: int, per_class: tuple[int, int], seed: int) -> None:
    """``train`` and ``val`` class folders of jittered crops of the sample photos' cells."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    photos = load_sample_images().images
    rows, cols = GRID
    for p, photo in enumerate(photos):
        h, w = photo.shape[:2]
        ch, cw = h / rows, w / cols
        for r in range(rows):
            for c in range(cols):
                label = f"{p}-{r}-{c}"
                cy, cx = (r + 0.5) * ch, (c + 0.5) * cw
                for split, n in zip(("train", "val"), per_class, strict=True):
                    folder = root / split / label
                    folder.mkdir(parents=True, exist_ok=True)
                    for i in range(n):
                        s = min(ch, cw) * rng.uniform(1.0, 1.2)  # 142-170 source pixels
                        y = np.clip(cy + rng.uniform(-0.2, 0.2) * ch - s / 2, 0, h - s)
                        x = np.clip(cx + rng.uniform(-0.2, 0.2) * cw - s / 2, 0, w - s)
                        crop = Image.fromarray(photo).crop((x, y, x + s, y + s))
                        crop = crop.resize((side, side), Image.Resampling.BICUBIC)
                        crop.save(folder / f"{i:04d}.jpg", quality=QUALITY)


def make_digits(root: Path, side: int, seed: int) -> None:
    """``train`` and ``val`` class folders of the digits (a fifth held out per class)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    for label in range(10):
        idx = np.flatnonzero(digits.target == label)
        rng.shuffle(idx)
        n_val = round(len(idx) * 0.2)
        for split, part in (("val", idx[:n_val]), ("train", idx[n_val:])):
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            for i in part:
                glyph = Image.fromarray((digits.images[i] * 255 / 16).astype(np.float32))
                big = np.asarray(glyph.resize((side, side), Image.Resampling.BICUBIC))
                big = big + rng.normal(0, 12, big.shape)
                grey = Image.fromarray(big.clip(0, 255).astype(np.uint8), "L")
                grey.convert("RGB").save(folder / f"{i:05d}.jpg", quality=QUALITY)


def make_data(out: Path, data: str, side: int, seed: int) -> Path:
    """The data set's folder under ``out``, made once per (data, side, seed)."""
    root = out / f"{data}-{side}-{seed}"
    if not (root / ".done").exists():
        if data == "photos":
            make_photos(root, side, (60, 20), seed)
        else:
            make_digits(root, side, seed)
        (root / ".done").touch()
    return root


def crop_difference(files: list[Path], size: int, caps: list[int], seed: int) -> dict:
    """Per cap: mean and 99th percentile of |cached crop - uncached crop| (grey levels)
    over epoch 0's train plans of ``files`` (the key is the index here)."""
    out = {}
    for cap in caps:
        diffs = []
        for key, f in enumerate(files):
            data = f.read_bytes()
            choose = lambda w, h, key=key: plan(w, h, train=True, rng=sample_rng(seed, 0, key),  # noqa: E731
                                                scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                                                flip=True)  # fmt: skip
            full = decode_crop(data, size, choose)
            rgb = decode_capped(data, cap, None)
            capped = crop_chw(rgb, choose(rgb.shape[1], rgb.shape[0]), size)
            diffs.append(np.abs(full.astype(np.int16) - capped.astype(np.int16)).ravel())
        d = np.concatenate(diffs)
        out[str(cap)] = {"mean_abs_diff": round(float(d.mean()), 3),
                         "p99_abs_diff": round(float(np.percentile(d, 99)), 1)}  # fmt: skip
    return out


def held_out(config: PipelineConfig):
    """The validation split decoded once (train=False: resize + center crop), by key."""
    import torch

    from raypipe import Pipeline

    images, labels, keys = [], [], []
    with Pipeline(config, epochs=1, device="cpu", drop_last=False, progress_s=0) as pipe:
        for _, batches in pipe.epochs():
            for b in batches:
                images.append(b["image"].clone())
                labels.append(b["label"].clone())
                keys.append(b["key"].clone())
    order = torch.cat(keys).argsort()
    return torch.cat(images)[order], torch.cat(labels)[order]


def accuracy(model, val) -> float:
    import torch

    images, labels = val
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(x).argmax(1) for x in images.split(256)])
    return float((pred == labels).float().mean())


def train_run(config: PipelineConfig, val, num_classes: int, epochs: int, lr: float) -> dict:
    """One run: the model from ``config.seed``, ``epochs`` epochs of the warm `Pipeline`."""
    import torch
    import torch.nn.functional as F

    from raypipe import Pipeline
    from raypipe.cli.classify import small_cnn

    torch.manual_seed(config.seed)
    model = small_cnn(num_classes)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    rows = []
    t_run = time.perf_counter()
    try:
        with Pipeline(config, epochs=epochs, device="cpu", progress_s=0) as pipe:
            steps_per_epoch = pipe.listing.num_samples // config.batch_size
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * steps_per_epoch)
            run = pipe.epochs()
            while True:
                t0 = time.perf_counter()
                try:
                    epoch, batches = next(run)
                except StopIteration:
                    break
                model.train()
                loss_sum, steps, order = 0.0, 0, hashlib.sha1()
                for batch in batches:
                    loss = F.cross_entropy(model(batch["image"]), batch["label"])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    schedule.step()
                    loss_sum += loss.item()
                    steps += 1
                    order.update(batch["key"].numpy().tobytes())
                seconds = time.perf_counter() - t0
                stats = batches.stats()
                rows.append({"epoch": epoch, "loss": loss_sum / max(steps, 1),
                             "wall_s": round(seconds, 3), "samples": stats["samples"],
                             "wait_fraction": round(stats["wait_fraction"], 4),
                             "val_accuracy": accuracy(model, val),
                             "order": order.hexdigest()[:12],
                             "cache": stats.get("cache")})  # fmt: skip
                print(f"    epoch {epoch}: loss {rows[-1]['loss']:.4f}  val_acc "
                      f"{rows[-1]['val_accuracy']:.4f}  {seconds:.1f} s", flush=True)  # fmt: skip
    finally:
        if config.cache is not None:
            node.release(config)
    cache = rows[-1]["cache"] or {}
    return {"val_accuracy": rows[-1]["val_accuracy"], "run_s": round(time.perf_counter() - t_run, 2),
            "cache_hits": cache.get("hits"), "cache_misses": cache.get("misses"),
            "epochs": rows}  # fmt: skip


def variants(caps: list[int]) -> dict[str, dict]:
    out: dict[str, dict] = {"uncached": {}}
    for cap in caps:
        out[f"cap {cap}"] = {"cache": "memory", "cache_max_side": cap}
    return out


def summary(seeds: dict[str, dict]) -> dict:
    """Per variant, medians over seeds; accuracy differences to the same seed's uncached run."""
    names = list(next(iter(seeds.values()))["runs"])
    out = {}
    for name in names:
        runs = [s["runs"][name] for s in seeds.values()]
        acc = [r["val_accuracy"] for r in runs]
        base = [s["runs"]["uncached"]["val_accuracy"] for s in seeds.values()]
        out[name] = {
            "val_accuracy": {"median": statistics.median(acc), "min": min(acc), "max": max(acc)},
            "minus_uncached": [round(a - b, 4) for a, b in zip(acc, base, strict=True)],
            "loss_by_epoch": by_epoch(runs, "loss"),
            "val_accuracy_by_epoch": by_epoch(runs, "val_accuracy"),
            "wall_s_by_epoch": by_epoch(runs, "wall_s"),
            "cache_hits": [r["cache_hits"] for r in runs],
            "cache_misses": [r["cache_misses"] for r in runs],
            "same_order_as_uncached": all(
                [e["order"] for e in s["runs"][name]["epochs"]]
                == [e["order"] for e in s["runs"]["uncached"]["epochs"]]
                for s in seeds.values()
            ),
        }
    return out


def by_epoch(runs: list[dict], key: str) -> list[float]:
    """Each epoch's median of ``key`` over ``runs``."""
    epochs = len(runs[0]["epochs"])
    return [round(statistics.median(r["epochs"][e][key] for r in runs), 4) for e in range(epochs)]


def start_ray(store: int) -> None:
    """raypipe's local Ray on loopback, no dashboard (as benchmarks/cache.py)."""
    import ray.data

    localray.start("local", num_cpus=os.cpu_count(), include_dashboard=False,
                   log_to_driver=False, object_store_memory=store,
                   configure_logging=False)  # fmt: skip
    ray.data.DataContext.get_current().enable_progress_bars = False


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every option's default."""


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--data", choices=("photos", "digits"), default="photos",
                   help="the images made locally")  # fmt: skip
    p.add_argument("--side", type=int, default=160, help="the JPEGs' side in pixels")
    p.add_argument("--caps", type=int, nargs="+", default=[64, 96, 320],
                   help="cache_max_side values run with cache='memory' (320: the default)")  # fmt: skip
    p.add_argument("--image-size", type=int, default=64, help="the crops' side in pixels")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="one round of every variant per seed")  # fmt: skip
    p.add_argument("--epochs", type=int, default=6, help="epochs per run")
    p.add_argument("--batch-size", type=int, default=64, help="training batch size")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam's initial learning rate")
    p.add_argument("--out", type=Path, default=Path("/tmp/raypipe-cache-train"),
                   help="where the data is made (kept for later runs)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the raw results here")
    p.add_argument("--store-mib", type=int, default=1024, help="Ray's object store in MiB")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    root = make_data(args.out, args.data, args.side, seed=0)
    classes = sorted(d.name for d in (root / "train").iterdir())
    train_files = sorted((root / "train").rglob("*.jpg"))
    files = train_files[:: max(1, len(train_files) // 64)][:64]
    import ray
    import torch

    result = {"machine": platform.platform(), "cpus": os.cpu_count(),
              "versions": {"python": platform.python_version(), "ray": ray.__version__,
                           "torch": torch.__version__},
              "torch_threads": torch.get_num_threads(),
              "args": {k: str(v) for k, v in vars(args).items()},
              "data": {"root": str(root), "classes": len(classes),
                       "train": len(train_files),
                       "val": len(list((root / "val").rglob("*.jpg")))},
              "crop_difference": crop_difference(files, args.image_size, args.caps, seed=0)}  # fmt: skip
    print(json.dumps({k: result[k] for k in ("data", "crop_difference")}), flush=True)
    base = PipelineConfig(source=str(root / "train"), image_size=args.image_size,
                          batch_size=args.batch_size)  # fmt: skip
    start_ray(args.store_mib << 20)
    try:
        val = held_out(base.replace(source=str(root / "val"), train=False))
        result["seeds"] = {}
        names = list(variants(args.caps))
        for i, seed in enumerate(args.seeds):
            order = names[i % len(names) :] + names[: i % len(names)]
            runs = {}
            for name in order:
                print(f"  seed {seed} {name}", flush=True)
                config = base.replace(seed=seed, **variants(args.caps)[name])
                runs[name] = train_run(config, val, len(classes), args.epochs, args.lr)
            result["seeds"][str(seed)] = {"order": order, "runs": {n: runs[n] for n in names}}
    finally:
        localray.shutdown()
    result["summary"] = summary(result["seeds"])
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(result["summary"], indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
