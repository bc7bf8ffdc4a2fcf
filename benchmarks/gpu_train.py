"""A GPU training step fed three ways, and JPEG decode on the GPU (CUDA machine).

(1) feeds: a data-bound step (a tiny CNN, batch ``--tiny-batch``) and a compute-bound one
    (ResNet-50, bf16 autocast, channels_last, batch ``--batch``), each fed by
      raypipe    the warm ``Pipeline`` (pinned ring, side-stream copy, normalize on device):
                 one Ray Data execution and one actor pool for every epoch
      ray_data   Ray Data's ``iter_torch_batches(pin_memory=True, device=...)`` over the same
                 ``build_dataset`` Dataset, iterated once per epoch as a user writes it,
                 normalized the same way. Ray Data executes a lazy Dataset again at every
                 iteration: every epoch of this feed pays an execution's start (its first
                 blocks wait on the decode), as only raypipe's first epoch does, so its
                 whole-epoch rate measures that restart; ``flowing`` is its rate once
                 blocks flow
      raypipe_decode_gpu  the same with ``decode="gpu"``: JPEG bytes travel, nvJPEG decodes
      dali       NVIDIA DALI (`dali_feed`): nvJPEG on "mixed" with its random crop, resize,
                 flip, normalize on the GPU, ``actors`` CPU threads; only where DALI is
                 installed
      on_device  batches already on the GPU (the upper bound)
    The feeds run ``--repeats`` times, interleaved (the order rotates from one repeat to the
    next); each figure is the median over repeats with its range. Per repeat: samples/s
    over whole epochs (epochs >= 1, median), the same from each epoch's first batch to its
    end (``flowing``: without the wait for the first batch, which holds a pool's start),
    the wait for each epoch's first batch, the median GPU step time (CUDA events, no host
    sync inside an epoch; each epoch's first 3 steps left out) over epochs >= 1, and over
    epoch 0 apart, its ratio to on_device in the same repeat, the image bytes moved per
    second, and device segments / pinned host allocations made after each feed's first
    two epochs (on_device: the model's own; the most over the repeats).
(2) decode: ``decode="cpu"`` vs ``decode="gpu"`` through the same ``Pipeline`` with no model
    (and DALI's uint8 crops where it is installed): images/s and node CPU-seconds per image
    (epochs >= 1, medians), and the mean absolute difference between raypipe's two paths'
    uint8 crops of the same keys.

The corpus is ``--images`` JPEG files of 400×300: 2,048 crops of scikit-learn's sample photos,
linked again under new names up to ``--images``.

    python benchmarks/gpu_train.py --json gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import dali_feed
import torch
from h2d import delta, machine, resnet50
from ingest import make_corpus
from nodecpu import CpuMeter
from torch import nn

import raypipe
from raypipe.cli import localray
from raypipe.config import IMAGENET_MEAN, IMAGENET_STD
from raypipe.loader.device import normalize

WARM_STEPS = 3  # steps per epoch left out of the step-time median (the epoch's start)


def corpus(root: Path, n: int, unique: int = 2048) -> Path:
    """``n`` JPEG files: ``unique`` photos written once, the rest hard links to them
    under new names (each key still gets its own crop; writing 12k photos takes a minute)."""
    photos = make_corpus(root, min(n, unique))
    files = sorted(photos.rglob("*.jpg"))
    for i in range(len(files), n):
        src = files[i % len(files)]
        os.link(src, src.parent / f"{i:06d}.jpg")
    return photos


def tiny_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 7, stride=4, padding=3), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1000),
    )  # fmt: skip


def big_model() -> nn.Module:
    try:
        import torchvision

        return torchvision.models.resnet50(weights=None)
    except ImportError:
        return resnet50()


def trainer(model: nn.Module, device):
    model = model.to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(image, label) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(image), label % 1000)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def timed_epochs(step, epochs, device) -> dict:
    """``epochs`` yields one iterable of (image, label) per epoch; samples/s and step times.

    The loop never waits for the GPU inside an epoch, as a training loop runs: a CUDA event
    recorded on the compute stream as each step starts times the steps on the GPU, so a
    step's time holds any wait for its batch and nothing of the host's launch latency. The
    wait for an epoch's first batch comes before its first step: it is in samples/s, not
    in any step time, and is reported apart (``first_batch_s``)."""
    rates, flowing, firsts, steps, moved = [], [], [], [], []
    stream = torch.cuda.current_stream(device)
    for batches in epochs:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        rows = nbytes = first_rows = 0
        t_first = None
        marks = []
        for image, label in batches:
            if t_first is None:
                t_first = time.perf_counter()
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record(stream)
            step(image, label)
            rows, nbytes = rows + len(label), nbytes + image.numel()
            first_rows = first_rows or rows
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record(stream)
        torch.cuda.synchronize(device)
        t_end = time.perf_counter()
        timed = marks[WARM_STEPS:]
        steps.append([a.elapsed_time(b) / 1e3 for a, b in zip(timed, timed[1:], strict=False)])
        rates.append(rows / (t_end - t0))
        flowing.append((rows - first_rows) / max(t_end - (t_first or t0), 1e-9))
        firsts.append((t_first or t_end) - t0)
        moved.append(nbytes / (t_end - t0) / 1e9)  # uint8 bytes in
    later = [t for epoch in steps[1:] for t in epoch]
    return {"epoch_samples_s": [round(r, 1) for r in rates],
            "samples_s": round(statistics.median(rates[1:] or rates), 1),
            "flowing_samples_s": round(statistics.median(flowing[1:] or flowing), 1),
            "first_batch_s": [round(f, 3) for f in firsts],
            "step_s": round(statistics.median(later), 5) if later else None,
            "step_s_epoch0": round(statistics.median(steps[0]), 5) if steps[0] else None,
            "image_GBps": round(statistics.median(moved[1:] or moved), 2)}  # fmt: skip


def raypipe_epochs(config, epochs, device):
    with raypipe.Pipeline(config, epochs=epochs, device=device, channels_last=True) as pipe:
        for _, batches in pipe.epochs():
            yield ((b["image"], b["label"]) for b in batches)


def metered(epochs, device, meter: dict):
    """The feed's epochs; allocator counters taken after two epochs of warm-up and at the end."""
    for e, batches in enumerate(epochs):
        if e == 2:
            meter["host0"], meter["dev0"] = _alloc_stats(device)
        yield batches
    meter["host1"], meter["dev1"] = _alloc_stats(device)


