"""Region decoding (`raypipe.preprocess.region`): the pixels of a crop's region are the
ones a whole decode gives, at every DCT scale, subsampling and layout, and damage is
refused, never patched over."""

import io
import os

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from raypipe.preprocess import decode, region
from raypipe.preprocess.augment import Box, Plan, plan, sample_rng
from raypipe.skips.records import reason_of

HEADERS = any(os.path.exists(f"{d}/jpeglib.h") for d in ("/usr/include", "/usr/local/include"))
needs_region = pytest.mark.skipif(
    not region.available() and not HEADERS,
    reason="no libjpeg headers on this machine, so region decoding was not built",
)


def photo(width: int, height: int, seed: int, **save) -> bytes:
    """A smooth gradient with noise and edges: chroma that upsampling must get right."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1),
                    (x ^ y) & 0xFF], axis=2).astype(np.int16)  # fmt: skip
    rgb += rng.integers(-20, 21, rgb.shape, dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buf, format="JPEG", **save)
    return buf.getvalue()


def whole(data: bytes, k: int) -> np.ndarray:
    h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    if k == 1:
        return simplejpeg.decode_jpeg(data, colorspace="RGB")
    return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-h // k),
                                  min_width=-(-w // k))  # fmt: skip


def test_region_decoding_is_built_where_libjpeg_headers_are():
    """The package builds it wherever the headers are (as on CI); a build that silently
    left it out would make every other test here pass on the fallback."""
    assert region.available() or not HEADERS


@needs_region
@pytest.mark.parametrize(
    "save",
    [
        {"quality": 90},
        {"quality": 95, "subsampling": 0},
        {"quality": 85, "subsampling": 1},
        {"quality": 90, "progressive": True},
    ],  # fmt: skip
    ids=["420", "444", "422", "progressive"],
)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_a_region_has_the_whole_decodes_pixels(save, k):
    rng = np.random.default_rng(k)
    data = photo(437, 301, seed=k, **save)
    full = whole(data, k)
    for _ in range(12):
        w, h = rng.uniform(20, 437), rng.uniform(20, 301)
        box = Box(rng.uniform(0, 437 - w), rng.uniform(0, 301 - h), w, h)
        rgb, inner = region.decode_box(data, k, 437, 301, box)
        sx, sy = full.shape[1] / 437, full.shape[0] / 301
        left, top = box.left * sx, box.top * sy
        x0, y0 = max(0, int(left) - region.MARGIN), max(0, int(top) - region.MARGIN)
        x1 = min(full.shape[1], int(np.ceil(left + box.width * sx)) + region.MARGIN)
        y1 = min(full.shape[0], int(np.ceil(top + box.height * sy)) + region.MARGIN)
        assert inner == pytest.approx(Box(left - x0, top - y0, box.width * sx, box.height * sy))
        expect = full[y0:y1, x0:x1]
        assert np.array_equal(rgb, expect), (k, box)


@needs_region
def test_a_grey_jpeg_comes_out_rgb_with_equal_channels():
    grey = np.random.default_rng(0).integers(0, 256, (120, 200), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(grey).save(buf, format="JPEG", quality=90)
    rgb, _ = region.decode_box(buf.getvalue(), 1, 200, 120, Box(30, 20, 100, 80))
    assert rgb.shape[2] == 3
    assert np.array_equal(rgb[..., 0], rgb[..., 1]) and np.array_equal(rgb[..., 1], rgb[..., 2])


@needs_region
@pytest.mark.parametrize("cut", ["truncated", "garbage", "empty"])
def test_damaged_data_is_refused_not_patched(cut):
    data = photo(300, 200, seed=1, quality=90)
    bad = {"truncated": data[: len(data) // 2],
           "garbage": data[:600] + bytes(np.random.default_rng(2).integers(0, 256, 4000,
                                                                           dtype=np.uint8)),
           "empty": b""}[cut]  # fmt: skip
    with pytest.raises(ValueError):
        region.decode_box(bad, 1, 300, 200, Box(0, 100, 300, 100))


@needs_region
def test_a_box_outside_the_image_is_refused():
    data = photo(120, 80, seed=3, quality=90)
    with pytest.raises(ValueError, match="outside"):
        region.decode_box(data, 1, 120, 80, Box(200, 0, 10, 10))


@needs_region
@pytest.mark.parametrize("size", [(500, 375), (1024, 768)])
def test_decode_crop_gives_the_same_pixels_with_and_without_region_decoding(size, monkeypatch):
    """Same plans, same output, to the grey level: region decoding changes the work,
    not the result (and the whole-image path stays what a build without it runs)."""
    datas = [photo(*size, seed=s, quality=90) for s in range(3)]

    def crops():
        out = []
        for key in range(24):
            rng = sample_rng(0, 0, key)
            choose = lambda w, h, rng=rng: plan(  # noqa: E731
                w, h, train=True, rng=rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip=True
            )
            out.append(np.ascontiguousarray(decode.decode_crop(datas[key % 3], 224, choose)))
        return out

    calls = []
    decode_box = region.decode_box
    monkeypatch.setattr(region, "decode_box", lambda *a: calls.append(1) or decode_box(*a))
    with_region = crops()
    assert calls, "the crops above never went through region decoding"
    monkeypatch.setattr(region, "_jpegregion", None)
    assert not region.available()
    without = crops()
    for a, b in zip(with_region, without, strict=True):
        assert np.array_equal(a, b)


@needs_region
@pytest.mark.parametrize("keep", [0.3, 0.6, 0.9])
def test_a_truncated_jpeg_is_refused_whatever_its_crop_needs(keep, monkeypatch):
    """A crop in the top rows needs none of a truncated file's missing end, and the region
    decoder would never read it; the file is still refused, in every epoch alike, as the
    whole-image path refuses it (a bad sample does not come and go with its crops)."""
    data = photo(300, 200, seed=4, quality=90)
    cut = data[: int(len(data) * keep)]
    top = lambda w, h: Plan(Box(0, 0, w, 16), False)  # noqa: E731
    region.decode_box(data, 1, 300, 200, Box(0, 0, 300, 16))  # the whole file decodes
    with pytest.raises(OSError) as with_region:
        decode.decode_crop(cut, 32, top)
    monkeypatch.setattr(region, "_jpegregion", None)
    with pytest.raises(OSError) as without:
        decode.decode_crop(cut, 32, top)
    assert type(with_region.value) is type(without.value)
    assert reason_of(with_region.value) == reason_of(without.value) == "truncated_image"


@needs_region
def test_mutated_jpegs_are_decoded_or_refused_never_crash_the_process():
    """2,000 seeded mutations (bytes overwritten, files cut) of three layouts at every
    scale: each region decodes to an H×W×3 array or raises ValueError; a crash in the C
    code would take the test process down."""
    bases = [photo(300, 200, seed=0, quality=90), photo(300, 200, seed=1, quality=95,
             subsampling=0), photo(300, 200, seed=2, quality=85, progressive=True)]  # fmt: skip
    outcomes = mutated_regions(bases, seed=7)
    assert min(outcomes.values()) > 200, outcomes  # both paths were exercised


def mutated_regions(bases: list[bytes], *, seed: int, end: bytes = b"") -> dict[str, int]:
    """2,000 seeded mutations of the 300×200 JPEGs ``bases`` (bytes overwritten; files
    cut, ``end`` put after the cut) decoded by region at every scale: each an H×W×3 array
    or a ValueError. How many of each."""
    rng = np.random.default_rng(seed)
    outcomes = {"decoded": 0, "refused": 0}
    for n in range(2000):
        data = bytearray(bases[n % len(bases)])
        for _ in range(rng.integers(1, 8)):
            data[rng.integers(0, len(data))] = rng.integers(0, 256)
        if rng.random() < 0.2:
            data = data[: rng.integers(2, len(data))] + end
        w, h = rng.uniform(10, 300), rng.uniform(10, 200)
        box = Box(rng.uniform(0, 300 - w), rng.uniform(0, 200 - h), w, h)
        try:
            rgb, _ = region.decode_box(bytes(data), int(rng.choice([1, 2, 4, 8])), 300, 200, box)
        except ValueError:
            outcomes["refused"] += 1
        else:
            assert rgb.ndim == 3 and rgb.shape[2] == 3 and rgb.dtype == np.uint8
            outcomes["decoded"] += 1
    return outcomes
