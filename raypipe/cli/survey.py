"""``raypipe inspect``: what raypipe reads from a source, before a run trains on it.

Lists the source as a run would (format, shards, samples, classes, where labels come
from), then reads and decodes a few samples spread over the shards exactly as the
preprocessing actors do, in this process, without Ray: their sizes, labels, and the
reason for every sample that would be skipped.
"""

from __future__ import annotations

import collections
import io
from typing import Any

import numpy as np

from raypipe.config import PipelineConfig
from raypipe.formats.parquet import is_image_type, label_kind
from raypipe.formats.pieces import split_piece
from raypipe.plan.shards import Listing, list_shards
from raypipe.preprocess import decode, region
from raypipe.preprocess.actor import Preprocessor
from raypipe.preprocess.augment import plans_compiled
from raypipe.skips.records import detail_of, reason_of

__all__ = ["format_survey", "survey"]
assert __all__ == sorted(__all__)


def survey(config: PipelineConfig, *, samples: int = 32) -> dict[str, Any]:
    """Facts about ``config.source`` and ``samples`` of its samples, spread over its shards."""
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"{samples=} must be an integer >= 1")
    listing = list_shards(config)
    looked = list(_spread(listing, samples))
    pre = Preprocessor(config.replace(on_error="skip", train=False), listing.reader, 0)
    sizes: collections.Counter[str] = collections.Counter()
    labels: collections.Counter[int] = collections.Counter()
    skipped: list[dict[str, Any]] = []
    jpegs = by_mcu = 0  # the JPEGs looked at, and those the built-in crop reads by MCU
    crop = pre.cache is None and pre.usermap is None and config.decode != "gpu"
    for raw in looked:
        if crop and config.image_column is not None and (raw.data or b"")[:2] == b"\xff\xd8":
            jpegs, by_mcu = jpegs + 1, by_mcu + decode.by_mcu(raw.data)
        try:
            item = pre._decode(raw, 0)
        except Exception as e:
            reason = reason_of(e, raw.data)
            skipped.append({"where": raw.where, "reason": reason, "detail": detail_of(e, raw.data)})
            continue
        sizes[_size(raw.data) if config.image_column is not None else _fields(item)] += 1
        labels[raw.label] += 1
    storage = listing.reader.storage
    return {
        "source": config.source,
        "format": listing.format,
        "format_inferred": config.format is None,
        "storage": storage.scheme + "://" if storage.remote else "local",
        "shards": len(listing.shards),
        "files": len({split_piece(s.path)[0] for s in listing.shards}),
        "samples": listing.num_samples,
        "classes": list(listing.classes),
        "labels": listing.labels,
        "looked_at": len(looked),
        "good": len(looked) - len(skipped),
        "sizes": dict(sizes.most_common()),  # with no image: the fields
        "image": config.image_column is not None,
        "labels_seen": dict(sorted(labels.items())),
        "skipped": skipped,
        "skipped_by_reason": dict(collections.Counter(s["reason"] for s in skipped)),
        "jpeg_decoding": "region" if region.available() else "whole",
        "jpegs_by_mcu": (by_mcu, jpegs),
        "crop_plans": "compiled" if plans_compiled() else "numpy",
        "hint": _column_hint(listing, config)
        if any(s["reason"] == "missing_column" for s in skipped)
        else None,
    }


