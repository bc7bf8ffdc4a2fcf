"""``decode="gpu"``, the rank's half: the blocks of `raypipe.preprocess.encoded` (JPEG bytes
and each sample's crop plan) decoded on the rank's device, in step 4 of the iterator.

```
 iterator  step 4: label/key through the pinned ring; then on the copy stream:
           nvJPEG decodes the batch (torchvision.io.decode_jpeg, device=...) → crop the
           plan's box → resize to S×S (bilinear, antialiased, `raypipe.loader.resample`)
           → flip → uint8 N×3×S×S
```

nvJPEG has two front ends, chosen by ``RAYPIPE_GPU_DECODER``: ``torchvision`` (the default:
``decode_jpeg`` on a list of files) and ``nvimgcodec`` (NVIDIA nvImageCodec's batched
decoder, which uses the GPU's hardware JPEG engines where it has them and decodes each file
only over the rows and columns its crop reads; ``pip install nvidia-nvimgcodec-cu13[all]``
or ``-cu12``). A JPEG that nvJPEG refuses is decoded on the CPU (libjpeg-turbo, then
Pillow); one that both refuse is a bad sample under ``on_error``. On a CPU device (tests,
machines without CUDA) the same step runs with libjpeg-turbo, or with nvImageCodec's CPU
decoder when it is chosen.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from raypipe.loader.resample import crop_resize, read_region, resample
from raypipe.skips.records import SampleError, SkipRecord

__all__ = ["DECODERS", "DeviceDecode", "collate_encoded", "crop_resize", "decode_rgb",
           "device_map_for", "front_end_name"]  # fmt: skip
assert __all__ == sorted(__all__)

DECODERS = ("nvimgcodec", "torchvision")


def front_end_name() -> str:
    """The nvJPEG front end ``RAYPIPE_GPU_DECODER`` names (`DECODERS`; torchvision unset)."""
    name = os.environ.get("RAYPIPE_GPU_DECODER", "torchvision")
    if name not in DECODERS:
        raise ValueError(f"RAYPIPE_GPU_DECODER={name!r}: expected one of {', '.join(DECODERS)}")
    return name


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
        self._nvjpeg = self._regions = None
        if front_end_name() == "nvimgcodec":
            self._regions = NvImageCodec(self.device)
        elif self.device.type == "cuda":
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
        decoded, boxes = self._decode([payload[i] for i in encoded], plans[encoded])
        images, kept, used = [], [], []
        for i, image, box in zip(encoded.tolist(), decoded, boxes, strict=True):
            if image is None:  # nvJPEG refused it (or there is no nvJPEG): the CPU decodes
                image, box = self._on_cpu(payload[i], where[i], int(batch["key"][i])), plans[i]
            if image is not None:
                images.append(image)
                kept.append(i)
                used.append(box)
        out = torch.empty((n, 3, size, size), dtype=torch.uint8, device=self.device)
        if images:
            out[kept] = resample(images, np.asarray(used), size)
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

    def _decode(self, payload: list[np.ndarray], plans: np.ndarray) -> tuple[list, np.ndarray]:
        """3×H×W uint8 device tensors, None where nvJPEG refused a sample (or no nvJPEG),
        and the plans in their coordinates (a region's own where only it was decoded)."""
        import torch

        if self._regions is not None and payload:
            images, plans = self._regions(payload, plans, self.size)
            self.fallbacks += sum(image is None for image in images)
            return images, plans
        if self._nvjpeg is None or not payload:
            return [None] * len(payload), plans
        data = [torch.from_numpy(p) for p in payload]
        try:
            return list(self._nvjpeg(data)), plans
        except RuntimeError:  # one bad file fails the whole batch call: one at a time
            return [self._one(d) for d in data], plans

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
        from raypipe.preprocess.pillow import open_image, to_rgb

        with open_image(data) as img:
            return np.asarray(to_rgb(img))


class NvImageCodec:
    """nvImageCodec's batched decoder on ``device`` (its CPU decoder on a CPU device): each
    file decoded over the region its plan's resample reads (`read_region`), the plans moved
    into the regions' coordinates."""

    def __init__(self, device):
        try:
            from nvidia import nvimgcodec
        except ImportError as e:
            raise RuntimeError(
                f"RAYPIPE_GPU_DECODER=nvimgcodec needs nvImageCodec: {e}; pip install "
                "nvidia-nvimgcodec-cu13[all] (or -cu12 for CUDA 12)"
            ) from None
        self.nv, self.device = nvimgcodec, device
        if device.type == "cuda":
            import torch

            index = torch.cuda.current_device() if device.index is None else device.index
            self.decoder = nvimgcodec.Decoder(device_id=index)
        else:
            cpu = nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)
            self.decoder = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                                              backends=[cpu])  # fmt: skip
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False,
                                              color_spec=nvimgcodec.ColorSpec.SRGB,
                                              sample_format=nvimgcodec.SampleFormat.I_RGB)  # fmt: skip

    def __call__(self, payload: list[np.ndarray], plans: np.ndarray, size: int):
        import torch

        nv, shifted, streams = self.nv, plans.copy(), []
        for j, data in enumerate(payload):
            try:
                stream = nv.CodeStream(data)
                (y0, y1), (x0, x1) = read_region(plans[j], size, stream.height, stream.width)
                streams.append(stream.get_sub_code_stream(region=nv.Region(y0, x0, y1, x1)))
            except Exception:  # a header it cannot parse: the CPU decodes (or skips) it
                streams.append(None)
                continue
            shifted[j, 0] -= x0
            shifted[j, 1] -= y0
        images = [None] * len(payload)
        todo = [j for j, s in enumerate(streams) if s is not None]
        if todo:
            on_gpu = self.device.type == "cuda"
            stream = torch.cuda.current_stream(self.device).cuda_stream if on_gpu else 0
            try:
                out = self.decoder.decode([streams[j] for j in todo], params=self.params,
                                          cuda_stream=stream)  # fmt: skip
            except Exception:  # the batch refused whole: the CPU decodes each
                out = [None] * len(todo)
            for j, image in zip(todo, out, strict=True):
                if image is not None:
                    images[j] = self._tensor(image).permute(2, 0, 1)
        return images, shifted

    def _tensor(self, image):
        """An H×W×3 tensor over a decoded `nvimgcodec.Image`'s buffer (no copy on the GPU)."""
        import torch

        if self.device.type != "cuda":
            return torch.from_numpy(np.asarray(image.cpu()))
        try:
            return torch.from_dlpack(image)
        except (TypeError, RuntimeError, BufferError):  # an older build: its array interface
            return torch.as_tensor(image, device=self.device)
