"""`LoaderConfig`: how each rank's iterator hands batches to its trainer."""

from __future__ import annotations

import dataclasses
from typing import Any

from raypipe.config.checks import is_int, is_num, python_scalars

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "LoaderConfig", "rank_loader"]
assert __all__ == sorted(__all__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """The rank iterator's settings; `raypipe.PipelineConfig.loader` makes one from a
    pipeline's fields, and `raypipe.iter_torch_batches` and `raypipe.Pipeline` take one.

    Args:
        batch_size: rows per batch on each rank.
        device: ``"auto"`` (Ray Train's device inside a Train worker, else the CPU) or a
            torch device.
        pin_memory: copy to a CUDA device through a ring of pinned host buffers.
        prefetch_batches: batches each rank holds ready ahead of the trainer.
        drop_last: leave out the last partial batch (every rank gets the same count).
        normalize: ``(x/255 - mean) / std`` as float32 on the device; else uint8.
        mean, std: per-channel normalization (0..1 scale).
        shuffle_buffer: rows in the rank's local shuffle buffer (0 = off).
        shuffle_seed: seeds that buffer, with each pass's epoch (None: unseeded).
        channels_last: images laid out as ``torch.channels_last``.
    """

    batch_size: int = 256
    device: Any = "auto"
    pin_memory: bool = True
    prefetch_batches: int = 2
    drop_last: bool = True
    normalize: bool = True
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    shuffle_buffer: int = 0
    shuffle_seed: int | None = None
    channels_last: bool = False

    def __post_init__(self) -> None:
        for name in ("mean", "std"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        python_scalars(self)
        check_loader(self, "LoaderConfig")

    def replace(self, **changes: Any) -> LoaderConfig:
        return dataclasses.replace(self, **changes)


def rank_loader(config, **overrides: Any) -> LoaderConfig:
    """A `raypipe.Pipeline` rank's settings: ``config.loader`` with the ``overrides`` that
    are not None, checked; it holds at least one batch ready (``prefetch_batches`` >= 1;
    the Dataset path's iterator takes 0)."""
    loader = config.loader.replace(**{k: v for k, v in overrides.items() if v is not None})
    if loader.prefetch_batches < 1:
        raise ValueError(f"prefetch_batches={loader.prefetch_batches} must be an integer >= 1")
    return loader


def check_loader(c, where: str) -> None:
    """The loader settings of ``c`` (a `LoaderConfig` or a `raypipe.PipelineConfig`);
    ValueError naming ``where.field`` and the value."""

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"{where}.{field}={getattr(c, field)!r}: {why}")

    if not is_int(c.batch_size) or c.batch_size < 1:
        raise bad("batch_size", "must be an integer >= 1")
    for name in ("prefetch_batches", "shuffle_buffer"):  # a Pipeline's prefetch: at least 1
        if not is_int(getattr(c, name)) or getattr(c, name) < 0:
            raise bad(name, "must be an integer >= 0")
    for name in ("pin_memory", "normalize", "channels_last", "drop_last"):
        if hasattr(c, name) and not isinstance(getattr(c, name), bool):
            raise bad(name, "must be true or false")
    _check_normalization(c, bad)
    if getattr(c, "device", "auto") != "auto" and not _is_device(c.device):
        raise bad("device", "must be 'auto' or a torch device ('cpu', 'cuda', 'cuda:1', ...)")
    seed = getattr(c, "shuffle_seed", None)
    if seed is not None and (not is_int(seed) or seed < 0):
        raise bad("shuffle_seed", "must be an integer >= 0, or None")


def _check_normalization(c, bad) -> None:
    for name in ("mean", "std"):
        value = getattr(c, name)
        if not (isinstance(value, tuple) and len(value) == 3 and all(is_num(v) for v in value)):
            raise bad(name, "must be three numbers, one per RGB channel")
    if any(s <= 0 for s in c.std):
        raise bad("std", "must be > 0 in every channel")


def _is_device(value: Any) -> bool:
    import torch

    try:
        torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True
