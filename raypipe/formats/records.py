"""Fields of one record (a TFRecord ``Example``, an LMDB value, an HDF5 row): which hold
the image and the label, and what their values become in a `RawSample`.

The config's ``image_column`` / ``label_column`` name them; while both keep their defaults
(``image``, ``label``), a format's conventions are tried in order when the record has no
such fields (TF's ImageNet build script: ``image/encoded``, ``image/class/label``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

__all__ = ["DEFAULTS", "as_label", "pick", "pixels_to_pnm", "unknown_fields"]
assert __all__ == sorted(__all__)

DEFAULTS = ("image", "label")  # PipelineConfig.image_column, label_column


def pick(fields: Collection[str], image: str, label: str,
         conventions: Sequence[tuple[str, str, str]] = ()) -> tuple[str, str, str] | None:  # fmt: skip
    """``(image field, label field, convention)`` of a record with ``fields``; None when
    neither the names given nor (for the default names) a convention's are all there."""
    if image in fields and label in fields:
        named = next((c[2] for c in conventions if c[:2] == (image, label)), "")
        return image, label, named
    if (image, label) == DEFAULTS:
        return next((c for c in conventions if c[0] in fields and c[1] in fields), None)
    return None


def unknown_fields(what: str, fields: Collection[str], image: str, label: str,
                   conventions: Sequence[tuple[str, str, str]] = ()) -> str:  # fmt: skip
    """One line for a record without the image or label field: the fields it has."""
    tried = f"image_column={image!r}, label_column={label!r}"
    if (image, label) == DEFAULTS and conventions:
        tried += "".join(f" or {c[0]!r}/{c[1]!r} ({c[2]})" for c in conventions)
    return f"{what} has fields {sorted(fields)}, not {tried}: set image_column / label_column"


def as_label(value) -> int | None:
    """An integer label from an int, a numpy integer, a one-element array (0-d too) or a
    one-element sequence of one."""
    if isinstance(value, np.ndarray):
        value = value.reshape(-1)[0] if value.size == 1 else None
    elif isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    return None


def pixels_to_pnm(pixels: np.ndarray) -> bytes:
    """Raw uint8 pixels (H×W, H×W×1 or H×W×3) as a binary PGM / PPM: a header of a few bytes
    before the pixels, which the decoders read with a copy instead of decoding work."""
    if pixels.dtype != np.uint8:
        raise ValueError(f"pixels of dtype {pixels.dtype}, not uint8")
    if pixels.ndim == 3 and pixels.shape[2] == 1:
        pixels = pixels[:, :, 0]
    if pixels.ndim == 2:
        magic = b"P5"
    elif pixels.ndim == 3 and pixels.shape[2] == 3:
        magic = b"P6"
    else:
        raise ValueError(f"pixels of shape {pixels.shape}, not H×W, H×W×1 or H×W×3")
    h, w = pixels.shape[:2]
    return b"%s\n%d %d\n255\n" % (magic, w, h) + np.ascontiguousarray(pixels).tobytes()
