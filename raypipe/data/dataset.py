"""`build_dataset`: shards → autoscaling preprocessing actors → blocks of uint8 images.

```
 driver: list shards (dense keys) → seeded per-epoch order → small blocks of shard rows
   ▼ object store (paths, not bytes)
 actor pool (config.actors = min..max): read shard → decode + crop → yield blocks of
   ``rows_per_block`` rows {image uint8 N×3×S×S, label int64, key int64}
```

Reading is fused with decoding inside the actors, so raw bytes never cross the object
store; only finished uint8 images do.

A bad sample never becomes a row. ``on_error="skip"``: the actor drops it and sends
(key, where, reason) to the dataset's `SkipLog` before yielding the next block, so the
rows `streaming_split` divides are good ones only and every rank still gets equal
batches. ``on_error="raise"``: the actor raises `SampleError` naming the file.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from raypipe import localnode
from raypipe.config import PipelineConfig
from raypipe.data.augment import Plan, plan, sample_rng
from raypipe.data.blocksize import sized_blocks
from raypipe.data.budget import check_budget
from raypipe.data.decode import decode_crop
from raypipe.data.gpudecode import Encoded, EncodedBlocks
from raypipe.data.imageblocks import ImageBlocks
from raypipe.data.samples.fields import sample_map
from raypipe.data.shards import Listing, Reader, epoch_order, list_shards, pending_rows, unpack_done
from raypipe.data.skips import (
    BadSample,
    SampleError,
    SkipLog,
    SkipRecord,
    detail_of,
    reason_of,
)
from raypipe.data.userrows import RowBuilder, Schema
from raypipe.formats.sample import RawSample

__all__ = ["Preprocessor", "SampleError", "build_dataset"]
assert __all__ == sorted(__all__)

log = logging.getLogger(__name__)

LOGGED_SKIPS = 20  # per actor; the SkipLog has them all
SKIPS_PER_SEND = 1024  # records an actor holds at most before sending them
ACTOR_NICE = 10  # how much lower an actor's CPU priority is than the trainer's


def build_dataset(
    config: PipelineConfig,
    *,
    epoch: int = 0,
    listing: Listing | None = None,
    skips: SkipLog | None = None,
    consumed: np.ndarray | None = None,
):
    """The dataset of one epoch: rows ``image`` (uint8 C×H×W), ``label``, ``key`` (int64).

    ``listing`` lets a caller list the shards once and build many epochs from it.
    ``consumed`` (bool per key, e.g. ``PipelineState.consumed``) resumes an interrupted
    epoch: those keys are left out before their shards are read or decoded.
    Skipped samples go to ``skips``, a `SkipLog` (``SkipLog.create()``); pass the same log
    to ``iter_torch_batches(ds, config, skips=skips)`` for its counts in ``stats()``. Without
    one the dataset makes its own, for the skip budget.
    """
    import ray
    import ray.data

    if not isinstance(config, PipelineConfig):
        raise TypeError(f"config must be a PipelineConfig, got {type(config).__name__}")
    if not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"{epoch=} must be an integer >= 0")
    listing = listing or list_shards(config)
    if consumed is not None and np.shape(consumed) != (listing.num_samples,):
        raise ValueError(f"consumed has shape {np.shape(consumed)}, not ({listing.num_samples},)")
    shards = epoch_order(
        listing.shards, seed=config.seed, epoch=epoch, shuffle=config.shuffle_files
    )
    rows = pending_rows(shards, None if consumed is None else np.asarray(consumed, bool))
    lo, hi = config.actors
    if skips is None:  # after listing: a bad source fails before Ray starts
        localnode.ensure()
        skips = SkipLog.create()
    config = sized_blocks(config)  # one execution, whatever streaming_split then does
    per_task = listing.shards_per_task(config)
    ds = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // per_task)))
    kwargs = {"config": config, "reader": listing.reader, "epoch": epoch, "skips": skips,
              "samples": listing.num_samples - (0 if consumed is None else int(np.sum(consumed)))}  # fmt: skip
    if config.compute == "tasks":  # pooled workers stay warm across epochs: no pool start
        ds = ds.map_batches(preprocess_task, fn_kwargs=kwargs, batch_size=per_task,
                            batch_format="numpy", compute=ray.data.TaskPoolStrategy(size=hi),
                            num_cpus=config.actor_cpus)  # fmt: skip
    else:
        ds = ds.map_batches(
            Preprocessor,
            fn_constructor_kwargs=kwargs,
            batch_size=per_task,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(min_size=lo, max_size=hi),
            num_cpus=config.actor_cpus,
        )
    return ds


def preprocess_task(shards: dict[str, np.ndarray], **kwargs) -> Iterator[dict[str, np.ndarray]]:
    """`Preprocessor` as a plain Ray task (``PipelineConfig.compute="tasks"``)."""
    yield from Preprocessor(**kwargs)(shards)


class Preprocessor:
    """The map each pool actor runs: a batch of shard rows in, blocks of images out.

    Every read or decode failure of one sample goes through ``_bad``, whichever decoder
    raised it (the libjpeg-turbo path or its Pillow fallback): ``"raise"`` stops with a
    `SampleError`, ``"skip"`` keeps a `SkipRecord` for ``skips``.
    """

    def __init__(self, config: PipelineConfig, reader: Reader | str, epoch: int,
                 skips: SkipLog | None = None, samples: int | None = None):  # fmt: skip

        self.config = config
        _limit_threads(config.actor_cpus)
        _yield_to_trainers()
        self.usermap = sample_map(config)  # None: the built-in crop
        self.schema = Schema()  # the user transform's fields, for every task of this actor
        self.samples = samples  # the epoch's samples to read, for the skip budget
        self.reader = reader if isinstance(reader, Reader) else Reader(reader)
        self.epoch = epoch
        self.skips = skips
        self.skipped = 0

    def __call__(self, shards: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        yield from self._blocks(shards, self.epoch, self.skips)

    def _blocks(self, shards: dict[str, np.ndarray], epoch: int, skips: SkipLog | None):
        """Blocks of ``rows_per_block`` decoded samples of ``shards`` (rows as `pending_rows`
        makes them), the last one shorter; skips reach ``skips`` before the rows after them."""
        out, pending = self._builder(epoch), []
        for path, first_key, num_samples, label, done in zip(
            shards["path"], shards["first_key"], shards["num_samples"], shards["label"],
            shards["done"], strict=True,
        ):  # fmt: skip
            done = unpack_done(done, int(num_samples))
            for raw in self._samples(str(path), int(first_key), int(num_samples), int(label), done):
                try:
                    item = self._decode(raw, epoch)
                except Exception as e:  # any read, decode or transform failure: a bad sample
                    pending.append(self._bad(raw, e))
                    if len(pending) >= SKIPS_PER_SEND:  # a shard of nothing but bad rows
                        self._flush(pending, skips, epoch)
                    continue
                if out.add(item, raw):
                    yield from self._take(out, pending, skips, epoch)
        if len(out):
            yield from self._take(out, pending, skips, epoch)
        self._flush(pending, skips, epoch)

    def _builder(self, epoch: int):
        rows = self.config.rows_per_block or self.config.batch_size
        if self.usermap is None:
            blocks = EncodedBlocks if self.config.decode == "gpu" else ImageBlocks
            return blocks(self.config.image_size, rows)
        return RowBuilder(rows, self.usermap, self.schema, self._bad, epoch)

    def _take(self, out, pending: list[SkipRecord], skips: SkipLog | None, epoch: int):
        block = out.take()
        pending.extend(out.bad)  # a per-batch transform's failed batch, if any
        out.bad.clear()
        self._flush(pending, skips, epoch)  # skips reach the log before the rows after them
        if block is not None:
            yield block

    def _samples(self, path: str, first_key: int, num_samples: int, label: int, done=None):
        """The shard's samples, exactly ``num_samples`` keys whatever the reader does.

        The keys a reader does not reach (it raised, or the shard shrank since it was
        listed) are unreadable_shard samples. Keys marked in ``done`` (consumed before a
        resume) are none of them: the reader passes over them.
        """
        end, next_key = first_key + num_samples, first_key
        detail = "the shard holds fewer samples than when it was listed"
        todo = (lambda key: True) if done is None else (lambda key: not done[key - first_key])
        try:
            for raw in self.reader.read(path, first_key, label, done):
                if raw.key >= end:
                    return  # the shard grew since it was listed
                next_key = raw.key + 1
                if todo(raw.key):
                    yield raw
        except Exception as e:
            detail = f"{type(e).__name__}: {e}"
        for key in filter(todo, range(next_key, end)):
            yield RawSample(key, -1, None, f"{path}:key{key}", detail, "unreadable_shard")

    def _decode(self, raw: RawSample, epoch: int):
        if raw.reason is not None:
            raise BadSample(raw.reason, raw.error or raw.reason)
        if not raw.data and self.config.image_column is not None:  # else: fields, no image
            raise BadSample("empty_file", "zero bytes")
        if self.usermap is not None:  # a row of the user's fields; per batch: later
            return None if self.usermap.per_batch else self.usermap(raw, epoch)
        rng = sample_rng(self.config.seed, epoch, raw.key)
        choose = lambda w, h: self._plan(w, h, rng)  # noqa: E731
        if self.config.decode == "gpu" and (encoded := Encoded.of(raw.data, choose)) is not None:
            return encoded  # the rank decodes it on its device, with this plan
        return decode_crop(raw.data, self.config.image_size, choose)

    def _plan(self, width: int, height: int, rng: np.random.Generator) -> Plan:
        """The crop plan; refuses an image with too many pixels before it is decoded."""
        c, limit = self.config, self.config.max_image_pixels
        if limit is not None and width * height > limit:
            raise BadSample(
                "decompression_bomb",
                f"{width}x{height} = {width * height} pixels > max_image_pixels={limit}",
            )
        return plan(
            width, height, train=c.train, rng=rng, scale=c.scale, ratio=c.ratio, flip=c.flip
        )

    def _bad(self, raw: RawSample, error: Exception) -> SkipRecord:
        reason = reason_of(error, raw.data)
        detail = detail_of(error, raw.data)
        if self.config.on_error == "raise":
            raise SampleError(raw.where, raw.key, reason, detail) from error
        self.skipped += 1
        if self.skipped <= LOGGED_SKIPS:
            log.warning("raypipe: skipped %s (key %d): %s: %s", raw.where, raw.key, reason, detail)
        return SkipRecord(raw.key, raw.where, reason, detail)

    def epoch_samples(self, epoch: int) -> int | None:
        """The samples epoch ``epoch`` reads (over all ranks), for the skip budget."""
        return self.samples

    def _flush(self, pending: list[SkipRecord], skips: SkipLog | None, epoch: int) -> None:
        """Send ``pending`` to ``skips``; stop the run once the epoch's skips pass the budget
        (`SkipBudgetError`): past ``max_skipped`` of its samples, or all of them."""
        if pending and skips is not None:
            total, samples = skips.add(pending), self.epoch_samples(epoch)
            if samples is not None:
                check_budget(total, epoch=epoch, samples=samples,
                             max_skipped=self.config.max_skipped, skips=skips)  # fmt: skip
        pending.clear()


def _yield_to_trainers() -> None:
    """Run this pool actor at a lower CPU priority (nice +`ACTOR_NICE`): where a trainer
    shares the node, it gets the CPU its steps need and the pool the rest (epoch 0's
    read-ahead no longer slows the trainer's first steps); alone on a node, nothing
    changes."""
    import contextlib
    import os

    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return  # a task on a pooled worker (compute="tasks"), or no Ray: left as it is
    if hasattr(os, "nice"):  # an actor's process is its own: one Preprocessor, one nice
        with contextlib.suppress(OSError):
            os.nice(ACTOR_NICE)


def _limit_threads(cpus: float) -> None:
    """OpenCV's threads (and torch's, where a user transform imported it) to the CPUs
    this worker reserved, at least one.

    Both start a thread per core of the node for one resize; with one actor per reserved
    CPU those threads only contend (on a 16-core node, 14 actors would run 16 each).
    """
    import sys

    import cv2

    threads = max(1, int(cpus))
    if cv2.getNumThreads() != threads:
        cv2.setNumThreads(threads)
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
