"""A user transform written the way torchvision v2 / albumentations transforms are: an
importable callable object drawing from torch's global generator. ``raypipe bench`` and
``benchmarks/transform.py`` run it; it doubles as a template for your own.

    PipelineConfig(source=..., transform=raypipe.cli.examples.ColorCrop(224), transform_input="pil")
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ColorCrop"]


class ColorCrop:
    """Random-resized-crop + horizontal flip + brightness/contrast/saturation jitter on a
    PIL image; returns ``{"image": uint8 3×S×S, "label"}``."""

    def __init__(self, size: int = 224, jitter: float = 0.4, scale=(0.08, 1.0)):
        self.size, self.jitter, self.scale = size, jitter, scale

    def __call__(self, sample: dict) -> dict:
        import torch
        from PIL import Image, ImageEnhance

        img = sample["image"]
        w, h = img.size
        r = torch.rand(6).tolist()
        area = w * h * (self.scale[0] + r[0] * (self.scale[1] - self.scale[0]))
        ratio = math.exp(math.log(3 / 4) + r[1] * (math.log(4 / 3) - math.log(3 / 4)))
        cw = min(w, max(1, round(math.sqrt(area * ratio))))
        ch = min(h, max(1, round(math.sqrt(area / ratio))))
        left, top = int(r[2] * (w - cw + 1)), int(r[3] * (h - ch + 1))
        out = img.resize((self.size, self.size), Image.Resampling.BILINEAR,
                         box=(left, top, left + cw, top + ch))  # fmt: skip
        if r[4] < 0.5:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        factors = (1 - self.jitter + 2 * self.jitter * torch.rand(3)).tolist()
        out = ImageEnhance.Brightness(out).enhance(factors[0])
        out = ImageEnhance.Contrast(out).enhance(factors[1])
        out = ImageEnhance.Color(out).enhance(factors[2])
        image = np.ascontiguousarray(np.asarray(out).transpose(2, 0, 1))
        return {"image": image, "label": sample["label"]}
