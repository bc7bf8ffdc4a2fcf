"""The rank iterator's collate: a numpy batch of exact size in, the trainer's batch out.

Without a user transform every column is numeric and becomes a zero-copy tensor. A user
transform's array fields (one array per row where their shapes vary) are padded to the
batch's maximum shape with a ``<field>_mask`` in every batch; strings and other objects
(arrays of strings too) become lists. A user ``collate`` replaces it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from raypipe.config import resolve_callable

__all__ = ["collate_for", "holding_dtype", "pad_collate"]
assert __all__ == sorted(__all__)

NUMBERS = "biufc"  # the dtype kinds a column of which becomes a tensor


def collate_for(config) -> Callable | None:
    """The rank iterator's collate for a `PipelineConfig`: its own, `pad_collate` when it
    has a transform or its samples no image, else None (zero-copy tensors)."""
    if config.decode == "gpu":  # payloads stay on the host for the device decode
        from raypipe.loader.devicedecode import collate_encoded

        return collate_encoded
    own = resolve_callable(config.collate, "collate")
    if own is not None or (config.transform is None and config.image_column is not None):
        return own
    if config.image_column is None and not config.pack:  # packed rows: tokens, no padding
        return _fields_collate
    image_rows = config.transform is not None and config.image_column is not None
    return _transform_collate if image_rows else pad_collate  # packed rows: as they are


def pad_collate(batch: dict[str, np.ndarray], *, pad_value: int = 0,
                masks: bool = False) -> dict[str, Any]:  # fmt: skip
    """The default collate: numeric columns as tensors; a column of arrays (ragged) padded
    to the batch's maximum shape with ``<field>_mask``, of the padded field's own shape
    and True where the row has data (so a field's mask has one layout in every batch,
    whichever of its axes the batch's rows differ in); any other column (strings, dicts)
    as a list. ``masks``: a column of arrays that came stacked (every row of the block one
    shape) gets its all-True mask too."""
    import torch

    out: dict[str, Any] = {}
    for field, column in batch.items():
        if column.dtype.kind in NUMBERS:
            with warnings.catch_warnings():  # Ray's arrays may be read-only views
                warnings.filterwarnings("ignore", message=".*not writable.*")
                out[field] = torch.from_numpy(np.ascontiguousarray(column))
            if masks and column.ndim > 1:  # as `_pad` masks rows of one shape
                out[f"{field}_mask"] = torch.ones(column.shape, dtype=torch.bool)
        elif len(column) and all(isinstance(v, np.ndarray) and v.dtype.kind in NUMBERS
                                 for v in column):  # fmt: skip
            out[field], out[f"{field}_mask"] = _pad(field, list(column), pad_value)
        else:  # strings, dicts, arrays of strings
            out[field] = list(column)
    return out


def _transform_collate(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """A transform's rows: every array field but ``image`` with its mask in every batch, as
    `_fields_collate` gives them (a field stacked in the first blocks, one shape there, came
    without one until a batch's rows differed)."""
    image = pad_collate({k: v for k, v in batch.items() if k == "image"})
    return {**image, **pad_collate({k: v for k, v in batch.items() if k != "image"}, masks=True)}


def _fields_collate(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """Samples with no image: every array field with its mask, in every batch (Ray's block
    conversion stacks a block whose rows share a shape, which then came without one)."""
    return pad_collate(batch, masks=True)


def _pad(field: str, arrays: list[np.ndarray], pad_value: int):
    """The rows in one array of the type that holds them all (rows of two actors can differ:
    uint16 and int32 token ids, int and float), and their mask."""
    import torch

    if len({a.ndim for a in arrays}) > 1:
        ndims = sorted({a.ndim for a in arrays})
        raise ValueError(f"field {field!r} has rows of {ndims} dimensions in one batch (mono "
                         "and stereo clips?): make every row's dimensions the same")  # fmt: skip
    top = tuple(np.array([a.shape for a in arrays]).max(axis=0))
    dtype = holding_dtype(field, arrays)
    padded = np.full((len(arrays), *top), pad_value, dtype=dtype)
    mask = np.zeros(padded.shape, bool)
    for i, a in enumerate(arrays):
        index = (i, *(slice(0, n) for n in a.shape))
        padded[index] = a
        mask[index] = True
    return torch.from_numpy(padded), torch.from_numpy(mask)


def holding_dtype(field: str, arrays: list[np.ndarray]) -> np.dtype:
    """The rows' common type, empty rows left out (an empty list has no type of its own:
    numpy makes it float64); int64 for signed and unsigned integers where the unsigned
    values fit it (numpy's common type of int64 and uint64 is float64, exact to 2**53)."""
    full = [a for a in arrays if a.size] or arrays
    dtypes = {a.dtype for a in full}
    dtype = np.result_type(*dtypes)
    if dtype.kind == "f" and all(d.kind in "biu" for d in dtypes):
        top = max((int(a.max()) for a in full if a.dtype.kind == "u" and a.size), default=0)
        if top > np.iinfo(np.int64).max:
            raise ValueError(f"field {field!r} has unsigned values up to {top} and signed ones "
                             "in one batch: no integer type holds both; give them one type")  # fmt: skip
        dtype = np.dtype(np.int64)
    return dtype
