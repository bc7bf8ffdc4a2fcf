"""nvJPEG's front ends alone, on a batch of the same photo JPEGs (CUDA machine): images/s and
this process's CPU-seconds per image for each, decode only (no crop, no resample).

  torchvision          ``decode_jpeg(list, device="cuda")``: raypipe's default front end
  nvimgcodec           nvImageCodec's batched ``Decoder.decode``, whole files (the GPU's
                       hardware JPEG engines where it has them)
  nvimgcodec_regions   the same over the region each file's random-resized-crop reads
                       (`raypipe.loader.resample.read_region`), which would spare decoding
                       the rest of each file

and the rest of the rank's ``decode="gpu"`` step, so that its parts can be told apart:

  rank_step            the whole step: ``collate_encoded`` + ``DeviceDecode`` (nvJPEG,
                       then crop, resize and flip), uint8 N×3×224×224 out
  resample             the crop-resize-flip alone on images already decoded
  resample_mixed       the same with each image cut by 0–31 rows and columns (the shapes
                       of a batch differ, as ImageNet's do)

    python benchmarks/gpu_decoders.py --json gpu_decoders.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from ingest import make_corpus

from raypipe.loader.devicedecode import DeviceDecode, collate_encoded
from raypipe.loader.resample import read_region, resample
from raypipe.preprocess.augment import plan, sample_rng
from raypipe.preprocess.decode import jpeg_size


def front_ends(device, size: int):
    """{name: decode(list of uint8 arrays, plans) -> list of device tensors}."""
    from torchvision.io import ImageReadMode, decode_jpeg

    out = {"torchvision": lambda data, plans: decode_jpeg(
        [torch.from_numpy(d) for d in data], mode=ImageReadMode.RGB, device=device)}  # fmt: skip
    try:
        from nvidia import nvimgcodec as nv
    except ImportError:
        return out
    decoder = nv.Decoder(device_id=device.index or 0)
    params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB,
                             sample_format=nv.SampleFormat.I_RGB)  # fmt: skip
    stream = torch.cuda.current_stream(device).cuda_stream

    def whole(data, plans):
        images = decoder.decode([nv.CodeStream(d) for d in data], params=params,
                                cuda_stream=stream)  # fmt: skip
        return [torch.from_dlpack(i) for i in images]

    def regions(data, plans):
        streams = []
        for d, p in zip(data, plans, strict=True):
            s = nv.CodeStream(d)
            (y0, y1), (x0, x1) = read_region(p, size, s.height, s.width)
            streams.append(s.get_sub_code_stream(region=nv.Region(y0, x0, y1, x1)))
        images = decoder.decode(streams, params=params, cuda_stream=stream)
        return [torch.from_dlpack(i) for i in images]

    out["nvimgcodec"], out["nvimgcodec_regions"] = whole, regions
    return out


def rank_parts(device, size: int, batches: list) -> dict:
    """{name: step(data, plans) -> N×3×size×size}: the rank's step and its resample."""
    decoded = {id(d): front_ends(device, size)["torchvision"](d, p) for d, p in batches}
    rng = np.random.default_rng(0)
    mixed = {k: [im[:, : im.shape[1] - int(rng.integers(32)), : im.shape[2] - int(rng.integers(32))]
                 .contiguous() for im in v] for k, v in decoded.items()}  # fmt: skip
    step = DeviceDecode(size, device)

    def whole(data, plans):
        n = len(data)
        batch = {"payload": data, "plan": np.stack(plans), "where": ["bench"] * n,
                 "label": np.zeros(n, dtype=np.int64), "key": np.arange(n)}  # fmt: skip
        return step(collate_encoded(batch))["image"]

    def alone(images, version):
        return lambda data, plans: version(images[id(data)], np.stack(plans), size)

    return {"rank_step": whole,
            "resample": alone(decoded, resample),
            "resample_mixed": alone(mixed, resample)}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2048, help="photo JPEGs (400x300)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA: run it on a GPU machine", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    folder = make_corpus(Path(tempfile.mkdtemp(prefix="raypipe-dec-")), args.images)
    data = [np.fromfile(f, dtype=np.uint8) for f in sorted(folder.rglob("*.jpg"))]
    plans = []
    for key, d in enumerate(data):
        h, w = jpeg_size(d.tobytes())
        pl = plan(w, h, train=True, rng=sample_rng(0, 0, key), scale=(0.08, 1.0),
                  ratio=(3 / 4, 4 / 3), flip=True)  # fmt: skip
        plans.append(np.array([*pl.box, float(pl.flip)], dtype=np.float32))
    batches = [(data[i : i + args.batch], plans[i : i + args.batch])
               for i in range(0, len(data) - args.batch + 1, args.batch)]  # fmt: skip
    fronts = {**front_ends(device, 224), **rank_parts(device, 224, batches)}
    for decode in fronts.values():  # warm-up: the decoders' own allocations
        decode(*batches[0])
    torch.cuda.synchronize(device)
    rates: dict[str, list] = {n: [] for n in fronts}
    cpus: dict[str, list] = {n: [] for n in fronts}
    for r in range(args.rounds):
        names = list(fronts)[r % len(fronts) :] + list(fronts)[: r % len(fronts)]
        for name in names:
            t0, c0 = time.perf_counter(), time.process_time()
            n = 0
            for batch in batches:
                n += len(fronts[name](*batch))
            torch.cuda.synchronize(device)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            rates[name].append(n / dt)
            cpus[name].append(cpu / n)
        print(f"round {r + 1}", {n: round(v[-1]) for n, v in rates.items()}, flush=True)
    out = {"gpu": torch.cuda.get_device_name(device), "images": len(batches) * args.batch,
           "batch": args.batch, "rounds": args.rounds,
           **{n: {"images_s": round(statistics.median(rates[n]), 1),
                  "range": [round(min(rates[n])), round(max(rates[n]))],
                  "cpu_ms_per_image": round(1e3 * statistics.median(cpus[n]), 4)}
              for n in fronts}}  # fmt: skip
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
