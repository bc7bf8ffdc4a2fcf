"""Counters of the per-rank iterator: what it delivered (keys, for checkpoints) and how long
the trainer waited."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Iterator

import numpy as np


@dataclasses.dataclass
class IterStats:
    """Wall-clock accounting of one rank's iteration.

    ``wait_s`` is time the consumer spent blocked inside ``next()``; everything
    else between the first request and the pass's end (or now, while it runs) is the
    consumer's own work. ``wait_fraction`` near 0 means the trainer never waited for data.
    """

    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    first_batch_s: float | None = None
    _started: float | None = None
    _ended: float | None = None  # the pass ran out: what the loop does after is not its time

    def start(self) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def end(self) -> None:
        if self._started is not None and self._ended is None:
            self._ended = time.perf_counter()

    def waited(self, seconds: float, rows: int) -> None:
        self.batches += 1
        self.samples += rows
        self.wait_s += seconds
        if self.first_batch_s is None and self._started is not None:
            self.first_batch_s = time.perf_counter() - self._started

    def as_dict(self) -> dict[str, float | int | None]:
        now = self._ended or time.perf_counter()
        elapsed = (now - self._started) if self._started else 0.0
        return {
            "batches": self.batches,
            "samples": self.samples,
            "wait_s": round(self.wait_s, 6),
            "elapsed_s": round(elapsed, 6),
            "wait_fraction": (self.wait_s / elapsed) if elapsed > 0 else 0.0,
            "samples_per_s": (self.samples / elapsed) if elapsed > 0 else 0.0,
            "first_batch_s": self.first_batch_s,
        }


WAITS_BELOW = 0.1  # a trainer waiting less than this share of its time is the bound
STAGE_NAMES = {
    "ray_s": "preprocessing: reading, decoding or the object store; add actors or nodes",
    "peers_s": "other ranks: equal batch counts wait for the rank whose data comes last",
    "iterator_s": "rank iterator: fetching blocks and re-batching",
}


def bound(wait_fraction: float, stalls: dict[str, float]) -> str:
    """Which stage bounds the epoch: the trainer when it barely waited for data, else the
    stage of the data side that held the rank's feeder longest (name: what to do)."""
    if wait_fraction < WAITS_BELOW:
        return "trainer: data was ready; more preprocessing would not help"
    stage = max(STAGE_NAMES, key=lambda k: stalls.get(k, 0.0))
    return STAGE_NAMES[stage]


class Delivered:
    """Keys of the batches one rank's iterator handed to its consumer, in order.

    ``track`` sits on the host side of the iterator (it may run on the prefetch thread)
    and queues each batch's keys; ``pop`` runs when the batch is yielded to the consumer
    and moves its keys to the delivered list. Batches still in flight are not delivered.
    """

    def __init__(self) -> None:
        self._queued: collections.deque[np.ndarray] = collections.deque()
        self._delivered: list[np.ndarray] = []

    def track(self, batches: Iterable[dict[str, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
        for batch in batches:
            self._queued.append(np.array(batch["key"], dtype=np.int64))
            yield batch

    def pop(self) -> int:
        """Deliver the oldest queued batch; its row count (whatever the collate made of it)."""
        keys = self._queued.popleft()
        self._delivered.append(keys)
        return len(keys)

    def keys(self) -> np.ndarray:
        if not self._delivered:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(self._delivered)
