"""The augmentation plan of one sample: its crop box and flip, drawn reproducibly.

Every random choice comes from ``sample_rng(seed, epoch, key)``, so a sample gets the
same augmentation whichever actor runs it, and a retried task repeats it exactly.

train: random-resized-crop (torchvision's algorithm) + optional horizontal flip.
eval:  resize the shorter side to ``size / 0.875`` and center-crop ``size``
       (the classic 256 → 224), done as one crop box + one resize.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

EVAL_CROP_FRACTION = 0.875


class Box(NamedTuple):
    """A crop box in source pixels: left, top, width, height (floats allowed)."""

    left: float
    top: float
    width: float
    height: float

    def scaled(self, sx: float, sy: float) -> Box:
        """The box in an image scaled by ``sx``, ``sy`` (a DCT-scaled decode)."""
        return Box(self.left * sx, self.top * sy, self.width * sx, self.height * sy)


def sample_rng(seed: int, epoch: int, key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, epoch, key]))


def random_resized_box(
    width: int,
    height: int,
    rng: np.random.Generator,
    *,
    scale: tuple[float, float],
    ratio: tuple[float, float],
) -> Box:
    """torchvision's RandomResizedCrop.get_params, on a numpy Generator."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return Box(left, top, w, h)
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return Box((width - w) // 2, (height - h) // 2, w, h)


def center_box(width: int, height: int) -> Box:
    side = min(width, height) * EVAL_CROP_FRACTION
    return Box((width - side) / 2, (height - side) / 2, side, side)


class Plan(NamedTuple):
    """What to do to one image, decided before decoding."""

    box: Box
    flip: bool


def plan(
    width: int,
    height: int,
    *,
    train: bool,
    rng: np.random.Generator,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    flip: bool,
) -> Plan:
    if not train:
        return Plan(center_box(width, height), False)
    box = random_resized_box(width, height, rng, scale=scale, ratio=ratio)
    return Plan(box, bool(flip and rng.random() < 0.5))
