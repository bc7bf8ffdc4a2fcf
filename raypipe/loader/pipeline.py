"""`Pipeline`: every epoch of a run, for one rank, from one warm preprocessing pool.

```
 Pipeline(config, epochs=E, rank=r, world_size=W)
   plan      RankPlan: rank r's keys of every epoch, fixed by (listing, seed, epoch, W)
   dataset   one Ray Data execution over all E epochs (raypipe.preprocess.datasets), started once:
             by ``with pipeline:`` or ``start()``, so that the pool warms up while the
             trainer builds its model, else by ``epochs()``
   feeder    one thread: blocks → epochs → exact batches → equal counts over ranks
   epochs()  yields (epoch, batches); batches are the loader's steps 3-5 (tensors,
             device copy, normalize) over the feeder's batches of that epoch
```

The same object serves a single process (``world_size=1``) and each Ray Train worker of
`raypipe.train_ddp`. With ``world_size > 1`` the ranks share an `raypipe.loader.ledger` actor
(``Pipeline.ledger(world_size)``) that keeps their batch counts equal when bad samples are
skipped. ``drop_last=False`` (evaluation: `raypipe.train.TrainContext.eval_batches`) keeps
every row: each rank's last batch of an epoch is short, batch counts may differ.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from raypipe import localnode
from raypipe.config import PipelineConfig, rank_loader
from raypipe.config.checks import check_share
from raypipe.loader.args import check_args
from raypipe.loader.blocks import execute
from raypipe.loader.buckets import Bucketing
from raypipe.loader.collate import collate_for
from raypipe.loader.demand import Demand
from raypipe.loader.device import resolve_device
from raypipe.loader.devicedecode import device_map_for
from raypipe.loader.errors import collect_failed
from raypipe.loader.feeder import Feeder
from raypipe.loader.iterator import TorchBatches
from raypipe.loader.ledger import Gate, create_ledger
from raypipe.loader.packing import Packing, documents_per_block
from raypipe.loader.progress import ProgressLine
from raypipe.loader.stats import bound
from raypipe.plan.blocksize import sized_blocks
from raypipe.plan.rankplan import RankPlan, rank_pool
from raypipe.plan.shards import Listing, list_shards
from raypipe.pool.follow import follower_for
from raypipe.preprocess.cache import node as node_cache
from raypipe.preprocess.datasets import rank_dataset
from raypipe.preprocess.tasks import rank_tasks
from raypipe.skips.log import SkipLog

__all__ = ["Pipeline"]
assert __all__ == sorted(__all__)
PROGRESS_S = 30.0  # rank 0's live progress line, by default


class Pipeline:
    """One rank's batches for a whole run; the preprocessing actors start once.

    Args:
        config: the dataset's `PipelineConfig` (batch size, seed, actors, shuffle buffer).
        epochs: the run's number of epochs.
        rank, world_size: this rank and the number of ranks (1: a single process).
        ledger: with ``world_size > 1``, the ranks' shared `Pipeline.ledger` handle.
        group: names this group of ranks in the ledger (every rank passes the same).
        device: ``"auto"`` (Ray Train's device in a worker, else CPU) or a torch device.
        pin_memory, prefetch_batches, normalize, channels_last: override ``config.loader``
            (`raypipe.config.LoaderConfig`); None keeps the config's.
        listing: the source's listing (listed once by the caller), or None to list it.
        skips: the run's `SkipLog` (one log per epoch under it), shared by all its ranks
            (`train_ddp` does so); None: a log of this rank's own. The skip budget
            (``config.max_skipped``) counts the samples of the ranks that share the log.
        start: a `raypipe.train.state.PipelineState` to resume from: its epoch leaves out
            the keys it marks consumed, and the run starts there (refused when it is of other
            data or another seed, `PipelineState.check`).
        progress_s: seconds between live progress lines on stderr (`raypipe.loader.progress`);
            None: every 30 s on rank 0 and none on the others; 0: none.
        drop_last: True: every rank the same number of ``batch_size`` batches per epoch,
            the rows beyond them dropped (training; a batch larger than a rank's share of
            the samples is refused). False: every row of the rank's share,
            the epoch's last batch short, counts per rank unequal by a batch or so, and
            no ledger needed (evaluation, where nothing may be left out). With
            ``config.pack`` the counts are equal either way, fixed by the plan
            (`raypipe.loader.packing`); ``config.bucket_by`` batches as re-batching does.

    Each rank's pool is its share of ``config.actors`` (the run's total), at least one
    actor: each bound split in whole actors over the ranks (`raypipe.plan.rankplan.rank_pool`).
    """

    def __init__(self, config: PipelineConfig, *, epochs: int, rank: int = 0,
                 world_size: int = 1, ledger=None, group: str = "", device: Any = "auto",
                 pin_memory: bool | None = None, prefetch_batches: int | None = None,
                 normalize: bool | None = None, channels_last: bool | None = None,
                 listing: Listing | None = None, skips: SkipLog | None = None, start=None,
                 progress_s: float | None = None, drop_last: bool = True):  # fmt: skip
        if not isinstance(config, PipelineConfig):
            raise TypeError(f"config must be a PipelineConfig, got {type(config).__name__}")
        loader = rank_loader(config, device=device, pin_memory=pin_memory,
                             prefetch_batches=prefetch_batches, normalize=normalize,
                             channels_last=channels_last)  # fmt: skip
        check_args(epochs=epochs, rank=rank, world_size=world_size, ledger=ledger,
                   progress_s=progress_s, skips=skips, start=start, drop_last=drop_last)  # fmt: skip
        self.config, self.num_epochs, self.rank, self.world_size = config, epochs, rank, world_size
        self.drop_last = drop_last
        self.listing = listing = listing or list_shards(config)
        if drop_last:  # a batch no rank can fill: every epoch would be empty
            check_share(config, listing.num_samples, world_size)
        if start is not None:  # the same data and seed, or the keys mean other samples
            start.check(listing, config.seed)
        self._shared_skips = skips is not None and world_size > 1
        if skips is None:
            localnode.ensure()
            skips = SkipLog.create()
        self.skips = skips
        self.config = config = sized_blocks(
            documents_per_block(config, listing), world_size=world_size,
            actors=rank_pool(config.actors, world_size, rank)[1], listing=listing,
        )  # fmt: skip
        self.first_epoch = start.epoch if start is not None else 0
        self.plan = rank_plan(config, listing, rank, world_size, start=start)
        self.loader = loader.replace(device=resolve_device(loader.device))
        self._collate = collate_for(config)
        equal = world_size > 1 and drop_last  # the ledger evens batch counts out
        self._gate = Gate(ledger if equal else None, group, rank, config.batch_size)
        self._feeder: Feeder | None = None
        self._iterated = False
        self.follower = None  # a raypipe.pool.follow.Follower once started, if the pool follows
        if progress_s is None:
            progress_s = PROGRESS_S if rank == 0 else 0
        self._progress_s, self._progress = progress_s, None

    @staticmethod
    def ledger(world_size: int):
        """The handle ``world_size`` ranks of one run share as ``ledger=`` (one run only);
        with no Ray up, raypipe's local one starts first (loopback only), as a Pipeline's."""
        localnode.ensure()
        return create_ledger(world_size)

    def epochs(self) -> Iterator[tuple[int, TorchBatches]]:
        """Yield ``(epoch, batches)`` from the first epoch to the last, once.

        ``batches`` is iterated once; what the consumer leaves of an epoch is dropped when
        the next one is asked for. Every rank gets the same number of batches per epoch
        (with ``drop_last``; without it, every row).
        """
        if self._iterated:
            raise RuntimeError("Pipeline.epochs() runs once; make a new Pipeline for a new run")
        self._iterated = True
        feeder = self.start()._feeder
        epochs = range(self.first_epoch, self.num_epochs)
        h2d = batches = None  # one ring and copy stream for the run: none new after epoch 0
        try:
            for e in epochs:
                if e > self.first_epoch:  # nodes that joined since: a decoded cache each
                    node_cache.ensure(self.config)
                skips = self.skips.epoch(e)
                batches = TorchBatches(
                    lambda _, e=e: feeder.epoch(e), self.loader, skips=skips, first_pass=e,
                    more_stats=functools.partial(self._epoch_stats, e), collate=self._collate,
                    device_map=device_map_for(self.config, self.loader.device, skips), h2d=h2d,
                )  # fmt: skip
                h2d = batches.h2d
                yield e, batches
                batches.close()
                feeder.finish(e)
        finally:
            self.close()  # the feeder first: a copy thread waiting on it then ends
            if batches is not None:
                batches.close()

    @property
    def stopped(self) -> bool:
        """Whether the pool stopped with an error its consumer was given (a data error):
        no later epoch comes (asking raises)."""
        return self._feeder is not None and self._feeder.ended is not None

    def start(self) -> Pipeline:
        """Start the run's preprocessing now (once; `epochs` and ``with`` do it too), so
        that the pool starts and the first blocks are decoded while the trainer gets
        ready: its model built, moved and wrapped."""
        if self._feeder is not None:
            return self
        epochs = range(self.first_epoch, self.num_epochs)
        demand = Demand()
        self.follower = follower_for(self.config, self.world_size, demand, self.rank)
        args = (self.config, self.listing, self.plan, epochs, self.skips)
        kwargs = {"world_size": self.world_size, "shared_skips": self._shared_skips}
        if self.config.compute == "tasks":  # plain Ray tasks on Ray's pooled workers
            start = rank_tasks(*args, **kwargs, follower=self.follower)
        else:  # a Ray Data execution over the rank's actor pool
            start = _starter(rank_dataset(*args, **kwargs), self.follower)
        self._feeder = Feeder(
            start, self.plan, self._gate, epochs,
            batch_size=self.config.batch_size, prefetch=self.loader.prefetch_batches,
            shuffle_buffer=self.config.shuffle_buffer, seed=self.config.seed, demand=demand,
            drop_last=self.drop_last, form=batch_form(self.config, self.listing, self.drop_last),
            lead=self.config.lead_batches if self._gate.ledger is not None else 0,
        )  # fmt: skip
        if self._progress_s:
            self._progress = ProgressLine(self._progress_s, rank=self.rank, demand=demand,
                                      planned=lambda e: self.plan.sizes(e)[self.rank],
                                      follower=self.follower,
                                      cache=self.cache_stats if self.config.cache else None)  # fmt: skip
        return self

    def _epoch_stats(self, epoch: int, base: dict[str, Any]) -> dict[str, Any]:
        stalls = {k: round(v, 6) for k, v in self._feeder.stalls(epoch).items()}
        return {**self._feeder.counts(epoch), "stalls": stalls,
                "bound": bound(base["wait_fraction"], stalls), **self._pool(),
                **({"cache": self.cache_stats()} if self.config.cache else {})}  # fmt: skip

    def cache_stats(self) -> dict[str, Any] | None:
        """The decoded cache's counters since its actors started (a later Pipeline of these
        settings adds to them), summed over nodes: `raypipe.preprocess.cache.store.Tally`."""
        return node_cache.stats(self.config)

    def _pool(self) -> dict[str, Any]:
        """``{"pool": ...}``: the follower's summary, or a fixed pool's size (min = max:
        Ray Data keeps it there); nothing when Ray Data sizes it or there is no pool."""
        if self.follower is not None and self.follower.in_charge:
            return {"pool": self.follower.summary()}
        lo, hi = rank_pool(self.config.actors, self.world_size, self.rank)
        if self.config.compute != "actors" or lo != hi:
            return {}
        return {"pool": {"actors": hi, "target": hi, "min": lo, "max": hi, "changes": 0}}

    def close(self) -> None:
        """Stop the feeder thread and the execution (the pool's actors end with it)."""
        if self._progress is not None:
            self._progress.close()
        if self._feeder is not None:
            self._feeder.close()

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, kind, error, tb) -> None:
        self.close()
        if self._feeder is not None and self._feeder.failed and error is not None:
            collect_failed(error)  # what the error's way out released: the pool's actors


