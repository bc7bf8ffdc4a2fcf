"""Decoding less: CPU per image of raypipe's fast path, decoding whole images at full size
(before), with libjpeg-turbo's DCT scaling, and with only the crop's region decoded, for
the same crop plans, on photos of ImageNet's sizes and larger.

For each size, --images photos (crops of scikit-learn's two sample photos, resized to
W×H, JPEG quality 90) are decoded and cropped to 224 by raypipe's fast path
(`raypipe.preprocess.decode.decode_crop`, random-resized-crop with flips, seeded plans)
three ways: ``full`` decodes every whole image at full size; ``scaled`` decodes at 1/2,
1/4 or 1/8 DCT scale whenever the crop keeps 224 pixels across; ``region`` (as shipped,
where `raypipe.preprocess.region` was built) also decodes only the crop's region;
``restarts`` is ``region`` on the same photos as ``raypipe convert`` stores them by default,
re-written losslessly with a restart marker after every MCU, so that only the crop's MCUs
are entropy-decoded (``full`` decodes the photos as they were), and ``full_restarts``
decodes those re-written photos whole (what a whole decode, such as the decoded cache's
first epoch, pays for the markers). The five interleave over
--rounds rounds on one thread, the order rotating; each round gives
CPU seconds per image (``time.process_time``), and the table shows medians. Also: how
often a plan decodes scaled, and how far each output is from ``full``'s (grey levels:
mean, 99th percentile and worst pixel).

    python benchmarks/decode.py [--images 64] [--rounds 5] [--sizes 500x375 1024x768]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from raypipe.preprocess import decode, region
from raypipe.preprocess.augment import plan, sample_rng

SIZE, SEED = 224, 0
SIZES = ("500x375", "640x480", "1024x768", "1600x1200")


def photos(width: int, height: int, n: int, seed: int = SEED) -> list[bytes]:
    """``n`` JPEGs of ``width``×``height``: random crops of the sample photos, resized."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    sources = [Image.fromarray(a) for a in load_sample_images().images]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        src = sources[i % len(sources)]
        scale = rng.uniform(0.6, 1.0)  # a crop of the photo with the target's aspect
        w = min(src.width, int(src.height * scale * width / height))
        h = int(w * height / width)
        x, y = rng.integers(0, src.width - w + 1), rng.integers(0, src.height - h + 1)
        img = src.crop((x, y, x + w, y + h)).resize((width, height), Image.Resampling.LANCZOS)
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def chooser(key: int):
    rng = sample_rng(SEED, 0, key)
    return lambda w, h: plan(w, h, train=True, rng=rng, scale=(0.08, 1.0),
                             ratio=(3 / 4, 4 / 3), flip=True)  # fmt: skip


MODES = ("full", "scaled", "region", "restarts", "full_restarts")


def full_size(width: int, height: int, box, size: int) -> int:
    return 1  # every decode at full size: the DCT scaling off


def decode_all(images: list[bytes], mode: str) -> tuple[float, list[np.ndarray]]:
    """CPU seconds per image, and the outputs: ``full`` decodes every whole image at full
    size (before scaled decoding), ``scaled`` adds the DCT scaling, ``region`` (as shipped
    where the extension is built) decodes only the crop's region too."""
    shipped, built = decode._dct_reduction, region._jpegregion
    decode._dct_reduction = full_size if mode.startswith("full") else shipped
    region._jpegregion = built if mode in ("region", "restarts") else None
    try:
        c0 = time.process_time()
        outs = [np.ascontiguousarray(decode.decode_crop(d, SIZE, chooser(k)))
                for k, d in enumerate(images)]  # fmt: skip
        return (time.process_time() - c0) / len(images), outs
    finally:
        decode._dct_reduction, region._jpegregion = shipped, built


