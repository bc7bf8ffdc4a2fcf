"""Ingest throughput: raypipe against a tuned torch DataLoader, same files, same node.

One run measures, on one generated corpus of ~400×300 photo JPEGs
(``raypipe.demo.photo_crops``), random-resized-crop(224) + flip to uint8:

  (a) each transform in one process (the node's per-core limit);
  (b) torch DataLoader, best of a small sweep (workers, persistent workers, prefetch
      factor, pin_memory where CUDA exists), with the standard Pillow transform and
      with raypipe's fast transform;
  (c) raypipe ``build_dataset`` → ``iter_torch_batches``: first epoch with startup,
      then the median of several epochs; and the per-batch cost of the rank iterator
      over blocks already in the object store.

Every path yields uint8 N×3×224×224 batches of 256 on the host (normalisation belongs
on the device). Prints a table, writes ``ingest.json`` and ``ingest.png`` under --out.

    python benchmarks/ingest.py --size small
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from raypipe import fastimage, transforms
from raypipe.config import PipelineConfig
from raypipe.demo import write_photos
from raypipe.sources import list_shards
from raypipe.transforms import plan, sample_rng

SIZES = {"small": (2048, 3), "medium": (6144, 4), "large": (16384, 5)}  # images, epochs
BATCH, IMAGE, SEED = 256, 224, 0
TRANSFORMS = {"pillow": transforms.decode_crop, "fast": fastimage.decode_crop}


def chooser(key: int, epoch: int):
    rng = sample_rng(SEED, epoch, key)
    return lambda w, h: plan(
        w, h, train=True, rng=rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip=True
    )


def make_corpus(root: Path, n: int) -> Path:
    folder = root / f"corpus-{n}"
    if not (folder / "photos").is_dir():
        write_photos(folder, n, seed=SEED)
    return folder / "photos"


def single_process(files: list[str], limit: int) -> dict:
    """(a) img/s of each transform in this process, and how far apart their pixels are."""
    out, sample = {}, files[:limit]
    for name, fn in TRANSFORMS.items():
        fn(Path(sample[0]).read_bytes(), IMAGE, chooser(0, 0))  # import + warm
        t0 = time.perf_counter()
        for key, f in enumerate(sample):
            np.ascontiguousarray(fn(Path(f).read_bytes(), IMAGE, chooser(key, 0)))
        out[name] = len(sample) / (time.perf_counter() - t0)
    diffs = [
        np.abs(
            transforms.decode_crop(d, IMAGE, chooser(k, 0)).astype(np.int16)
            - fastimage.decode_crop(d, IMAGE, chooser(k, 0)).astype(np.int16)
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

    def __getitem__(self, i: int):
        import torch

        s = self.shards[i]
        data = Path(s.path).read_bytes()
        image = np.ascontiguousarray(self.fn(data, IMAGE, chooser(s.first_key, self.epoch)))
        return {"image": torch.from_numpy(image), "label": s.label, "key": s.first_key}


def run_epochs(make_iter, epochs: int) -> dict:
    """Wall time per epoch from asking for the iterator to the last batch."""
    rates, firsts, flowing, rows = [], [], [], 0
    for epoch in range(epochs):
        t0 = time.perf_counter()
        rows, t_first = 0, None
        for batch in make_iter(epoch):
            rows += len(batch["key"])
            if t_first is None:
                t_first, first_rows = time.perf_counter(), rows
        t_end = time.perf_counter()
        rates.append(rows / (t_end - t0))
        firsts.append(t_first - t0)
        flowing.append((rows - first_rows) / max(t_end - t_first, 1e-9))
    steady = rates[1:] or rates
    return {
        "epoch_img_s": rates,
        "first_epoch_img_s": rates[0],
        "steady_img_s": statistics.median(steady),
        "flowing_img_s": statistics.median(flowing[1:] or flowing),
        "first_batch_s": firsts,
        "rows_per_epoch": rows,
    }


def dataloader(shards, transform: str, epochs: int, settings: list[dict]) -> dict:
    """(b) best steady rate over the sweep; every setting's numbers kept."""
    import torch
    from torch.utils.data import DataLoader

    results = []
    for s in settings:
        ds = FileDataset(shards, transform)
        loader = DataLoader(ds, batch_size=BATCH, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(SEED),
                            pin_memory=torch.cuda.is_available(), **s)  # fmt: skip

        def epoch_iter(epoch, ds=ds, loader=loader):
            ds.epoch = epoch  # persistent workers keep epoch 0's plan; the cost is the same
            return iter(loader)

        r = run_epochs(epoch_iter, epochs)
        results.append({"settings": s, **r})
        del loader
        print(f"  dataloader {transform:6s} {s}: steady {r['steady_img_s']:.0f} img/s")
    best = max(results, key=lambda r: r["steady_img_s"])
    return {"best": best, "sweep": results}


