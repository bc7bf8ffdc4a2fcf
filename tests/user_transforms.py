"""Transforms the user-transform tests run in the actors (importable, so they pickle by
reference). They have the interface of torchvision v2 / albumentations callables: a sample
in, a dict of fields out, randomness from the global generators."""

from __future__ import annotations

import contextlib
import os
import random
import time
from pathlib import Path

import albumentations as A
import numpy as np
import torch


def small(image: np.ndarray, size: int = 8) -> np.ndarray:
    """Nearest-neighbour resize of an H×W(×C) array to size×size."""
    h, w = image.shape[:2]
    return image[np.arange(size) * h // size][:, np.arange(size) * w // size]


def noisy(sample: dict) -> dict:
    """Draws from torch's, NumPy's and Python's global generators."""
    image = small(sample["image"])
    draws = np.array([torch.rand(()).item(), np.random.rand(), random.random()])
    return {"image": image.transpose(2, 0, 1).copy(), "label": sample["label"], "draws": draws}


def with_mask(sample: dict) -> dict:
    """Image and its ``mask.png`` member (``mask``), both flipped together half the time."""
    image, mask = small(sample["image"]), small(sample["mask"])
    if torch.rand(()) < 0.5:
        image, mask = image[:, ::-1], mask[:, ::-1]
    return {"image": torch.from_numpy(image.transpose(2, 0, 1).copy()),
            "mask": mask.copy(), "meta": sample["json"]["source"]}  # fmt: skip


def tokens(sample: dict) -> dict:
    """A variable-length output: key % 5 + 1 token ids."""
    n = sample["key"] % 5 + 1
    return {"tokens": np.arange(n, dtype=np.int64) + 100 * sample["key"], "label": sample["label"]}


def fails_on_every_20th(sample: dict) -> dict:
    if sample["key"] % 20 == 0:
        raise RuntimeError("augmentation failed")
    return {"label": sample["label"]}


def dtype_changes_at_7(sample: dict) -> dict:
    value = np.float32(1.0) if sample["key"] == 7 else np.int64(1)
    return {"value": value}


def batch_mean(batch: dict) -> dict:
    """A per-batch transform: lists in, one value per row out."""
    return {"mean": [float(np.mean(im)) for im in batch["image"]], "label": batch["label"]}


def torch_input(sample: dict) -> dict:
    image = sample["image"]
    assert isinstance(image, torch.Tensor) and image.shape[0] == 3 and image.dtype == torch.uint8
    return {"shape": torch.tensor(image.shape), "label": sample["label"]}


def sum_collate(batch: dict) -> dict:
    return {"label_sum": int(batch["label"].sum()), "key": torch.from_numpy(batch["key"])}


COLLATED = [0]  # fails_once_collate's calls in this process


def fails_once_collate(batch: dict) -> dict:
    """A collate whose first call fails: a bug of the loop's own, not the pool's."""
    COLLATED[0] += 1
    if COLLATED[0] == 1:
        raise RuntimeError("a collate bug")
    return {"key": torch.from_numpy(batch["key"])}


def label_sum_collate(batch: dict) -> dict:
    """A collate that keeps no ``key``."""
    return {"label_sum": int(batch["label"].sum())}


# An albumentations pipeline as it is: called with keyword targets, seeded per sample
# through its own generator (set_random_seed).
ALBU = A.Compose([A.RandomResizedCrop(size=(8, 8)), A.HorizontalFlip(), A.ColorJitter()])


STALL_KEY = 5  # the sample whose task is in flight when its actor is killed


def stall_once(folder: str, sample: dict) -> dict:
    """tests/elastic_driver.py's actor-kill epoch: a tiny subsample of the image. For `STALL_KEY` it
    appends this process's id to ``folder``/attempts and, on the first attempt only, blocks
    until its actor is killed: that task is in flight when the kill comes. Every call
    appends its node's id to ``folder``/nodes (where preprocessing ran)."""
    import ray

    with open(Path(folder) / "nodes", "a") as f:
        f.write(f"{ray.get_runtime_context().get_node_id()}\n")
    if sample["key"] == STALL_KEY:
        attempts = Path(folder) / "attempts"
        with open(attempts, "a") as f:
            f.write(f"{os.getpid()}\n")
        if len(attempts.read_text().split()) == 1:
            time.sleep(300)
    image = np.ascontiguousarray(sample["image"][::64, ::64].transpose(2, 0, 1))
    return {"image": image, "label": sample["label"]}


def after_actors(folder: str, count: int, sample: dict) -> dict:
    """A tiny subsample of the image, once ``count`` processes have run this (for at most
    60 s in all): a lone actor's tasks wait, so the pool grows, whatever else ran before."""
    pids = Path(folder) / "pids"
    with open(pids, "a") as f:
        f.write(f"{os.getpid()}\n")
    start = Path(folder) / "start"  # one minute from the first call, for all of them
    with contextlib.suppress(FileExistsError), open(start, "x") as f:
        f.write(str(time.time()))
    deadline = float(start.read_text() or time.time()) + 60
    while len(set(pids.read_text().split())) < count and time.time() < deadline:
        time.sleep(0.05)
    image = np.ascontiguousarray(sample["image"][::64, ::64].transpose(2, 0, 1))
    return {"image": image, "label": sample["label"]}


def shifted_ids(sample: dict) -> dict:
    """A token sample's ids plus one, and their count (samples with no image)."""
    ids = np.asarray(sample["tokens"], dtype=np.int64) + 1
    return {"ids": ids, "length": len(ids), "label": sample["label"]}


AUDIO_FRAMES = 400  # what `cropped_audio` keeps of every clip


def cropped_audio(sample: dict) -> dict:
    """The first `AUDIO_FRAMES` samples of a decoded audio member, and its rate."""
    return {"audio": sample["audio"][:AUDIO_FRAMES].copy(), "rate": sample["sample_rate"],
            "label": sample["label"]}  # fmt: skip


def image_shape(sample: dict) -> dict:
    """The height and width of the image the transform got, and its pixel sum."""
    image = sample["image"]
    return {"hw": np.array(image.shape[:2], np.int64), "total": np.int64(image.sum())}


def returns_none_at_2(sample: dict) -> dict | None:
    """Breaks the contract for one key: a transform must return a dict."""
    return None if sample["key"] == 2 else {"label": sample["label"]}
