"""Decode only the part of a JPEG a crop needs (libjpeg-turbo's cropped decoding).

A random-resized crop keeps 8–100 % of a photo. libjpeg-turbo can leave out the rest:
the rows above the crop are entropy-decoded but not transformed, the columns beside it
are not transformed, and the rows below it are never read. raypipe's small C extension
(`raypipe.preprocess._jpegregion`, built with the package where a compiler and the
libjpeg-turbo headers are found) calls those functions; without it, `available()` is
False and the fast path decodes the whole image, as before. The pixels of the region
are the ones a whole decode gives (`tests/preprocess/test_region.py` checks it).
"""

from __future__ import annotations

import math

import numpy as np

from raypipe.preprocess.augment import Box

try:
    from raypipe.preprocess import _jpegregion
except ImportError:  # built without a compiler or libjpeg's headers
    _jpegregion = None

__all__ = ["MARGIN", "available", "decode_box"]
assert __all__ == sorted(__all__)

MARGIN = 3  # source pixels kept around the box for the resize's low-pass and warp


def available() -> bool:
    """True when region decoding was built (else decode_box is not to be called)."""
    return _jpegregion is not None


def decode_box(data: bytes, k: int, width: int, height: int, box: Box) -> tuple[np.ndarray, Box]:
    """The part of the JPEG ``data`` (``width``×``height``) around ``box``, decoded at
    1/``k`` scale: uint8 H×W×3 (a view), and ``box`` in that array's pixels (scaled to the
    decode and shifted to the region's origin). The region is ``box`` plus `MARGIN`
    pixels each side, clipped to the image.

    Raises ValueError for data libjpeg-turbo refuses or warns about."""
    sw, sh = -(-width // k), -(-height // k)  # libjpeg's size at 1/k: rounded up
    fx, fy = sw / width, sh / height
    left, top = box.left * fx, box.top * fy
    bw, bh = box.width * fx, box.height * fy
    x0, y0 = max(0, math.floor(left) - MARGIN), max(0, math.floor(top) - MARGIN)
    x1 = min(sw, math.ceil(left + bw) + MARGIN)
    y1 = min(sh, math.ceil(top + bh) + MARGIN)
    if x1 <= x0 or y1 <= y0:
        raise ValueError(f"crop box {box} is outside the {width}x{height} image")
    # one column more each side: the decoder starts a region at a block edge, where the
    # chroma upsampling has no left (or right) neighbour and the edge pixel differs
    a, b = max(0, x0 - 1), min(sw, x1 + 1)
    buf, xs, cols = _jpegregion.decode(data, k, a, y0, b - a, y1 - y0)
    rgb = np.frombuffer(buf, dtype=np.uint8).reshape(y1 - y0, cols, 3)[:, x0 - xs : x1 - xs]
    return rgb, Box(left - x0, top - y0, bw, bh)