def scaled_share(images: list[bytes]) -> float:
    """The share of plans whose decode is scaled (k > 1)."""
    scaled = 0
    for k, data in enumerate(images):
        height, width = decode.jpeg_size(data)
        box = chooser(k)(width, height).box
        scaled += decode._dct_reduction(width, height, box, SIZE) > 1
    return scaled / len(images)


def difference(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
    """|a - b| in grey levels: mean, 99th percentile and worst pixel."""
    diff = [np.abs(x.astype(np.int16) - y.astype(np.int16)) for x, y in zip(a, b, strict=True)]
    return {"mean": float(np.mean([d.mean() for d in diff])),
            "p99": float(np.percentile(np.concatenate([d.ravel() for d in diff]), 99)),
            "max": int(max(d.max() for d in diff))}  # fmt: skip


def one_size(width: int, height: int, n: int, rounds: int, modes: tuple[str, ...]) -> dict:
    images = photos(width, height, n)
    restarted = [region.with_restarts(d) for d in images] if "restarts" in modes else []
    given = {m: restarted if m.endswith("restarts") else images for m in modes}
    for mode in modes:
        decode_all(given[mode][:8], mode)  # imports, warm caches
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):  # interleaved, the order rotating
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            cpu[mode].append(decode_all(given[mode], mode)[0])
    outs = {m: decode_all(given[m], m)[1] for m in modes}
    med = {m: statistics.median(v) for m, v in cpu.items()}
    return {
        "size": f"{width}x{height}", "images": n, "mean_jpeg_kib": sum(map(len, images)) / n / 1024,
        "mean_restarted_jpeg_kib": sum(map(len, restarted)) / n / 1024 if restarted else None,
        "scaled_share": scaled_share(images),
        "cpu_ms": {m: v * 1e3 for m, v in med.items()},
        "speedup_vs_full": {m: med["full"] / v for m, v in med.items()},
        "cpu_ms_rounds": {m: [round(x * 1e3, 3) for x in v] for m, v in cpu.items()},
        "diff_vs_full": {m: difference(outs[m], outs["full"]) for m in modes if m != "full"},
        "diff_region_vs_scaled": (difference(outs["region"], outs["scaled"])
                                  if "region" in modes else None),
        "diff_restarts_vs_region": (difference(outs["restarts"], outs["region"])
                                    if "restarts" in modes else None),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=64, help="photos per size (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="(default: %(default)s)")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), help="WxH (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = p.parse_args(argv)
    try:
        sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes]
    except ValueError:
        p.error(f"--sizes takes WxH, e.g. 500x375, not {args.sizes}")
    if args.images < 1 or args.rounds < 1 or any(len(s) != 2 or min(s) < SIZE for s in sizes):
        p.error(f"--images and --rounds must be >= 1 and every size at least {SIZE}x{SIZE}")
    import cv2

    cv2.setNumThreads(1)  # one thread, as in a pool actor
    modes = MODES if region.available() else MODES[:2]  # the last three need the extension
    if not region.available():
        print(
            "region decoding was not built (no compiler or libjpeg headers): full and scaled only"
        )
    rows = []
    for width, height in sizes:
        rows.append(one_size(width, height, args.images, args.rounds, modes))
        r = rows[-1]
        times = "  ".join(f"{m} {r['cpu_ms'][m]:5.2f} ms" for m in modes)
        gains = "  ".join(f"{m} x{r['speedup_vs_full'][m]:.2f}" for m in modes[1:])
        diffs = "  ".join(f"{m} {d['mean']:.2f}/{d['p99']:.0f}/{d['max']}"
                          for m, d in r["diff_vs_full"].items())  # fmt: skip
        print(
            f"{r['size']:>10s}  {times}  |  {gains}  |  scaled plans {r['scaled_share']:.0%}"
            f"  |  vs full, mean/p99/max: {diffs}",
            flush=True,
        )
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0]},
              "images": args.images, "rounds": args.rounds, "rows": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'decode.json'}")
    return result


if __name__ == "__main__":
    main()
