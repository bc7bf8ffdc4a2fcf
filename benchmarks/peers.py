"""raypipe against the streaming loaders users pick instead, side by side in one run.

On ``ingest.py``'s corpus (~400×300 photo JPEGs, random-resized-crop(224) + flip to uint8
N×3×224×224 batches of 256), each loader reads the data in the form it asks for:

  raypipe    the image folder, its warm run-long ``Pipeline`` (defaults: Ray tasks)
  dataloader a torch DataLoader over the image folder (``ingest.FileDataset``)
  litdata    LitData: the JPEG bytes ``optimize()``d into chunks, ``StreamingDataset`` +
             ``StreamingDataLoader``
  streaming  MosaicML Streaming: the JPEG bytes in MDS shards (``MDSWriter``),
             ``StreamingDataset`` + a torch DataLoader

The three torch loaders run the same per-sample work in their workers, ``--transform``'s
decode and crop (``pillow``: Pillow, as their users write it; ``fast``: raypipe's own
decoder, which isolates the loader), with the same seeded crop plans, the same settings
(``--workers`` workers, persistent, ``--prefetch`` batches each) and the same batch size.
Every path runs once per round, the order rotating (``ingest_rounds.rounds``); a ratio is
taken within a round, and the median over rounds is reported, of the whole stretch of
later epochs (``steady_run_img_s``: a warm pipeline's epochs trade work with their
neighbours, so per-epoch rates would flatter it) and of the median later epoch; every path
runs one epoch more, left out of both (`trimmed`).

LitData and MosaicML Streaming are not raypipe's dependencies: ``make bench-peers``
installs them without theirs (both ask for torchvision, whose PyPI build does not load
beside the CPU torch, and Streaming for transformers, whose hub version breaks `datasets`;
Streaming imports them only for datasets and checks this benchmark does not use, so
`_streaming` stands in for them).

    python benchmarks/peers.py --images 2048 --epochs 4 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import importlib.machinery
import json
import os
import platform
import statistics
import sys
import types
from pathlib import Path

import numpy as np
from ingest import (
    BATCH,
    IMAGE,
    SEED,
    TRANSFORMS,
    EpochOrder,
    FileDataset,
    chooser,
    make_corpus,
    one_thread,
    run_epochs,
    warm_alone,
)
from ingest_rounds import rounds

from raypipe.config import PipelineConfig
from raypipe.plan.shards import list_shards

PEERS = ("litdata", "streaming")


def _record(item: tuple[str, int, int]) -> dict:
    """One sample as both peers store it: the file's JPEG bytes, its label and key."""
    path, label, key = item
    return {"image": Path(path).read_bytes(), "label": label, "key": key}


def write_litdata(shards, out: Path) -> Path:
    from litdata import optimize

    if not (out / "index.json").exists():
        optimize(fn=_record, inputs=[(s.path, s.label, s.first_key) for s in shards],
                 output_dir=str(out), chunk_bytes="64MB", num_workers=1, verbose=False)  # fmt: skip
    return out


def write_mds(shards, out: Path) -> Path:
    MDSWriter = _streaming().MDSWriter  # noqa: N806

    if not (out / "index.json").exists():
        columns = {"image": "bytes", "label": "int", "key": "int"}
        with MDSWriter(out=str(out), columns=columns, size_limit=64 << 20) as writer:
            for s in shards:
                writer.write(_record((s.path, s.label, s.first_key)))
    return out


def crop(record: dict, epoch: int, transform: str) -> dict:
    """The per-sample work every torch loader here runs: decode, crop, flip, as uint8."""
    import torch

    key = int(record["key"])
    image = TRANSFORMS[transform](record["image"], IMAGE, chooser(key, epoch))
    return {"image": torch.from_numpy(np.ascontiguousarray(image)), "label": int(record["label"]),
            "key": key}  # fmt: skip


def litdata_loader(root: Path, transform: str, settings: dict):
    from litdata import StreamingDataLoader, StreamingDataset

    class Crops(StreamingDataset):
        def __getitem__(self, index):
            return crop(super().__getitem__(index), self.current_epoch, transform)

    data = Crops(str(root), shuffle=True, seed=SEED, drop_last=True)
    loader = StreamingDataLoader(data, batch_size=BATCH, drop_last=True,
                                 worker_init_fn=one_thread, **settings)  # fmt: skip
    return loader, lambda epoch: iter(loader)


def streaming_loader(root: Path, transform: str, settings: dict):
    StreamingDataset = _streaming().StreamingDataset  # noqa: N806
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    class Crops(StreamingDataset):
        def get_item(self, index):
            return crop(super().get_item(index), max(self.next_epoch - 1, 0), transform)

    clean_stale_shared_memory()
    data = Crops(local=str(root), shuffle=True, shuffle_seed=SEED, batch_size=BATCH)
    loader = DataLoader(data, batch_size=BATCH, drop_last=True, worker_init_fn=one_thread,
                        **settings)  # fmt: skip
    return loader, lambda epoch: iter(loader)


def dataloader_loader(shards, transform: str, settings: dict):
    from torch.utils.data import DataLoader

    order = EpochOrder(len(shards), SEED)
    loader = DataLoader(FileDataset(shards, transform), batch_size=BATCH, sampler=order,
                        drop_last=True, worker_init_fn=one_thread, **settings)  # fmt: skip

    def epoch_iter(epoch):
        order.epoch = epoch
        return iter(loader)

    return loader, epoch_iter


