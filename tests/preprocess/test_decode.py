import io

import numpy as np
import pytest
from PIL import Image

from raypipe.preprocess import decode
from raypipe.preprocess.augment import Box, Plan, plan, sample_rng
from raypipe.preprocess.pillow import pillow_decode_crop
from raypipe.skips.records import reason_of
from tests.conftest import checks_jpeg, image_bytes


def chooser(key: int, *, train: bool = True, seed: int = 0, epoch: int = 0):
    rng = sample_rng(seed, epoch, key)
    return lambda w, h: plan(
        w, h, train=train, rng=rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip=True
    )


def both(data: bytes, size: int, key: int, **kw) -> tuple[np.ndarray, np.ndarray]:
    fast = decode.decode_crop(data, size, chooser(key, **kw))
    standard = pillow_decode_crop(data, size, chooser(key, **kw))
    return np.ascontiguousarray(fast), standard


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("image_size", [(400, 300), (1600, 1200)])
def test_fast_matches_standard_on_the_same_boxes(train, image_size):
    """Same seeded crop box and flip; only resampling arithmetic may differ a little.

    The images are blocky noise, a harsh case for resampling; on photos the mean
    difference is well under one grey level (benchmarks/ingest.py reports it).
    """
    rng = np.random.default_rng(0)
    for key in range(12):
        data = image_bytes(rng, size=image_size)
        assert decode.fast_decodable(data)
        fast, standard = both(data, 64, key, train=train)
        assert fast.shape == standard.shape == (3, 64, 64) and fast.dtype == np.uint8
        diff = np.abs(fast.astype(int) - standard.astype(int))
        assert diff.mean() < 3.5, (key, diff.mean())
        assert np.percentile(diff, 99) <= 20, (key, np.percentile(diff, 99))


def test_preprocessor_caps_opencv_threads_at_its_cpus(tmp_path):
    """A pool actor's resizes use the CPUs it reserved, not a thread per core of the node
    (torch's too: this process has imported it)."""
    import cv2
    import torch

    from raypipe.config import PipelineConfig
    from raypipe.preprocess.actor import Preprocessor

    before = cv2.getNumThreads(), torch.get_num_threads()
    try:
        for cpus, threads in ((1.0, 1), (0.5, 1), (2.0, 2)):
            cv2.setNumThreads(8)
            torch.set_num_threads(8)
            Preprocessor(PipelineConfig(source=str(tmp_path), actor_cpus=cpus), "imagefolder", 0)
            assert (cv2.getNumThreads(), torch.get_num_threads()) == (threads, threads), cpus
    finally:
        cv2.setNumThreads(before[0])
        torch.set_num_threads(before[1])


def test_flip_is_the_mirror_of_the_same_crop():
    data = image_bytes(np.random.default_rng(1), size=(200, 150))
    box = Box(10, 20, 120, 100)
    plain = decode.decode_crop(data, 32, lambda w, h: Plan(box, False))
    flipped = decode.decode_crop(data, 32, lambda w, h: Plan(box, True))
    assert np.array_equal(plain[:, :, ::-1], flipped)


def test_deterministic_per_seed_epoch_key():
    data = image_bytes(np.random.default_rng(2), size=(320, 240))
    a = decode.decode_crop(data, 48, chooser(5, seed=1, epoch=2))
    assert np.array_equal(a, decode.decode_crop(data, 48, chooser(5, seed=1, epoch=2)))
    others = [decode.decode_crop(data, 48, chooser(k, seed=1, epoch=2)) for k in range(6, 12)]
    assert sum(not np.array_equal(a, o) for o in others) >= len(others) - 1


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "WEBP"])
def test_other_formats_fall_back_to_pillow_exactly(fmt):
    data = image_bytes(np.random.default_rng(3), fmt=fmt, size=(90, 70))
    assert not decode.fast_decodable(data)
    for key in range(4):
        fast, standard = both(data, 32, key)
        assert np.array_equal(fast, standard)


