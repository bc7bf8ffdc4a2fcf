"""Answers the ledger holds back until they settle what a rank asked for (a long poll).

A rank that asks `EpochLedger.settle` for ``want`` rows gets its answer once every rank is
sure to have them, once a finished rank has fewer (the epoch ends below ``want``), once the
run failed, or after ``WAIT_S``: one message and one reply where polling sent one per
pause. The ranks of a run move in step (DDP), so a round of reports of the same rows is
answered as soon as its last report arrives, every rank with the fresh minimum::

    rank r ── settle(rows, want) ──► ledger: record rows; want settled? ── yes ──► answer
                                              │ no
                                              └── wait (a future per ask, sorted by want) ──┐
    rank q ── settle / report ─────► ledger: record rows → min rose? → answer the settled ◄┘
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["WAIT_S", "Waiters", "concurrency", "held"]
assert __all__ == sorted(__all__)

WAIT_S = 0.5  # the longest an answer is held: the rank then asks again
PRUNE_MIN = 64  # asks held for one epoch before the timed-out ones are first swept out


def concurrency(world_size: int) -> int:
    """Calls a ledger of ``world_size`` ranks runs at once (its actor's ``max_concurrency``):
    every rank may have an answer held and another report on the way, with room to spare."""
    return max(1000, 4 * world_size)


class Waiters:
    """Futures of one ledger's held answers, per (run, epoch), cheapest to wake first."""

    def __init__(self):
        self._held: dict[tuple[str, int], list] = {}  # key -> heap of (want, n, future)
        self._sweep_at: dict[tuple[str, int], int] = {}  # key -> heap size of its next sweep
        self._scanned: dict[tuple[str, int], float] = {}  # key -> final rows of its last scan
        self._count = itertools.count()

    def hold(self, key: tuple[str, int], want: float) -> asyncio.Future:
        """A future woken by `wake` once ``want`` is settled (or by `wake_all`).

        An ask whose answer timed out (`held` cancels it) stays in the heap until its rows
        settle; ranks stalled on a straggler ask again every `WAIT_S`, so each time the heap
        doubles its timed-out asks are swept out: it stays within twice the live ones."""
        heap = self._held.setdefault(key, [])
        if len(heap) >= self._sweep_at.get(key, PRUNE_MIN):
            heap[:] = [x for x in heap if not x[2].done()]
            heapq.heapify(heap)
            self._sweep_at[key] = max(PRUNE_MIN, 2 * len(heap))
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(heap, (want, next(self._count), future))
        return future

    async def until(self, key: tuple[str, Any], want: float, now: Callable[[], float]) -> None:
        """Hold until `wake` settles ``want`` for ``key`` (at most `WAIT_S`), unless ``now()``
        is there already: looked at again once held, as the `wake` of a count made on
        another thread meanwhile found nothing to wake."""
        if now() >= want:
            return
        future = self.hold(key, want)
        if now() >= want:
            future.cancel()  # swept out of the heap later
            return
        await held(future)

    def wake(self, key: tuple[str, int], sure: float, final: float) -> None:
        """Wake the asks of ``key`` that ``sure`` rows settle, and every ask above ``final``
        (that epoch ends below them: the answer says so)."""
        held = self._held.get(key)
        if not held:
            return
        woken = []
        while held and held[0][0] <= sure:
            woken.append(heapq.heappop(held)[2])
        # a rank finished below the rows some asks want: they end here. An ask is held only
        # at or below the final rows its report saw, so only a fall of them finds new ones
        if held and final < self._scanned.get(key, float("inf")):
            self._scanned[key] = final
            woken += [f for w, _, f in held if w > final]
            held[:] = [x for x in held if x[0] <= final]
            heapq.heapify(held)
        for future in woken:
            _resolve(future)

    def wake_all(self, run: str) -> None:
        """Wake every ask of ``run``: it failed."""
        for key in [k for k in self._held if k[0] == run]:
            self.forget(key)

    def forget(self, key: tuple[str, int]) -> None:
        """Wake the asks of ``key`` (the ledger forgets that epoch)."""
        self._sweep_at.pop(key, None)
        self._scanned.pop(key, None)
        for _, _, future in self._held.pop(key, ()):
            _resolve(future)


def _resolve(future: asyncio.Future) -> None:
    """Wake ``future`` from any thread (Ray may run a sync method off the loop's thread)."""

    def done() -> None:
        if not future.done():
            future.set_result(None)

    future.get_loop().call_soon_threadsafe(done)


async def held(future: asyncio.Future) -> None:
    """Wait for ``future`` at most `WAIT_S`."""
    try:
        await asyncio.wait_for(asyncio.shield(future), WAIT_S)
    except asyncio.TimeoutError:
        future.cancel()
