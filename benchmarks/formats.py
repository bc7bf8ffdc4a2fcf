"""Record formats: samples/s read and decoded from TFRecord, LMDB and HDF5 against the same
images as an image folder, through the same warm ``Pipeline``.

One corpus of ~400×300 photo JPEGs (``ingest.make_corpus``) is written once per format:

  imagefolder     the JPEG files themselves, class sub-folders
  tfrecord        4 shards ``train-0000s-of-00004`` of ``tf.train.Example``s with TF's
                  ImageNet build script's features (``image/encoded``, ``image/class/label``)
  lmdb            one environment, pickled ``(jpeg bytes, label)`` per key
  hdf5            4 files, ``images`` variable-length uint8 (the JPEG bytes), ``labels``
  hdf5-pixels     4 files, ``images`` raw uint8 N×H×W×3 pixels (center 256×256 crops)
  imagefolder-restarts  the same folder, each JPEG re-written losslessly with a restart
                  marker after every MCU (as ``raypipe convert`` stores them), which region
                  decoding reads only the crop's MCUs of

Each format is read by a warm ``Pipeline`` (``--actors`` actors, random-resized-crop(224) +
flip, uint8 batches of 256 on the host, no consumer work) for ``--epochs`` epochs; its rate
is the later epochs' samples over their time (the first epoch starts the pool). The
formats run in turn, ``--rounds`` times, interleaved; the table has each format's median
over the rounds, its ratio to the image folder's in the same round (median), and the
single-process rate of its reader alone (bytes out of the file, no decoding). Writes
``formats.json`` under --out (``formats-cache-<mode>.json`` with --cache).

``--cache memory`` (or ``disk``) runs every format with the decoded cache, a fresh one per
run: later epochs crop from the cached pixels, an image folder without reading its files,
the shard formats reading theirs for each sample's label.

    python benchmarks/formats.py --images 2048 --epochs 3 --rounds 3 [--cache memory]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from ingest import make_corpus, run_epochs

from raypipe.cli import localray
from raypipe.config import PipelineConfig
from raypipe.formats.tfexample import encode_example, frame
from raypipe.plan.shards import list_shards

BATCH, IMAGE, SEED, SHARDS = 256, 224, 0, 4
FORMATS = ("imagefolder", "tfrecord", "lmdb", "hdf5", "hdf5-pixels", "imagefolder-restarts")


def write_formats(corpus: Path, out: Path) -> dict[str, Path]:
    """Each format's copy of ``corpus`` under ``out`` (written once, kept for reruns)."""
    listing = list_shards(PipelineConfig(source=str(corpus)))
    samples = [(Path(s.path).read_bytes(), s.label) for s in listing.shards]
    parts = np.array_split(np.arange(len(samples)), SHARDS)
    roots = {"imagefolder": corpus}
    for name, write in (("tfrecord", _tfrecord), ("lmdb", _lmdb), ("hdf5", _hdf5),
                        ("hdf5-pixels", _hdf5_pixels)):  # fmt: skip
        root = out / f"{corpus.parent.name}-{name}"
        if not (root / ".done").exists():
            root.mkdir(parents=True, exist_ok=True)
            write(root, samples, parts)
            (root / ".done").write_text("")
        roots[name] = root
    roots["imagefolder-restarts"] = _restarted(corpus, out / f"{corpus.parent.name}-restarts")
    return roots


def _restarted(corpus: Path, root: Path) -> Path:
    """``corpus`` with every JPEG re-written with restart markers (the same pixels)."""
    from raypipe.preprocess import region

    if not (root / ".done").exists():
        for path in sorted(corpus.rglob("*.jpg")):
            (root / path.relative_to(corpus)).parent.mkdir(parents=True, exist_ok=True)
            (root / path.relative_to(corpus)).write_bytes(region.with_restarts(path.read_bytes()))
        (root / ".done").write_text("")
    return root


def _tfrecord(root: Path, samples, parts) -> None:
    for s, part in enumerate(parts):
        with open(root / f"train-{s:05d}-of-{SHARDS:05d}", "wb") as f:
            for i in part:
                data, label = samples[i]
                example = {"image/encoded": data, "image/class/label": label,
                           "image/format": b"JPEG"}  # fmt: skip
                f.write(frame(encode_example(example)))


def _lmdb(root: Path, samples, parts) -> None:
    import lmdb

    size = sum(len(d) for d, _ in samples) * 2 + (1 << 24)
    env = lmdb.open(str(root / "train"), map_size=size)
    with env.begin(write=True) as txn:
        for i, (data, label) in enumerate(samples):
            txn.put(f"{i:08d}".encode(), pickle.dumps((data, label)))
    env.close()


def _hdf5(root: Path, samples, parts) -> None:
    import h5py

    for s, part in enumerate(parts):
        with h5py.File(root / f"train-{s}.h5", "w") as f:
            images = f.create_dataset("images", (len(part),), h5py.vlen_dtype(np.uint8),
                                      chunks=(64,))  # fmt: skip
            for j, i in enumerate(part):
                images[j] = np.frombuffer(samples[i][0], np.uint8)
            f.create_dataset("labels", data=np.array([samples[i][1] for i in part]))