def raypipe_run(corpus: Path, epochs: int, actors: int) -> dict:
    """(c) raypipe through iter_torch_batches, one dataset per epoch as train_ddp does."""
    import ray
    import ray.data

    from raypipe import build_dataset, iter_torch_batches

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
             log_to_driver=False,
             object_store_memory=1 << 30, configure_logging=False)  # fmt: skip
    ray.data.DataContext.get_current().enable_progress_bars = False
    ray_up_s = time.perf_counter() - t0
    config = PipelineConfig(source=str(corpus), batch_size=BATCH, image_size=IMAGE,
                            seed=SEED, actors=(actors, actors))  # fmt: skip
    listing = list_shards(config)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)

    def epoch_iter(epoch):
        ds = build_dataset(config, epoch=epoch, listing=listing)
        return iter(iter_torch_batches(ds, batch_size=BATCH, device="cpu", normalize=False))

    r = run_epochs(epoch_iter, epochs)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    r["driver_cpu_s_per_epoch"] = (
        cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    ) / epochs
    r["ray_init_s"] = ray_up_s
    r["iterator_ms_per_batch"] = iterator_cost(build_dataset(config, epoch=0, listing=listing))
    ray.shutdown()
    return r


def iterator_cost(ds, repeats: int = 3) -> float:
    """Per-batch time of the rank iterator over blocks already in the object store."""
    from raypipe import iter_torch_batches

    ready = ds.materialize()
    best = float("inf")
    for _ in range(repeats):
        it = iter_torch_batches(ready, batch_size=BATCH, device="cpu", normalize=False)
        t0, n = time.perf_counter(), 0
        for _ in it:
            n += 1
        best = min(best, (time.perf_counter() - t0) / max(n, 1))
    return best * 1e3


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        ("1 process, Pillow", result["single_process"]["pillow"]),
        ("1 process, fast", result["single_process"]["fast"]),
        ("DataLoader, Pillow", result["dataloader"]["pillow"]["best"]["steady_img_s"]),
        ("DataLoader, fast", result["dataloader"]["fast"]["best"]["steady_img_s"]),
        ("raypipe, 1st epoch", result["raypipe"]["first_epoch_img_s"]),
        ("raypipe, steady", result["raypipe"]["steady_img_s"]),
    ]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh([r[0] for r in rows][::-1], [r[1] for r in rows][::-1], color="#4477aa")
    ax.set_xlabel("images / s (uint8 224², batch 256)")
    ax.set_title(f"ingest, {result['machine']['cpus']} CPUs, {result['images']} JPEGs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    p.add_argument("--actors", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    n, epochs = SIZES[args.size]
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
    dl_pil = result["dataloader"]["pillow"]["best"]["steady_img_s"]
    dl_fast = result["dataloader"]["fast"]["best"]["steady_img_s"]
    rp = result["raypipe"]
    result["ratios"] = {
        "raypipe_vs_dataloader_pillow": rp["steady_img_s"] / dl_pil,
        "raypipe_vs_dataloader_fast": rp["steady_img_s"] / dl_fast,
    }
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    print_table(result)
    (args.out / "ingest.json").write_text(json.dumps(result, indent=2, default=str))
    chart(result, args.out / "ingest.png")
    print(f"wrote {args.out / 'ingest.json'} and {args.out / 'ingest.png'}")
    return result


def print_table(r: dict) -> None:
    rp, sp, dl = r["raypipe"], r["single_process"], r["dataloader"]
    rows = [
        ("1 process, Pillow transform", sp["pillow"], ""),
        ("1 process, fast transform", sp["fast"], f"mean |diff| {sp['fast_vs_pillow_mean_abs_diff']:.2f}"),
        ("DataLoader best, Pillow", dl["pillow"]["best"]["steady_img_s"], dl["pillow"]["best"]["settings"]),
        ("DataLoader best, fast", dl["fast"]["best"]["steady_img_s"], dl["fast"]["best"]["settings"]),
        ("raypipe first epoch", rp["first_epoch_img_s"], f"first batch {rp['first_batch_s'][0]:.2f} s"),
        ("raypipe steady (median)", rp["steady_img_s"], f"in-epoch flow {rp['flowing_img_s']:.0f} img/s"),
    ]  # fmt: skip
    print(f"\n{'path':32s} {'img/s':>8s}  note")
    for name, rate, note in rows:
        print(f"{name:32s} {rate:8.0f}  {note}")
    ratios = r["ratios"]
    print(
        f"\nraypipe / DataLoader(Pillow)  = {ratios['raypipe_vs_dataloader_pillow']:.2f}  (target >= 2.0)"
    )
    print(
        f"raypipe / DataLoader(fast)    = {ratios['raypipe_vs_dataloader_fast']:.2f}  (target >= 0.9)"
    )
    print(
        f"Ray up {rp['ray_init_s']:.1f} s; time to first batch {rp['first_batch_s'][0]:.2f} s "
        f"(then {statistics.median(rp['first_batch_s'][1:] or [0]):.2f} s per epoch)"
    )
    print(
        f"rank iterator, data ready: {rp['iterator_ms_per_batch']:.2f} ms per batch of {BATCH} "
        f"(target <= 0.5); driver CPU {rp['driver_cpu_s_per_epoch']:.2f} s per epoch"
    )
    print(f"load average at start {r['machine']['loadavg_at_start']}, end {r['machine']['loadavg_at_end']}")  # fmt: skip


if __name__ == "__main__":
    main()
