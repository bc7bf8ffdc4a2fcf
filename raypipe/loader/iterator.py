"""The per-rank iterator: Ray blocks in, equal exact-size torch batches out.

A straight line of iterator-to-iterator stages, each testable alone::

    1. host_batches   a Dataset's blocks read directly (raypipe.loader.blocks), or Ray's
                      iter_batches for a split's iterator
    2. rebatch        exactly ``batch_size`` rows per batch, whatever Ray yields (or the
                      rank's seeded local shuffle, ``raypipe.loader.shuffle``)
    3. collate        numpy → torch on the host (``pad_collate`` unless told: numeric
                      columns without a copy, ragged rows padded, strings as lists)
    4. to_device      pinned ring slot → copy on a side CUDA stream (``raypipe.loader.h2d``);
                      nothing on a CPU device: the batch is already where it is read
    5. normalize      uint8 → float32, (x - mean) / std, on the device

In flight at once: ``prefetch_batches`` Ray batches in step 1's threads, one partial
batch in step 2, up to ``prefetch_batches`` device batches queued by step 4's thread
(which runs steps 1-4), one batch in the consumer's hands.

Step 2 is what keeps DDP from hanging: ranks with the same number of rows do not get the
same blocks, and Ray's own batcher can cut short batches mid-stream (Ray issue 66085), so
batch *counts* would differ between ranks. Re-batching here makes the count
``rows // batch_size`` on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from raypipe.config import LoaderConfig, PipelineConfig
from raypipe.loader.blocks import dataset_columns
from raypipe.loader.collate import collate_for, pad_collate
from raypipe.loader.device import normalize, resolve_device
from raypipe.loader.errors import quiet_ray_data_aborts, raising_ours
from raypipe.loader.h2d import HostToDevice
from raypipe.loader.rebatch import rebatch
from raypipe.loader.shuffle import shuffled
from raypipe.loader.stats import Delivered, IterStats
from raypipe.preprocess.cache import node as node_cache

Batch = dict[str, Any]


def iter_torch_batches(
    source,
    config: PipelineConfig | LoaderConfig | None = None,
    *,
    skips=None,
    watch=None,
    collate=None,
    **settings: Any,
) -> TorchBatches:
    """Iterate ``source`` (a ``ray.data.DataIterator`` or ``Dataset``) as torch batches.

    ``config``: a `raypipe.PipelineConfig` (its ``loader`` settings, its ``collate``, and
    the device step of ``decode="gpu"``) or a `raypipe.config.LoaderConfig`. Keyword
    ``settings`` override it, by `LoaderConfig` field: ``batch_size`` (required without a
    config), ``device``, ``pin_memory``, ``prefetch_batches``, ``drop_last``, ``normalize``,
    ``mean``, ``std``, ``shuffle_buffer``, ``shuffle_seed``, ``channels_last``.

    Yields dicts: ``image`` (float32 N×C×H×W normalized, or uint8 with
    ``normalize=False``) on the device, ``label`` and ``key`` (int64). ``collate`` turns each
    exact-size numpy batch into the batch (its tensors then move to the device); without
    one, the config's, else `raypipe.loader.collate.pad_collate` (strings as lists; a column
    whose rows differ in shape padded, with its ``<field>_mask``: a batch whose rows share
    a shape has no mask). Each pass over the returned object is one epoch of ``source``;
    ``.stats()`` and ``.state_dict()`` describe the current pass. ``stats()["skipped"]``
    counts skipped samples per reason from ``skips``, the `raypipe.SkipLog` the dataset was
    built with;
    ``stats()["pool"]`` is the summary of ``watch``, a started `raypipe.PoolWatch`;
    ``stats()["cache"]``, with a ``config`` whose decoded cache is on, its counts over the
    nodes (as `raypipe.Pipeline`'s).
    """
    if not hasattr(source, "iter_batches"):
        raise TypeError(
            f"source must be a ray.data.DataIterator or Dataset, got {type(source).__name__}"
        )
    loader = loader_config(config, settings)
    pipeline = config if isinstance(config, PipelineConfig) else None
    if pipeline is not None and (pipeline.pack or pipeline.bucket_by):
        field = "pack" if pipeline.pack else "bucket_by"
        raise ValueError(f"PipelineConfig.{field}={getattr(pipeline, field)!r}: packing and "
                         "bucketing run in raypipe.Pipeline and train_ddp, which plan each "
                         "rank's rows; iter_torch_batches re-batches only")  # fmt: skip
    device, device_map = resolve_device(loader.device), None
    if pipeline is not None and pipeline.decode == "gpu":
        from raypipe.loader.devicedecode import collate_encoded, device_map_for

        collate, device_map = collate_encoded, device_map_for(pipeline, device, skips)
    elif collate is None and pipeline is not None:
        collate = collate_for(pipeline)
    loader = loader.replace(device=device)
    more_stats = None
    if pipeline is not None and pipeline.cache:  # the decoded cache's counts, as Pipeline's
        more_stats = lambda base: {"cache": node_cache.stats(pipeline)}  # noqa: E731
    return TorchBatches(
        functools.partial(_ray_host, source, loader),
        loader,
        skips=skips,
        watch=watch,
        more_stats=more_stats,
        collate=collate,
        device_map=device_map,
    )


def loader_config(config, settings: dict[str, Any]) -> LoaderConfig:
    """``config``'s loader settings (a PipelineConfig's, a LoaderConfig, or the defaults
    with ``batch_size`` required), with ``settings`` over them."""
    known = {f.name for f in dataclasses.fields(LoaderConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(
            f"iter_torch_batches() got unknown settings {unknown}; known: {sorted(known)}"
        )
    if isinstance(config, PipelineConfig):
        base = config.loader
    elif isinstance(config, LoaderConfig):
        base = config
    elif config is None:
        if settings.get("batch_size") is None:
            raise TypeError("iter_torch_batches() needs batch_size= or a config")
        base = LoaderConfig(batch_size=settings["batch_size"])
    else:
        raise TypeError(
            f"config must be a PipelineConfig or LoaderConfig, got {type(config).__name__}"
        )
    return base.replace(**{k: v for k, v in settings.items() if v is not None})


def _ray_host(source, loader: LoaderConfig, epoch: int) -> Iterator[dict[str, np.ndarray]]:
    """Steps 1-2 of ``epoch`` over a Ray source, re-cut to exactly ``batch_size`` rows: a
    Dataset's blocks read directly (`raypipe.loader.blocks`), else Ray's batches (a split's
    iterator); drawn through the local shuffle buffer when there is one, a new order each
    epoch (the same for the same ``shuffle_seed``)."""
    import ray.data

    size, buffer = loader.batch_size, loader.shuffle_buffer
    if isinstance(source, ray.data.Dataset):
        host = dataset_columns(source)
    else:  # whole blocks when shuffling: the buffer does the batching
        host = host_batches(source, None if buffer else size, loader.prefetch_batches)
    if buffer:
        seed = loader.shuffle_seed
        rng = np.random.default_rng(None if seed is None else [seed, epoch, 0xB0F])
        return shuffled(raising_ours(host), size, buffer, rng, drop_last=loader.drop_last)
    return rebatch(raising_ours(host), size, drop_last=loader.drop_last)


class TorchBatches:
    """Iterable returned by `iter_torch_batches`; owns the running pass and its stats.

    ``host(epoch)`` starts steps 1-2 of a pass: exact-size numpy batches on the host.
    ``more_stats(stats)``, when given, adds its entries to `stats`.
    """

    def __init__(self, host, loader: LoaderConfig, *, skips=None, watch=None, more_stats=None,
                 first_pass=0, collate=None, device_map=None, h2d=None):  # fmt: skip
        device, channels_last = loader.device, loader.channels_last  # the device resolved
        self._host = host
        self._collate = collate or pad_collate
        self._device_map = device_map  # on the device after the copy (decode="gpu")
        self._device = device
        self._normalize = (loader.mean, loader.std) if loader.normalize else None
        self._channels_last = channels_last
        # ``h2d``: an earlier pass's ring, slots and copy stream, reused (allocations made
        # for one stream's pool are not reused by another's: a new stream per epoch costs new
        # device segments every epoch)
        self.h2d = h2d or HostToDevice(device, pin_memory=loader.pin_memory,
                                       channels_last=channels_last,
                                       prefetch=max(loader.prefetch_batches, 1))  # fmt: skip
        self._stays = getattr(device, "type", str(device)) == "cpu" and not channels_last
        self._stats = IterStats()
        self._delivered = Delivered()  # keys handed to the consumer this pass
        self._epoch = first_pass - 1  # the epoch number of the running or last pass
        self._passes = 0
        self._running: Iterator[Batch] | None = None
        self._more_stats = more_stats
        self.skips = skips  # the source's raypipe.SkipLog, or None
        self.watch = watch  # a raypipe.PoolWatch (its owner closes it), or None

    @property
    def device(self):
        return self._device

    @property
    def epoch(self) -> int:
        """The running or last pass's epoch; before the first, the first's."""
        return self._epoch if self._passes else self._epoch + 1

    def __iter__(self) -> Iterator[Batch]:
        self.close()
        self._epoch, self._passes = self._epoch + 1, self._passes + 1
        self._stats = IterStats()
        self._delivered = Delivered()
        self._running = self._pass()
        return self._running

    def _pass(self) -> Iterator[Batch]:
        # 1 → 5: the straight line described in the module docstring.
        exact = self._delivered.track(self._host(self._epoch))
        tensors = (self._collate(b) for b in exact)
        if self._stays:
            device_map = self._device_map
            on_device = _Stay(tensors if device_map is None else (device_map(b) for b in tensors))
        else:
            on_device = self.h2d(tensors, finish=self._device_map)
        if self._normalize:
            mean, std = self._normalize
            out = (normalize(b, mean, std, channels_last=self._channels_last) for b in on_device)
        else:
            out = on_device
        stats = self._stats
        stats.start()
        with on_device:  # step 4's thread ends with the pass, however it ends
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(out)
                except StopIteration:
                    stats.end()  # a stats() after the loop's eval is the pass's own
                    return
                waited = time.perf_counter() - t0
                stats.waited(waited, self._delivered.pop())  # a collate may drop "key"
                yield batch

    def stats(self) -> dict[str, Any]:
        skipped = self.skips.counts() if self.skips is not None else {}
        pool = {"pool": self.watch.summary()} if self.watch is not None else {}
        base = {"epoch": self.epoch, **self._stats.as_dict(), "skipped": skipped, **pool}
        return {**base, **self._more_stats(base)} if self._more_stats is not None else base

    def state_dict(self) -> dict[str, Any]:
        """The pass so far; ``keys`` (int64) are those delivered, for `raypipe.train.state`."""
        return {
            "epoch": self.epoch,
            "batches": self._stats.batches,
            "samples": self._stats.samples,
            "keys": self._delivered.keys(),
        }

    def close(self) -> None:
        """Stop the running pass (Ray's prefetch threads end with it)."""
        if self._running is not None:
            self._running.close()
            self._running = None

    def __enter__(self) -> TorchBatches:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def host_batches(source, batch_size: int | None, prefetch: int) -> Iterator[dict[str, np.ndarray]]:
    """Step 1: numpy batches from Ray, sizes only approximately ``batch_size`` (None: whole
    blocks)."""
    quiet_ray_data_aborts()  # an execution of this process: its error is raised as itself
    return source.iter_batches(
        batch_size=batch_size, batch_format="numpy", prefetch_batches=prefetch, drop_last=False
    )


class _Stay:
    """Step 4 when the device is the host CPU: no ring, no copy; closes upstream on exit.

    With ``normalize=False`` the images may view the object store's read-only memory.
    """

    def __init__(self, batches: Iterator[Batch]):
        self._batches = batches

    def __iter__(self) -> _Stay:
        return self

    def __next__(self) -> Batch:
        return next(self._batches)

    def __enter__(self) -> _Stay:
        return self

    def __exit__(self, *exc) -> None:
        self._batches.close()