def _hdf5_pixels(root: Path, samples, parts) -> None:
    import h5py
    from PIL import Image

    for s, part in enumerate(parts):
        with h5py.File(root / f"train-{s}.h5", "w") as f:
            images = f.create_dataset("images", (len(part), 256, 256, 3), np.uint8,
                                      chunks=(16, 256, 256, 3))  # fmt: skip
            for j, i in enumerate(part):
                with Image.open(io.BytesIO(samples[i][0])) as img:
                    w, h = img.size
                    box = ((w - 256) // 2, (h - 256) // 2, (w + 256) // 2, (h + 256) // 2)
                    images[j] = np.asarray(img.convert("RGB").crop(box))
            f.create_dataset("labels", data=np.array([samples[i][1] for i in part]))


def read_only(root: Path, fmt: str) -> float:
    """Samples/s of the format's reader alone, in this process (bytes out, no decoding)."""
    listing = list_shards(PipelineConfig(source=str(root), format=fmt.split("-")[0]))
    t0, n = time.perf_counter(), 0
    for s in listing.shards:
        n += sum(1 for _ in listing.reader.read(s.path, s.first_key, s.label))
    return n / (time.perf_counter() - t0)


def pipeline_rate(root: Path, fmt: str, epochs: int, actors: int, cache: str | None = None,
                  cache_dir: Path | None = None) -> dict:  # fmt: skip
    from raypipe import Pipeline
    from raypipe.preprocess.cache import node

    config = PipelineConfig(source=str(root), format=fmt.split("-")[0], batch_size=BATCH,
                            image_size=IMAGE, seed=SEED, actors=(actors, actors), cache=cache,
                            cache_dir=str(cache_dir) if cache_dir else None)  # fmt: skip
    try:
        with Pipeline(config, epochs=epochs, device="cpu", normalize=False) as pipe:
            run = pipe.epochs()
            return run_epochs(lambda epoch: iter(next(run)[1]), epochs)
    finally:
        node.release(config)  # a fresh cache for the next run
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--actors", type=int, default=os.cpu_count())
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    p.add_argument("--cache", choices=("memory", "disk"),
                   help="run every format with the decoded cache (a fresh one per run)")  # fmt: skip
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    roots = write_formats(make_corpus(args.out, args.images), args.out)
    reads = {fmt: read_only(roots[fmt], fmt) for fmt in FORMATS}
    # raypipe's own local Ray: every server on 127.0.0.1 (docs/security.md)
    localray.start("local", num_cpus=os.cpu_count(), include_dashboard=False,
                   log_to_driver=False, configure_logging=False)  # fmt: skip
    rounds: list[dict[str, dict]] = []
    try:
        for r in range(args.rounds):
            rounds.append({})
            for fmt in FORMATS[r % len(FORMATS) :] + FORMATS[: r % len(FORMATS)]:  # rotated
                disk = args.out / "disk-cache" if args.cache == "disk" else None
                rounds[-1][fmt] = pipeline_rate(roots[fmt], fmt, args.epochs, args.actors,
                                                args.cache, disk)  # fmt: skip
                rate = rounds[-1][fmt]["steady_run_img_s"]
                print(f"round {r + 1}: {fmt:<12} {rate:7.0f} samples/s", flush=True)
    finally:
        localray.shutdown()
    table = summary(rounds, reads)
    print_table(table, args)
    result = {"images": args.images, "epochs": args.epochs, "cache": args.cache,
              "rounds": rounds, "table": table,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0], "loadavg_at_end": os.getloadavg()}}  # fmt: skip
    name = f"formats-cache-{args.cache}.json" if args.cache else "formats.json"
    (args.out / name).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out / name}")
    return result


def summary(rounds: list[dict[str, dict]], reads: dict[str, float]) -> list[dict]:
    rows = []
    for fmt in FORMATS:
        rates = [r[fmt]["steady_run_img_s"] for r in rounds]
        ratios = [r[fmt]["steady_run_img_s"] / r["imagefolder"]["steady_run_img_s"] for r in rounds]
        rows.append({"format": fmt, "median": statistics.median(rates), "rates": rates,
                     "ratio": statistics.median(ratios), "read_only": reads[fmt]})  # fmt: skip
    return rows


def print_table(table: list[dict], args) -> None:
    cache = f", cache={args.cache}" if args.cache else ""
    print(f"\n{args.images} images, {args.actors} actors, {args.epochs} epochs x "
          f"{args.rounds} rounds{cache} (samples/s, read + decode + crop(224) + flip)")  # fmt: skip
    print("| format | median samples/s | rounds | vs image folder | reader alone, 1 process |")
    print("|---|---:|---|---:|---:|")
    for row in table:
        rates = ", ".join(f"{x:.0f}" for x in row["rates"])
        print(f"| {row['format']} | {row['median']:.0f} | {rates} | {row['ratio']:.2f}x | "
              f"{row['read_only']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
