"""The preprocessing actor: shard rows in, blocks of finished samples out.

```
 task: shard rows {path, first_key, num_samples, label, done} of one epoch
       (`raypipe.plan.shards.shard_row`; a run-long dataset's task id names its epoch and
       rows through `raypipe.plan.ranktasks.RankTasks`)
   ▼ read the shard (raypipe.formats) → decode + crop, or the user's transform
     (with ``config.cache``: the capped image from the node's cache, or decoded and kept
     there: `raypipe.preprocess.cache`)
 blocks of ``rows_per_block`` rows {image uint8 N×3×S×S, label int64, key int64}
   (a run-long dataset's blocks also carry ``epoch``)
```

Reading is fused with decoding inside the actors, so raw bytes never cross the object
store; only finished uint8 images do.

A bad sample never becomes a row. ``on_error="skip"``: the actor drops it and sends
(key, where, reason) to the dataset's `SkipLog` before yielding the next block, so a
rank's rows are good ones only (the ledger keeps the ranks' batch counts equal).
``on_error="raise"``: the actor raises `SampleError` naming the file.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np

from raypipe.config import PipelineConfig
from raypipe.formats import get_format
from raypipe.formats.sample import RawSample
from raypipe.plan.ranktasks import RankTasks
from raypipe.plan.shards import Reader, unpack_done
from raypipe.preprocess.augment import Plan, sample_plan
from raypipe.preprocess.cache import mapped
from raypipe.preprocess.cache.capped import Stored
from raypipe.preprocess.cache.reuse import SampleCache
from raypipe.preprocess.decode import crop_chw, decode_crop
from raypipe.preprocess.encoded import Encoded, EncodedBlocks
from raypipe.preprocess.imageblocks import ImageBlocks, Reused
from raypipe.preprocess.samples.fields import sample_map
from raypipe.preprocess.usermap import TransformOutputError
from raypipe.preprocess.userrows import RowBuilder, Schema
from raypipe.skips.budget import check_budget
from raypipe.skips.log import SkipLog
from raypipe.skips.records import BadSample, SampleError, SkipRecord, detail_of, reason_of

__all__ = ["Preprocessor", "RankPreprocessor", "preprocess_task"]
assert __all__ == sorted(__all__)

log = logging.getLogger(__name__)

LOGGED_SKIPS = 20  # per actor; the SkipLog has them all
SKIPS_PER_SEND = 1024  # records an actor holds at most before sending them
ACTOR_NICE = 10  # how much lower an actor's CPU priority is than the trainer's


def preprocess_task(batch: dict[str, np.ndarray], **kwargs) -> Iterator[dict[str, np.ndarray]]:
    """`Preprocessor` as a plain Ray task (``build_dataset`` with ``compute="tasks"``): on
    Ray's pooled workers, which outlive the run, so each task first lets go of the memory
    caches released since this worker's last (`mapped.Mappings.drop_cleared`)."""
    mapped.PROCESS.drop_cleared()
    yield from Preprocessor(**kwargs)(batch)


