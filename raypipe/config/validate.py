"""`PipelineConfig`'s checks: each field's, in groups, the first bad value a ValueError that
names the field and the value."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

from raypipe.config.checks import is_int, is_num, is_pair, resolve_callable
from raypipe.config.loader import check_loader
from raypipe.config.samples import check_samples

if TYPE_CHECKING:
    from raypipe.config.pipeline import PipelineConfig

__all__ = [
    "CACHE",
    "CACHE_BLOCK",
    "CACHE_HEADER",
    "COMPUTE",
    "DECODE",
    "FORMATS",
    "INPUTS",
    "ON_ERROR",
    "cache_block",
    "validate",
]
assert __all__ == sorted(__all__)

FORMATS = ("imagefolder", "webdataset", "parquet", "tfrecord", "lmdb", "hdf5")
ON_ERROR = ("skip", "raise")
COMPUTE = ("actors", "tasks")
INPUTS = ("numpy", "pil", "torch")  # what a user transform's image is
DECODE = ("cpu", "gpu")
CACHE = ("memory", "disk")  # or None: no decoded cache
_PASSWORD = re.compile(r"([A-Za-z][\w+.-]*://)([^/@:]*):[^/@]*@")  # scheme://user:pw@
CACHE_BLOCK = 4096  # a cache entry's file takes whole pages of shared memory, or disk blocks
CACHE_HEADER = 512  # an entry's header before its pixels (about 240 bytes with a short path)
DISK_BUDGET = 2 << 30  # bytes per node under cache_dir, by default


def validate(c: PipelineConfig) -> None:
    """Every field's check, in groups; the first bad value raises ValueError naming it."""
    for check in (_check_source, _check_choices, _check_counts, _check_flags, _check_pool,
                  _check_follow, _check_augment, _check_user_code):  # fmt: skip
        check(c, _Bad(c))
    check_loader(c, "PipelineConfig")  # before the cache's budget, which uses batch_size
    for check in (_check_cache, check_samples):
        check(c, _Bad(c))


class _Bad:
    """``bad(field, why)``: the ValueError for one field of one config, naming its value."""

    def __init__(self, config: PipelineConfig):
        self.config = config

    def __call__(self, field: str, why: str) -> ValueError:
        return ValueError(f"PipelineConfig.{field}={getattr(self.config, field)!r}: {why}")


def _check_source(c: PipelineConfig, bad: _Bad) -> None:
    if isinstance(c.source, str):
        if not c.source:
            raise bad("source", "must be a non-empty path, glob or list")
    elif not (isinstance(c.source, tuple) and c.source
              and all(isinstance(s, str) and s for s in c.source)):  # fmt: skip
        raise bad("source", "must be a non-empty path, glob or list of them")
    _check_no_password(c.source)
    if c.storage_options is not None and not isinstance(c.storage_options, Mapping):
        raise bad("storage_options", "must be a mapping of settings, or None")
    if c.image_column is not None and (not isinstance(c.image_column, str) or not c.image_column):
        raise bad("image_column", "must be a non-empty string, or None for samples with no image")
    for name in ("label_column", "label_key"):
        if not isinstance(getattr(c, name), str) or not getattr(c, name):
            raise bad(name, "must be a non-empty string")
    member = c.label_member
    if member is not None and (not isinstance(member, str) or not member or "/" in member
                               or member.startswith(".")):  # fmt: skip
        raise bad("label_member", 'must be a member extension without its dot, such as "cls", '
                  '"txt", "json", or None')  # fmt: skip


def _check_no_password(source: str | tuple[str, ...]) -> None:
    """A URI with a password (``scheme://user:pw@host``) is refused, named without it (not
    through `_Bad`, which shows the value): every error and skip record naming it would."""
    for item in (source,) if isinstance(source, str) else source:
        if secret := _PASSWORD.match(item):
            shown = f"{secret.group(1)}{secret.group(2)}:***@{item[secret.end() :]}"
            raise ValueError(f"PipelineConfig.source {shown!r} holds a password, which every "
                             "error and skip record naming it would print: give credentials "
                             "in storage_options")  # fmt: skip


def _check_choices(c: PipelineConfig, bad: _Bad) -> None:
    if c.format is not None and c.format not in FORMATS:
        raise bad("format", f"must be one of {FORMATS} or None")
    for name, choices in (("compute", COMPUTE), ("on_error", ON_ERROR),
                          ("decode", DECODE), ("transform_input", INPUTS)):  # fmt: skip
        if getattr(c, name) not in choices:
            raise bad(name, f"must be one of {choices}")
    if c.decode == "gpu" and (c.transform is not None or c.collate is not None):
        raise bad("decode", "ships JPEG bytes to the trainer; a transform or collate needs "
                  "pixels in the actors (use decode='cpu')")  # fmt: skip


def _check_counts(c: PipelineConfig, bad: _Bad) -> None:
    if not is_int(c.image_size) or c.image_size < 1:
        raise bad("image_size", "must be an integer >= 1")
    for name in ("files_per_task", "rows_per_block"):  # None: sized from the object store
        value = getattr(c, name)
        if value is not None and (not is_int(value) or value < 1):
            raise bad(name, "must be an integer >= 1, or None")
    if not is_int(c.seed) or c.seed < 0:
        raise bad("seed", "must be an integer >= 0")
    if c.lead_batches is not None and (not is_int(c.lead_batches) or c.lead_batches < 0):
        raise bad("lead_batches", "must be an integer >= 0, or None")
    if c.max_skipped is not None and (not is_num(c.max_skipped) or not 0 <= c.max_skipped <= 1):
        raise bad("max_skipped", "must be a fraction 0 <= x <= 1, or None for no limit")
    limit = c.max_image_pixels
    if limit is not None and (not is_int(limit) or limit < 1):
        raise bad("max_image_pixels", "must be an integer >= 1, or None for no limit")