def _jpeg(img: Image.Image, **save) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **save)
    return buf.getvalue()


def test_exif_rotated_and_cmyk_jpegs_take_pillow_with_the_same_plan():
    base = Image.open(io.BytesIO(image_bytes(np.random.default_rng(4), size=(120, 80))))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90°: width and height swap after transposition
    rotated = _jpeg(base, exif=exif.tobytes())
    assert decode.exif_orientation(rotated) == 6
    cmyk = _jpeg(base.convert("CMYK"))
    for data in (rotated, cmyk):
        assert not decode.fast_decodable(data)
        for key in range(4):
            fast, standard = both(data, 32, key)
            assert np.array_equal(fast, standard)
    upright = Image.Exif()
    upright[0x0112] = 1
    assert decode.exif_orientation(_jpeg(base, exif=upright.tobytes())) == 1
    assert decode.exif_orientation(_jpeg(base)) == 1


def test_an_orientation_in_xmp_alone_turns_the_image_on_every_path():
    """Pillow reads ``tiff:Orientation`` from an XMP packet where EXIF has none: the fast
    path took such a file as upright, and drew its plan for the unturned size."""
    base = Image.open(io.BytesIO(image_bytes(np.random.default_rng(4), size=(96, 40))))
    packet = b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:Description tiff:Orientation="6"/>'
    turned = _jpeg(base, xmp=packet + b"</x:xmpmeta>")
    assert decode.exif_orientation(turned) == 6 and not decode.fast_decodable(turned)
    for key in range(4):
        fast, standard = both(turned, 32, key)
        assert np.array_equal(fast, standard)
    exif = Image.Exif()
    exif[0x0112] = 1  # EXIF's own tag wins over XMP's, as in Pillow
    assert decode.exif_orientation(_jpeg(base, exif=exif.tobytes(), xmp=packet)) == 1
    # Pillow reads the first EXIF block only, and the last XMP packet, tagged or not
    untagged, plain = Image.Exif().tobytes(), b"<x:xmpmeta/>"
    for blocks, want in [
        ((b"Exif\0\0" + untagged[6:], b"Exif\0\0" + exif.tobytes()[6:], _XMP_HEAD + packet), 6),
        ((_XMP_HEAD + packet, _XMP_HEAD + plain), 1),
    ]:
        data = _with_app1(_jpeg(base), blocks)
        img = Image.open(io.BytesIO(data))
        assert decode.exif_orientation(data) == (img.getexif().get(0x0112) or 1) == want
    # an orientation entry Pillow skips (type 0) says 1 in its value: Pillow reads XMP's 6
    odd = b"MM\0*\0\0\0\x08\0\x01" + b"\x01\x12\0\0\0\0\0\x01\0\x01\0\0" + b"\0" * 4
    data = _with_app1(_jpeg(base), (b"Exif\0\0" + odd, _XMP_HEAD + packet))
    assert Image.open(io.BytesIO(data)).getexif().get(0x0112) == 6
    assert decode.exif_orientation(data) != 1 and not decode.fast_decodable(data)


_XMP_HEAD = b"http://ns.adobe.com/xap/1.0/\0"


def _with_app1(jpeg: bytes, segments) -> bytes:
    """``jpeg`` with APP1 ``segments`` (each a payload) after its SOI, in order."""
    app1 = b"".join(b"\xff\xe1" + (len(s) + 2).to_bytes(2, "big") + s for s in segments)
    return jpeg[:2] + app1 + jpeg[2:]


def test_grayscale_jpeg_becomes_three_equal_channels():
    gray = Image.open(io.BytesIO(image_bytes(np.random.default_rng(5), size=(100, 100))))
    data = _jpeg(gray.convert("L"))
    assert decode.fast_decodable(data)
    fast, standard = both(data, 40, 0)
    assert np.array_equal(fast[0], fast[1]) and np.array_equal(fast[1], fast[2])
    assert np.abs(fast.astype(int) - standard.astype(int)).mean() < 2.0


