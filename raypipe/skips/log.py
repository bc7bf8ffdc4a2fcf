"""The skip log of a dataset: the bad samples the actors dropped, counted per reason and
recorded (`raypipe.skips.records`) in one small actor per driver.

```
 preprocess actors ──(key, where, reason, detail) per task with skips──► SkipStore actor
   (records sent before the block they precede is yielded, so when the      │ counts exact,
    epoch's last block arrives every skip of the epoch is in the store)     │ records capped
 driver / rank iterator / Train worker ── SkipLog.report() / counts() ──────┘
```

Skipped samples never become rows: they are dropped inside the actors, so a rank's rows
are good ones only and the ledger (`raypipe.loader.ledger`) keeps the ranks' batch counts
equal. The side channel is one small actor per driver (named, no CPUs), holding for each
dataset ("run") exact counts per reason, the skipped keys (a bitmap in pieces: a retried task
cannot count a key twice) and at most ``max_records`` records.

What the store holds is bounded by records, not by runs: one store serves every log of a
Ray job (hundreds of ranks with a log each, or two logs an epoch over hundreds of epochs),
so it keeps the counts of up to `MAX_RUNS` runs, and past `RECORDS_KEPT` records over all
of them, the runs touched longest ago give up their last records first.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import uuid
from typing import Any

from raypipe.skips.records import SkipRecord

__all__ = ["REPORT_FILE", "SkipLog", "SkipStore", "write_reports"]
assert __all__ == sorted(__all__)

ACTOR_NAME = "raypipe-skip-store"
MAX_RUNS = 1 << 16  # runs whose counts the store keeps (the one touched longest ago goes)
RECORDS_KEPT = 200_000  # records over all runs: past it the runs touched longest ago drop some


class SkipStore:
    """The store behind `SkipLog` (run as a Ray actor; plain Python, testable alone)."""

    def __init__(self, max_runs: int = MAX_RUNS, records_kept: int = RECORDS_KEPT):
        self._runs: collections.OrderedDict[str, _Run] = collections.OrderedDict()
        self._max_runs, self._records_kept = max_runs, records_kept
        self._records = 0  # held over all runs
        # run → the data error that ended it: pickled, and its text (`SkipLog.stop_with`)
        self._stops: collections.OrderedDict[str, tuple[bytes, str]] = collections.OrderedDict()

    def stop(self, run: str, error: bytes, text: str) -> None:
        """Keep ``run``'s first error that no retry can mend (the last `MAX_RUNS` runs')."""
        self._stops.setdefault(run, (error, text))
        while len(self._stops) > self._max_runs:
            self._stops.popitem(last=False)

    def stopped(self, run: str) -> tuple[bytes, str] | None:
        return self._stops.get(run)

    def is_stopped(self, run: str) -> bool:
        return run in self._stops

    def add(self, run: str, max_records: int, records: list[tuple[int, str, str, str]]) -> int:
        """Record ``(key, where, reason, detail)`` tuples; returns the run's total so far."""
        entry = self._runs.get(run)
        if entry is None:
            entry = self._runs[run] = _Run(max_records)
            while len(self._runs) > self._max_runs:
                self._records -= len(self._runs.popitem(last=False)[1].records)
        self._runs.move_to_end(run)
        held = len(entry.records)
        for record in records:
            entry.add(SkipRecord(*record))
        self._records += len(entry.records) - held
        self._trim(entry)
        return entry.total

    def _trim(self, keep: _Run) -> None:
        """Past `RECORDS_KEPT`, the runs touched longest ago drop their last records, as
        many as it is past; ``keep`` keeps its. Counts and keys seen stay: a live run may
        still get a retried task's keys."""
        for entry in self._runs.values():
            excess = self._records - self._records_kept
            if excess <= 0:
                return
            if entry is not keep and entry.records:
                cut = min(excess, len(entry.records))
                del entry.records[len(entry.records) - cut :]
                self._records -= cut

    def counts(self, run: str) -> dict[str, int]:
        entry = self._runs.get(run)
        return dict(sorted(entry.counts.items())) if entry else {}

    def report(self, run: str) -> dict[str, Any]:
        entry = self._runs.get(run) or _Run(0)
        return {
            "skipped": entry.total,
            "by_reason": dict(sorted(entry.counts.items())),
            "records": [dataclasses.asdict(r) for r in entry.records],
            "records_left_out": entry.total - len(entry.records),
        }


