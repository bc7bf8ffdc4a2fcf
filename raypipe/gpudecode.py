"""``decode="gpu"``: the actors ship JPEG bytes and the seeded crop plan; the rank decodes.

```
 actor     JPEG header → plan(width, height, rng(seed, epoch, key))      no pixel decoded
           row: payload = the file's bytes, plan = (left, top, width, height, flip)
           (a PNG, CMYK or EXIF-rotated JPEG: decoded and cropped here as with "cpu";
            its row's payload is the uint8 3×S×S pixels, plan width 0)
 iterator  step 4: label/key through the pinned ring; then on the copy stream:
           nvJPEG decodes the batch (torchvision.io.decode_jpeg, device=...) → crop the
           plan's box → resize to S×S (bilinear, antialiased) → flip → uint8 N×3×S×S
```

The plan is the one ``decode="cpu"`` draws for the key, so a key gets the same crop and
flip either way; only the resampling arithmetic differs (a few grey levels on average).

A JPEG that nvJPEG refuses is decoded on the CPU (libjpeg-turbo, then Pillow). One that
both refuse is a bad sample as usual: ``on_error="raise"`` raises `SampleError` naming the
file; ``"skip"`` records it in the run's `SkipLog` and leaves it out of its batch — that
batch is one row short, the batch *count* (what DDP needs) is unchanged. The actors check
each JPEG's header, so only files damaged after their header get that far.

On a CPU device (tests, machines without CUDA) the same step runs with libjpeg-turbo.
"""

from __future__ import annotations

import io
import math
from typing import Any, NamedTuple

import numpy as np

from raypipe.fastimage import jpeg_size
from raypipe.skips import SampleError, SkipRecord
from raypipe.transforms import Plan

__all__ = [
    "DeviceDecode",
    "Encoded",
    "EncodedBlocks",
    "collate_encoded",
    "crop_resize",
    "decode_rgb",
    "device_map_for",
]
assert __all__ == sorted(__all__)

PLAN_FIELDS = 5  # left, top, width, height, flip; width 0: the payload is decoded pixels


class Encoded(NamedTuple):
    """One sample the actor did not decode: its JPEG bytes and the plan drawn for it."""

    data: bytes
    plan: Plan

    @classmethod
    def of(cls, data: bytes, choose) -> Encoded | None:
        """``data`` with ``choose(width, height)``'s plan when it is a JPEG the device path
        handles (YCbCr/grey, upright); None otherwise (decode it on the CPU)."""
        size = jpeg_size(data)
        if size is None:
            return None
        height, width = size
        return cls(bytes(data), choose(width, height))


class EncodedBlocks:
    """The actor's block builder for ``decode="gpu"``: ``payload`` (bytes per row), ``plan``
    (float32 N×5), ``where`` (the file), ``label``, ``key``."""

    def __init__(self, size: int, rows: int):
        self.size, self.rows = size, rows
        self.bad: list[SkipRecord] = []  # never any: nothing fails after the actor's checks
        self._reset()

    def _reset(self) -> None:
        self.payload: list[bytes] = []
        self.plan = np.zeros((self.rows, PLAN_FIELDS), dtype=np.float32)
        self.where: list[str] = []
        self.label = np.empty(self.rows, dtype=np.int64)
        self.key = np.empty(self.rows, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.payload)

    def add(self, item: Encoded | np.ndarray, raw) -> bool:
        """Append a sample (`Encoded`, or pixels the actor decoded); True when full."""
        n = len(self.payload)
        if isinstance(item, Encoded):
            box, flip = item.plan
            self.plan[n] = (*box, float(flip))
            self.payload.append(item.data)
        else:
            self.payload.append(np.ascontiguousarray(item, dtype=np.uint8).tobytes())
        self.where.append(raw.where)
        self.label[n], self.key[n] = raw.label, raw.key
        return n + 1 == self.rows

    def take(self) -> dict[str, np.ndarray]:
        n = len(self.payload)
        payload, where = np.empty(n, dtype=object), np.empty(n, dtype=object)
        payload[:], where[:] = self.payload, self.where
        block = {"payload": payload, "plan": self.plan[:n], "where": where,
                 "label": self.label[:n], "key": self.key[:n]}  # fmt: skip
        self._reset()
        return block


def device_map_for(config, device, skips=None) -> DeviceDecode | None:
    """The rank iterator's device step for a `PipelineConfig` (None with decode="cpu")."""
    if config.decode != "gpu":
        return None
    return DeviceDecode(config.image_size, device, on_error=config.on_error, skips=skips)


