"""The fast decode + crop: libjpeg-turbo (simplejpeg) and OpenCV, Pillow for the rest.

Same contract and same seeded plan as `raypipe.preprocess.pillow.pillow_decode_crop`: the crop box
and flip a key gets come from the one ``plan`` call, so only the pixel arithmetic
differs (a few grey levels). What makes it cheaper:

- the DCT decodes at 1/2, 1/4 or 1/8 scale whenever the crop keeps ``size`` pixels;
- only the crop's region is decoded (`raypipe.preprocess.region`, where it was built):
  the rows below it are not read, the rest outside it not transformed;
- only the crop box is low-passed and resized (OpenCV's SIMD bilinear resize or one
  affine warp), never the whole image;
- a flip is one ``cv2.flip`` of the resized crop, the HWC → CHW change a view that
  ``put_chw`` writes into a block's planes with OpenCV's SIMD channel split (about 4×
  numpy's strided copy).

JPEGs that are CMYK, carry an EXIF rotation, or that libjpeg-turbo rejects, and every
other format, go through Pillow with the plan already drawn.
"""

from __future__ import annotations

import math
import re

import numpy as np

from raypipe.preprocess import region
from raypipe.preprocess.augment import Box, Plan
from raypipe.preprocess.pillow import pillow_decode_crop

__all__ = ["by_mcu", "crop_chw", "crop_resize", "decode_around", "decode_crop",
           "decode_scaled", "exif_orientation", "fast_decodable", "jpeg_size", "put_chw"]  # fmt: skip
assert __all__ == sorted(__all__)

_FAST_COLORSPACES = ("YCbCr", "Gray", "RGB")
_BLUR = 0.5  # Gaussian sigma per sqrt(shrink² - 1): close to Pillow's triangle filter
# OpenCV's 8-bit Gaussian kernels are fixed point (8 fractional bits): up to this sigma the
# side taps round to 0 and a pass along that axis returns its input (found by bisection; a
# test holds it against cv2.GaussianBlur)
_SIGMA_IDENTITY = 0.283


def decode_crop(data: bytes, size: int, choose) -> np.ndarray:
    """Decode ``data`` and apply ``choose(width, height)``'s plan: uint8 (3, size, size).

    The result may be the CHW view of an H×W×3 array; copy it where contiguity matters
    (`put_chw` does, fast).
    """
    head = jpeg_size(data)
    if head is None:
        return pillow_decode_crop(data, size, choose)
    height, width = head
    p = choose(width, height)
    try:
        k = _dct_reduction(width, height, p.box, size)
        rgb, box = decode_around(data, width, height, k, p.box)
    except ValueError:  # recoverable damage libjpeg-turbo refuses strictly: let Pillow try
        return pillow_decode_crop(data, size, lambda w, h: p)
    return crop_chw(rgb, Plan(box, p.flip), size)


def decode_around(data: bytes, width: int, height: int, k: int, box: Box):
    """The pixels of the JPEG ``data`` (``width``×``height``) that a crop of ``box`` reads,
    decoded at 1/``k`` scale, and ``box`` in them: only the crop's region where
    `region.fits`, else the whole image (the same pixels). Raises ValueError on damage."""
    if region.fits(data):
        return region.decode_box(data, k, width, height, box)
    rgb = decode_scaled(data, width, height, k)
    return rgb, box.scaled(rgb.shape[1] / width, rgb.shape[0] / height)


