"""The augmentation plan of one sample: its crop box and flip, drawn reproducibly.

Every random choice comes from ``sample_rng(seed, epoch, key)``, so a sample gets the
same augmentation whichever actor runs it, and a retried task repeats it exactly. A
worker draws them through `SampleRngs`: the same plans, each in one call of the compiled
`_draws` where it was built, else from the same streams seeded a task's keys at once.

train: random-resized-crop (torchvision's algorithm) + optional horizontal flip.
eval:  resize the shorter side to ``size / 0.875`` and center-crop ``size``
       (the classic 256 → 224), done as one crop box + one resize.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
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
    """True when `_draws` was built: `SampleRngs.plan` draws a plan in one compiled call."""
    return _draws is not None


def sample_rng(seed: int, epoch: int, key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, epoch, key]))


class SampleRngs:
    """`sample_rng`'s generators for the keys of one task, in the order it meets them, and
    the crop plans drawn from them (`plan`: compiled where it was built, no generator).

    ``PCG64([seed, epoch, key])`` runs NumPy's SeedSequence, about 10 µs a sample (as much
    as the crop plan itself); `expect` names the keys to come, and `rng` seeds them a
    window at a time (`_pcg64_states`: SeedSequence's hash and PCG64's seeding on uint32
    arrays) and sets one generator of this object's to a key's state, about 2 µs. The
    streams are `sample_rng`'s, bit for bit; a key met out of order, or a seed, epoch or
    key of 2**32 and over, takes `sample_rng` itself. The generator `rng` returns is valid
    until its next call.
    """

    WINDOW = 512  # keys seeded at once

    def __init__(self, seed: int):
        self.seed = seed
        self._epoch: int | None = None
        self._keys: Iterable[int] = iter(())
        self._states: dict[int, tuple[int, int]] = {}
        self._gen = np.random.Generator(np.random.PCG64(0))

    def expect(self, epoch: int, keys: Iterable[int]) -> None:
        """The keys of ``epoch`` that `rng` is asked for next, in order (lazily)."""
        fits = all(0 <= v < 2**32 for v in (self.seed, epoch))
        self._epoch, self._keys, self._states = (epoch if fits else None), iter(keys), {}

    def rng(self, epoch: int, key: int) -> np.random.Generator:
        if epoch != self._epoch:
            return sample_rng(self.seed, epoch, key)
        state = self._states.get(key)
        if state is None:
            state = self._seed_from(key)
            if state is None:
                return sample_rng(self.seed, epoch, key)
        bits = {"state": state[0], "inc": state[1]}
        self._gen.bit_generator.state = {"bit_generator": "PCG64", "state": bits,
                                         "has_uint32": 0, "uinteger": 0}  # fmt: skip
        return self._gen

    def plan(self, epoch: int, key: int, width: int, height: int, *, train: bool,
             scale: tuple[float, float], ratio: tuple[float, float], flip: bool) -> Plan:  # fmt: skip
        """`plan` drawn from this key's stream. A training plan is one call of `_draws`
        (its seeding and draws are NumPy's, bit for bit: about 1.5 µs a sample where
        seeding a generator and drawing through it take about 12) where it was built and
        seed, epoch and key are below 2**32; an evaluation plan draws nothing."""
        if not train:
            return plan(width, height, train=False, rng=None, scale=scale, ratio=ratio, flip=flip)
        ids = (self.seed, epoch, key)
        if _draws is not None and min(ids) >= 0 and max(ids) < 2**32:
            left, top, w, h, flipped = _draws.rrc(self.seed, epoch, key, width, height, scale[0],
                                                  scale[1], ratio[0], ratio[1], flip)  # fmt: skip
            return Plan(Box(left, top, w, h), flipped)
        rng = self.rng(epoch, key)
        return plan(width, height, train=True, rng=rng, scale=scale, ratio=ratio, flip=flip)

    def _seed_from(self, key: int) -> tuple[int, int] | None:
        """Seed the window of expected keys that starts at ``key``; its state, or None when
        ``key`` is not among the keys still expected."""
        for k in self._keys:
            if k == key:
                window = np.fromiter(itertools.chain((key,), itertools.islice(
                    self._keys, self.WINDOW - 1)), dtype=np.int64)  # fmt: skip
                window = window[(window >= 0) & (window < 2**32)]
                self._states = dict(zip(window.tolist(), _pcg64_states(
                    self.seed, self._epoch, window), strict=True))  # fmt: skip
                return self._states.get(key)
        return None


# NumPy's SeedSequence (pool of 4 words) and PCG64 seeding, as numpy/random/bit_generator.pyx
# and pcg64.c define them
_M32, _M128 = 0xFFFFFFFF, (1 << 128) - 1
_MIX_L, _MIX_R = np.uint32(0xCA01F9DD), np.uint32(0x4973F715)
_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645


def _hash_consts(init: int, mult: int, n: int) -> list[tuple[np.uint32, np.uint32]]:
    """The (xor, multiplier) pairs of a SeedSequence hash's first ``n`` calls."""
    out, h = [], init
    for _ in range(n):
        out.append((np.uint32(h), np.uint32(h * mult & _M32)))
        h = h * mult & _M32
    return out


_HASH_A = _hash_consts(0x43B0D7E5, 0x931E8875, 16)  # mixing 3 entropy words into 4
_HASH_B = _hash_consts(0x8B51F9DD, 0x58F38DED, 8)  # 4 uint64 words out


def _hashmix(value: np.ndarray, consts: tuple[np.uint32, np.uint32]) -> np.ndarray:
    x = (value ^ consts[0]) * consts[1]
    return x ^ (x >> np.uint32(16))


def _pcg64_states(seed: int, epoch: int, keys: np.ndarray) -> list[tuple[int, int]]:
    """PCG64's (state, inc) after seeding from SeedSequence([seed, epoch, key]), for each
    key; ``seed``, ``epoch`` and every key in [0, 2**32)."""
    n = len(keys)
    entropy = [np.full(n, seed, np.uint32), np.full(n, epoch, np.uint32),
               keys.astype(np.uint32), np.zeros(n, np.uint32)]  # fmt: skip
    pool = [_hashmix(v, _HASH_A[i]) for i, v in enumerate(entropy)]
    calls = iter(_HASH_A[4:])
    for src in range(4):
        for dst in range(4):
            if src != dst:
                x = _MIX_L * pool[dst] - _MIX_R * _hashmix(pool[src], next(calls))
                pool[dst] = x ^ (x >> np.uint32(16))
    words = [_hashmix(pool[i % 4], _HASH_B[i]).astype(np.uint64) for i in range(8)]
    w = [(words[2 * i] | (words[2 * i + 1] << np.uint64(32))).tolist() for i in range(4)]
    states = []
    for hi, lo, inc_hi, inc_lo in zip(*w, strict=True):
        inc = (((inc_hi << 64) | inc_lo) << 1 | 1) & _M128
        states.append((((inc + ((hi << 64) | lo)) * _PCG_MULT + inc) & _M128, inc))
    return states


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