def _check_flags(c: PipelineConfig, bad: _Bad) -> None:
    for name in ("train", "flip", "shuffle_files", "transform_batch", "follow"):
        if not isinstance(getattr(c, name), bool):
            raise bad(name, "must be true or false")


def _check_pool(c: PipelineConfig, bad: _Bad) -> None:
    lo_hi = c.actors
    if not (isinstance(lo_hi, tuple) and len(lo_hi) == 2 and all(is_int(a) for a in lo_hi)
            and 1 <= lo_hi[0] <= lo_hi[1]):  # fmt: skip
        raise bad("actors", "must be (min, max) integers with 1 <= min <= max")
    if not is_num(c.actor_cpus) or not c.actor_cpus > 0:  # NaN too
        raise bad("actor_cpus", "must be a number > 0")


def _check_follow(c: PipelineConfig, bad: _Bad) -> None:
    if not is_num(c.follow_wait) or not 0 < c.follow_wait < 1:
        raise bad("follow_wait", "must be a share of the trainer's time, 0 < wait < 1")
    for name in ("follow_period_s", "follow_shrink_s"):
        if not is_num(getattr(c, name)) or not 0 < getattr(c, name) < 3600:
            raise bad(name, "must be seconds, 0 < s < 3600")
    if c.follow_period_s > c.follow_shrink_s:
        raise bad("follow_period_s", f"must be <= follow_shrink_s={c.follow_shrink_s!r}")


def _check_augment(c: PipelineConfig, bad: _Bad) -> None:
    if not is_pair(c.scale) or not 0 < c.scale[0] <= c.scale[1] <= 1:
        raise bad("scale", "must be (lo, hi) with 0 < lo <= hi <= 1")
    if not is_pair(c.ratio) or not 0 < c.ratio[0] <= c.ratio[1]:
        raise bad("ratio", "must be (lo, hi) with 0 < lo <= hi")


def _check_user_code(c: PipelineConfig, bad: _Bad) -> None:
    resolve_callable(c.transform, "transform")
    resolve_callable(c.collate, "collate")


def _check_cache(c: PipelineConfig, bad: _Bad) -> None:
    """The decoded cache's fields; a cache directory must be writable before any work."""
    if c.cache is not None and c.cache not in CACHE:
        raise bad("cache", f"must be one of {CACHE} or None")
    if not is_int(c.cache_max_side) or c.cache_max_side < 1:
        raise bad("cache_max_side", "must be an integer >= 1 (pixels of the short side)")
    if c.cache_budget is not None and (not is_int(c.cache_budget) or c.cache_budget < 1):
        raise bad("cache_budget", "must be an integer >= 1 (bytes per node), or None")
    if c.cache_dir is not None and (not isinstance(c.cache_dir, str) or not c.cache_dir):
        raise bad("cache_dir", "must be a directory path, or None")
    if c.cache_encoding not in ("raw", "jpeg"):
        raise bad("cache_encoding", "must be 'raw' (the pixels as they are) or 'jpeg'")
    if c.cache is None:
        return
    if c.image_column is None or c.decode == "gpu" or c.transform_batch:
        raise bad("cache", "keeps decoded images: it needs image_column, decode='cpu' and a "
                  "per-sample transform (or none)")  # fmt: skip
    _check_cache_size(c, bad)
    if c.cache == "disk":
        _check_cache_dir(c, bad)


def _check_cache_size(c: PipelineConfig, bad: _Bad) -> None:
    if c.cache_max_side < c.image_size:  # once per place that makes such a config
        warnings.warn(f"PipelineConfig.cache_max_side={c.cache_max_side} is below image_size="
                      f"{c.image_size}: every crop, a held-out center crop too, is scaled up "
                      "from the capped image", stacklevel=6)  # fmt: skip
    rows, side, block = c.rows_per_block or c.batch_size, c.cache_max_side, cache_block(c)
    budget, default = c.cache_budget, ""
    if budget is None and c.cache == "disk":  # a memory cache's default: checked on the node
        budget, default = DISK_BUDGET, f"the default, {DISK_BUDGET} bytes with cache='disk', "
    if budget is not None and budget < block:
        raise bad("cache_budget", f"{default}is below one block: {rows} rows of {side}x{side}x3 "
                  f"bytes in {CACHE_BLOCK}-byte pages = {block} bytes")  # fmt: skip


def cache_block(c: PipelineConfig) -> int:
    """Bytes one block of capped images takes in the cache (square ones: a 4:3 photo capped
    at its short side takes a third more)."""
    side = c.cache_max_side
    return (
        (c.rows_per_block or c.batch_size)
        * -(-(3 * side * side + CACHE_HEADER) // CACHE_BLOCK)
        * CACHE_BLOCK
    )


def _check_cache_dir(c: PipelineConfig, bad: _Bad) -> None:
    """``cache_dir`` (made where it is missing) can be written: checked on this node,
    without writing anything."""
    import os

    if c.cache_dir is None:
        raise bad("cache_dir", "must be a node-local directory with cache='disk'")
    existing = os.path.expanduser(c.cache_dir)
    if not os.path.isabs(existing):  # a worker would find it under its own folder
        raise bad("cache_dir", "must be an absolute path (or start with ~): every node's "
                  "workers resolve it, each in its own working folder")  # fmt: skip
    while not os.path.isdir(existing) and existing != os.path.dirname(existing):
        if os.path.exists(existing):
            raise bad("cache_dir", f"{existing} is not a directory")
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise bad("cache_dir", f"cannot be written ({existing} is not writable)")
