"""JPEGs with a restart marker after every MCU (`raypipe.preprocess.region.with_restarts`,
what ``raypipe convert`` writes): re-written without changing a pixel, and a crop's region
decoded from its own MCUs alone, to the same pixels, at every scale and layout."""

import io
import struct
import subprocess
import sys

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from raypipe.preprocess import decode, region
from raypipe.preprocess.augment import Box, plan, sample_rng
from tests.preprocess.test_region import mutated_regions, needs_region, photo, whole

LAYOUTS = {
    "420": {"quality": 90},
    "444": {"quality": 95, "subsampling": 0},
    "422": {"quality": 85, "subsampling": 1},
    "progressive": {"quality": 90, "progressive": True},
}
DRI_ONE = b"\xff\xdd\x00\x04\x00\x01"  # define restart interval: one MCU


def grey(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (height, width), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img)


def markers(data: bytes) -> list[bytes]:
    """The APPn and COM segments before the scan, in order."""
    out, i = [], 2
    while data[i + 1] != 0xDA:
        n = int.from_bytes(data[i + 2 : i + 4], "big")
        if 0xE0 <= data[i + 1] <= 0xEF or data[i + 1] == 0xFE:
            out.append(data[i : i + 2 + n])
        i += 2 + n
    return out


@needs_region
@pytest.mark.parametrize("layout", [*LAYOUTS, "grey"])
def test_a_restarted_jpeg_has_the_same_pixels_in_every_decoder(layout):
    data = grey(203, 117) if layout == "grey" else photo(437, 301, seed=1, **LAYOUTS[layout])
    again = region.with_restarts(data)
    assert DRI_ONE in again and DRI_ONE not in data
    assert again[:2] == b"\xff\xd8" and b"\xff\xc2" not in again[: again.index(b"\xff\xda")]
    assert np.array_equal(pixels(again), pixels(data))
    if layout != "grey":
        for k in (1, 2, 4, 8):
            assert np.array_equal(whole(again, k), whole(data, k)), k