class Preprocessor:
    """The map each pool actor runs: a batch of task ids (or of shard rows) in, blocks of
    images out.

    Args:
        tasks: the `RankTasks` the batch's ``id`` column names (each task its epoch and
            shard rows); None: the batch holds shard rows of ``epoch`` themselves.
        epoch: the one epoch the actor reads (`raypipe.build_dataset`), or None for a
            rank's run-long dataset, whose tasks name their own epochs: its blocks then
            carry an ``epoch`` column and its skips go to that epoch's log
            (``skips.epoch(e)``).
        samples: the epoch's samples, for the skip budget (``tasks`` knows its own).

    Every read or decode failure of one sample goes through ``_bad``, whichever decoder
    raised it (the libjpeg-turbo path or its Pillow fallback): ``"raise"`` stops with a
    `SampleError`, ``"skip"`` keeps a `SkipRecord` for ``skips``.
    """

    def __init__(self, config: PipelineConfig, reader: Reader | str, epoch: int | None = None,
                 skips: SkipLog | None = None, samples: int | None = None,
                 tasks: RankTasks | None = None, reused: Reused | None = None):  # fmt: skip
        if epoch is None and tasks is None:
            raise ValueError("epoch=None needs tasks= (each task names its epoch)")
        self.config = config
        _limit_threads(config.actor_cpus)
        _yield_to_trainers()
        self.usermap = sample_map(config)  # None: the built-in crop
        self.schema = Schema(arrays_ragged=config.image_column is None)  # every task's rows
        self.samples = samples  # the epoch's samples to read, for the skip budget
        self.reader = reader if isinstance(reader, Reader) else Reader(reader)
        self.epoch, self.tasks = epoch, tasks
        self.skips = skips
        self.skipped = 0
        self.cache = None
        if config.cache:
            whole_rows = get_format(self.reader.format).one_per_file  # labelled by the listing
            self.cache = SampleCache(config, self.reader.storage, whole_rows=whole_rows)
        self.reused = reused  # a pooled worker's block arrays (compute="tasks"), or new ones

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        if self.tasks is None:  # shard rows of self.epoch
            yield from self._blocks(batch, self.epoch, self.skips)
            return
        run_long = self.epoch is None  # else: one epoch's tasks, its own log, no epoch column
        for task in batch["id"]:
            epoch, rows = self.tasks.rows(int(task))
            skips = self.skips.epoch(epoch) if run_long and self.skips is not None else self.skips
            for block in self._blocks(rows, epoch, skips):
                if run_long:
                    block["epoch"] = np.full(len(block["key"]), epoch, dtype=np.int64)
                yield block

    def _blocks(self, shards: dict[str, np.ndarray], epoch: int, skips: SkipLog | None):
        """Blocks of ``rows_per_block`` decoded samples of ``shards`` (rows as `shard_row`
        makes them), the last one shorter; skips reach ``skips`` before the rows after them."""
        out, pending = self._builder(epoch), []
        rows = [(str(path), int(first), int(n), int(label), unpack_done(done, int(n)))
                for path, first, n, label, done in zip(
                    shards["path"], shards["first_key"], shards["num_samples"],
                    shards["label"], shards["done"], strict=True)]  # fmt: skip
        if self.cache is not None:
            raws = self.cache.raws(rows, self._samples)
        else:
            raws = (raw for row in rows for raw in self._samples(*row))
        try:
            for raw in raws:
                try:
                    item = self._decode(raw, epoch)
                except TransformOutputError:  # the transform broke its contract: the run stops
                    raise
                except Exception as e:  # any read, decode or transform failure: a bad sample
                    pending.append(self._bad(raw, e))
                    if len(pending) >= SKIPS_PER_SEND:  # a shard of nothing but bad rows
                        self._flush(pending, skips, epoch)
                    continue
                if out.add(item, raw):
                    yield from self._take(out, pending, skips, epoch)
        finally:  # a task that stops (an error, the skip budget, a cancel) settles too
            if self.cache is not None:
                self.cache.flush()
        if len(out):
            yield from self._take(out, pending, skips, epoch)
        self._flush(pending, skips, epoch)

    def _builder(self, epoch: int):
        rows = self.config.rows_per_block or self.config.batch_size
        if self.usermap is None:
            if self.config.decode == "gpu":
                return EncodedBlocks(self.config.image_size, rows)
            return ImageBlocks(self.config.image_size, rows, self.reused)
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
        if self.cache is not None:  # the capped image: cached, or decoded and kept
            rgb = self.cache.image(raw)
            if self.usermap is not None:
                return self.usermap(raw, epoch, image=self.cache.whole(rgb))
            if isinstance(rgb, Stored):  # a JPEG: decoded here, only what the crop reads
                rgb, p = self.cache.region(rgb, self._plan(rgb.width, rgb.height, epoch, raw.key))
            else:
                p = self._plan(rgb.shape[1], rgb.shape[0], epoch, raw.key)
            return crop_chw(rgb, p, self.config.image_size)
        if raw.reason is not None:
            raise BadSample(raw.reason, raw.error or raw.reason)
        if not raw.data and self.config.image_column is not None:  # else: fields, no image
            raise BadSample("empty_file", "zero bytes")
        if self.usermap is not None:  # a row of the user's fields; per batch: later
            return None if self.usermap.per_batch else self.usermap(raw, epoch)
        choose = lambda w, h: self._plan(w, h, epoch, raw.key)  # noqa: E731
        if self.config.decode == "gpu" and (encoded := Encoded.of(raw.data, choose)) is not None:
            return encoded  # the rank decodes it on its device, with this plan
        return decode_crop(raw.data, self.config.image_size, choose)

    def _plan(self, width: int, height: int, epoch: int, key: int) -> Plan:
        """The crop plan of ``key``; refuses an image with too many pixels before it is
        decoded."""
        c, limit = self.config, self.config.max_image_pixels
        if limit is not None and width * height > limit:
            raise BadSample(
                "decompression_bomb",
                f"{width}x{height} = {width * height} pixels > max_image_pixels={limit}",
            )
        return sample_plan(c.seed, epoch, key, width, height, train=c.train, scale=c.scale,
                           ratio=c.ratio, flip=c.flip)  # fmt: skip

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
        """The samples epoch ``epoch`` reads under the skip budget."""
        return self.samples if self.tasks is None else self.tasks.samples(epoch)

    def _flush(self, pending: list[SkipRecord], skips: SkipLog | None, epoch: int) -> None:
        """Send ``pending`` to ``skips``; stop the run once the epoch's skips pass the budget
        (`SkipBudgetError`): past ``max_skipped`` of its samples, or all of them."""
        if pending and skips is not None:
            total, samples = skips.add(pending), self.epoch_samples(epoch)
            if samples is not None:
                check_budget(total, epoch=epoch, samples=samples,
                             max_skipped=self.config.max_skipped, skips=skips)  # fmt: skip
        pending.clear()


class RankPreprocessor(Preprocessor):
    """`Preprocessor` under the name a `raypipe.Pipeline`'s pool shows: Ray Data names the
    actors ``MapWorker(MapBatches(RankPreprocessor))``, which ``PoolWatch(match=...)`` and
    the process list tell apart from a `raypipe.build_dataset` pool. No behaviour of its own."""


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
