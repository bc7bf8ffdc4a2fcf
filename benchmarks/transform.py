"""Your own transform: the same one in raypipe's actors and in a tuned torch DataLoader.

The transform is `raypipe.cli.examples.ColorCrop(224)` (random-resized-crop + flip + colour
jitter on a PIL image, drawing from torch's generator, as a torchvision v2 pipeline does).
Both paths decode the same photo JPEGs with Pillow, run it, and hand uint8 3×224×224
batches of 256 to a consumer that takes them as fast as they come. The DataLoader is the
best of a sweep (workers = cpus and cpus + 1, prefetch 2 and 4, persistent workers);
raypipe is the warm ``Pipeline`` with ``cpus`` actors (in a local Ray of its own, shut
down before the DataLoader runs). Steady epochs (all but the first), their median per run.
After the sweep, ``--rounds`` rounds run the sweep's winner and raypipe once each, in an
order that alternates from round to round; reported: each path's median over the rounds,
and the median of the rounds' own ratios. Writes ``transform.json`` under --out.

    python benchmarks/transform.py --images 2048 --epochs 4 --rounds 4
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from ingest import EpochOrder, make_corpus, run_epochs

from raypipe.cli import localray
from raypipe.cli.examples import ColorCrop
from raypipe.config import PipelineConfig
from raypipe.plan.shards import list_shards

BATCH, IMAGE, SEED = 256, 224, 0


class PhotoDataset:
    """The DataLoader side: file → PIL → the same transform, seeded per (epoch, key)."""

    def __init__(self, shards):
        self.shards, self.fn, self.epoch = shards, ColorCrop(IMAGE), 0

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, item):
        """``item``: ``(epoch, index)`` from `ingest.EpochOrder`, or an index."""
        import torch
        from PIL import Image

        from raypipe.preprocess.usermap import seed_globals

        epoch, i = item if isinstance(item, tuple) else (self.epoch, item)
        s = self.shards[i]
        with Image.open(io.BytesIO(Path(s.path).read_bytes())) as img:
            rgb = img.convert("RGB")
        seed_globals(SEED, epoch, s.first_key)
        out = self.fn({"image": rgb, "label": s.label})
        return {"image": torch.from_numpy(out["image"]), "label": s.label, "key": s.first_key}


def dataloader(shards, epochs: int, settings: list[dict]) -> dict:
    from torch.utils.data import DataLoader

    results = []
    for s in settings:
        ds, order = PhotoDataset(shards), EpochOrder(len(shards), SEED)
        loader = DataLoader(ds, batch_size=BATCH, sampler=order, drop_last=True, **s)

        def epoch_iter(epoch, order=order, loader=loader):
            order.epoch = epoch  # each item carries it to the persistent workers
            return iter(loader)

        r = run_epochs(epoch_iter, epochs)
        results.append({"settings": s, **r})
        print(f"  dataloader {s}: steady {r['steady_img_s']:.0f} img/s")
        del loader
    return {"best": max(results, key=lambda r: r["steady_img_s"]), "sweep": results}


def raypipe_run(corpus: Path, epochs: int, actors: int) -> dict:
    import ray

    from raypipe import Pipeline

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
             log_to_driver=False, configure_logging=False)  # fmt: skip
    try:
        config = PipelineConfig(source=str(corpus), batch_size=BATCH, seed=SEED,
                                actors=(actors, actors), transform=ColorCrop(IMAGE),
                                transform_input="pil")  # fmt: skip
        with Pipeline(config, epochs=epochs, device="cpu", normalize=False) as pipe:
            run = pipe.epochs()
            r = run_epochs(lambda epoch: iter(next(run)[1]), epochs)
        print(f"  raypipe warm, {actors} actors: steady {r['steady_img_s']:.0f} img/s")
        return r
    finally:
        localray.shutdown()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    p.add_argument("--actors", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=4, help="rounds after the sweep (default: 4)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(args.out, args.images)
    listing = list_shards(PipelineConfig(source=str(corpus)))
    cpus = os.cpu_count()
    sweep = [{"num_workers": w, "persistent_workers": True, "prefetch_factor": f}
             for w in sorted({cpus, cpus + 1}) for f in (2, 4)]  # fmt: skip
    result = {
        "images": args.images, "epochs": args.epochs, "batch_size": BATCH,
        "machine": {"cpus": cpus, "platform": platform.platform(),
                    "python": sys.version.split()[0], "loadavg_at_start": os.getloadavg()},
        "dataloader": dataloader(listing.shards, args.epochs, sweep),
    }  # fmt: skip
    best = result["dataloader"]["best"]["settings"]
    paths = {"dataloader": lambda: dataloader(listing.shards, args.epochs, [best])["best"],
             "raypipe": lambda: raypipe_run(corpus, args.epochs, args.actors)}  # fmt: skip
    rounds = []
    for r in range(args.rounds):
        order = list(paths) if r % 2 == 0 else list(paths)[::-1]
        rounds.append({"order": order, **{name: paths[name]() for name in order}})
    result["rounds"] = rounds
    med = lambda f: statistics.median(f(r) for r in rounds)  # noqa: E731
    result["summary"] = {
        "dataloader_settings": best,
        "dataloader_steady_img_s": med(lambda r: r["dataloader"]["steady_img_s"]),
        "raypipe_steady_img_s": med(lambda r: r["raypipe"]["steady_img_s"]),
        "ratio_steady": med(lambda r: r["raypipe"]["steady_img_s"] / r["dataloader"]["steady_img_s"]),
        "ratio_per_cpu_s": med(lambda r: r["raypipe"]["img_per_cpu_s"] / r["dataloader"]["img_per_cpu_s"]),
        "ratios_by_round": [r["raypipe"]["steady_img_s"] / r["dataloader"]["steady_img_s"] for r in rounds],
    }  # fmt: skip
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    s = result["summary"]
    print(f"raypipe {s['raypipe_steady_img_s']:.0f} img/s, DataLoader {best} "
          f"{s['dataloader_steady_img_s']:.0f} img/s (medians of {args.rounds} rounds): "
          f"{s['ratio_steady']:.2f}x (rounds {', '.join(f'{x:.2f}' for x in s['ratios_by_round'])}); "
          f"per CPU-second {s['ratio_per_cpu_s']:.2f}x")  # fmt: skip
    (args.out / "transform.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out / 'transform.json'}")
    return result


if __name__ == "__main__":
    main()
