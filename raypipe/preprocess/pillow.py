"""The Pillow decoder: any image Pillow reads, decoded and cropped as its plan says.

`raypipe.preprocess.decode.decode_crop` takes the libjpeg-turbo path for ordinary JPEGs and
comes here for everything else (PNG, WebP, CMYK or rotated JPEGs, ...).
"""

from __future__ import annotations

import io
import math

import numpy as np

from raypipe.preprocess.augment import Box

__all__ = ["open_image", "pillow_decode_crop", "to_rgb"]
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


def open_image(data: bytes):
    """``Image.open`` of ``data``, where raypipe's ``max_image_pixels`` decides, not Pillow.

    Pillow refuses images over twice its process-wide ``Image.MAX_IMAGE_PIXELS`` as it
    opens them; raypipe leaves that setting alone (it belongs to the process) and checks
    its own limit per image from the header before decoding. An image only Pillow's
    limit refused is opened again without that check.
    """
    from PIL import Image

    try:
        return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        return _open_unchecked(data)


def _open_unchecked(data: bytes):
    """``Image.open`` less its pixel-count check: the first format plugin that accepts it."""
    import struct

    from PIL import Image

    Image.init()
    for fmt in Image.ID:
        factory, accept = Image.OPEN[fmt]
        if accept is None or accept(data[:16]):
            try:
                return factory(io.BytesIO(data), None)
            except (SyntaxError, IndexError, TypeError, struct.error):
                continue
    raise Image.UnidentifiedImageError("cannot identify image file")


def to_rgb(img):
    """8-bit RGB of any Pillow image, valid but unusual ones included.

    Transparency (RGBA, LA, palette with a transparent index) is composited over black;
    16-bit and 32-bit integer grey keeps its top 8 bits of 0..65535; CMYK, YCbCr,
    1-bit, grey and palette images go through Pillow's own conversion.
    """
    from PIL import Image

    if img.mode == "RGB":
        return img
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "RGBa", "LA", "La", "PA"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode.startswith("I"):  # I;16, I;16B, I;16L, I
        grey = np.clip(np.asarray(img).astype(np.int64), 0, 65535) >> 8
        return Image.fromarray(grey.astype(np.uint8), "L").convert("RGB")
    return img.convert("RGB")


_SWAPS_SIDES = (5, 6, 7, 8)  # EXIF orientations that turn the image a quarter


def _orientation(img) -> int:
    """EXIF orientation 1..8, or 0 when there is none or it cannot be read."""
    try:
        value = img.getexif().get(0x0112, 0)
    except Exception:  # a damaged EXIF block is not a damaged image
        return 0
    return value if isinstance(value, int) and 1 <= value <= 8 else 0
