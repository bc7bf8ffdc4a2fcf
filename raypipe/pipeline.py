"""`build_dataset`: shards → autoscaling preprocessing actors → blocks of uint8 images.

```
 driver: list shards (dense keys) → seeded per-epoch order → small blocks of shard rows
   ▼ object store (paths, not bytes)
 actor pool (config.actors = min..max): read shard → decode + crop → yield blocks of
   ``rows_per_block`` rows {image uint8 N×3×S×S, label int64, key int64}
```

Reading is fused with decoding inside the actors, so raw bytes never cross the object
store; only finished uint8 images do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from raypipe.config import PipelineConfig
from raypipe.sources import Listing, epoch_order, list_shards, read_shard
from raypipe.fastimage import decode_crop
from raypipe.transforms import plan, sample_rng

log = logging.getLogger(__name__)


class SampleError(RuntimeError):
    """A sample could not be read or decoded (``on_error="raise"``); names the file."""


def build_dataset(config: PipelineConfig, *, epoch: int = 0, listing: Listing | None = None):
    """The dataset of one epoch: rows ``image`` (uint8 C×H×W), ``label``, ``key`` (int64).

    ``listing`` lets a caller list the shards once and build many epochs from it.
    """
    import ray.data

    if not isinstance(config, PipelineConfig):
        raise TypeError(f"config must be a PipelineConfig, got {type(config).__name__}")
    if not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"{epoch=} must be an integer >= 0")
    listing = listing or list_shards(config)
    shards = epoch_order(
        listing.shards, seed=config.seed, epoch=epoch, shuffle=config.shuffle_files
    )
    per_task = config.files_per_task if listing.format == "imagefolder" else 1
    rows = [{"path": s.path, "first_key": s.first_key, "label": s.label} for s in shards]
    lo, hi = config.actors
    ds = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // per_task)))
    return ds.map_batches(
        Preprocessor,
        fn_constructor_kwargs={"config": config, "fmt": listing.format, "epoch": epoch},
        batch_size=per_task,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=lo, max_size=hi),
        num_cpus=config.actor_cpus,
    )


class Preprocessor:
    """The map each pool actor runs: a batch of shard rows in, blocks of images out."""

    def __init__(self, config: PipelineConfig, fmt: str, epoch: int):
        self.config = config
        self.fmt = fmt
        self.epoch = epoch
        self.skipped = 0

    def __call__(self, shards: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        c = self.config
        size, out = c.image_size, _BlockBuilder(c.image_size, c.rows_per_block)
        for path, first_key, label in zip(
            shards["path"], shards["first_key"], shards["label"], strict=True
        ):
            for raw in read_shard(str(path), self.fmt, int(first_key), int(label)):
                try:
                    if raw.error is not None:
                        raise ValueError(raw.error)
                    rng = sample_rng(c.seed, self.epoch, raw.key)
                    image = decode_crop(
                        raw.data,
                        size,
                        lambda w, h, rng=rng: plan(
                            w, h, train=c.train, rng=rng, scale=c.scale, ratio=c.ratio, flip=c.flip
                        ),
                    )
                except Exception as e:  # any decoder failure is a bad sample
                    self._bad(raw.where, raw.key, e)
                    continue
                if out.add(image, raw.label, raw.key):
                    yield out.take()
        if len(out):
            yield out.take()

    def _bad(self, where: str, key: int, error: Exception) -> None:
        reason = f"{type(error).__name__}: {error}"
        if self.config.on_error == "raise":
            raise SampleError(f"bad sample {where} (key {key}): {reason}") from error
        self.skipped += 1
        log.warning("raypipe: skipped bad sample %s (key %d): %s", where, key, reason)


class _BlockBuilder:
    """Fills preallocated arrays so a block is built without concatenation copies."""

    def __init__(self, size: int, rows: int):
        self.size, self.rows = size, rows
        self._reset()

    def _reset(self) -> None:
        self.image = np.empty((self.rows, 3, self.size, self.size), dtype=np.uint8)
        self.label = np.empty(self.rows, dtype=np.int64)
        self.key = np.empty(self.rows, dtype=np.int64)
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def add(self, image: np.ndarray, label: int, key: int) -> bool:
        """Append one sample; True when the block is full."""
        self.image[self.n], self.label[self.n], self.key[self.n] = image, label, key
        self.n += 1
        return self.n == self.rows

    def take(self) -> dict[str, np.ndarray]:
        n = self.n
        block = {"image": self.image[:n], "label": self.label[:n], "key": self.key[:n]}
        self._reset()
        return block
