"""Decode only the part of a JPEG a crop needs (libjpeg-turbo's cropped decoding).

A random-resized crop keeps 8–100 % of a photo. libjpeg-turbo can leave out the rest:
the rows above the crop are entropy-decoded but not transformed, the columns beside it
are not transformed, and the rows below it are never read. raypipe's small C extension
(`raypipe.preprocess._jpegregion`, built with the package where a compiler and the
libjpeg-turbo headers are found) calls those functions; without it, `available()` is
False and the fast path decodes the whole image, as before. The pixels of the region
are the ones a whole decode gives (`tests/preprocess/test_region.py` checks it).

A JPEG with a restart marker after every MCU (16×16 pixels of a 4:2:0 photo; what
`with_restarts` writes, and ``raypipe convert`` by default) lets it leave out the rows
above the crop as well: each MCU's entropy-coded bytes stand alone, so the MCUs under the
crop, cut out with their restart markers renumbered, are a JPEG of their own, and the rest
of the file is never entropy-decoded. The same pixels again; damage to the bytes of an
MCU outside the crop goes unseen by that crop (a marker missing or out of place is
refused whatever the crop).
"""

from __future__ import annotations

import math

import numpy as np

from raypipe.preprocess.augment import Box

try:
    from raypipe.preprocess import _jpegregion
except ImportError:  # built without a compiler or libjpeg's headers
    _jpegregion = None

__all__ = ["MARGIN", "available", "by_mcu", "decode_box", "fits", "window", "with_restarts"]
assert __all__ == sorted(__all__)

MARGIN = 3  # source pixels kept around the box for the resize's low-pass and warp
_EOI = b"\xff\xd9"  # a JPEG's end marker


def available() -> bool:
    """True when region decoding was built."""
    return _jpegregion is not None


def fits(data) -> bool:
    """Whether ``data`` (a JPEG the fast path takes) may be region-decoded: built, and the
    file ends with its end marker. A region decode stops below the crop, so it cannot see
    a file cut short; such a file is decoded whole, which refuses it whatever the crop, so
    a file cut short does not come and go with its crops. (Damage inside the entropy-coded
    bytes is seen only by the crops that decode them: below a plain JPEG's crop, or
    outside a restart-marked one's MCUs, it goes unseen.)"""
    return _jpegregion is not None and data[-2:] == _EOI


def by_mcu(data) -> bool:
    """Whether `decode_box` reads only the crop's MCUs of the JPEG ``data`` (a restart
    marker after every MCU, as `with_restarts` writes), where region decoding was built."""
    return _jpegregion is not None and _jpegregion.by_mcu(data)


def window(box: Box, width: int, height: int) -> tuple[int, int, int, int]:
    """The whole pixels ``x0, y0, x1, y1`` of a ``width``×``height`` image that a crop of
    the fractional ``box`` reads: the box and `MARGIN` pixels each side, clipped."""
    x0, y0 = max(0, math.floor(box.left) - MARGIN), max(0, math.floor(box.top) - MARGIN)
    x1 = min(width, math.ceil(box.left + box.width) + MARGIN)
    y1 = min(height, math.ceil(box.top + box.height) + MARGIN)
    return x0, y0, x1, y1


def decode_box(data: bytes, k: int, width: int, height: int, box: Box) -> tuple[np.ndarray, Box]:
    """The `window` around ``box`` of the JPEG ``data`` (``width``×``height``) decoded at
    1/``k`` scale: uint8 H×W×3 (a view), and ``box`` in that array's pixels (scaled to the
    decode and shifted to the window's origin). Call it only where `fits` holds.

    Raises ValueError for data libjpeg-turbo refuses or warns about."""
    sw, sh = -(-width // k), -(-height // k)  # libjpeg's size at 1/k: rounded up
    scaled = box.scaled(sw / width, sh / height)
    x0, y0, x1, y1 = window(scaled, sw, sh)
    if x1 <= x0 or y1 <= y0:
        raise ValueError(f"crop box {box} is outside the {width}x{height} image")
    # one column more each side: the decoder starts a region at a block edge, where the
    # chroma upsampling has no left (or right) neighbour and the edge pixel differs
    a, b = max(0, x0 - 1), min(sw, x1 + 1)
    buf, xs, cols = _jpegregion.decode(data, k, a, y0, b - a, y1 - y0)
    rgb = np.frombuffer(buf, dtype=np.uint8).reshape(y1 - y0, cols, 3)[:, x0 - xs : x1 - xs]
    return rgb, Box(scaled.left - x0, scaled.top - y0, scaled.width, scaled.height)


def with_restarts(data: bytes) -> bytes:
    """The JPEG ``data`` re-written losslessly (the same DCT coefficients, quantisation
    tables and APP/COM markers; Huffman tables made optimal for it) as one baseline scan with
    a restart marker after every MCU, which `decode_box` reads a crop's MCUs of alone. Every
    decoder gives the same pixels for it as for ``data``; it is a few per cent larger
    (2–7 % on quality-90 photos). Call it only where `available`.

    Raises ValueError for data libjpeg-turbo refuses or warns about."""
    return _jpegregion.restart(data)