def ray_data_epochs(config, epochs, device):
    ds = raypipe.build_dataset(config, epoch=0)
    for _ in range(epochs):
        it = ds.iter_torch_batches(batch_size=config.batch_size, device=device, pin_memory=True,
                                   drop_last=True, prefetch_batches=2)  # fmt: skip
        yield (
            (normalize(b, IMAGENET_MEAN, IMAGENET_STD)["image"]
             .contiguous(memory_format=torch.channels_last), b["label"])
            for b in it
        )  # fmt: skip


def on_device_epochs(config, epochs, device, steps_per_epoch: int):
    g = torch.Generator().manual_seed(0)
    shape = (config.batch_size, 3, config.image_size, config.image_size)
    held = [
        (torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(device)
         .to(torch.float32).contiguous(memory_format=torch.channels_last),
         torch.randint(0, 1000, (config.batch_size,), generator=g).to(device))
        for _ in range(2)
    ]  # fmt: skip
    for _ in range(epochs):
        yield (held[i % 2] for i in range(steps_per_epoch))


def _alloc_stats(device):
    return torch.cuda.host_memory_stats(), torch.cuda.memory_stats(device)


SUMMED = ("samples_s", "flowing_samples_s", "step_s", "step_s_epoch0", "image_GBps",
          "step_ratio_to_on_device")  # fmt: skip


def feeds(name: str, model, config, args, device) -> dict:
    """Every feed ``args.repeats`` times, the order rotating by one from repeat to repeat;
    per feed, each figure's median over repeats, its range and every repeat's value."""
    step = trainer(model, device)
    steps = args.images // config.batch_size
    runs = {
        "on_device": lambda c: on_device_epochs(c, args.epochs, device, steps),
        "raypipe": lambda c: raypipe_epochs(c, args.epochs, device),
        "raypipe_decode_gpu": lambda c: raypipe_epochs(
            c.replace(decode="gpu"), args.epochs, device
        ),
        "ray_data": lambda c: ray_data_epochs(c, args.epochs, device),
    }
    if dali_feed.available():
        runs["dali"] = lambda c: dali_feed.dali_epochs(
            Path(c.source), batch=c.batch_size, size=c.image_size, epochs=args.epochs,
            threads=c.actors[1], device_id=device.index,
        )  # fmt: skip
    names = list(runs)
    repeats: list[dict[str, dict]] = []
    for i in range(args.repeats):
        k = i % len(names)
        done = {}
        for feed in names[k:] + names[:k]:
            meter: dict = {}
            r = timed_epochs(step, metered(runs[feed](config), device, meter), device)
            r["after_warm_up"] = {
                "pinned_host_allocs": delta(meter["host0"], meter["host1"], "num_host_alloc"),
                "device_segments": delta(meter["dev0"], meter["dev1"], "segment.all.allocated"),
            }
            done[feed] = r
        for r in done.values():  # paired within the repeat
            r["step_ratio_to_on_device"] = round(r["step_s"] / done["on_device"]["step_s"], 4)
        repeats.append(done)
        print(name, f"repeat {i + 1}/{args.repeats}", json.dumps(done), flush=True)
    out = {feed: summary([rep[feed] for rep in repeats]) for feed in names}
    return {"batch": config.batch_size, "repeats": args.repeats, **out}


