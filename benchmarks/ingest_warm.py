"""The two figures a refactor must not move, alone: the warm `Pipeline`'s steady rate and
the rank iterator's cost per batch, with `ingest.py`'s own functions on its small corpus.

Cheaper than ``ingest.py --size small`` (no DataLoader sweeps, no rounds), so two trees can
be measured interleaved on one machine: ``--ingest`` names the ``benchmarks/`` whose
`ingest.py` to use, and the raypipe measured is the one Python imports (``PYTHONPATH``)::

    PYTHONPATH=../other-tree python benchmarks/ingest_warm.py --ingest ../other-tree/benchmarks \\
        --tag before --out /tmp/warm.jsonl

Prints one JSON line and appends it to ``--out``: ``steady_img_s`` (median of epochs 2-5),
``epoch_img_s`` (the first with the pool's start), ``first_batch_s``,
``iterator_ms_per_batch`` (best of 10 passes, blocks already in the store).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ingest", type=Path, default=Path(__file__).parent)
    p.add_argument("--corpus", type=Path, default=Path(__file__).parent / "out")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    sys.path.insert(0, str(args.ingest.resolve()))
    import ingest

    import raypipe
    from raypipe import build_dataset

    shards = _listing_module()
    corpus = ingest.make_corpus(args.corpus, ingest.SIZES["small"][0])
    ingest.start_ray()
    config = ingest.pool_config(corpus, args.actors)
    listing = shards.list_shards(config)
    warm = ingest.warm_epochs(config, listing, args.epochs)
    ready = build_dataset(config.replace(compute="tasks"), epoch=0, listing=listing)
    result = {
        "tag": args.tag,
        "raypipe": str(Path(raypipe.__file__).parent),
        "steady_img_s": warm["steady_img_s"],
        "epoch_img_s": warm["epoch_img_s"],
        "first_batch_s": warm["first_batch_s"],
        "iterator_ms_per_batch": ingest.iterator_cost(ready),
    }
    ingest.localray.shutdown()
    print(json.dumps(result))
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
    return result


def _listing_module():
    """`list_shards`'s module, where the measured tree has it (it moved in 0.x)."""
    for name in ("raypipe.plan.shards", "raypipe.data.shards"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no raypipe.plan.shards or raypipe.data.shards")


if __name__ == "__main__":
    main()
