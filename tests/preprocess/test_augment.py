from types import SimpleNamespace

import numpy as np
import pytest

from raypipe.preprocess.augment import center_box, plan, random_resized_box, sample_rng
from raypipe.preprocess.pillow import pillow_decode_crop as decode_crop
from tests.conftest import image_bytes


@pytest.mark.parametrize("w, h", [(400, 300), (31, 97), (1, 1), (640, 20)])
def test_random_resized_box_stays_inside(w, h):
    for key in range(200):
        rng = sample_rng(0, 0, key)
        b = random_resized_box(w, h, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
        assert b.left >= 0 and b.top >= 0 and b.width > 0 and b.height > 0
        assert b.left + b.width <= w and b.top + b.height <= h


@pytest.mark.parametrize("w, h", [(1, 40), (40, 1), (2, 300), (300, 2), (1, 1)])
@pytest.mark.parametrize("ratio", [(3, 4), (0.2, 0.3), (5, 6)])
def test_a_thin_image_far_from_the_ratio_still_gets_a_pixel_each_way(w, h, ratio):
    """The centre fallback rounded a side to 0 (1×40 at ratio 3-4: a 1×0 box): the image
    became a decode_error; compiled plans or NumPy's, every box holds a pixel."""
    from raypipe.preprocess.augment import sample_plan

    for key in range(50):
        boxes = [random_resized_box(w, h, sample_rng(0, 0, key), scale=(0.08, 1.0), ratio=ratio),
                 sample_plan(0, 0, key, w, h, train=True, scale=(0.08, 1.0), ratio=ratio,
                             flip=False).box]  # fmt: skip
        for b in boxes:
            assert b.width >= 1 and b.height >= 1, (b, key)
            assert b.left + b.width <= w and b.top + b.height <= h


def test_augmentation_depends_only_on_seed_epoch_key():
    data = image_bytes(np.random.default_rng(0), size=(96, 80))

    def run(seed, epoch, key):
        rng = sample_rng(seed, epoch, key)
        choose = lambda w, h: plan(  # noqa: E731
            w, h, train=True, rng=rng, scale=(0.08, 1.0), ratio=(0.75, 1.33), flip=True
        )
        return decode_crop(data, 32, choose)

    a = run(1, 2, 3)
    assert a.shape == (3, 32, 32) and a.dtype == np.uint8 and a.flags.c_contiguous
    assert np.array_equal(a, run(1, 2, 3))
    others = [run(1, 2, k) for k in range(4, 12)] + [run(1, e, 3) for e in range(3, 8)]
    assert sum(not np.array_equal(a, o) for o in others) >= len(others) - 1


def test_eval_is_center_crop_and_deterministic():
    data = image_bytes(np.random.default_rng(1), fmt="PNG", size=(64, 48))
    choose = lambda w, h: plan(  # noqa: E731
        w, h, train=False, rng=None, scale=(1, 1), ratio=(1, 1), flip=True
    )
    a = decode_crop(data, 24, choose)
    assert a.shape == (3, 24, 24)
    assert np.array_equal(a, decode_crop(data, 24, choose))
    box = center_box(64, 48)
    assert box.width == box.height == 48 * 0.875
    assert box.left == (64 - box.width) / 2


def test_flip_mirrors_the_same_crop():
    data = image_bytes(np.random.default_rng(2), fmt="PNG", size=(40, 40))
    from raypipe.preprocess.augment import Box, Plan

    box = Box(4, 6, 20, 20)
    plain = decode_crop(data, 16, lambda w, h: Plan(box, False))
    flipped = decode_crop(data, 16, lambda w, h: Plan(box, True))
    assert np.array_equal(plain[:, :, ::-1], flipped)


def test_jpeg_draft_decode_matches_full_decode():
    """Draft (DCT-scaled) decoding must give nearly the image a full decode gives."""
    from PIL import Image

    from raypipe.preprocess.augment import Box, Plan

    rng = np.random.default_rng(3)
    data = image_bytes(rng, size=(800, 600))
    box = Box(0, 0, 800, 600)
    got = decode_crop(data, 64, lambda w, h: Plan(box, False)).astype(int)
    import io

    full = Image.open(io.BytesIO(data)).convert("RGB").resize((64, 64), Image.Resampling.BILINEAR)
    want = np.asarray(full).transpose(2, 0, 1).astype(int)
    assert np.abs(got - want).mean() < 4


def test_compiled_plans_are_built_where_a_compiler_is():
    """The package builds `_draws` wherever a C compiler is (as on CI); a build that left it
    out would make the next test compare NumPy with itself."""
    import shutil

    from raypipe.preprocess import augment

    assert augment.plans_compiled() or not (shutil.which("cc") or shutil.which("gcc"))


# the default crop; a narrow one; ranges few boxes fit, so most plans are the centre
# fallback (its sides at exact halves, rounded to even, then; an image too tall); scale 1
# at ratio 1 (a square of a non-square image never fits)
CROPS = [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (0.5, 2.0)), ((0.99, 1.0), (2.0, 2.5)),
         ((0.99, 1.0), (0.1, 0.2)), ((1.0, 1.0), (1.0, 1.0))]  # fmt: skip


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("scale, ratio", CROPS)
def test_sample_plan_is_plan_from_sample_rng(monkeypatch, compiled, scale, ratio):
    """`sample_plan` gives `plan(..., rng=sample_rng(seed, epoch, key))` bit for bit,
    compiled (`_draws`: NumPy's seeding, doubles, bounded integers with their buffered 32
    bits, Python's rounding) or not: over seeds, epochs and keys at 0 and up to 2**32 and
    past it, images of 1 px to 2,000, with and without flips, and evaluation plans."""
    from raypipe.preprocess import augment

    if not compiled:
        monkeypatch.setattr(augment, "_draws", None)
    elif not augment.plans_compiled():
        pytest.skip("no C compiler here: _draws was not built")
    calls = []
    if compiled:  # counted: the compiled case must go through `_draws`
        rrc = augment._draws.rrc
        monkeypatch.setattr(augment, "_draws",
                            SimpleNamespace(rrc=lambda *a: calls.append(1) or rrc(*a)))  # fmt: skip
    draw = np.random.default_rng(int(scale[0] * 100 + ratio[1] * 10))
    edges = [0, 1, 2**32 - 1, 2**32]
    fallbacks = 0  # train plans of the fallback ranges that took the centre crop
    for i in range(1500 if compiled else 300):
        seed, epoch, key = (int(draw.choice(edges)) if draw.random() < 0.2
                            else int(draw.integers(0, 2**32)) for _ in range(3))  # fmt: skip
        width, height = (int(draw.choice([1, 2, 3, draw.integers(4, 64), draw.integers(64, 2000)]))
                         for _ in range(2))  # fmt: skip
        flip, train = bool(draw.random() < 0.8), bool(i % 10)
        got = augment.sample_plan(seed, epoch, key, width, height, train=train, scale=scale,
                                  ratio=ratio, flip=flip)  # fmt: skip
        want = plan(width, height, train=train, rng=sample_rng(seed, epoch, key), scale=scale,
                    ratio=ratio, flip=flip)  # fmt: skip
        assert got == want, (seed, epoch, key, width, height, flip, train)
        assert [type(v) for v in got.box] == [type(v) for v in want.box]
        if train and scale[0] >= 0.99:  # ranges no attempt fits: the centre fallback's box
            b = got.box
            centred = (b.left, b.top) == ((width - b.width) // 2, (height - b.height) // 2)
            fallbacks += centred and (b.width == width or b.height == height)
    assert fallbacks > 0 or scale[0] < 0.99
    assert (len(calls) > 1000) == compiled, len(calls)


def test_compiled_plans_that_differ_from_numpys_are_not_used():
    """At import the compiled plans are checked against NumPy's on a few keys (a compiler
    that fused the arithmetic would change them): one box a pixel off is refused."""
    from raypipe.preprocess import augment

    class OnePixelOff:
        @staticmethod
        def rrc(seed, epoch, key, width, height, *crop):
            left, top, w, h, flip = augment._draws.rrc(seed, epoch, key, width, height, *crop)
            return (left + (key == 3 and width > 1), top, w, h, flip)

    if not augment.plans_compiled():
        pytest.skip("no C compiler here: _draws was not built")
    assert augment._agrees(augment._draws)
    assert not augment._agrees(OnePixelOff)
