"""Equal batch counts per epoch when bad samples make the ranks' row counts differ.

Each rank reads its own planned keys (`raypipe.plan.rankplan`); a rank's good rows in an epoch are
known only once its last task has run. DDP needs every rank to take the same number of
steps, ``n = min over ranks of good_rows // batch_size``. A rank yields its batch ``k``
only once that is certain::

    rank r ── report(epoch, rows so far, done?) ──► EpochLedger (one tiny actor per run)
           ◄── (min rows any rank is sure to have, min final rows of the finished ranks)

    batch k of epoch e:  (k+1)·B <= min sure rows   → yield it
                         (k+1)·B >  min planned, or
                         (k+1)·B >  a finished rank's final rows → the epoch ends here
                         otherwise                  → ask again (a rank is still reading)

Which rows a rank delivers is then a function of its planned keys and the bad samples
only: the first ``n·B`` good rows of its slice, in the plan's order.

A rank reports when its cached answer settles fewer than ``ahead`` batches past the next
one and it has news (unless an answer to come settles the next batch), when it has all its
rows, and when it must wait; the ledger holds each answer until its rows settle
(`raypipe.loader.waiters`), as it holds joins and leaves until every rank came. A rank
``L`` batches ahead reports every ``L - ahead`` batches or so (``lead_batches``): about 0.6
a second at ten steps a second at 1,024 ranks (`benchmarks/scale.py`). A feeder held by
its trainer for `FLUSH_S` reports what it holds (`Gate.flush`), so no rank waits forever.

A rank whose data fails (``on_error="raise"``, a skip budget spent) tells the ledger
(`Gate.fail`); a rank waiting on it then raises the same error instead of waiting forever,
and a rank that closes while it waits (`Gate.close`: a peer that closed first sends
nothing) raises `GateClosed`.

Ranks that build their pipelines themselves (`raypipe.Loader`) `join` with their rank,
world size and settings and wait for every rank (`raypipe.train.ranks.wait_for_ranks`): one
that disagrees stops them all before any work, in one line. They may share the ledger by
name (`raypipe.train.ranks.named_ledger`), each group of ranks in a run of its own.
"""

from __future__ import annotations

import time

from raypipe.loader.waiters import Waiters, concurrency, held

__all__ = ["EpochLedger", "Gate", "GateClosed", "RanksDisagree", "create_ledger"]
assert __all__ == sorted(__all__)

_INF, JOINED, LEFT = float("inf"), "joined", "left"  # held answers' keys: (run, JOINED)
NAMESPACE = "raypipe"  # named ledgers live here: drivers of ray.init(address=) get their own


class GateClosed(Exception):
    """The rank closed while its gate waited on its peers."""


class RanksDisagree(ValueError):
    """Ranks of one run were started with different world sizes, ranks or settings."""


