"""The Pillow decoder: any image Pillow reads, decoded and cropped as its plan says.

`raypipe.preprocess.decode.decode_crop` takes the libjpeg-turbo path for ordinary JPEGs and
comes here for everything else (PNG, WebP, CMYK or rotated JPEGs, ...).
"""

from __future__ import annotations

import math

import numpy as np

from raypipe.formats.pixels import open_image, to_rgb
from raypipe.preprocess.augment import Box

__all__ = ["pillow_decode_crop"]
assert __all__ == sorted(__all__)


def pillow_decode_crop(data: bytes, size: int, choose) -> np.ndarray:
    """Decode ``data``, apply the plan ``choose(width, height)`` returns; uint8 (3, size, size).

    ``choose`` sees the upright size (EXIF orientation applied) read from the header,
    before any pixel is decoded, so it can refuse an image (see ``max_image_pixels``).
    JPEGs use Pillow's draft mode: the DCT scales down by 1/2, 1/4 or 1/8 as long as
    the crop box keeps at least ``size`` pixels on each side, which is exact for the
    result's resolution and several times cheaper for large photos.
    """
    from PIL import Image, ImageOps

    with open_image(data) as img:
        orientation = _orientation(img)
        width, height = img.size
        if orientation in _SWAPS_SIDES:
            width, height = height, width
        p = choose(width, height)
        if orientation not in (0, 1):
            img = ImageOps.exif_transpose(img)
        box = p.box
        if img.format == "JPEG" and img.mode in ("RGB", "L"):
            want = (
                max(1, math.ceil(width * size / box.width)),
                max(1, math.ceil(height * size / box.height)),
            )
            img.draft(img.mode, want)
            sx, sy = img.size[0] / width, img.size[1] / height
            box = Box(box.left * sx, box.top * sy, box.width * sx, box.height * sy)
        rgb = to_rgb(img)
        out = rgb.resize(
            (size, size),
            Image.Resampling.BILINEAR,
            box=(box.left, box.top, box.left + box.width, box.top + box.height),
        )
    arr = np.asarray(out)
    if p.flip:
        arr = arr[:, ::-1]
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


_SWAPS_SIDES = (5, 6, 7, 8)  # EXIF orientations that turn the image a quarter


def _orientation(img) -> int:
    """EXIF orientation 1..8, or 0 when there is none or it cannot be read."""
    try:
        value = img.getexif().get(0x0112, 0)
    except Exception:  # a damaged EXIF block is not a damaged image
        return 0
    return value if isinstance(value, int) and 1 <= value <= 8 else 0