@needs_region
def test_a_restarted_jpeg_keeps_its_exif_and_comment():
    img = Image.fromarray(np.zeros((40, 60, 3), np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif.tobytes(), comment=b"from the camera")
    data = buf.getvalue()
    again = region.with_restarts(data)
    kept = [m for m in markers(data) if m[4:9] != b"JFIF\0"]
    assert markers(again)[-len(kept) :] == kept
    assert decode.exif_orientation(again) == decode.exif_orientation(data) == 6


def mcu_edges(size: int, step: int) -> list[int]:
    """Offsets on and beside the edges of MCUs ``step`` pixels apart."""
    return sorted({min(max(0, e + d), size - 1) for e in range(0, size, step) for d in (-1, 0, 1)})


@needs_region
@pytest.mark.parametrize("layout", [*LAYOUTS, "grey"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_a_region_of_a_restarted_jpeg_is_the_one_the_original_gives(layout, k):
    """Regions starting and ending on, before and after every MCU edge, and random ones:
    the restarted file's decode of each is the original's, byte for byte (its pixels, and
    the columns the decoder widened it to); and `decode_box` gives the whole decode's."""
    width, height = (203, 117) if layout == "grey" else (437, 301)
    data = grey(width, height) if layout == "grey" else photo(width, height, seed=k,
                                                              **LAYOUTS[layout])  # fmt: skip
    again = region.with_restarts(data)
    sw, sh = -(-width // k), -(-height // k)
    step = max(1, 16 // k)  # an MCU of 4:2:0 at this scale; finer layouts' edges among them
    rng = np.random.default_rng(k)
    regions = [(x, y, min(sw - x, 1 + (x * 7) % 40), min(sh - y, 1 + (y * 5) % 30))
               for x in mcu_edges(sw, step)[::2] for y in mcu_edges(sh, step)[::3]]  # fmt: skip
    regions += [(0, 0, sw, sh), (sw - 1, sh - 1, 1, 1)]
    for _ in range(60):
        w, h = int(rng.integers(1, sw + 1)), int(rng.integers(1, sh + 1))
        regions.append((int(rng.integers(0, sw - w + 1)), int(rng.integers(0, sh - h + 1)), w, h))
    for r in regions:
        assert region._jpegregion.decode(again, k, *r) == region._jpegregion.decode(data, k, *r), r
    full = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=sw, min_height=sh)
    for x, y, w, h in regions[::7]:
        box = Box(x * width / sw, y * height / sh, w * width / sw, h * height / sh)
        rgb, _ = region.decode_box(again, k, width, height, box)
        x0, y0, x1, y1 = region.window(box.scaled(sw / width, sh / height), sw, sh)
        assert np.array_equal(rgb, full[y0:y1, x0:x1]), (x, y, w, h)


@needs_region
def test_a_restarted_jpegs_crop_reads_only_its_own_mcus():
    """Bytes of the top-left MCU overwritten (no marker touched): a crop of the bottom
    rows still decodes to the clean file's pixels, where the file without restart markers
    entropy-decodes every row above its crop, and a crop over that MCU does not."""
    data = region.with_restarts(photo(320, 240, seed=5, quality=90))
    scan = data.index(b"\xff\xda")
    scan += 2 + int.from_bytes(data[scan + 2 : scan + 4], "big")
    first = data.index(b"\xff\xd0", scan)  # the end of the first MCU's bytes
    damaged = data[:scan] + bytes([0x55]) * (first - scan) + data[first:]
    clean = whole(data, 1)
    rgb, _ = region.decode_box(damaged, 1, 320, 240, Box(100, 160, 200, 70))
    expect, _ = region.decode_box(data, 1, 320, 240, Box(100, 160, 200, 70))
    assert np.array_equal(rgb, expect)
    try:
        top_left, _ = region.decode_box(damaged, 1, 320, 240, Box(0, 0, 40, 40))
    except ValueError:
        return
    assert not np.array_equal(top_left, clean[: top_left.shape[0], : top_left.shape[1]])


@needs_region
@pytest.mark.parametrize("cut", ["marker_dropped", "marker_renumbered", "truncated"])
def test_restart_markers_out_of_place_are_refused_whatever_the_crop(cut):
    data = region.with_restarts(photo(320, 240, seed=6, quality=90))
    at = data.index(b"\xff\xd3")
    bad = {"marker_dropped": data[:at] + data[at + 2 :],
           "marker_renumbered": data[:at] + b"\xff\xd4" + data[at + 2 :],
           "truncated": data[: len(data) * 3 // 4] + b"\xff\xd9"}[cut]  # fmt: skip
    for box in (Box(0, 0, 20, 20), Box(250, 200, 60, 30)):
        with pytest.raises(ValueError):
            region.decode_box(bad, 1, 320, 240, box)


@needs_region
def test_decode_crop_of_a_restarted_jpeg_is_the_originals():
    datas = [photo(500, 375, seed=s, quality=90) for s in range(3)]
    again = [region.with_restarts(d) for d in datas]
    for key in range(30):
        rngs = [sample_rng(0, 0, key) for _ in range(2)]
        outs = [
            decode.decode_crop(src[key % 3], 224, lambda w, h, r=r: plan(
                w, h, train=True, rng=r, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip=True))
            for src, r in zip((datas, again), rngs, strict=True)
        ]  # fmt: skip
        assert np.array_equal(outs[0], outs[1]), key


@needs_region
def test_mutated_restarted_jpegs_are_decoded_or_refused_never_crash_the_process():
    bases = [region.with_restarts(photo(300, 200, seed=s, **LAYOUTS[lay]))
             for s, lay in enumerate(("420", "444", "422"))]  # fmt: skip
    outcomes = mutated_regions(bases, seed=8, end=b"\xff\xd9")  # cut files keep an end
    assert min(outcomes.values()) > 200, outcomes


@needs_region
def test_a_jpeg_libjpeg_refuses_is_not_re_written():
    data = photo(120, 80, seed=9, quality=90)
    with pytest.raises(ValueError, match="libjpeg"):
        region.with_restarts(data[: len(data) // 2])
    with pytest.raises(ValueError, match="libjpeg"):
        region.with_restarts(b"not a jpeg")


def _segment(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body


def grey_blocks(blocks: int, *, app1: int = 0, dri: int = 0) -> bytes:
    """A grey JPEG ``blocks`` 8×8 blocks wide whose every block adds 2047 to the DC (a
    file libjpeg decodes, no warning, and whose DC no JPEG can hold once restarts write
    it whole), behind an APP1 of ``app1`` bytes."""
    out = b"\xff\xd8" + (_segment(0xE1, b"Exif\0\0" + b"A" * (app1 - 6)) if app1 else b"")
    one = bytes([1] + [0] * 15)  # one Huffman code, of length 1
    out += _segment(0xDB, b"\x00" + bytes([1] * 64))
    out += _segment(0xC0, b"\x08" + struct.pack(">HH", 8, 8 * blocks) + b"\x01\x01\x11\x00")
    out += _segment(0xC4, b"\x00" + one + bytes([11])) + _segment(0xC4, b"\x10" + one + b"\x00")
    out += _segment(0xDD, struct.pack(">H", dri)) if dri else b""
    out += _segment(0xDA, b"\x01\x01\x00\x00\x3f\x00")
    bits = ("0" + "1" * 11 + "0") * blocks
    bits += "1" * (-len(bits) % 8)
    data = bytearray()
    for i in range(0, len(bits), 8):
        data.append(int(bits[i : i + 8], 2))
        if data[-1] == 0xFF:
            data.append(0)
    return out + bytes(data) + b"\xff\xd9"


@needs_region
def test_a_re_write_libjpeg_refuses_late_is_a_value_error_not_a_crash(tmp_path):
    """The re-write fails once the output buffer has grown (a 10 kB APP1 is written
    first): libjpeg's memory destination had freed the buffer it outgrew, and the error
    path freed it again (the process aborted: "double free"). In a child process."""
    path = tmp_path / "drift.jpg"
    path.write_bytes(grey_blocks(4, app1=10_000))
    code = ("import sys; from raypipe.preprocess import region\n"
            "data = open(sys.argv[1], 'rb').read()\n"
            "try:\n    region.with_restarts(data)\nexcept ValueError as e:\n    print('refused', e)\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused libjpeg: DCT coefficient out of range" in done.stdout


@needs_region
def test_headers_that_lie_are_refused_before_any_work():
    """A scan header cut short at the file's end was read one byte past it; a 150-byte
    file claiming 65535×65535 pixels of restart intervals had 1 GiB allocated for its
    MCU index before its bytes were looked at."""
    start = grey_blocks(2, dri=1)
    head = start[: start.index(b"\xff\xda")] + b"\xff\xda\x00\x02"
    beyond = bytearray(head + b"\x01")  # the byte past the header: the scan's component count
    assert not region.by_mcu(memoryview(beyond)[: len(head)])
    huge = start.replace(struct.pack(">HH", 8, 16), struct.pack(">HH", 65535, 65535), 1)
    assert len(huge) < 200
    with pytest.raises(ValueError, match="cannot fit in"):
        region._jpegregion.decode(huge, 1, 0, 0, 8, 8)


@needs_region
def test_a_jpeg_without_a_jfif_header_gets_none():
    """A camera's file (EXIF first, no JFIF APP0) keeps its markers as they were."""
    data = photo(64, 48, seed=3, quality=90)
    jfif = data.index(b"\xff\xe0")
    bare = data[:jfif] + data[jfif + 2 + int.from_bytes(data[jfif + 2 : jfif + 4], "big") :]
    assert b"JFIF" not in bare and markers(bare) == []
    again = region.with_restarts(bare)
    assert markers(again) == [] and np.array_equal(pixels(again), pixels(bare))