def decode_scaled(data: bytes, width: int, height: int, k: int) -> np.ndarray:
    """The whole JPEG ``data`` (``width``×``height``) as H×W×3 RGB, decoded at 1/``k``
    scale (libjpeg's size: each side rounded up). Raises ValueError on damage."""
    import simplejpeg

    return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-height // k),
                                  min_width=-(-width // k))  # fmt: skip


def crop_chw(rgb: np.ndarray, p: Plan, size: int) -> np.ndarray:
    """``p``'s crop of the H×W×3 ``rgb``, resized to size×size and flipped as planned:
    uint8 (3, size, size), the CHW view of an H×W×3 array."""
    import cv2

    out = crop_resize(rgb, p.box, size)
    if p.flip:
        out = cv2.flip(out, 1)
    return out.transpose(2, 0, 1)


def crop_resize(rgb: np.ndarray, box: Box, size: int | tuple[int, int]) -> np.ndarray:
    """Resize the pixels inside ``box`` of an H×W×3 image to size×size×3 (``size`` a
    (width, height) pair: to height×width×3).

    Along an axis that shrinks, the crop is first low-passed (a Gaussian close to Pillow's
    triangle filter); then a whole-pixel box is cropped (a view) and resized bilinearly, and
    a box with fractional edges (center crops, DCT-scaled boxes) is sampled by one affine
    warp, both with Pillow's pixel-centre convention, so sub-pixel edges stay where Pillow
    puts them. (OpenCV's area resize, at a fractional factor, costs more than twice the
    blur and the bilinear resize together.)
    """
    import cv2

    out = (size, size) if isinstance(size, int) else tuple(size)
    sx, sy = box.width / out[0], box.height / out[1]
    whole = all(abs(v - round(v)) < 1e-6 for v in box)
    h, w = rgb.shape[:2]
    if whole:
        x0, y0 = round(box.left), round(box.top)
        crop = rgb[y0 : y0 + round(box.height), x0 : x0 + round(box.width)]
    else:
        x0, y0, x1, y1 = region.window(box, w, h)
        crop = rgb[y0:y1, x0:x1]
    blur_x, blur_y = (_BLUR * math.sqrt(max(0.0, s * s - 1.0)) for s in (sx, sy))
    taps = (_taps(blur_x), _taps(blur_y))
    if taps != (1, 1):  # shrinking: low-pass first, as Pillow's filter does
        crop = cv2.GaussianBlur(
            crop, taps, sigmaX=max(blur_x, 1e-3), sigmaY=max(blur_y, 1e-3),
            borderType=cv2.BORDER_REPLICATE,
        )  # fmt: skip
    if whole:
        return cv2.resize(crop, out, interpolation=cv2.INTER_LINEAR)
    to_source = np.array(
        [[sx, 0.0, box.left - x0 + 0.5 * sx - 0.5], [0.0, sy, box.top - y0 + 0.5 * sy - 0.5]]
    )
    flags = cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP
    return cv2.warpAffine(crop, to_source, out, flags=flags, borderMode=cv2.BORDER_REPLICATE)


def _taps(sigma: float) -> int:
    """The Gaussian's kernel size along one axis: 1 (no pass) where OpenCV's 8-bit kernel
    is the identity, else 0 (OpenCV's own size for ``sigma``)."""
    return 1 if sigma <= _SIGMA_IDENTITY else 0


def put_chw(dst: np.ndarray, image: np.ndarray) -> None:
    """Copy the uint8 (3, H, W) ``image`` into the C-contiguous ``dst`` of the same shape.

    An image that is the CHW view of a contiguous H×W×3 array (what `decode_crop`
    returns) is split into ``dst``'s three planes by OpenCV's SIMD deinterleave; anything
    else is copied by numpy.
    """
    import cv2

    hwc = image.transpose(1, 2, 0)
    if (image.dtype == dst.dtype == np.uint8 and image.shape == dst.shape
            and image.shape[0] == 3 and hwc.flags.c_contiguous and dst.flags.c_contiguous):  # fmt: skip
        cv2.split(hwc, [dst[0], dst[1], dst[2]])
    else:
        np.copyto(dst, image)


def fast_decodable(data: bytes) -> bool:
    """True when ``decode_crop`` takes the libjpeg-turbo path for these bytes."""
    return jpeg_size(data) is not None


def exif_orientation(data: bytes) -> int:
    """The orientation of a JPEG as Pillow reads it (1 = upright): EXIF's tag, else an XMP
    packet's ``tiff:Orientation``; 0 when the markers cannot be walked."""
    i, n, xmp, exif = 2, len(data), 1, False
    while i + 4 <= n:
        if data[i] != 0xFF:
            return 0
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD9, 0xDA):  # end of image, start of scan: no EXIF before pixels
            return xmp
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        end, app1 = i + 2 + length, marker == 0xE1
        if app1 and not exif and data[i + 4 : i + 10] == b"Exif\0\0":  # Pillow: the first one
            exif, tagged = True, _tiff_orientation(data[i + 10 : end])
            if tagged is not None:
                return tagged
        elif app1 and data[i + 4 : i + 4 + len(_XMP)] == _XMP:  # the last, tagged or not
            found = _XMP_ORIENTATION.search(data, i + 4, end)  # in place: the packet uncopied
            xmp = int(found[2]) if found else 1
        i = end
    return 0


_XMP = b"http://ns.adobe.com/xap/1.0/\0"
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')  # Pillow's own pattern


def _tiff_orientation(tiff: bytes) -> int | None:
    """The orientation tag of an EXIF block; None where it has none, 0 where it is cut or
    is not one SHORT (Pillow skips such an entry: its reading decides)."""
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return 0
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 0
    for e in range(int.from_bytes(tiff[ifd : ifd + 2], order)):
        at = ifd + 2 + 12 * e
        if at + 12 > len(tiff):
            return 0
        if int.from_bytes(tiff[at : at + 2], order) == 0x0112:  # a SHORT, one: else Pillow's
            plain = tiff[at + 2 : at + 8] == (3).to_bytes(2, order) + (1).to_bytes(4, order)
            return int.from_bytes(tiff[at + 8 : at + 10], order) if plain else 0
    return None


def by_mcu(data: bytes) -> bool:
    """Whether `decode_crop` decodes only a crop's MCUs of ``data``: a JPEG the fast path
    takes, whole (`region.fits`), with a restart marker after every MCU (`region.by_mcu`)."""
    return jpeg_size(data) is not None and region.fits(data) and region.by_mcu(data)


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from the header of a JPEG the fast path handles (YCbCr, grey or
    RGB, upright), else None."""
    import simplejpeg

    if not isinstance(data, (bytes, bytearray, memoryview)) or data[:3] != b"\xff\xd8\xff":
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in _FAST_COLORSPACES or exif_orientation(data) != 1:
        return None
    return height, width


def _dct_reduction(width: int, height: int, box: Box, size: int) -> int:
    """Largest k in 8, 4, 2 whose 1/k-scale decode keeps ``size`` pixels across the box."""
    for k in (8, 4, 2):
        sx, sy = math.ceil(width / k) / width, math.ceil(height / k) / height
        if box.width * sx >= size and box.height * sy >= size:
            return k
    return 1
