"""Bad samples: why a sample failed, the ``"raise"`` error, and the skip log of a dataset.

```
 preprocess actors ──(key, where, reason, detail) per task with skips──► SkipStore actor
   (records sent before the block they precede is yielded, so when the      │ counts exact,
    epoch's last block arrives every skip of the epoch is in the store)     │ records capped
 driver / rank iterator / Train worker ── SkipLog.report() / counts() ──────┘
```

Skipped samples never become rows: they are dropped inside the actors, before
``streaming_split``, so every rank still gets the same row count. The side channel is
one small actor per driver (named, no CPUs), holding for each dataset ("run") exact
counts per reason, a bitmap of skipped keys (a retried task cannot count a key twice)
and at most ``max_records`` records.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import uuid
from typing import Any

__all__ = [
    "BadSample",
    "REASONS",
    "SampleError",
    "SkipLog",
    "SkipRecord",
    "SkipStore",
    "detail_of",
    "reason_of",
    "write_reports",
]
assert __all__ == sorted(__all__)

# Why a sample was dropped: the keys of ``counts()``.
REASONS = (
    "bad_audio",  # an audio member libsndfile cannot decode (samples with no image)
    "bad_checksum",  # a TFRecord record whose CRC32C fails (its file and byte offset)
    "bad_label",  # a label that is not an integer
    "bad_record",  # a record that is not a tf.train.Example, an LMDB value not pickle/msgpack
    "decode_error",  # the decoder failed for another reason
    "decompression_bomb",  # more pixels than PipelineConfig.max_image_pixels
    "empty_file",  # zero bytes
    "missing_column",  # a Parquet column, TFRecord feature, LMDB or HDF5 field that is missing
    "missing_label",  # a WebDataset sample without its .cls member
    "not_an_image",  # bytes no decoder recognises (text, random bytes, ...)
    "null_value",  # a Parquet row whose image or label is null
    "transform_error",  # the user's transform (PipelineConfig.transform) raised
    "truncated_image",  # the image data ends early
    "truncated_shard",  # a tar or TFRecord shard that ends early; its lost tail is one sample
    "unreadable",  # the file or member could not be read (permissions, vanished, I/O)
    "unreadable_shard",  # a shard that could not be opened or read to its end
    "wrong_type",  # a column, feature or dataset of the wrong type
)

ACTOR_NAME = "raypipe-skip-store"
MAX_RUNS = 256  # datasets whose skips the store keeps per driver (oldest dropped first)


@dataclasses.dataclass(frozen=True)
class SkipRecord:
    """One dropped sample: its key, where it came from (path, or shard:member), why."""

    key: int
    where: str
    reason: str
    detail: str


class BadSample(Exception):
    """Raised inside the pipeline for a sample known to be bad, with its reason."""

    def __init__(self, reason: str, detail: str):
        assert reason in REASONS, reason
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail

    def __str__(self) -> str:
        return self.detail


class SampleError(RuntimeError):
    """A sample could not be read or decoded under ``on_error="raise"``.

    The message names the file (and member, for shards), the key and the reason; it
    survives Ray's error wrapping (``RayTaskError(SampleError)`` is still a SampleError).
    """

    def __init__(self, where: str, key: int, reason: str, detail: str):
        super().__init__(where, key, reason, detail)
        self.where, self.key, self.reason, self.detail = where, key, reason, detail

    def __str__(self) -> str:
        return f"bad sample {self.where} (key {self.key}): {self.reason}: {self.detail}"


def reason_of(error: BaseException, data: bytes | None = None) -> str:
    """Sort a decoder's exception into one of `REASONS`."""
    from PIL import Image, UnidentifiedImageError

    reason = getattr(error, "reason", None)
    if reason in REASONS:
        return reason
    if data is not None and len(data) == 0:
        return "empty_file"
    if isinstance(error, Image.DecompressionBombError):
        return "decompression_bomb"
    if isinstance(error, UnidentifiedImageError):
        return "not_an_image"
    message = str(error).lower()
    if "truncated" in message or "premature end" in message:
        return "truncated_image"
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return "unreadable"
    return "decode_error"


def detail_of(error: BaseException, data: bytes | None = None) -> str:
    """A one-line description of what went wrong, for the record and the error."""
    from PIL import UnidentifiedImageError

    if isinstance(error, BadSample):
        return error.detail
    if isinstance(error, UnidentifiedImageError) and data is not None:
        return f"no decoder recognises the data (it starts {bytes(data[:8])!r})"
    return f"{type(error).__name__}: {error}"


class SkipStore:
    """The store behind `SkipLog` (run as a Ray actor; plain Python, testable alone)."""

    def __init__(self, max_runs: int = MAX_RUNS):
        self._runs: collections.OrderedDict[str, _Run] = collections.OrderedDict()
        self._max_runs = max_runs

    def add(self, run: str, max_records: int, records: list[tuple[int, str, str, str]]) -> int:
        """Record ``(key, where, reason, detail)`` tuples; returns the run's total so far."""
        entry = self._runs.get(run)
        if entry is None:
            entry = self._runs[run] = _Run(max_records)
            while len(self._runs) > self._max_runs:
                self._runs.popitem(last=False)
        for record in records:
            entry.add(SkipRecord(*record))
        return entry.total

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
    """Skips of one dataset: exact counts, a bitmap of keys seen, the first records."""

    def __init__(self, max_records: int):
        self.max_records = max_records
        self.counts: collections.Counter[str] = collections.Counter()
        self.total = 0
        self.records: list[SkipRecord] = []
        self._seen = bytearray()

    def add(self, record: SkipRecord) -> None:
        byte, bit = divmod(record.key, 8)
        if byte >= len(self._seen):
            self._seen.extend(bytes(byte + 1 - len(self._seen)))
        if self._seen[byte] >> bit & 1:
            return  # the same key again: a retried task
        self._seen[byte] |= 1 << bit
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

    def counts(self) -> dict[str, int]:
        """Skipped samples per reason (reasons with none are left out)."""
        import ray

        return ray.get(self._handle.counts.remote(self.run))

    def report(self) -> dict[str, Any]:
        """``{"skipped", "by_reason", "records": [{key, where, reason, detail}], "records_left_out"}``."""
        import ray

        return ray.get(self._handle.report.remote(self.run))