def collate_encoded(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """The rank's collate: ``label``/``key`` as tensors (they take the pinned ring); the
    payloads, plans and files stay on the host for `DeviceDecode`."""
    import torch

    out = {k: torch.from_numpy(np.array(batch[k])) for k in ("label", "key")}
    payload = [np.frombuffer(p, dtype=np.uint8) for p in batch["payload"]]
    return {**out, "payload": payload, "plan": np.asarray(batch["plan"]),
            "where": list(batch["where"])}  # fmt: skip


class DeviceDecode:
    """Step 4's device half for ``decode="gpu"``: a collated batch in, ``image`` (uint8
    N×3×S×S on ``device``), ``label``, ``key`` out. Runs on the copy stream.

    ``fallbacks`` counts samples nvJPEG refused and the CPU decoded; ``skipped`` those
    neither could (``on_error="skip"``), also sent to ``skips`` (a `SkipLog`) when given.
    """

    def __init__(self, size: int, device, *, on_error: str = "skip", skips=None):
        import torch

        self.size, self.device, self.on_error = size, torch.device(device), on_error
        self.skips = skips
        self.fallbacks = 0
        self.skipped = 0
        self._nvjpeg = None
        if self.device.type == "cuda":
            try:
                from torchvision.io import ImageReadMode, decode_jpeg
            except ImportError as e:
                raise RuntimeError(
                    "decode='gpu' on a CUDA device needs torchvision (its decode_jpeg runs "
                    f"nvJPEG): {e}; install the torchvision that matches your torch"
                ) from None
            self._nvjpeg = lambda data: decode_jpeg(
                data, mode=ImageReadMode.RGB, device=self.device
            )

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import torch

        payload, plans, where = batch["payload"], batch["plan"], batch["where"]
        images = self._decode([p for p, plan in zip(payload, plans, strict=True) if plan[2] > 0])
        out, keep, it = [], [], iter(images)
        for i, (data, plan) in enumerate(zip(payload, plans, strict=True)):
            if plan[2] == 0:  # decoded by the actor: 3×S×S pixels
                pixels = torch.from_numpy(data).view(3, self.size, self.size)
                out.append(pixels.to(self.device, non_blocking=True))
                keep.append(i)
                continue
            image = next(it)
            if image is None:
                image = self._on_cpu(data, where[i], int(batch["key"][i]))
            if image is not None:
                out.append(crop_resize(image, plan, self.size))
                keep.append(i)
        rest = {k: v for k, v in batch.items() if k not in ("payload", "plan", "where")}
        if len(keep) < len(payload):
            index = torch.tensor(keep, device=batch["key"].device)
            rest = {
                k: v.index_select(0, index) if torch.is_tensor(v) else v for k, v in rest.items()
            }
        image = torch.stack(out) if out else torch.empty((0, 3, self.size, self.size),
                                                          dtype=torch.uint8, device=self.device)  # fmt: skip
        return {**rest, "image": image}

    def _decode(self, payload: list[np.ndarray]) -> list:
        """3×H×W uint8 device tensors, None where nvJPEG refused a sample (or no nvJPEG)."""
        import torch

        if self._nvjpeg is None or not payload:
            return [None] * len(payload)
        data = [torch.from_numpy(p) for p in payload]
        try:
            return list(self._nvjpeg(data))
        except RuntimeError:  # one bad file fails the whole batch call: one at a time
            return [self._one(d) for d in data]

    def _one(self, data):
        try:
            return self._nvjpeg([data])[0]
        except RuntimeError:
            self.fallbacks += 1
            return None

    def _on_cpu(self, data: np.ndarray, where: str, key: int):
        """libjpeg-turbo (Pillow for what it refuses), then to the device; a file neither
        reads is a bad sample under ``on_error``."""
        import torch

        try:
            rgb = decode_rgb(data.tobytes())
        except Exception as e:
            detail = f"{type(e).__name__}: {e}"
            if self.on_error == "raise":
                raise SampleError(where, key, "decode_error", detail) from e
            self.skipped += 1
            if self.skips is not None:
                self.skips.add([SkipRecord(key, where, "decode_error", detail)])
            return None
        chw = torch.from_numpy(np.ascontiguousarray(rgb.transpose(2, 0, 1)))
        return chw.to(self.device, non_blocking=True)


def decode_rgb(data: bytes) -> np.ndarray:
    """H×W×3 uint8: libjpeg-turbo, or Pillow for the damage it refuses strictly."""
    import simplejpeg

    try:
        return simplejpeg.decode_jpeg(data, colorspace="RGB")
    except ValueError:
        from PIL import Image

        from raypipe.transforms import to_rgb

        with Image.open(io.BytesIO(data)) as img:
            return np.asarray(to_rgb(img))


def crop_resize(image, plan, size: int):
    """``plan``'s box of a 3×H×W uint8 tensor resampled to size×size on the tensor's device,
    flipped when the plan says so.

    Pillow's bilinear resize with a box, as two small matrix products: each output pixel
    is a triangle-filter average (as wide as the scale when it shrinks) of the source
    pixels around the box's exact pixel centre, so fractional boxes (the eval center crop)
    and whole-pixel ones (random-resized-crop) are one code path.
    """
    import torch

    left, top, width, height, flip = (float(v) for v in plan)
    h, w = image.shape[1:]
    rows, ys = _weights(top, height, size, h, image.device)
    cols, xs = _weights(left, width, size, w, image.device)
    crop = image[:, ys, xs].to(torch.float32)
    out = torch.matmul(torch.matmul(rows, crop), cols.T)
    out = out.round_().clamp_(0, 255).to(torch.uint8)
    return out.flip(-1) if flip else out


def _weights(start: float, extent: float, size: int, limit: int, device):
    """(size × n) weights over the n source pixels of the slice they read, and that slice."""
    import torch

    scale = extent / size
    support = max(scale, 1.0)  # the triangle's half-width in source pixels
    first = max(0, math.floor(start - support))
    stop = min(limit, math.ceil(start + extent + support) + 1)
    centres = start + (torch.arange(size, device=device, dtype=torch.float32) + 0.5) * scale
    pixels = torch.arange(first, stop, device=device, dtype=torch.float32) + 0.5
    weights = (1 - ((pixels[None, :] - centres[:, None]) / support).abs()).clamp_(min=0)
    return weights / weights.sum(dim=1, keepdim=True), slice(first, stop)
