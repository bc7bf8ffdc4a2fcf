"""`Loader`: one rank's warm `raypipe.Pipeline` in the shape of a ``torch`` DataLoader.

```
 Loader(config, epochs=E)                 rank / world size: given, or torch.distributed's
   iter(loader)  ──► next(pipeline.epochs())  one Pipeline, one pool, for the whole run
   iter(loader)  ──► the next epoch ...      (a new one after a data error stopped it):
                                             what an epoch left unread is dropped
   len(loader)      this rank's batches of a whole epoch (every rank the same)
   state_dict()     {"epoch", "state"}: PipelineState's bytes, the keys consumed over all
                    ranks (one all_reduce when torch.distributed is up: every rank calls it)
   load_state_dict  the next iter() resumes there: the rest of that epoch, then whole ones
```

With ``world_size > 1`` the ranks share an `raypipe.loader.ledger` actor (a handle, a name,
or a name rank 0 broadcasts over torch.distributed); before any work each rank joins it
with its world size and settings, and a rank that disagrees stops them all in one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from raypipe.config import PipelineConfig
from raypipe.config.checks import check_share, is_int
from raypipe.loader.pipeline import Pipeline, rank_batches, rank_plan
from raypipe.plan.rankplan import RankPlan
from raypipe.plan.shards import Listing, list_shards
from raypipe.train import epochread, ranks
from raypipe.train.checkpoint import any_rank
from raypipe.train.epochread import MISUSE, EpochRead, EpochSampler, start_point
from raypipe.train.state import PipelineState, merge_states

__all__ = ["Loader"]
assert __all__ == sorted(__all__)


class Loader:
    """This rank's batches, an epoch per ``iter()``, from one preprocessing pool per run.

    Args:
        config: the dataset's `raypipe.PipelineConfig`.
        epochs: the run's number of epochs (the pool works ahead across them).
        rank, world_size: this rank; None: torch.distributed's when it is initialized,
            else ``RANK`` and ``WORLD_SIZE`` (torchrun and Ray Train set them), else 0 and 1.
        ledger: with ``world_size > 1``: a `raypipe.Pipeline.ledger` handle, or a name every
            rank passes; None: a name rank 0 picks and broadcasts over torch.distributed.
        group: names this loader's ranks in a ledger handle that other loaders share.
        join_timeout_s: how long a rank waits for the others to start.
        options: `raypipe.Pipeline`'s other keywords (``device``, ``prefetch_batches``,
            ``drop_last``, ``progress_s``, ``skips`` ...).

    ``set_epoch(e)`` picks the epoch the next ``iter()`` gives, as a DistributedSampler's;
    another than the next one starts the pool anew there. ``close()`` (or ``with``) ends the
    pool; with a named ledger, it waits for the other ranks to be done with it.
    """

    def __init__(self, config: PipelineConfig, *, epochs: int, rank: int | None = None,
                 world_size: int | None = None, ledger: Any = None, group: str = "",
                 join_timeout_s: float = 300.0, **options: Any):  # fmt: skip
        epochread.check_arguments(config, epochs, options)
        self.config, self.num_epochs = config, epochs
        self._asked = (rank, world_size, ledger)
        self._group, self._join_timeout_s, self._options = group, join_timeout_s, options
        self._drop_last = options.get("drop_last", True)
        self._world: tuple[int, int] | None = None
        self._ledger, self._named, self._run = None, False, group
        self._listing: Listing | None = None
        self._pipeline: Pipeline | None = None
        self._epochs: Iterator | None = None  # the pipeline's epochs() generator
        self._generation = 0  # pipelines built so far: each reports under its own group
        self._next, self._base = 0, None  # the next epoch and its keys consumed before
        self._running: EpochRead | None = None
        self._latest: object | None = None  # the newest iter()'s token: older ones are stale
        self._closed = False
        self._len_plan: RankPlan | None = None  # a fresh epoch's plan, for len()

    # -- the DataLoader shape --------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The next epoch's batches, from the first ``next()`` (which raises when the epochs
        were all read: Lightning asks for an iterator before it sees a fit has none left)."""
        self._check_open()
        if self._running is not None:  # an epoch left early is dropped from here on
            self._running.left = False
        token = self._latest = object()
        return self._read(token)

    def _claim(self) -> EpochRead:
        """Take the next epoch from the pipeline (what is left of the last one is dropped)."""
        if self._next >= self.num_epochs:
            raise RuntimeError(f"the Loader's epochs={self.num_epochs} were all read: pass a "
                               "larger epochs= (or set_epoch() to read one again)")  # fmt: skip
        if self._epochs is None:
            self._build()
        try:
            epoch, batches = next(self._epochs)
        except BaseException:  # the pipeline failed: the next iter() gets a new one
            self._stop_pipeline()
            raise
        assert epoch == self._next, (epoch, self._next)
        most = rank_batches(self.config, self.listing, self._pipeline.plan, epoch, self._drop_last)
        run = EpochRead(epoch, batches, self._base, most)  # Lightning stops at len(), not the end
        self._next, self._base, self._running = epoch + 1, None, run
        return run

    def _read(self, token: object) -> Iterator[dict[str, Any]]:
        self._check_open()  # made before close(): a new pool that no close() would stop
        if self._latest is not token:
            raise RuntimeError(MISUSE)
        run = self._claim()
        it = iter(run.batches)
        try:
            while True:
                if self._latest is not token or self._running is not run:
                    raise RuntimeError(run.stale or MISUSE)
                try:
                    batch = next(it)
                except StopIteration:
                    run.over = True
                    return
                except BaseException:  # the pool's own (a data error): the next iter() makes
                    if self._pipeline is not None and self._pipeline.stopped:  # a new one
                        self._stop_pipeline()
                    raise
                run.count += 1
                run.over = run.most is not None and run.count >= run.most
                yield batch
        finally:  # read to the end, or left (break, an error): the next iter() is the next epoch
            run.left, run.over = not run.over, True

    def __len__(self) -> int:
        """This rank's batches in a whole epoch, a resumed one too (Lightning counts a
        resumed epoch's steps on from its checkpoint's): the same on every rank (with
        ``drop_last``; fewer when samples are skipped); with packing, its packed rows'."""
        if self._drop_last:  # a batch no rank can fill: refused, as by iter(), not 0
            check_share(self.config, self.listing.num_samples, self._rank_world()[1])
        if self._len_plan is None:
            self._len_plan = rank_plan(self.config, self.listing, *self._rank_world())
        epoch = min(self.epoch, self.num_epochs - 1)
        return rank_batches(self.config, self.listing, self._len_plan, epoch, self._drop_last)

    def set_epoch(self, epoch: int) -> None:
        """The next epoch read is ``epoch`` (an iterator not started yet reads it too); the
        next epoch anyway: nothing changes. Set during an epoch's loop, it ends that loop."""
        if not is_int(epoch) or not 0 <= epoch < self.num_epochs:
            raise ValueError(f"{epoch=} must be an integer in 0..{self.num_epochs - 1}")
        if epoch != self._next:
            why = epochread.called_within(f"set_epoch({epoch})", self._running)
            epochread.stop_reading(self._running, why)
            latest = self._latest
            self._restart(epoch, None)
            self._latest = latest  # a started one is stale: its epoch is no longer running

    batch_sampler = None  # what Lightning reads beside ``sampler`` (no batches of indices)

    @property
    def sampler(self) -> EpochSampler:
        """What Lightning calls ``set_epoch`` on at each epoch: a fit resumed from a
        checkpoint taken at an epoch's end gives the Loader no state, only the epoch."""
        return EpochSampler(self, fresh=self._running is None)  # no epoch read yet

    @property
    def epoch(self) -> int:
        """The epoch being read, or the one the next ``iter()`` gives."""
        run = self._running
        return run.epoch if run is not None and not run.over else self._next

    # -- resume state -----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the run stands over all ranks: ``epoch``, the one being read (or the next
        one), and ``state``, the `raypipe.train.state.PipelineState` that `train_ddp`
        checkpoints (the keys handed out so far), as the bytes of its file in a tensor.

        With torch.distributed initialized over this Loader's ranks it is a collective:
        every rank calls it together (Lightning does, when it checkpoints). Else a rank of
        several holds only its own keys: OR the ranks' ``consumed`` before resuming. An epoch
        left early (``break``, an error, ``max_steps``) stays here, with what was read of it,
        until the next ``iter()``: a run saved then resumes with the rest of it."""
        run = self._running
        if run is not None and (not run.over or run.left):
            epoch, keys, base = run.epoch, run.batches.state_dict()["keys"], run.base
        else:
            epoch, keys, base = self._next, [], self._base
        n = self.listing.num_samples
        mine = merge_states([{"keys": keys}], n, base)
        consumed = any_rank(mine, ranks.collective_device(), self._rank_world()[1])
        state = PipelineState(epoch, self.config.seed, n, self.listing.fingerprint, consumed)
        return {"epoch": epoch, "state": epochread.state_tensor(state.to_bytes())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (a `state_dict`, of any world size): the next ``iter()``
        gives the rest of its epoch, exactly once over the ranks, then whole epochs."""
        resumed = PipelineState.from_bytes(epochread.state_bytes(state), source="the Loader state")
        resumed.check(self.listing, self.config.seed)
        if not 0 <= resumed.epoch <= self.num_epochs:
            raise ValueError(f"the state is at epoch {resumed.epoch}: epochs={self.num_epochs}")
        epochread.stop_reading(
            self._running, epochread.called_within("load_state_dict()", self._running)
        )
        latest = self._latest
        self._restart(resumed.epoch, resumed.consumed)
        self._latest = latest  # an iterator not started yet resumes too (as set_epoch's)

    # -- the pipeline underneath -------------------------------------------------------

    @property
    def listing(self) -> Listing:
        """The source's shards, listed once, on first use."""
        if self._listing is None:
            self._listing = list_shards(self.config)
        return self._listing

    def start(self) -> Loader:
        """Start the pool now, so that it warms up while the model is built (``with`` and
        the first ``iter()`` do it too); with several ranks, wait for all of them first."""
        self._check_open()  # a closed Loader's new pool would outlive it: close() is done
        if self._epochs is None and self._next < self.num_epochs:
            self._build()
        if self._pipeline is not None:
            self._pipeline.start()
        return self

    def _build(self) -> None:
        rank, world = self._rank_world()
        if self._drop_last:  # every epoch empty otherwise; refused before the ranks join
            check_share(self.config, self.listing.num_samples, world)
        ledger = self._join()
        n = self.listing.num_samples
        start = None
        if self._next > 0 or self._base is not None:
            consumed = self._base if self._base is not None else np.zeros(n, dtype=bool)
            start = PipelineState(self._next, self.config.seed, n, self.listing.fingerprint,
                                  consumed)  # fmt: skip
        self._generation += 1
        self._pipeline = Pipeline(
            self.config, epochs=self.num_epochs, rank=rank, world_size=world, ledger=ledger,
            group=f"{self._run}/{self._generation}", listing=self.listing, start=start,
            **self._options,
        )  # fmt: skip
        self._epochs = self._pipeline.epochs()

    def _restart(self, epoch: int, base: np.ndarray | None) -> None:
        """The next ``iter()`` reads ``epoch`` (less ``base``) from a new pipeline."""
        self._stop_pipeline()
        self._next, self._base, self._running, self._latest = epoch, base, None, None

    def _stop_pipeline(self) -> None:
        if self._epochs is not None:
            self._epochs.close()
        if self._pipeline is not None:
            self._pipeline.close()
        self._epochs = self._pipeline = None

    def _rank_world(self) -> tuple[int, int]:
        if self._world is None:
            self._world = ranks.resolve_world(*self._asked[:2])
        return self._world

    def _join(self):
        """The ledger, made or found once, every rank joined with the same settings; at each
        restart (`set_epoch`, `load_state_dict` after a start), every rank restarted at the
        same point (one rank restarting alone read an empty epoch while it waited for ever)."""
        rank, world = self._rank_world()
        start = {"start": start_point(self._next, self._base)}  # loaded on some ranks only?
        if self._ledger is None and world > 1:
            settings = ranks.run_settings(self.config, epochs=self.num_epochs,
                                          listing=self.listing, drop_last=self._drop_last)  # fmt: skip
            self._ledger, self._run, self._named = ranks.join_ranks(
                self._asked[2], rank, world, group=self._group, settings={**settings, **start},
                timeout_s=self._join_timeout_s)  # fmt: skip
        elif world > 1:
            ranks.wait_for_ranks(self._ledger, f"{self._run}/restart{self._generation}",
                                 rank=rank, world_size=world, settings=start,
                                 timeout_s=self._join_timeout_s, doing="restarted")  # fmt: skip
        return self._ledger

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the Loader is closed")

    def close(self) -> None:
        """End the pool; with a named ledger, leave it and wait (a while) for the others."""
        if self._closed:
            return
        self._closed = True
        self._stop_pipeline()
        epochread.stop_reading(self._running, "the Loader is closed")  # not the epoch's end
        self._running = epochread.held(self._running)  # its keys: state_dict() still holds
        if self._named and self._ledger is not None:
            ranks.leave(self._ledger, self._run, self._rank_world()[0])

    def __enter__(self) -> Loader:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
