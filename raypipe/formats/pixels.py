"""Images as the pipeline sees their pixels, wherever it meets them: opened under raypipe's
own pixel limit, not Pillow's, and as 8-bit RGB whatever their mode (the Pillow decoder,
the decoded cache, a user transform's image, and the PNG that `raypipe convert` stores for
formats a shard does not keep as they are).
"""

from __future__ import annotations

import io

import numpy as np

__all__ = ["open_image", "to_rgb", "upright_rgb"]
assert __all__ == sorted(__all__)


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


def upright_rgb(img):
    """``img`` as the pipeline decodes a whole image: its EXIF orientation applied, then
    `to_rgb`."""
    from PIL import ImageOps

    return to_rgb(ImageOps.exif_transpose(img))
