"""``decode="gpu"``, the rank's half: the blocks of `raypipe.preprocess.encoded` (JPEG bytes
and each sample's crop plan) decoded on the rank's device, in step 4 of the iterator.

```
 iterator  step 4: label/key through the pinned ring; then on the copy stream:
           nvJPEG decodes the batch (torchvision.io.decode_jpeg, device=...) → crop the
           plan's box → resize to S×S (bilinear, antialiased, `raypipe.loader.resample`)
           → flip → uint8 N×3×S×S
```

A JPEG that nvJPEG refuses is decoded on the CPU (libjpeg-turbo, then Pillow); one that
both refuse is a bad sample under ``on_error``. On a CPU device (tests, machines without
CUDA) the same step runs with libjpeg-turbo.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raypipe.loader.resample import crop_resize, resample
from raypipe.skips.records import SampleError, SkipRecord, detail_of

__all__ = ["DeviceDecode", "collate_encoded", "crop_resize", "decode_rgb", "device_map_for"]
assert __all__ == sorted(__all__)


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

        payload, plans, where = batch["payload"], np.asarray(batch["plan"]), batch["where"]
        n, size = len(payload), self.size
        encoded = np.flatnonzero(plans[:, 2] > 0)
        decoded = self._decode([payload[i] for i in encoded])
        images, kept = [], []
        for i, image in zip(encoded.tolist(), decoded, strict=True):
            if image is None:  # nvJPEG refused it (or there is no nvJPEG): the CPU decodes
                image = self._on_cpu(payload[i], where[i], int(batch["key"][i]))
            if image is not None:
                images.append(image)
                kept.append(i)
        out = torch.empty((n, 3, size, size), dtype=torch.uint8, device=self.device)
        if images:
            out[kept] = resample(images, plans[kept], size)
        pixels = np.flatnonzero(plans[:, 2] == 0)  # rows the actor decoded (PNG, CMYK, ...)
        if len(pixels):
            host = np.stack([payload[i] for i in pixels]).reshape(-1, 3, size, size)
            out[pixels.tolist()] = torch.from_numpy(host).to(self.device)
        rest = {k: v for k, v in batch.items() if k not in ("payload", "plan", "where")}
        keep = sorted(kept + pixels.tolist())
        if len(keep) < n:  # samples neither decoder read, skipped: this batch is shorter
            out = out[keep]
            index = torch.tensor(keep, device=batch["key"].device)
            rest = {k: v.index_select(0, index) if torch.is_tensor(v) else v
                    for k, v in rest.items()}  # fmt: skip
        return {**rest, "image": out}

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
            detail = detail_of(e)
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
        from raypipe.formats.pixels import open_image, to_rgb

        with open_image(data) as img:
            return np.asarray(to_rgb(img))