def rank_plan(config: PipelineConfig, listing: Listing, rank: int, world_size: int, *,
              start=None) -> RankPlan:  # fmt: skip
    """The `RankPlan` of ``rank`` of ``world_size`` for ``config`` (unsized: for its keys
    and sizes), resumed at ``start`` (a `raypipe.train.state.PipelineState`, or None)."""
    return RankPlan.of(
        listing, seed=config.seed, shuffle=config.shuffle_files, rank=rank,
        world_size=world_size, per_task=config.files_per_task or 1,
        resume_epoch=start.epoch if start is not None else -1,
        consumed=start.consumed if start is not None else None,
        weights=listing.lengths if config.pack is not None else None,
    )  # fmt: skip


def rank_batches(config: PipelineConfig, listing: Listing, plan, epoch: int,
                 drop_last: bool) -> int:  # fmt: skip
    """The batches ``plan``'s rank yields in ``epoch`` if no sample is skipped: with
    ``drop_last`` every rank's (packing: full rows of ``seq_len`` tokens, so more batches
    than documents when they are long), else this rank's."""
    if config.pack is not None:
        return batch_form(config, listing, drop_last).batches(plan, epoch)
    sizes, B = plan.sizes(epoch), config.batch_size
    return min(sizes) // B if drop_last else -(-sizes[plan.rank] // B)


def batch_form(config: PipelineConfig, listing: Listing, drop_last: bool):
    """Step 3 of the feeder for ``config``: packing, bucketing, or None (re-batching)."""
    if config.pack is not None:
        return Packing(config.pack, config.seq_len, config.batch_size, drop_last, listing.lengths)
    if config.bucket_by is not None:
        return Bucketing(config.bucket_by, config.buckets, config.bucket_window,
                         config.batch_size, config.seed, drop_last)  # fmt: skip
    return None


def _starter(ds, follower):
    """Start ``ds``'s execution on the feeder thread; None when the rank has no task."""
    return None if ds is None else functools.partial(execute, ds, follower)