class EpochLedger:
    """The counts behind `Gate` (a Ray actor with no CPUs; plain Python, testable alone)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._rows: dict[tuple[str, int], list[int]] = {}
        self._final: dict[tuple[str, int], list[float]] = {}
        self._failed: dict[str, BaseException] = {}
        self._joined: dict[str, dict[int, dict[str, str]]] = {}  # run -> rank -> settings
        self._left: dict[str, set[int]] = {}
        self._waiters = Waiters()  # answers held by `settle`

    def join(self, run: str, rank: int, world_size: int, settings: dict[str, str]):
        """Rank ``rank`` of ``run`` starts with ``world_size`` ranks and ``settings`` (name:
        value as text); returns `joined`. The first disagreement fails the run."""
        ranks = self._joined.setdefault(run, {})
        problem = None
        if world_size != self.world_size:
            problem = (f"rank {rank} has world_size={world_size}, the ledger's ranks "
                       f"{self.world_size}")  # fmt: skip
        elif not 0 <= rank < world_size:
            problem = f"rank={rank} is not in 0..{world_size - 1}"
        elif rank in ranks:
            problem = (f"two ranks have rank={rank} (a rerun needs a new Pipeline.ledger(); "
                       "two Loaders on one ledger, each their own group=)")  # fmt: skip
        elif ranks:
            first, theirs = next(iter(ranks.items()))
            differ = [k for k in sorted(set(theirs) | set(settings))
                      if theirs.get(k) != settings.get(k)]  # fmt: skip
            if differ:
                k = differ[0]
                problem = (f"rank {rank} has {k}={settings.get(k)}, rank {first} "
                           f"{k}={theirs.get(k)}")  # fmt: skip
        if problem is not None:
            self.fail(run, RanksDisagree(f"the ranks of one run disagree: {problem}"))
        else:
            ranks[rank] = settings
            self._waiters.wake((run, JOINED), len(ranks), _INF)
        return len(ranks), self._failed.get(run)

    def size(self) -> int:
        """The world size the ledger was made for."""
        return self.world_size

    async def joined(self, run: str) -> tuple[int, BaseException | None]:
        """Ranks of ``run`` joined and its error (None), held until all came or `WAIT_S`."""
        if run not in self._failed:
            await self._waiters.until((run, JOINED), self.world_size, lambda: len(self._joined.get(run, ())))  # fmt: skip
        return len(self._joined.get(run, ())), self._failed.get(run)

    def leave(self, run: str, rank: int) -> int:
        """``rank`` is done with ``run``; returns how many of its ranks are not."""
        left = self._left.setdefault(run, set())
        left.add(rank)
        self._waiters.wake((run, LEFT), len(left), _INF)
        return self.world_size - len(left)

    async def left(self, run: str) -> int:
        """Ranks of ``run`` not done with it, held until none or `WAIT_S` (a long poll)."""
        await self._waiters.until((run, LEFT), self.world_size, lambda: len(self._left.get(run, ())))  # fmt: skip
        return self.world_size - len(self._left.get(run, ()))

    def fail(self, run: str, error: BaseException) -> None:
        """A rank of ``run`` stopped with ``error`` (the first one is kept)."""
        self._failed.setdefault(run, error)
        self._waiters.wake_all(run)

    def report(self, run: str, epoch: int, rank: int, rows: int, done: bool):
        """Record rank's rows of ``epoch``; returns ``(min sure rows, min final rows, the
        error a rank of ``run`` stopped with or None)``."""
        key = (run, epoch)
        if key not in self._rows:
            self._rows[key] = [0] * self.world_size
            self._final[key] = [_INF] * self.world_size
            for old in [k for k in self._rows if k[0] == run and k[1] < epoch - 2]:
                del self._rows[old], self._final[old]
                self._waiters.forget(old)
        rows_now = self._rows[key]
        rows_now[rank] = max(rows_now[rank], rows)
        if done:
            self._final[key][rank] = rows
        sure, final = min(rows_now), min(self._final[key])
        self._waiters.wake(key, sure, final)
        return sure, final, self._failed.get(run)

    async def settle(self, run: str, epoch: int, rank: int, rows: int, done: bool,
                     want: float):  # fmt: skip
        """`report`, its answer held until ``want`` rows are settled, the epoch is sure to
        end below them, the run failed, or `raypipe.loader.waiters.WAIT_S` passed."""
        sure, final, failed = self.report(run, epoch, rank, rows, done)
        if failed is None and sure < want <= final:
            await held(self._waiters.hold((run, epoch), want))
            if (run, epoch) in self._rows:
                sure, final = min(self._rows[run, epoch]), min(self._final[run, epoch])
            failed = self._failed.get(run)
        return sure, final, failed


class Gate:
    """One rank's side of the ledger: may batch ``k`` of an epoch be yielded?

    Args:
        ledger: an `EpochLedger` actor handle (None when ``world_size`` is 1).
        run: names this group of ranks in the ledger (a restarted group gets a new one).
        rank, batch_size: this rank, and rows per batch.
        ahead: report when the cached answer settles fewer batches than this past the next.
    """

    FLUSH_S = 1.0  # a feeder held this long by its trainer reports the rows it holds
    CLOSE_S = 0.1  # how often a wait on the peers looks whether its rank closed

    def __init__(self, ledger, run: str, rank: int, batch_size: int, *, ahead: int = 4):
        if ahead < 1:
            raise ValueError(f"{ahead=} must be >= 1")
        self.ledger, self.run, self.rank, self.batch_size = ledger, run, rank, batch_size
        self.waited_s = 0.0  # time spent waiting for other ranks
        self.reports = 0  # messages sent to the ledger
        self._low = ahead * batch_size  # report below this many rows settled
        self._closed = False
        self.start(-1, 0)

    def start(self, epoch: int, planned_min: int) -> None:
        """A new epoch; ``planned_min`` is the fewest samples any rank was given."""
        self._epoch, self._rows, self._done = epoch, 0, False
        self._planned_min = planned_min
        self._answer: tuple[float, float, BaseException | None] = (0, _INF, None)
        self._pending: list[tuple[object, float]] = []  # (answer ref, want) not yet read
        self._next = 0  # the next batch this rank asks for
        self._sent, self._sent_done = -1, False  # rows and done of the last report

    def add(self, rows: int, *, done: bool = False) -> None:
        """This rank now holds ``rows`` more good rows of the epoch (``done``: all of them)."""
        self._rows += rows
        self._done = self._done or done
        self._report_if_low()

    def allows(self, k: int) -> bool:
        """True when every rank will yield batch ``k``; False when none will."""
        need = (k + 1) * self.batch_size
        if need > self._planned_min:
            return False
        if self.ledger is None:  # one rank: the batch exists, so its rows are there
            return True
        if need <= self._answer[0]:  # settled by an earlier answer: no round trip
            self._next = k + 1
            self._report_if_low()
            return True
        t0 = time.perf_counter()
        try:
            self._collect()
            while True:
                sure, final, failed = self._answer
                if failed is not None:  # a peer stopped: it will never send its rows
                    raise failed
                if need <= sure:
                    self._next = k + 1
                    return True
                if need > final:
                    return False
                ask = next((ref for ref, want in self._pending if want == need), None)
                self._collect(ask if ask is not None else self._send(need))  # held answer
        finally:
            self.waited_s += time.perf_counter() - t0

    def flush(self) -> None:
        """Report the rows not reported yet (a feeder its trainer holds calls this)."""
        if self.ledger is not None and (self._rows > self._sent or self._done > self._sent_done):
            self._send(0)

    def close(self) -> None:
        """End a wait in `allows` (another thread's) in `GateClosed` within ``CLOSE_S``."""
        self._closed = True

    def fail(self, error: BaseException) -> None:
        """This rank stopped with ``error``: ranks waiting on it raise it too."""
        if self.ledger is not None:
            self.ledger.fail.remote(self.run, error)

    def _report_if_low(self) -> None:
        """Report when done, or when the cached answer is running out and there is news
        and no answer still to come will settle the next batch."""
        if self.ledger is None:
            return
        want = min(self._rows, (self._next + 1) * self.batch_size + self._low)
        if self._done and not self._sent_done:
            self._send(want)
            return
        if self._rows <= self._sent or self._settled_ahead() >= self._low:
            return
        self._collect()
        if self._settled_ahead() >= self._low:
            return
        if any(w >= (self._next + 1) * self.batch_size for _, w in self._pending):
            return  # its answer, once the peers have the rows, settles the next batch
        self._send(want)

    def _settled_ahead(self) -> float:
        """Rows the cached answer settles past the next batch this rank asks for."""
        return self._answer[0] - (self._next + 1) * self.batch_size

    def _send(self, want: float):
        """Report this rank's rows; the answer is held until ``want`` rows are settled."""
        self.reports += 1
        self._sent, self._sent_done = self._rows, self._done
        ref = self.ledger.settle.remote(
            self.run, self._epoch, self.rank, self._rows, self._done, want
        )
        self._pending.append((ref, want))
        return ref

    def _collect(self, wait_for=None) -> None:
        """Read the answers that have come (and ``wait_for``'s, waiting for it): the
        freshest counts of each kind are kept."""
        import ray

        while wait_for is not None and not ray.wait([wait_for], timeout=self.CLOSE_S)[0]:
            if self._closed:
                raise GateClosed(f"rank {self.rank} closed while waiting on its peers")
        if not self._pending:
            return
        refs = [ref for ref, _ in self._pending]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        if not ready:
            return
        self._pending = [(ref, want) for ref, want in self._pending if ref not in ready]
        sure, final, failed = self._answer
        for s, f, e in ray.get(list(ready)):
            sure, final, failed = max(sure, s), min(final, f), failed or e
        self._answer = (sure, final, failed)


def create_ledger(world_size: int):
    """A new `EpochLedger` actor on this node (no CPUs); it lives while its handle does."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return ray.remote(EpochLedger).options(
        num_cpus=0, max_restarts=0,
        max_concurrency=concurrency(world_size),  # answers `settle` holds
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(world_size)  # fmt: skip
