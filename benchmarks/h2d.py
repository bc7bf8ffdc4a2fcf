"""Host-to-device transfer: the pinned ring against per-batch pinning and pageable copies.

    (1) H2D GB/s for one ``--batch``x3x224x224 uint8 batch: a ring slot (pinned once),
        ``pin_memory()`` per batch, and a pageable ``.to(device)``; plus the ring end to end
        (host memcpy into the slot + side-stream copy, as the iterator runs it).
    (2) overlap: step time of a ResNet-50-sized network (plain torch) fed by steps 4-5 of
        the iterator (``HostToDevice`` + ``normalize``) vs fed by a batch already on the
        device; target ratio <= 1.03 (the copy fully hidden).
    (3) pinned host allocations, device segments and ring slots allocated after warm-up;
        target 0.
    (4) correctness under stress: a position-weighted checksum of every batch on the device
        equals the one computed on the host, while the consumer's stream is kept busy.

Without CUDA it says that (1)-(3) need CUDA and runs (4) with the CPU ops (same ring, no
pinning, no streams). Every figure is a median over ``--repeats``.

    python benchmarks/h2d.py                      # all four; CUDA machine
    python benchmarks/h2d.py --json out.json      # also write the figures as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

from raypipe.config import IMAGENET_MEAN, IMAGENET_STD
from raypipe.loader.device import normalize
from raypipe.loader.h2d import HostToDevice

SIZE = 224


def checksum(image: torch.Tensor) -> torch.Tensor:
    """Position-weighted: catches reordered or torn bytes, not only changed totals."""
    flat = image.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device) % 251 + 1
    return (flat * weights).sum()


def host_batch(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    image = torch.randint(0, 256, (rows, 3, SIZE, SIZE), dtype=torch.uint8, generator=g)
    return {"image": image, "label": torch.randint(0, 1000, (rows,), generator=g)}


def cycle(batches: list[dict], n: int):
    for i in range(n):
        yield batches[i % len(batches)]


def gbps(nbytes: int, seconds: list[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 2)


def bandwidth(args, device) -> dict:
    """(1): one batch, each way of copying it, timed with a device sync around each copy."""
    src = host_batch(args.batch, 0)["image"]
    slot = torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
    nbytes = src.numel()

    def timed(copy) -> list[float]:
        out = []
        for _ in range(args.repeats + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            copy()
            torch.cuda.synchronize(device)
            out.append(time.perf_counter() - t0)
        return out[1:]

    ring_s, ring_n = [], 8
    h2d = HostToDevice(device, prefetch=2)
    for _ in range(args.repeats + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _b in h2d(cycle([{"image": src}], ring_n)):
            pass
        torch.cuda.synchronize(device)
        ring_s.append((time.perf_counter() - t0) / ring_n)
    h2d.close()
    before = torch.cuda.host_memory_stats()
    pin_s = timed(lambda: src.pin_memory().to(device, non_blocking=True))
    after = torch.cuda.host_memory_stats()
    return {
        "bytes": nbytes,
        "pinned_slot_GBps": gbps(nbytes, timed(lambda: slot.to(device, non_blocking=True))),
        "pin_per_batch_GBps": gbps(nbytes, pin_s),
        "pin_per_batch_host_blocks": delta(before, after, "allocations.allocated"),
        "pageable_GBps": gbps(nbytes, timed(lambda: src.to(device))),
        "ring_end_to_end_GBps": gbps(nbytes, ring_s[1:]),
    }


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True), nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )  # fmt: skip
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x):
        return torch.relu(self.body(x) + self.skip(x))


def resnet50(classes: int = 1000) -> nn.Module:
    """ResNet-50's layer shapes (3-4-6-3 bottlenecks), written in plain torch."""
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, 2, 1)]  # fmt: skip
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def delta(before: dict, after: dict, key: str) -> int | None:
    """How much a counter of ``torch.cuda.*memory_stats`` grew; None where torch lacks it."""
    if key not in before or key not in after:
        return None
    return after[key] - before[key]