def test_plan_is_drawn_once_even_when_decoding_fails():
    data = image_bytes(np.random.default_rng(6), size=(100, 80))
    calls = []

    def choose(w, h):
        calls.append((w, h))
        return Plan(Box(0, 0, w, h), False)

    with pytest.raises(OSError) as e:  # the truncated file, as Pillow reports it
        decode.decode_crop(data[: len(data) // 3], 16, choose)
    assert reason_of(e.value) == "truncated_image"
    assert len(calls) <= 1
    calls.clear()
    decode.decode_crop(data, 16, choose)
    assert calls == [(100, 80)]


@pytest.mark.parametrize("box", [Box(0, 0, 300, 120), Box(0, 0, 120, 300)])
def test_an_axis_that_shrinks_is_low_passed_when_the_other_grows(box):
    """1-pixel checks across an axis that shrinks (300 → 224) while the other grows
    (120 → 224): Pillow's filter greys them out; bilinear sampling alone would keep most of
    their contrast as moiré bands (std 43 here)."""
    data = checks_jpeg((400, 400))
    fast = np.ascontiguousarray(decode.decode_crop(data, 224, lambda w, h: Plan(box, False)))
    standard = pillow_decode_crop(data, 224, lambda w, h: Plan(box, False))
    assert standard.std() < 25  # Pillow's output is close to uniform grey
    assert fast.std() < standard.std() + 18, (fast.std(), standard.std())
    assert abs(fast.mean() - standard.mean()) < 3


def test_the_low_pass_leaves_out_only_what_opencv_would_not_change():
    """The crop's blur takes no pass along an axis whose 8-bit kernel is the identity: for
    every sigma (both axes alike and mixed), the pixels equal those of OpenCV's own kernel
    sizes (the input itself where no pass is taken). A threshold set too high fails here."""
    import cv2

    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (61, 67, 3), dtype=np.uint8)
    img[0], img[1] = 0, 255  # the widest steps a kernel's rounding can show

    def blur(size, sx, sy):
        return cv2.GaussianBlur(img, size, sigmaX=sx, sigmaY=sy, borderType=cv2.BORDER_REPLICATE)

    sigmas = np.append(np.linspace(0.001, 1.2, 2400), decode._SIGMA_IDENTITY)
    others = (0.001, 0.2, decode._SIGMA_IDENTITY, 0.35, 0.7)
    taken = set()
    for sx in sigmas:
        for sy in (sx, *others):
            size = (decode._taps(sx), decode._taps(sy))
            taken.add(size)
            expected = blur((0, 0), sx, sy)
            got = img if size == (1, 1) else blur(size, sx, sy)
            assert np.array_equal(got, expected), (sx, sy, size)
    assert {(1, 1), (0, 0), (1, 0), (0, 1)} <= taken


@pytest.mark.parametrize("shape", [(224, 224), (31, 17), (1, 5)])
def test_put_chw_writes_every_layout_as_its_chw_copy(shape):
    """decode_crop's CHW view of an HWC array, a mirrored view, contiguous CHW arrays and
    other strides all land in the block's planes as numpy's own copy would put them."""
    rng = np.random.default_rng(7)
    h, w = shape
    hwc = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    chw = np.ascontiguousarray(hwc.transpose(2, 0, 1))
    wide = rng.integers(0, 256, (3, h, 2 * w), dtype=np.uint8)
    for image in (
        hwc.transpose(2, 0, 1),
        hwc[:, ::-1].transpose(2, 0, 1),
        chw,
        chw[:, ::-1],
        wide[:, :, ::2],
    ):
        block = np.zeros((4, 3, h, w), dtype=np.uint8)
        decode.put_chw(block[2], image)
        assert np.array_equal(block[2], image)
        assert not block[[0, 1, 3]].any()  # nothing written beside its row


def test_put_chw_refuses_a_wrong_shape():
    with pytest.raises(ValueError):
        decode.put_chw(np.zeros((3, 8, 8), np.uint8), np.zeros((3, 8, 9), np.uint8))
