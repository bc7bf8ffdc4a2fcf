"""The rank side of the run-long pipeline: one thread turns blocks into every epoch's batches.

```
 feeder thread (one per rank, for the whole run)                        consumer (trainer)
   1. blocks      numpy columns of this rank's execution (Ray Data's or its tasks')
   2. epochs      cut where the block's ``epoch`` changes (or the rank's planned rows are in)
   3. rebatch     exactly batch_size rows; zero-copy when a block is one batch
                  (or a seeded local shuffle buffer: PipelineConfig.shuffle_buffer)
   4. gate        batch k only when every rank will have one (raypipe.loader.ledger);
                  without drop_last (evaluation) every row, the last batch short
   5. queue       <= prefetch batches, then an end-of-epoch marker ──────► Feeder.epoch(e)
```

In flight at once: the executor's blocks in the object store (epoch e+1 while the trainer
is still on epoch e), one block and one partial batch here (and ``lead`` batches of blocks
pulled ahead of the batch the gate is asked about, when set), ``prefetch`` batches in the
queue. Time is accounted per epoch to the stage that held the thread, so ``stalls(e)``
says whether this rank's data was waiting on Ray (actors, read, object store), on other
ranks, on its own conversion, or on the trainer.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator

import numpy as np

from raypipe.loader.demand import Demand
from raypipe.loader.errors import collect_failed, unwrapped
from raypipe.loader.ledger import Gate, GateClosed
from raypipe.loader.rebatch import held_ahead, rebatch
from raypipe.loader.shuffle import shuffled
from raypipe.plan.rankplan import RankPlan

__all__ = ["Feeder"]
assert __all__ == sorted(__all__)

Columns = dict[str, np.ndarray]
_END, _BATCH, _FAIL = "end", "batch", "fail"
_POLL_S = 0.05  # how often a blocked put checks for close()
JOIN_S = 10.0  # how long close() waits for the thread
STAGES = ("ray_s", "peers_s", "iterator_s", "trainer_s")


class _Closed(Exception):
    """The consumer closed the feeder: its thread ends quietly."""


class Feeder:
    """Owns the feeder thread of one rank; ``epoch(e)`` yields that epoch's host batches.

    Args:
        start: called on the feeder thread, returns ``(blocks, stop)`` of the rank's
            execution: an iterator of numpy column blocks, in task order, and ``stop()``,
            which shuts it down from any thread; None when the rank has no data.
        plan: the rank's `RankPlan` (planned rows per rank and epoch).
        gate: the rank's `raypipe.loader.ledger.Gate`.
        epochs: the epochs the bundles hold, in order.
        batch_size, prefetch: rows per batch; batches queued ahead of the consumer.
        shuffle_buffer, seed: a seeded local shuffle of that many rows (0: off).
        drop_last: equal exact batches on every rank, the rest dropped (training); False:
            every row this rank reads, the epoch's last batch short, no gate (evaluation).
        demand: the `raypipe.loader.demand.Demand` this feeder adds its consumer's waits and its
            own held-back time to.
        form: step 3 in place of re-batching: `raypipe.loader.buckets.Bucketing` or
            `raypipe.loader.packing.Packing`, called ``form(rows, epoch, plan, counts)``;
            ``form.gated`` False: it fixes equal batch counts itself (no ledger).
        lead: batches of rows pulled (and told to the gate) ahead of the batch the gate
            is asked about (`held_ahead`): the gate reports less often.
    """

    def __init__(self, start, plan: RankPlan, gate: Gate, epochs: range, *, batch_size: int,
                 prefetch: int, shuffle_buffer: int = 0, seed: int = 0, demand=None,
                 drop_last: bool = True, form=None, lead: int = 0):  # fmt: skip
        self._start, self._plan, self._gate, self._epochs = start, plan, gate, epochs
        self._stop, self._failed = None, None  # the error the execution failed with
        self.failed = False  # the execution failed (known once closed)
        self._batch_size, self._buffer, self._seed = batch_size, shuffle_buffer, seed
        self._drop_last, self._form, self._lead = drop_last, form, lead * batch_size
        self._queue: queue.Queue = queue.Queue(maxsize=max(prefetch, 1))
        self._closed = threading.Event()
        self._stopping = threading.Lock()  # `_stop` changes hands under it: stopped once
        self._thread = threading.Thread(target=self._run, name="raypipe-feeder", daemon=True)
        self._stalls: dict[int, dict[str, float]] = {}
        self._counts: dict[int, dict[str, int]] = {}
        self._next = epochs.start
        self._open: Iterator[Columns] | None = None  # the epoch being read, not yet ended
        self.ended: tuple[int, BaseException] | None = None  # (epoch, the error it was given)
        self._draining = False  # `finish` reads the epoch's rest: rows no one is handed
        self._current = dict.fromkeys(STAGES, 0.0)
        self.demand = demand if demand is not None else Demand()  # for raypipe.pool.follow
        self._thread.start()

    # -- consumer side --------------------------------------------------------------

    def epoch(self, epoch: int) -> Iterator[Columns]:
        """This rank's batches of ``epoch``; epochs are read in order, each at most once."""
        if epoch != self._next:
            raise ValueError(f"epoch {epoch} asked for, but the next one is {self._next}")
        if self.ended is not None:  # the thread is gone: no batch of any epoch comes
            at, error = self.ended
            raise RuntimeError(
                f"the pipeline stopped in epoch {at} with {type(error).__name__}: {error}; it "
                "reads no later epoch: make a new Pipeline (start= a checkpoint's state resumes)"
            ) from error
        self.finish(epoch - 1)
        self._next += 1
        self._open = self._read(epoch)
        return self._open

    def finish(self, epoch: int) -> None:
        """Read ``epoch`` to its end, if the consumer did not (its batches are dropped)."""
        if self._next == epoch:  # never asked for
            self.epoch(epoch)
        if self._open is not None:
            self._draining = True
            try:
                for _ in self._open:
                    pass
            finally:
                self._draining = False

    def _read(self, epoch: int) -> Iterator[Columns]:
        demand = self.demand
        demand.epoch, demand.epoch_rows = epoch, 0
        while True:
            t0 = time.perf_counter()
            try:
                kind, at, item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._closed.is_set():  # closed while its consumer waited: the end
                    self._open = None
                    return
                continue
            finally:
                demand.waited_s += time.perf_counter() - t0  # a drain's too: the loop waits
            if kind == _FAIL:
                self._open, self.ended = None, (epoch, item)
                raise item
            assert at == epoch, (at, epoch)
            if kind == _END:
                self._open = None
                return
            rows = 0 if self._draining else len(item["key"])  # the trainer's only
            demand.rows, demand.epoch_rows = demand.rows + rows, demand.epoch_rows + rows
            yield item

    def stalls(self, epoch: int) -> dict[str, float]:
        """Seconds the feeder spent in each stage while producing ``epoch``."""
        return dict(self._stalls.get(epoch, dict.fromkeys(STAGES, 0.0)))

    def counts(self, epoch: int) -> dict[str, int]:
        """``planned`` samples, ``good`` rows received, ``batches``, ``dropped`` rows."""
        return dict(self._counts.get(epoch, {}))

    def close(self) -> None:
        """Stop the thread and the rank's execution (its actors go with it)."""
        self._closed.set()
        self._gate.close()  # a wait on the peers ends: one that closed first sends nothing
        with self._stopping:
            stop, self._stop = self._stop, None
        if stop is not None:
            stop()
        self._thread.join(timeout=JOIN_S)  # a start still running then: the thread stops it
        self._start = None  # the execution's last references on this side
        if self._failed is not None:
            collect_failed(self._failed)
            self.failed, self._failed = True, None

    # -- the thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            t0 = time.perf_counter()
            columns, stop = self._start() if self._start is not None else ((), None)
            with self._stopping:  # close() came meanwhile: this thread stops what it started
                closed = self._closed.is_set()
                self._stop = None if closed else stop
            if closed:
                if stop is not None:
                    stop()
                return
            startup = time.perf_counter() - t0  # the execution starts: counted to Ray
            blocks = self._timed(iter(columns), "ray_s")
            ahead = None
            for e in self._epochs:
                ahead = self._epoch(e, blocks, ahead, startup if e == self._epochs.start else 0)
        except (_Closed, GateClosed):
            return
        except BaseException as e:  # reaches the consumer, unless it is gone, and the peers
            self._failed = e
            error = unwrapped(e)
            with contextlib.suppress(Exception):  # a ledger that is gone: nobody waits
                self._gate.fail(error)
            with contextlib.suppress(_Closed):
                self._put((_FAIL, -1, error))

    def _epoch(self, e: int, blocks, ahead, startup: float):
        """Feed epoch ``e``; returns the first block of the next epoch if it was read."""
        sizes = self._plan.sizes(e)
        planned = sizes[self._plan.rank]
        stall = self._stalls[e] = dict.fromkeys(STAGES, 0.0)
        stall["ray_s"] = startup
        self._current = stall
        self._gate.start(e, min(sizes))
        got, state = 0, {"ahead": ahead}

        def mine() -> Iterator[Columns]:
            nonlocal got
            while got < planned:
                block = state["ahead"] if state["ahead"] is not None else next(blocks, None)
                state["ahead"] = None
                if block is None:
                    break
                at = int(block["epoch"][0])
                if at != e:
                    assert at > e, f"a block of epoch {at} after epoch {e}"
                    state["ahead"] = block
                    break
                if block["epoch"][-1] != e:  # Ray Data merged outputs of two epochs' tasks
                    cut = int(np.argmax(block["epoch"] != e))
                    block, state["ahead"] = ({k: v[:cut] for k, v in block.items()},
                                             {k: v[cut:] for k, v in block.items()})  # fmt: skip
                got += len(block["key"])
                self._gate.add(len(block["key"]), done=got >= planned)
                yield {k: v for k, v in block.items() if k != "epoch"}
            self._gate.add(0, done=True)

        source, formed = (held_ahead(mine(), self._lead) if self._lead else mine()), {}
        batches = self._batches(source, e, formed)
        k = rows = 0
        t0, ray0 = time.perf_counter(), stall["ray_s"]
        for batch in batches:  # iterator_s: this thread's own work, Ray's waits left out
            stall["iterator_s"] += time.perf_counter() - t0 - (stall["ray_s"] - ray0)
            if self._drop_last and getattr(self._form, "gated", True):
                waited = self._gate.waited_s
                allowed = self._gate.allows(k)
                stall["peers_s"] += self._gate.waited_s - waited
                if not allowed:
                    break
            self._put((_BATCH, e, batch), stall)
            k, rows = k + 1, rows + len(batch["key"])
            t0, ray0 = time.perf_counter(), stall["ray_s"]
        for _ in source:  # the rest of the epoch's rows, if the gate ended it early
            pass
        self._counts[e] = {"planned": planned, "good": got, "batches": k, "dropped": got - rows,
                           **formed}  # fmt: skip
        self._put((_END, e, None), stall)
        return state["ahead"]

    def _batches(self, source: Iterator[Columns], e: int, formed: dict) -> Iterator[Columns]:
        """Step 3: the form's batches (buckets, packing), shuffled ones, or re-batched."""
        if self._form is not None:
            return self._form(source, e, self._plan, formed)
        if self._buffer:
            rng = np.random.default_rng([self._seed, e, self._plan.rank, 0xB0F])
            return shuffled(source, self._batch_size, self._buffer, rng, drop_last=self._drop_last)
        return rebatch(source, self._batch_size, drop_last=self._drop_last)

    def _timed(self, it: Iterator[Columns], stage: str) -> Iterator[Columns]:
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                self._current[stage] += time.perf_counter() - t0
            yield item

    def _put(self, item, stall: dict[str, float] | None = None) -> None:
        """Queue ``item`` for the consumer; raises `_Closed` once `close` was called.

        The time the data waits on the trainer is added to ``demand.held_s`` as it passes,
        poll by poll: the follower reads it every ``follow_period_s``, and a trainer whose
        step is longer than that must still read as one the data waits on."""
        t0 = mark = time.perf_counter()
        flushed = False
        try:
            while not self._closed.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    return
                except queue.Full:
                    now = time.perf_counter()
                    self.demand.held_s += now - mark  # for the follower
                    mark = now
                    if not flushed and now - t0 > self._gate.FLUSH_S:
                        self._gate.flush()  # peers may wait on rows only this rank holds
                        flushed = True
            raise _Closed
        finally:
            end = time.perf_counter()
            self.demand.held_s += end - mark
            if stall is not None:
                stall["trainer_s"] += end - t0  # for the epoch's stall view