def overlap(args, device) -> dict:
    """(2) and (3): step time fed by the ring vs by device tensors; allocations after warm-up."""
    model = resnet50().to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(batch) -> None:
        x = normalize(batch, IMAGENET_MEAN, IMAGENET_STD)["image"]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
            loss = loss_fn(model(x), batch["label"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def run(batches) -> float:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for b in batches:
            step(b)
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / args.steps

    hosts = [host_batch(args.batch, s) for s in range(4)]
    on_device = [
        {"image": b["image"].to(device, memory_format=torch.channels_last),
         "label": b["label"].to(device)} for b in hosts
    ]  # fmt: skip
    h2d = HostToDevice(device, prefetch=2, channels_last=True)
    run(cycle(on_device, args.steps))  # warm-up: cuDNN autotuning, allocator, ring slots
    run(h2d(cycle(hosts, args.steps)))
    host0 = torch.cuda.host_memory_stats()
    dev0 = torch.cuda.memory_stats(device)
    ring0 = h2d.ring.allocations
    fed, resident = [], []
    for _ in range(args.repeats):
        fed.append(run(h2d(cycle(hosts, args.steps))))
        resident.append(run(cycle(on_device, args.steps)))
    host1 = torch.cuda.host_memory_stats()
    dev1 = torch.cuda.memory_stats(device)
    h2d.close()
    step_fed, step_resident = statistics.median(fed), statistics.median(resident)
    return {
        "step_s_fed_by_iterator": round(step_fed, 5),
        "step_s_on_device": round(step_resident, 5),
        "ratio": round(step_fed / step_resident, 4),
        "after_warm_up": {
            "ring_host_buffers": h2d.ring.allocations - ring0,
            "pinned_host_allocs": delta(host0, host1, "num_host_alloc"),
            "pinned_host_blocks_handed_out": delta(host0, host1, "allocations.allocated"),
            "device_segments": dev1["segment.all.allocated"] - dev0["segment.all.allocated"],
            "steps": 2 * args.repeats * args.steps,
        },
    }


def stress(args, device) -> dict:
    """(4): every batch's checksum on the device equals its host checksum."""
    busy = torch.randn(512, 512, device=device)
    h2d = HostToDevice(device, prefetch=2, slots=args.slots, channels_last=True)
    scratch = torch.empty((args.stress_rows, 3, SIZE, SIZE), dtype=torch.uint8)
    want, got = [], []

    def source():  # one host buffer rewritten for every batch, as a recycling loader does
        for i in range(args.stress_batches):
            batch = host_batch(args.stress_rows, 1000 + i)
            scratch.copy_(batch["image"])
            want.append(int(checksum(scratch)))
            yield {"image": scratch, "label": batch["label"]}

    for b in h2d(source()):
        busy.copy_(torch.tanh(busy @ busy))  # keep the consumer's stream busy
        got.append(checksum(b["image"].contiguous()))
    h2d.close()
    got = [int(c) for c in got]
    equal = sum(g == w for g, w in zip(got, want, strict=True))
    return {"batches": len(got), "checksums_equal": equal, "ok": equal == len(want) == len(got)}


def machine(device) -> dict:
    out = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256, help="rows of the 3x224x224 batch")
    p.add_argument("--steps", type=int, default=20, help="training steps per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; medians reported")
    p.add_argument("--no-amp", dest="amp", action="store_false", help="fp32 train step")
    p.add_argument("--stress-batches", type=int, help="default: 200 with CUDA, 40 without")
    p.add_argument("--stress-rows", type=int, default=32)
    p.add_argument("--slots", type=int, default=2, help="ring slots in (4): few, to stress")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    args.stress_batches = args.stress_batches or (200 if cuda else 40)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    results: dict = {"machine": machine(device), "device": str(device)}
    if cuda:
        results["bandwidth"] = bandwidth(args, device)
        results["overlap"] = overlap(args, device)
    else:
        print("CUDA is required for (1) bandwidth, (2) overlap and (3) pinned allocations;")
        print("skipping them. Running (4) with the CPU ops (no pinning, no streams).")
        results["skipped"] = ["bandwidth", "overlap", "allocations"]
    results["stress"] = stress(args, device)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if results["stress"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