def trimmed(result: dict) -> dict:
    """``run_epochs``' result with its last epoch left out of the later epochs' figures: a
    warm pipeline starts the next epoch while the loop reads this one, so the stretch
    after epoch 0 began with work done before it; an untimed epoch after it gives back
    as much at its end (the torch loaders' workers start an epoch only when asked)."""
    rates, cpus = result["epoch_img_s"][1:-1], result["cpu_s_per_epoch"][1:-1]
    return {**result, "steady_img_s": statistics.median(rates),
            "steady_run_img_s": len(rates) / sum(1 / r for r in rates),
            "img_per_cpu_s": statistics.median(result["rows_per_epoch"] / c for c in cpus)}  # fmt: skip


def timed(make, epochs: int) -> dict:
    """``run_epochs`` over the loader ``make()`` builds, built anew for each round; its
    persistent workers stopped after, so that no path runs beside another's."""
    loader, epoch_iter = make()
    try:
        return trimmed(run_epochs(epoch_iter, epochs))
    finally:
        workers = getattr(loader, "_iterator", None)
        if workers is not None:
            workers._shutdown_workers()
            loader._iterator = None


def _streaming():
    """``import streaming``, with `_stand_ins` for what it imports and cannot find; they are
    taken out of ``sys.modules`` after (other code would take them for the packages)."""
    before = set(sys.modules)
    _stand_ins()
    stood = {name for name in set(sys.modules) - before if name.split(".")[0] in STOOD_IN}
    import streaming

    for name in stood:
        del sys.modules[name]
    return streaming


STOOD_IN = ("torchvision", "transformers")


def _stand_ins() -> None:
    """Streaming imports torchvision and transformers at its import, for its vision and
    text datasets and a type check of HF batches, none of which this benchmark uses; where
    either does not load (PyPI's torchvision beside the CPU torch; transformers, whose
    hub version would break the `datasets` raypipe's tests use, not installed), modules of
    those names with the few names Streaming imports stand in."""
    wanted = {
        "torchvision": {"datasets": {"VisionDataset": type("VisionDataset", (), {}),
                                     "CIFAR10": None},
                        "transforms.functional": {"to_tensor": None}},
        "transformers": {"feature_extraction_utils": {"BatchFeature": type("BatchFeature", (dict,), {})},
                         "tokenization_utils_base": {"BatchEncoding": type("BatchEncoding", (dict,), {})},
                         "models.auto.tokenization_auto": {"AutoTokenizer": None}},
    }  # fmt: skip
    for package, parts in wanted.items():
        try:
            importlib.import_module(package)
            continue
        except Exception:
            pass
        for part, names in parts.items():
            path = package
            for piece in part.split("."):
                parent, path = path, f"{path}.{piece}"
                for name in (parent, path):
                    if name not in sys.modules:
                        sys.modules[name] = module = types.ModuleType(name)
                        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
                setattr(sys.modules[parent], piece, sys.modules[path])
            for name, value in names.items():
                setattr(sys.modules[path], name, value)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=4,
                   help="epochs per path and round (>= 2), then one more left out")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--transform", choices=sorted(TRANSFORMS), action="append",
                   help="the torch loaders' per-sample work (default: both)")  # fmt: skip
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--prefetch", type=int, default=2, help="batches per worker (torch's default)")
    p.add_argument("--actors", type=int, default=os.cpu_count(), help="raypipe's pool")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = p.parse_args(argv)
    if args.epochs < 2 or args.rounds < 1 or args.images < BATCH:
        p.error("needs --epochs >= 2, --rounds >= 1 and --images >= one batch (256)")
    transforms = args.transform or sorted(TRANSFORMS)
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(args.out, args.images)
    listing = list_shards(PipelineConfig(source=str(corpus)))
    shards = listing.shards
    stored = {"litdata": write_litdata(shards, args.out / f"litdata-{args.images}"),
              "streaming": write_mds(shards, args.out / f"mds-{args.images}")}  # fmt: skip
    # fork, Linux's default, for every torch loader: LitData's optimize() above sets spawn
    settings = {"num_workers": args.workers, "persistent_workers": True,
                "prefetch_factor": args.prefetch, "multiprocessing_context": "fork"}  # fmt: skip
    build = {"dataloader": functools.partial(dataloader_loader, shards),
             "litdata": functools.partial(litdata_loader, stored["litdata"]),
             "streaming": functools.partial(streaming_loader, stored["streaming"])}  # fmt: skip
    epochs = args.epochs + 1  # the last one left out of the figures (`trimmed`)
    paths = {"raypipe": lambda: trimmed(warm_alone(corpus, listing, epochs, args.actors))}
    for name, make in build.items():
        for t in transforms:
            paths[f"{name}_{t}"] = functools.partial(
                timed, functools.partial(make, t, settings), epochs
            )
    versus = [("raypipe", other) for other in paths if other != "raypipe"]
    versus += [(f"{peer}_{t}", f"dataloader_{t}") for peer in PEERS for t in transforms]
    result = {
        "images": args.images, "epochs": args.epochs, "batch_size": BATCH,
        "settings": {"torch_loaders": settings, "raypipe_actors": args.actors},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": sys.version.split()[0], "loadavg_at_start": os.getloadavg()},
        **rounds(paths, args.rounds, versus),
    }  # fmt: skip
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    print(f"{'path':22s} {'later epochs, img/s':>20s} {'whole stretch':>14s}")
    for name, r in result["paths"].items():
        print(f"{name:22s} {r['steady_img_s']['median']:20.0f} "
              f"{r['steady_run_img_s']['median']:14.0f}")  # fmt: skip
    for pair, r in result["ratios"].items():
        run, epoch = r["steady_run_img_s"], r["steady_img_s"]
        print(f"{pair:36s} {run['median']:.2f}× whole stretch (rounds "
              f"{', '.join(f'{x:.2f}' for x in run['per_round'])}), "
              f"{epoch['median']:.2f}× median epoch")  # fmt: skip
    (args.out / "peers.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out / 'peers.json'}")
    return result


if __name__ == "__main__":
    main()
