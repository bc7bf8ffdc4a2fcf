"""The device end of a rank's batches: which device they go to, and step 5 there.

`resolve_device` picks the device (``"auto"``: Ray Train's inside a Train worker, else
the CPU); `normalize` turns uint8 images into float32 ``(x/255 - mean) / std`` where they
already are, with the per-device constants made once.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["normalize", "resolve_device"]
assert __all__ == sorted(__all__)
Batch = dict[str, Any]


def normalize(batch: Batch, mean: tuple[float, ...], std: tuple[float, ...], *,
              channels_last: bool = False) -> Batch:  # fmt: skip
    """Step 5: uint8 image → float32 ``(x/255 - mean) / std``, where the image lives.

    Only the layouts it understands: uint8 N×C×H×W with C = ``len(mean)``, and, when the
    data is declared ``channels_last``, uint8 N×H×W×C (normalized in that layout). Any other
    ``image`` (a user transform's own layout, dtype or rank) passes untouched."""
    import torch

    image = batch.get("image")
    if not hasattr(image, "dtype") or image.dtype != torch.uint8 or image.dim() != 4:
        return batch
    channels = len(mean)
    if image.shape[1] == channels:
        view = (1, -1, 1, 1)
    elif channels_last and image.shape[-1] == channels:
        view = (1, 1, 1, -1)
    else:
        return batch
    scale, shift = _affine(tuple(mean), tuple(std), image.device, view)
    out = image.to(torch.float32).mul_(scale).sub_(shift)  # keeps channels_last
    return {**batch, "image": out}


@functools.lru_cache(maxsize=16)
def _affine(mean: tuple[float, ...], std: tuple[float, ...], device, view: tuple) -> tuple:
    """Scale and shift made once per device and layout: no host-to-device copy on the
    consumer's stream."""
    import torch

    scale = torch.tensor([1 / (255 * s) for s in std], device=device).view(view)
    shift = torch.tensor([m / s for m, s in zip(mean, std, strict=True)], device=device)
    return scale, shift.view(view)


def resolve_device(device):
    """``"auto"``: Ray Train's device inside a Train worker, CPU anywhere else."""
    import torch

    if device != "auto":
        return torch.device(device)
    import ray.train
    import ray.train.torch

    try:
        ray.train.get_context()
    except RuntimeError:  # not inside a Train worker
        return torch.device("cpu")
    return ray.train.torch.get_device()
