"""The augmentation plan of one sample: its crop box and flip, drawn reproducibly.

Every random choice comes from ``sample_rng(seed, epoch, key)``, so a sample gets the
same augmentation whichever actor runs it, and a retried task repeats it exactly. A
worker draws them through `sample_plan`: the same plans, each in one call of the compiled
`_draws` where it was built, else through that generator.

train: random-resized-crop (torchvision's algorithm) + optional horizontal flip.
eval:  resize the shorter side to ``size / 0.875`` and center-crop ``size``
       (the classic 256 → 224), done as one crop box + one resize.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

try:
    from raypipe.preprocess import _draws
except ImportError:  # built without a compiler: plans are drawn through NumPy
    _draws = None

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


def plans_compiled() -> bool:
    """True when `_draws` was built: `sample_plan` draws a plan in one compiled call."""
    return _draws is not None


def sample_rng(seed: int, epoch: int, key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, epoch, key]))


def sample_plan(seed: int, epoch: int, key: int, width: int, height: int, *, train: bool,
                scale: tuple[float, float], ratio: tuple[float, float], flip: bool) -> Plan:  # fmt: skip
    """`plan` drawn from ``sample_rng(seed, epoch, key)``, as a worker draws it. A training
    plan is one call of `_draws` (its seeding and draws are NumPy's, bit for bit: about
    1.5 µs a sample where seeding a generator and drawing through it take about 12) where
    it was built and seed, epoch and key are below 2**32; an evaluation plan draws
    nothing."""
    if not train:
        return plan(width, height, train=False, rng=None, scale=scale, ratio=ratio, flip=flip)
    if _draws is not None and min(seed, epoch, key) >= 0 and max(seed, epoch, key) < 2**32:
        left, top, w, h, flipped = _draws.rrc(seed, epoch, key, width, height, scale[0],
                                              scale[1], ratio[0], ratio[1], flip)  # fmt: skip
        return Plan(Box(left, top, w, h), flipped)
    return plan(width, height, train=True, rng=sample_rng(seed, epoch, key), scale=scale,
                ratio=ratio, flip=flip)  # fmt: skip


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
    if in_ratio < ratio[0]:  # at least a pixel: a thin image far from the ratio rounds to 0
        w, h = width, max(1, round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = max(1, round(height * ratio[1])), height
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
    rng: np.random.Generator | None,  # None for evaluation: it draws nothing
    scale: tuple[float, float],
    ratio: tuple[float, float],
    flip: bool,
) -> Plan:
    if not train:
        return Plan(center_box(width, height), False)
    box = random_resized_box(width, height, rng, scale=scale, ratio=ratio)
    return Plan(box, bool(flip and rng.random() < 0.5))


def _agrees(draws) -> bool:
    """Whether ``draws`` (`_draws`) gives NumPy's plans on this machine, for a few keys,
    image sizes and crop ranges (a build whose compiler fused its multiply-adds would not):
    checked once, at import, in about a millisecond."""
    crops = [((0.08, 1.0), (0.75, 4 / 3)), ((0.99, 1.0), (2.0, 2.5))]
    sizes = [(400, 300), (37, 1000), (1, 1)]
    for key, (w, h), (scale, ratio) in itertools.product(range(4), sizes, crops):
        want = plan(w, h, train=True, rng=sample_rng(1, 2, key), scale=scale, ratio=ratio,
                    flip=True)  # fmt: skip
        got = draws.rrc(1, 2, key, w, h, scale[0], scale[1], ratio[0], ratio[1], True)
        if (*want.box, want.flip) != got:
            return False
    return True


if _draws is not None and not _agrees(_draws):
    _draws = None