class _Run:
    """Skips of one dataset: exact counts, the keys seen, the first records.

    The keys seen are a bitmap in pieces of ``PIECE`` keys, made as a skip first lands in
    one: a few skips at high keys cost a piece each, where one bitmap up to the highest
    took 25 MB for one skip at key 2·10⁸ (in every epoch's run kept); many cost a bit each."""

    PIECE = 4096  # keys a piece of the bitmap holds (512 bytes)

    def __init__(self, max_records: int):
        self.max_records = max_records
        self.counts: collections.Counter[str] = collections.Counter()
        self.total = 0
        self.records: list[SkipRecord] = []
        self._seen: dict[int, bytearray] = {}  # piece -> its bits

    def add(self, record: SkipRecord) -> None:
        piece, i = divmod(record.key, self.PIECE)
        bits = self._seen.get(piece)
        if bits is None:
            bits = self._seen[piece] = bytearray(self.PIECE // 8)
        if bits[i >> 3] >> (i & 7) & 1:
            return  # the same key again: a retried task
        bits[i >> 3] |= 1 << (i & 7)
        self.counts[record.reason] += 1
        self.total += 1
        if len(self.records) < self.max_records:
            self.records.append(record)


REPORT_FILE = "skipped_samples.json"


def write_reports(logs: dict[str, SkipLog], directory: str, filesystem=None) -> tuple[str, int]:
    """Write ``{dataset name: SkipLog.report()}`` as JSON into ``directory``.

    ``filesystem`` is a ``pyarrow.fs.FileSystem`` (a Ray Train result's); local when None.
    Returns the file's path and the number of samples skipped over all datasets.
    """
    import json

    import pyarrow.fs

    reports = {name: log.report() for name, log in logs.items()}
    path = f"{directory.rstrip('/')}/{REPORT_FILE}"
    filesystem = filesystem or pyarrow.fs.LocalFileSystem()
    with filesystem.open_output_stream(path) as out:
        out.write(json.dumps(reports, indent=1).encode())
    return path, sum(r["skipped"] for r in reports.values())


_STORES: dict[tuple[str, str], Any] = {}  # (node id, job id) -> the store actor's handle
# Ranks in threads of one driver make their logs at once: one of them creates the actor.
# Unlocked, a second thread's get_if_exists handle could replace the creator's here, and
# the actor would die with the creator's handle ("all references ... were removed").
_STORES_LOCK = threading.Lock()


def _driver_store():
    """This driver's store actor, held here: an actor dies with its last handle.

    It lives on the driver's node: with no CPUs asked, Ray could place it on any node,
    and losing that node would lose every dataset's skips and fail ``counts()``.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    context = ray.get_runtime_context()
    session = (context.get_node_id(), context.get_job_id())  # a new ray.init is a new session
    with _STORES_LOCK:
        if session not in _STORES:
            store = ray.remote(SkipStore).options(
                name=ACTOR_NAME, get_if_exists=True, num_cpus=0, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(context.get_node_id(),
                                                                   soft=False),
            )  # fmt: skip
            _STORES.clear()
            _STORES[session] = store.remote()
        return _STORES[session]


class SkipLog:
    """The skipped samples of one dataset; `build_dataset` makes one per dataset.

    Cheap to pickle (an actor handle and a run id): the preprocessing actors write to
    it, and any process (a Ray Train worker, the driver) can read it. Counts are exact;
    ``report()`` holds at most ``max_records`` records (the first ones to arrive).
    """

    def __init__(self, handle, run: str, max_records: int):
        self._handle, self.run, self.max_records = handle, run, max_records

    @classmethod
    def create(cls, *, max_records: int = 1000) -> SkipLog:
        """A new, empty log on this driver's store actor (started on first use)."""
        import ray

        if not isinstance(max_records, int) or max_records < 0:
            raise ValueError(f"{max_records=} must be an integer >= 0")
        if not ray.is_initialized():
            raise RuntimeError("SkipLog.create() needs a running Ray: call ray.init() first")
        return cls(_driver_store(), uuid.uuid4().hex, max_records)

    def epoch(self, epoch: int) -> SkipLog:
        """The log of one epoch of a run-long pipeline (a run of its own in the store)."""
        return SkipLog(self._handle, f"{self.run}/epoch{epoch}", self.max_records)

    def add(self, records: list[SkipRecord]) -> int:
        """Store ``records`` and wait until they are stored (called by the actors); returns
        the run's count of skips so far."""
        import ray

        rows = [dataclasses.astuple(r) for r in records]
        return ray.get(self._handle.add.remote(self.run, self.max_records, rows))

    def stop_with(self, error: BaseException) -> None:
        """Record ``error``, a data error that fails every attempt alike, as what ended
        the run (the first one recorded stays): a rank of a run restarted after it ends at
        once (`is_stopped`), and the driver raises it (`stopped_by`). An error that does
        not pickle is kept as its text."""
        import ray
        import ray.cloudpickle

        try:
            blob = ray.cloudpickle.dumps(error)
        except Exception:  # noqa: BLE001  (its text is what the driver can still raise)
            blob = b""
        ray.get(self._handle.stop.remote(self.run, blob, f"{type(error).__name__}: {error}"))

    def is_stopped(self) -> bool:
        """Whether `stop_with` recorded an error for this run."""
        import ray

        return ray.get(self._handle.is_stopped.remote(self.run))

    def stopped_by(self) -> BaseException | None:
        """The error `stop_with` recorded for this run (a RuntimeError of its text where
        it does not unpickle here); None when there is none."""
        import ray
        import ray.cloudpickle

        if (stopped := ray.get(self._handle.stopped.remote(self.run))) is None:
            return None
        try:
            return ray.cloudpickle.loads(stopped[0])
        except Exception:  # noqa: BLE001
            return RuntimeError(stopped[1])

    def counts(self) -> dict[str, int]:
        """Skipped samples per reason (reasons with none are left out)."""
        import ray

        return ray.get(self._handle.counts.remote(self.run))

    def report(self) -> dict[str, Any]:
        """``{"skipped", "by_reason", "records": [{key, where, reason, detail}], "records_left_out"}``."""
        import ray

        return ray.get(self._handle.report.remote(self.run))