def format_survey(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The report as ``(name, value)`` rows for the command line."""
    classes = report["classes"]
    shown = ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
    rows = [
        ("format", report["format"] + (" (inferred)" if report["format_inferred"] else "")),
        ("storage", report["storage"]),
        ("shards", f"{report['shards']:,}" + _pieces(report)),
        ("samples", f"{report['samples']:,}"),
        ("classes", f"{len(classes)}: {shown}" if classes else "none named"),
        ("labels from", report["labels"]),
        (
            "looked at",
            f"{report['looked_at']} samples: {report['good']} good, "
            f"{report['looked_at'] - report['good']} would be skipped",
        ),  # fmt: skip
        ("jpeg decoding", _DECODING[report["jpeg_decoding"]] + _by_mcu(report)),
        ("crop plans", _PLANS[report["crop_plans"]]),
    ]
    if report["sizes"]:
        sizes = ", ".join(f"{s} ({n})" for s, n in list(report["sizes"].items())[:5])
        name = "sizes" if report.get("image", True) else "fields"
        rows.append((name, sizes + (", ..." if len(report["sizes"]) > 5 else "")))
        seen = report["labels_seen"]
        rows.append(("labels seen", ", ".join(f"{k} ({n})" for k, n in list(seen.items())[:10])))
    for reason, n in report["skipped_by_reason"].items():
        first = next(s for s in report["skipped"] if s["reason"] == reason)
        rows.append((f"skip: {reason}", f"{n}, e.g. {first['where']}: {first['detail']}"))
    return rows


_DECODING = {
    "region": "the crop's region only (libjpeg-turbo, built with raypipe)",
    "whole": "whole images: region decoding was not built (no C compiler or libjpeg "
    "headers at install; see docs/throughput.md)",
}
_PLANS = {
    "compiled": "one compiled call a sample (built with raypipe)",
    "numpy": "drawn through NumPy: the compiled plans were not built (no C compiler at "
    "install); the same plans, about 10 µs a sample slower",
}


def _pieces(report: dict[str, Any]) -> str:
    """How many files the shards are pieces of, where large record files were cut."""
    files = report.get("files", report["shards"])
    if files == report["shards"]:
        return ""
    return f" (pieces of {files:,} file{'' if files == 1 else 's'})"


def _spread(listing: Listing, n: int):
    """Up to ``n`` raw samples: the first few of shards spread evenly over the listing."""
    shards = listing.shards
    picks = sorted(set(np.linspace(0, len(shards) - 1, min(n, len(shards))).astype(int)))
    per_shard = -(-n // len(picks))
    taken = 0
    for i in picks:
        s = shards[i]
        for j, raw in enumerate(listing.reader.read(s.path, s.first_key, s.label)):
            if j >= per_shard or taken >= n:
                break
            taken += 1
            yield raw


def _column_hint(listing: Listing, config: PipelineConfig) -> str | None:
    """The ``--image-column``/``--label-column`` options that name a Parquet source's own
    columns, where the configured ones are missing and one column of each kind is there,
    with why; ``--image-column none`` where no column holds images (tokens, tables)."""
    if listing.format != "parquet":
        return None
    import pyarrow.parquet as pq

    try:
        with listing.reader.storage.open(split_piece(listing.shards[0].path)[0]) as f:
            schema = pq.read_schema(f)
    except Exception:  # a damaged file: its samples' skips say so already
        return None
    kinds = {"image": is_image_type, "label": label_kind}
    options, why = [], []
    for kind, fits in kinds.items():
        name = getattr(config, f"{kind}_column")
        if name is None or name in schema.names:
            continue
        found = [f.name for f in schema if fits(f.type)]
        if len(found) == 1:
            options.append(f"--{kind}-column {found[0]}")
            why.append("the files' own columns")
        elif not found and kind == "image":
            options.append("--image-column none")
            why.append("no column holds images: samples of the other columns")
    return f"{' '.join(options)} ({'; '.join(dict.fromkeys(why))})" if options else None


def _by_mcu(report: dict[str, Any]) -> str:
    """How many JPEGs looked at the built-in crop decodes by MCU (a transform, the decoded
    cache or ``decode="gpu"`` decodes whole images: none counted then)."""
    by_mcu, jpegs = report.get("jpegs_by_mcu", (0, 0))
    if report["jpeg_decoding"] != "region" or not jpegs:
        return ""
    return (f"; {by_mcu} of the {jpegs} JPEGs looked at by MCU (restart markers, as raypipe "
            "convert writes: only the crop's MCUs decoded)")  # fmt: skip


def _fields(item: dict) -> str:
    """A sample with no image: its fields, each with its type and dimensions."""
    shown = [f"{k} {v.dtype}" + (f" ({v.ndim}-D)" if v.ndim else "") if isinstance(v, np.ndarray)
             else f"{k} {type(v).__name__}" for k, v in item.items() if k != "key"]  # fmt: skip
    return ", ".join(shown)


def _size(data: bytes) -> str:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return f"{img.width}x{img.height} {img.mode}"
