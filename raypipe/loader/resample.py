"""Batched crop-and-resize on the device: each image's plan box (left, top, width, height,
flip) resampled to size×size as Pillow's antialiased bilinear resize would, in float32
matrix products. ``decode="gpu"`` runs it on the rank after nvJPEG (`raypipe.loader.devicedecode`).
"""

from __future__ import annotations

import math
import warnings

import numpy as np

__all__ = ["crop_resize", "read_region", "resample"]


def crop_resize(image, plan, size: int):
    """One image's `resample`: ``plan``'s box of a 3×H×W uint8 tensor to 3×size×size."""
    return resample([image], np.asarray([plan], dtype=np.float32), size)[0]


def resample(images: list, plans: np.ndarray, size: int, *, budget: int = 1 << 29):
    """Each plan's box of its 3×H×W uint8 image, resampled to size×size and flipped when
    its plan says so: uint8 N×3×size×size on the images' device.

    Pillow's bilinear resize with a box, as batched matrix products: each output pixel is
    a triangle-filter average (as wide as the scale when it shrinks) of the source pixels
    around the box's exact pixel centre, so fractional boxes (the eval center crop) and
    whole-pixel ones (random-resized-crop) are one code path. The images are laid into
    one padded batch in one or two calls (no copy per image issued from Python: on CUDA
    those launches were half the step's host time); the products run over chunks of it
    that stay under ``budget`` bytes of float32.
    """
    import torch

    device = images[0].device
    shapes = np.array([img.shape[1:] for img in images], dtype=np.float64)  # (n, 2): h, w
    region = _padded(images)
    _, _, hmax, wmax = region.shape
    geometry = torch.tensor(np.column_stack([plans[:, :4], shapes]), dtype=torch.float64,
                            device=device)  # fmt: skip
    left, top, width, height, h, w = geometry.unbind(1)
    flip = torch.tensor(plans[:, 4] > 0, device=device)
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
    step = max(1, budget // (12 * hmax * wmax))
    for c in range(0, len(images), step):
        part = slice(c, c + step)
        wy = _weights(top[part], height[part], h[part], size, hmax)
        wx = _weights(left[part], width[part], w[part], size, wmax)
        wx = torch.where(flip[part, None, None], wx.flip(1), wx)
        x = region[part].to(torch.float32)
        y = torch.matmul(torch.matmul(wy.unsqueeze(1), x), wx.transpose(1, 2).unsqueeze(1))
        out[part] = y.round_().clamp_(0, 255).to(torch.uint8)
    return out


def _padded(images: list):
    """The 3×H×W images as one N×3×Hmax×Wmax batch, zero past each image's edge: one
    stack when they share a shape, else one nested tensor padded in a single kernel (no
    per-image copy issued from Python)."""
    import torch

    if all(img.shape == images[0].shape for img in images):
        return torch.stack(images)
    with warnings.catch_warnings():  # torch calls its strided nested tensors a prototype
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor(images).to_padded_tensor(0)


def read_region(plan, size: int, height: int, width: int) -> tuple[tuple[int, int], ...]:
    """The rows ``(y0, y1)`` and columns ``(x0, x1)`` of a height×width image that `resample`
    reads for ``plan`` (left, top, width, height, flip): decoding only them gives the same
    output once the plan's box is moved by ``(-x0, -y0)``."""
    return _span(plan[1], plan[3], size, height), _span(plan[0], plan[2], size, width)


def _span(start: float, extent: float, size: int, limit: int) -> tuple[int, int]:
    """The source pixels ``[first, stop)`` that a box edge to edge ``start``..``start +
    extent`` reads when resampled to ``size`` pixels (its filter's reach included)."""
    support = max(extent / size, 1.0)
    first = max(0, math.floor(start - support))
    return first, min(limit, math.ceil(start + extent + support) + 1)


def _weights(start, extent, valid, size: int, length: int):
    """(m × size × length) float32 filter weights; sample i reads pixels ``< valid[i]`` of
    its region, its box starting at ``start[i]`` and ``extent[i]`` pixels long."""
    import torch

    scale = (extent / size)[:, None, None]
    support = scale.clamp(min=1.0)  # the triangle's half-width in source pixels
    out = torch.arange(size, device=start.device, dtype=torch.float64)[None, :, None] + 0.5
    centres = start[:, None, None] + out * scale
    pixels = torch.arange(length, device=start.device, dtype=torch.float64)[None, None, :]
    weights = (1 - ((pixels + 0.5 - centres) / support).abs()).clamp_(min=0)
    weights = weights * (pixels < valid[:, None, None])
    return (weights / weights.sum(dim=2, keepdim=True)).to(torch.float32)
