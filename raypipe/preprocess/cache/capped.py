"""Decode an image to its capped size (short side at most ``max_side``); crops from it are
`raypipe.preprocess.decode.crop_chw`'s.

With the cache on, every crop comes from the capped image, the first decode's too, so a
key gets the same pixels whether its image was just decoded or came from the cache. The
capped image is the whole upright RGB image (EXIF rotation applied), uint8 H×W×3:
libjpeg-turbo decodes at the 1/2, 1/4 or 1/8 DCT scale that keeps the short side at least
``max_side``, then a low-pass and a bilinear resize bring it down to exactly ``max_side``.

``cache_encoding="jpeg"`` keeps the capped image re-encoded, and every crop comes from what
that JPEG decodes to: it is served as `Stored`, just encoded or cached alike, and
`region_of` decodes only the crop's region of it (`raypipe.preprocess.region`: the same
pixels as the whole decode).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from raypipe.formats.pixels import open_image, upright_rgb
from raypipe.preprocess.augment import Box, Plan
from raypipe.preprocess.decode import crop_resize, decode_around, decode_scaled, jpeg_size
from raypipe.skips.records import BadSample

__all__ = ["JPEG_MAX_SIDE", "JPEG_QUALITY", "Stored", "decode_capped", "decode_stored",
           "encode_stored", "region_of"]  # fmt: skip
assert __all__ == sorted(__all__)

JPEG_QUALITY = 90  # cache_encoding="jpeg": 4:2:0, about a ninth of the raw bytes
JPEG_MAX_SIDE = 65500  # libjpeg's largest side: a longer capped image is kept raw


def decode_capped(data: bytes, max_side: int, max_pixels: int | None) -> np.ndarray:
    """The image in ``data`` as C-contiguous uint8 H×W×3 with ``min(H, W) <= max_side``.

    An image whose header claims more than ``max_pixels`` is refused before decoding
    (``decompression_bomb``), as the uncached path does."""
    head = jpeg_size(data)
    rgb = None
    if head is not None:
        height, width = head
        _check_pixels(width, height, max_pixels)
        rgb = _turbo(data, width, height, max_side)
    if rgb is None:
        rgb = _pillow(data, max_side, max_pixels)
    return _cap(rgb, max_side)


def encode_stored(rgb: np.ndarray) -> Stored | np.ndarray:
    """``cache_encoding="jpeg"``: the capped image re-encoded. Every crop of the key comes
    from what it decodes to, the first one too (`region_of`), cached or just decoded alike.
    An image with a side over `JPEG_MAX_SIDE` (a panorama whose short side is under the
    cap), which no JPEG holds, stays as its pixels, kept raw."""
    import simplejpeg

    if max(rgb.shape[:2]) > JPEG_MAX_SIDE:
        return rgb

    data = simplejpeg.encode_jpeg(np.ascontiguousarray(rgb), quality=JPEG_QUALITY,
                                  colorspace="RGB", colorsubsampling="420")  # fmt: skip
    return Stored(data, rgb.shape[0], rgb.shape[1])


def decode_stored(data: bytes) -> np.ndarray:
    """A re-encoded cache entry's pixels (raises ValueError on damaged bytes)."""
    import simplejpeg

    return simplejpeg.decode_jpeg(data, colorspace="RGB")


class Stored(NamedTuple):
    """A ``cache_encoding="jpeg"`` image, not decoded yet: its JPEG and size, and whether
    it came from the cache (a hit) or was just encoded."""

    data: bytes
    height: int
    width: int
    hit: bool = False

    def pixels(self) -> np.ndarray:
        """The whole image (for a user transform, which gets all of it)."""
        return decode_stored(self.data)


def region_of(stored: Stored, p: Plan) -> tuple[np.ndarray, Plan]:
    """The pixels of a stored JPEG that ``p``'s crop reads, and ``p`` in them (`crop_chw`
    of the two is the crop of the whole decode): `decode_around` at full scale."""
    rgb, box = decode_around(stored.data, stored.width, stored.height, 1, p.box)
    return rgb, Plan(box, p.flip)


def _turbo(data: bytes, width: int, height: int, max_side: int) -> np.ndarray | None:
    k = next((k for k in (8, 4, 2) if min(-(-width // k), -(-height // k)) >= max_side), 1)
    try:
        return decode_scaled(data, width, height, k)
    except ValueError:  # damage libjpeg-turbo refuses strictly: Pillow tries
        return None


def _pillow(data: bytes, max_side: int, max_pixels: int | None) -> np.ndarray:
    with open_image(data) as img:
        _check_pixels(img.width, img.height, max_pixels)
        if img.format == "JPEG" and img.mode in ("RGB", "L"):
            short = min(img.size)
            scale = max(1.0, short / max_side) if short > max_side else 1.0
            img.draft(img.mode, (math.ceil(img.width / scale), math.ceil(img.height / scale)))
        rgb = upright_rgb(img)
        rgb.load()
        return np.asarray(rgb)


def _cap(rgb: np.ndarray, max_side: int) -> np.ndarray:
    """``rgb`` with its short side brought down to ``max_side``: low-passed and resized
    bilinearly as every crop is (`crop_resize`). OpenCV's area resize, which this once
    was, cost 1.6-2.3 ms on a 500×375 photo, more than decoding it, against about 0.5."""
    height, width = rgb.shape[:2]
    short = min(height, width)
    if short <= max_side:
        return np.ascontiguousarray(rgb)
    scale = max_side / short
    if width <= height:  # the short side exactly max_side, the long one rounded
        size = (max_side, max(1, round(height * scale)))
    else:
        size = (max(1, round(width * scale)), max_side)
    return crop_resize(rgb, Box(0, 0, width, height), size)


def _check_pixels(width: int, height: int, limit: int | None) -> None:
    if limit is not None and width * height > limit:
        raise BadSample("decompression_bomb",
                        f"{width}x{height} = {width * height} pixels > max_image_pixels={limit}")  # fmt: skip
