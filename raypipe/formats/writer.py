"""Write one WebDataset tar, Parquet or TFRecord shard atomically, then read it back to verify it.

A shard is written under a hidden temporary name in the output folder and renamed to
its final name only after it was read back and matched what was meant to be in it, so
a final name always means a finished, verified shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from raypipe.formats import FORMATS, Reader, get_format
from raypipe.formats.pixels import upright_rgb
from raypipe.formats.webdataset import WDS_IMAGE_EXTS

# the formats raypipe writes, and the suffix of their shard files
INDEX = "index.json"  # raypipe convert's record of its shards and classes, beside them
EXTENSIONS = {name: f.suffix for name, f in FORMATS.items() if f.write is not None}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One image of the source folder: its key and label and where its bytes are."""

    key: int
    label: int
    path: str
    name: str  # the path relative to the source folder, stored with the sample


@dataclasses.dataclass(frozen=True)
class Written:
    """What went into one shard."""

    name: str
    samples: int
    first_key: int
    bytes: int
    skipped: tuple[tuple[str, str], ...]  # (path, reason) of each sample left out
    rewritten: int = 0  # JPEGs stored as ``rewrite`` gave them


def write_shard(
    samples: list[Sample], out: str, name: str, fmt: str,
    rewrite: Callable[[bytes], bytes] | None = None,
) -> Written:  # fmt: skip
    """Write ``samples`` in order into ``out/name``; unreadable images are skipped.

    ``rewrite``, where given, re-writes each JPEG's bytes (losslessly: convert's restart
    markers); a JPEG it raises ValueError for is stored as it is."""
    if fmt not in EXTENSIONS:
        raise ValueError(f"{fmt=} must be one of {sorted(EXTENSIONS)}")
    write = get_format(fmt).write
    kept, skipped, rewritten = [], [], 0
    for sample, data, ext in _load(samples):
        if data is None:
            skipped.append((sample.path, ext))  # ext carries the reason here
            continue
        if rewrite is not None and ext in ("jpg", "jpeg"):
            with contextlib.suppress(ValueError):  # one libjpeg is strict about: as it is
                data, rewritten = rewrite(data), rewritten + 1
        kept.append((sample, data, ext))
    final = os.path.join(out, name)
    tmp = os.path.join(out, f".{name}.{os.getpid()}.tmp")
    try:
        write(tmp, kept)
        _verify(tmp, fmt, kept)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    first_key = kept[0][0].key if kept else -1
    size = os.path.getsize(final)
    return Written(name, len(kept), first_key, size, tuple(skipped), rewritten)


def _load(samples: list[Sample]) -> Iterator[tuple[Sample, bytes | None, str]]:
    """Yield ``(sample, bytes, ext)``; JPEG, PNG and WebP stay as they are, others become PNG;
    bytes that are no image are ``(sample, None, why)``."""
    for s in samples:
        ext = Path(s.path).suffix.lower().lstrip(".")
        try:
            data = Path(s.path).read_bytes()
            if ext in WDS_IMAGE_EXTS:
                _identify(data)  # stored as it is: at least an image's header
            else:
                data, ext = _to_png(data), "png"
        except Exception as e:  # unreadable file or undecodable odd format
            yield s, None, f"{type(e).__name__}: {e}"
            continue
        yield s, data, ext


def _identify(data: bytes) -> None:
    """Pillow's reading of the header (nothing decoded): raises on bytes of no image, and
    on an image over twice Pillow's pixel limit (a decompression bomb)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)):
        pass


def _to_png(data: bytes) -> bytes:
    """The image in ``data`` as a PNG of the pixels the pipeline decodes from it: upright
    (its EXIF orientation applied) and in 8-bit RGB as `upright_rgb` makes it (transparency over
    black, the top 8 bits of 16-bit grey), not Pillow's plain RGB conversion. One over
    twice Pillow's pixel limit is refused before it is decoded (between, Pillow warns)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        buf = io.BytesIO()
        upright_rgb(img).save(buf, format="PNG")
    return buf.getvalue()


def _verify(path: str, fmt: str, kept: list[tuple[Sample, bytes, str]]) -> None:
    """Read the shard back as the pipeline will and compare labels and image bytes."""
    want = [(s.label, hashlib.sha1(d).digest()) for s, d, _ in kept]
    got = [
        (raw.label, hashlib.sha1(raw.data or b"").digest()) for raw in Reader(fmt).read(path, 0, -1)
    ]
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        raise RuntimeError(
            f"shard {path} does not read back as written: {len(got)} samples read, "
            f"{len(want)} written, first difference at sample {first}"
        )