def summary(runs: list[dict]) -> dict:
    """Median, min and max over repeats of each of `SUMMED`; the most allocations after
    warm-up in any repeat; every repeat's own result."""
    out: dict = {}
    for key in SUMMED:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = {"median": round(statistics.median(values), 5), "min": min(values),
                    "max": max(values)} if values else None  # fmt: skip
    out["after_warm_up"] = {
        k: max((r["after_warm_up"][k] for r in runs if r["after_warm_up"][k] is not None),
               default=None)
        for k in ("pinned_host_allocs", "device_segments")
    }  # fmt: skip
    out["per_repeat"] = runs
    return out


def decode_paths(config, args, device) -> dict:
    out, crops, every = {}, {}, max(1, args.images // args.compare)
    for name in ("cpu", "gpu"):
        cfg = config.replace(decode=name)
        with raypipe.Pipeline(cfg, epochs=args.epochs, device=device, normalize=False) as pipe:
            epochs = (((b["image"], b["key"]) for b in batches) for _, batches in pipe.epochs())
            out[name] = metered_rates(epochs, device, crops, name, every)
        print(name, json.dumps(out[name]), flush=True)
    if dali_feed.available():
        out["dali"] = metered_rates(dali_feed.dali_epochs(
            Path(config.source), batch=config.batch_size, size=config.image_size,
            epochs=args.epochs, threads=config.actors[1], device_id=device.index,
            normalize=False,
        ), device)  # fmt: skip
        print("dali", json.dumps(out["dali"]), flush=True)
    same = [k for (d, k) in crops if d == "cpu" and ("gpu", k) in crops]
    diffs = [(crops[("cpu", k)] - crops[("gpu", k)]).abs().float().mean().item() for k in same]
    out["same_keys_compared"] = len(same)
    out["mean_abs_diff"] = round(statistics.mean(diffs), 3) if diffs else None
    out["max_image_mean_abs_diff"] = round(max(diffs), 3) if diffs else None
    return out


def metered_rates(epochs, device, crops=None, name=None, every=1) -> dict:
    """Images/s and node CPU-seconds per image of each epoch of (image, key) batches; epoch
    0's crops of every ``every``-th key kept in ``crops`` under ``name`` when given."""
    rates, cpu_per_image = [], []
    for e, batches in enumerate(epochs):
        rows = 0
        with CpuMeter() as cpu:
            t0 = time.perf_counter()
            for image, key in batches:
                rows += len(key)
                if e == 0 and crops is not None:  # the same keys from every run
                    for k, img in zip(key.tolist(), image, strict=True):
                        if k % every == 0:
                            crops[(name, k)] = img.to("cpu", torch.int16)
            torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
        rates.append(rows / dt)
        cpu_per_image.append(cpu.seconds / rows)
    return {"epoch_images_s": [round(r, 1) for r in rates],
            "images_s": round(statistics.median(rates[1:] or rates), 1),
            "cpu_s_per_image": round(statistics.median(cpu_per_image[1:]), 6)}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=12288, help="photo JPEGs in the corpus")
    p.add_argument("--epochs", type=int, default=4, help="epochs per feed (medians of >= 1)")
    p.add_argument(
        "--repeats", type=int, default=3, help="interleaved repeats of every feed (medians)"
    )
    p.add_argument("--batch", type=int, default=256, help="ResNet-50 batch")
    p.add_argument("--tiny-batch", type=int, default=2048, help="tiny CNN batch")
    p.add_argument(
        "--actors",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 2),
        help="preprocessing actors for the tiny CNN and the decode runs",
    )
    p.add_argument(
        "--big-actors",
        type=int,
        default=10,
        help="actors for ResNet-50: enough for its rate, CPUs left to the trainer",
    )
    p.add_argument("--compare", type=int, default=512, help="keys whose crops are compared")
    p.add_argument("--only", choices=("feeds", "decode"), help="run one part")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.epochs < 2 or args.repeats < 1:
        p.error(f"--epochs {args.epochs} must be >= 2 and --repeats {args.repeats} >= 1")
    if not torch.cuda.is_available():
        print("needs CUDA: run it on a GPU machine", file=sys.stderr)
        return 2
    import ray

    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cudnn.benchmark = True
    folder = corpus(Path(tempfile.mkdtemp(prefix="raypipe-gpu-")), args.images)
    ray.init(include_dashboard=False, log_to_driver=False)
    config = raypipe.PipelineConfig(source=str(folder), image_size=224, batch_size=args.batch,
                                    actors=(args.actors, args.actors), seed=0)  # fmt: skip
    results: dict = {"machine": machine(device), "images": args.images, "epochs": args.epochs,
                     "repeats": args.repeats, "actors": args.actors,
                     "source": "400x300 photo JPEGs",
                     "dali": dali_feed.available()}  # fmt: skip
    if args.only in (None, "feeds"):
        results["data_bound_tiny_cnn"] = feeds(
            "tiny", tiny_cnn(), config.replace(batch_size=args.tiny_batch), args, device
        )
        big = config.replace(actors=(args.big_actors, args.big_actors))
        results["compute_bound_resnet50"] = feeds("resnet50", big_model(), big, args, device)
    if args.only in (None, "decode"):
        results["decode"] = decode_paths(config, args, device)
    localray.shutdown()
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
