"""Epoch plans: which keys each rank reads in an epoch, in which order, in which tasks.

Pure functions of the listing, the seed, the epoch and the world size, so every process
(the driver, each rank, each preprocessing actor) computes the same plan on its own and
nothing but three integers per task crosses the object store::

    shards (sorted, dense keys) ─► seeded shard permutation (seed, epoch) ─► the epoch's
    key order ─► minus keys consumed before a resume ─► np.array_split into ``world``
    contiguous slices (sizes differ by at most one) ─► rank r's slice ─► tasks of
    ``files_per_task`` image files, or of one piece of a shard (tar, Parquet, records) of
    at most that many samples: a task's output is bounded whatever a shard holds

With per-key weights (packing: each document's tokens) the slices even out the weight
instead of the count, so ranks pack about the same number of rows.

A rank's keys in an epoch depend on nothing that happens at run time, so the same seed
gives every rank the same samples in the same order, whatever the timing or pool size.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading

import numpy as np

from raypipe.plan.shards import Listing, shard_permutation

__all__ = ["RankPlan", "epoch_keys", "rank_pool"]
assert __all__ == sorted(__all__)


def epoch_keys(
    first: np.ndarray, counts: np.ndarray, *, seed: int, epoch: int, shuffle: bool
) -> np.ndarray:
    """Every key of the epoch in reading order: shards in a ``(seed, epoch)`` permutation
    (the one `raypipe.plan.shards.epoch_order` uses), members of a shard in key order."""
    if shuffle:
        perm = shard_permutation(len(first), seed=seed, epoch=epoch)
        first, counts = first[perm], counts[perm]
    total = int(counts.sum())
    offsets = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) + np.repeat(first - offsets, counts)


@dataclasses.dataclass(frozen=True, eq=False)
class RankPlan:
    """The epochs of one rank: its keys per epoch and the tasks that read them.

    Attributes:
        first, counts: first key and sample count of every shard, in key order.
        seed, shuffle: ``PipelineConfig.seed`` and ``shuffle_files``.
        rank, world_size: this rank and the number of ranks.
        per_task: image files one task reads (shards of one sample), or the most samples
            of a shard one task reads (a longer run of a shard is cut into near-equal pieces).
        resume_epoch, consumed: keys of ``resume_epoch`` already consumed (bool per
            key), left out of that epoch before it is split; None for a fresh start.
        weights: a weight per key (packing: its document's tokens) that the split evens
            out instead of the number of keys; None: slices of equal key counts.
    """

    first: np.ndarray
    counts: np.ndarray
    seed: int
    shuffle: bool
    rank: int
    world_size: int
    per_task: int
    resume_epoch: int = -1
    consumed: np.ndarray | None = None
    weights: np.ndarray | None = None

    @classmethod
    def of(cls, listing: Listing, *, seed: int, shuffle: bool, rank: int, world_size: int,
           per_task: int, resume_epoch: int = -1, consumed=None,
           weights=None) -> RankPlan:  # fmt: skip
        if not 0 <= rank < world_size:
            raise ValueError(f"{rank=} must be in 0..{world_size - 1} ({world_size=})")
        first, counts = listing.shards.first_key, listing.shards.num_samples
        if consumed is not None:
            consumed = np.asarray(consumed, dtype=bool)
            if consumed.shape != (int(counts.sum()),):
                raise ValueError(f"consumed has shape {consumed.shape}, not ({counts.sum()},)")
        if weights is not None:
            weights = np.asarray(weights)
            if weights.shape != (int(counts.sum()),):
                raise ValueError(f"weights has shape {weights.shape}, not ({counts.sum()},)")
        return cls(first, counts, seed, shuffle, rank, world_size, per_task, resume_epoch,
                   consumed, weights)  # fmt: skip

    def __getstate__(self) -> dict:
        """Pickled (every rank's tasks carry their plan to the workers) with ``consumed`` as
        bits: a byte per sample of the whole dataset was 1 GB at 10⁹ samples a rank."""
        state = dict(self.__dict__)
        if self.consumed is not None:
            state["consumed"] = (np.packbits(self.consumed), len(self.consumed))
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state.get("consumed"), tuple):
            bits, n = state["consumed"]
            state = {**state, "consumed": np.unpackbits(bits, count=n).astype(bool)}
        self.__dict__.update(state)

    @property
    def num_samples(self) -> int:
        return int(self.counts.sum())

    def all_keys(self, epoch: int) -> np.ndarray:
        """The epoch's keys in order, before the split: what all ranks read together."""
        keys = epoch_keys(self.first, self.counts, seed=self.seed, epoch=epoch,
                          shuffle=self.shuffle)  # fmt: skip
        if epoch == self.resume_epoch and self.consumed is not None:
            keys = keys[~self.consumed[keys]]
        return keys

    def sizes(self, epoch: int) -> list[int]:
        """Samples each rank is given in ``epoch`` (before bad ones are skipped)."""
        if self.weights is not None:
            return [len(keys) for keys in self.split(epoch)]
        total = self.num_samples
        if epoch == self.resume_epoch and self.consumed is not None:
            total -= int(self.consumed.sum())
        q, r = divmod(total, self.world_size)
        return [q + (i < r) for i in range(self.world_size)]

    def split(self, epoch: int) -> list[np.ndarray]:
        """Every rank's keys of ``epoch``: the epoch's keys in ``world_size`` contiguous
        slices whose sizes differ by at most one; with ``weights``, slices whose weights
        differ by at most about one key's (rank r's slice ends at the first key where the
        running weight reaches ``(r + 1) / world_size`` of the epoch's)."""
        keys = self.all_keys(epoch)
        if self.weights is None:
            return np.array_split(keys, self.world_size)
        running = np.cumsum(self.weights[keys])  # (keys,): weight up to and with each key
        total = running[-1] if len(running) else 0
        targets = total * np.arange(1, self.world_size) / self.world_size
        cuts = np.minimum(np.searchsorted(running, targets, side="left") + 1, len(keys))
        return np.split(keys, cuts)

    def keys(self, epoch: int) -> np.ndarray:
        """This rank's keys of ``epoch``, in reading order (cached: actors ask per task)."""
        return _rank_keys(self, epoch)

    def shard_of(self, keys: np.ndarray) -> np.ndarray:
        """Index of the shard holding each key."""
        return np.searchsorted(self.first, keys, side="right") - 1

    def tasks(self, epoch: int) -> list[tuple[int, int]]:
        """``(lo, hi)`` positions into `keys`: ``per_task`` image files, or one piece of a
        shard of at most ``per_task`` samples."""
        return [(lo, hi) for lo, hi in self.task_bounds(epoch).tolist()]

    def task_bounds(self, epoch: int) -> np.ndarray:
        """`tasks` as a ``(tasks, 2)`` array, from the shards the rank's slice touches
        and not its keys (but with ``weights``): a run's task table (`task_table`, every
        epoch at its start) costs O(shards) an epoch, not O(keys). Where every shard holds
        one sample (an image folder's files) each key is a run of its own, so the rank's
        key count alone gives the bounds."""
        if self.weights is None and self.one_per_shard:
            count = self.sizes(epoch)[self.rank]
            starts = np.arange(0, count, self.per_task, dtype=np.int64)
        else:
            if self.weights is None:  # each touched shard's run of keys, from the shards
                runs = _rank_runs(self, epoch)[2]
            else:
                shard = self.shard_of(self.keys(epoch))
                runs = np.diff(np.flatnonzero(np.diff(shard, prepend=-1, append=-1)))
            count = int(runs.sum())
            starts, runs = _starts(runs)[runs > 0], runs[runs > 0]
            if self.one_per_shard:  # packing over files of one document each
                starts = starts[:: self.per_task]
            else:
                starts = _pieces(starts, runs, self.per_task)
        ends = np.append(starts[1:], count) if count else starts
        return np.stack([starts, ends], axis=1).astype(np.int64, copy=False)

    @functools.cached_property
    def one_per_shard(self) -> bool:
        """Every shard holds exactly one sample."""
        return bool(np.all(self.counts == 1))


KEYS_KEPT, KEYS_CACHE, KEYS_CACHE_BYTES = 4, 32, 64 << 20  # entries, entries, bytes: `_rank_keys`
_KEYS: collections.OrderedDict = collections.OrderedDict()  # (plan, epoch) → keys, newest last
_KEYS_LOCK = threading.Lock()  # an actor's threads share it


def rank_pool(actors: tuple[int, int], world_size: int, rank: int = 0) -> tuple[int, int]:
    """Rank ``rank``'s share of ``PipelineConfig.actors`` (the run's total): each bound
    split in whole actors, the first ranks taking one more, so the shares add up to the
    run's (a fixed pool stays fixed: min = max on every rank); at least one a rank."""
    lo, hi = (n // world_size + (rank < n % world_size) for n in actors)
    return max(1, lo), max(1, lo, hi)


def _rank_keys(plan: RankPlan, epoch: int) -> np.ndarray:
    """`RankPlan.keys`, cached: the newest `KEYS_KEPT` entries always (two ranks sharing
    a pooled worker at an epoch's turn, which alternate: fewer rebuilt the keys at every
    task, 70-130 ms at 10M samples), more up to `KEYS_CACHE_BYTES` and `KEYS_CACHE`
    entries (32 entries of a 1.28M-sample epoch held 313 MiB)."""
    with _KEYS_LOCK:
        found = _KEYS.get((plan, epoch))
        if found is not None:
            _KEYS.move_to_end((plan, epoch))
            return found
    keys = _build_rank_keys(plan, epoch)
    with _KEYS_LOCK:
        _KEYS[(plan, epoch)] = keys
        held = sum(k.nbytes for k in _KEYS.values())
        while len(_KEYS) > KEYS_KEPT and (len(_KEYS) > KEYS_CACHE or held > KEYS_CACHE_BYTES):
            held -= _KEYS.popitem(last=False)[1].nbytes
    return keys


def _build_rank_keys(plan: RankPlan, epoch: int) -> np.ndarray:
    """``np.array_split(plan.all_keys(epoch), world_size)[rank]``, built from the shards
    the rank's slice touches only: O(shards + the rank's keys), not O(the epoch's keys).
    With weights (packing), the weighted `RankPlan.split`'s slice."""
    if plan.weights is not None:
        return _frozen(plan.split(epoch)[plan.rank].copy())
    first, counts, runs, skip = _rank_runs(plan, epoch)
    if len(runs) == 0:
        return _frozen(np.zeros(0, dtype=np.int64))
    # as `epoch_keys`, over the touched shards; in a resumed epoch, less what was consumed
    keys = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(first - _starts(counts), counts)
    if epoch == plan.resume_epoch and plan.consumed is not None:
        keys = keys[~plan.consumed[keys]]
    return _frozen(keys[skip : skip + int(runs.sum())].copy())


def _rank_runs(plan: RankPlan, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The shards the rank's slice of ``epoch`` touches, in reading order (their first
    keys and sample counts), the run of keys it reads from each (the samples left in each
    after a resume, less what falls before or after the slice; 0 for a shard a resume
    emptied) and where its first run starts in its shard's keys: O(shards), no key."""
    first, counts = plan.first, plan.counts
    resumed = epoch == plan.resume_epoch and plan.consumed is not None
    left = counts - _consumed_per_shard(plan.consumed, counts) if resumed else counts
    if plan.shuffle:
        perm = shard_permutation(len(first), seed=plan.seed, epoch=epoch)
        first, counts, left = first[perm], counts[perm], left[perm]
    # left: (shards,) samples each shard still holds this epoch, in reading order
    ends = np.cumsum(left)
    q, r = divmod(int(ends[-1]) if len(ends) else 0, plan.world_size)
    lo = plan.rank * q + min(plan.rank, r)  # the rank's positions [lo, hi) in that order
    hi = lo + q + (plan.rank < r)
    if hi == lo:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, 0
    a = int(np.searchsorted(ends, lo, side="right"))  # the shards holding lo .. hi-1
    b = int(np.searchsorted(ends, hi - 1, side="right")) + 1
    skip = lo - int(ends[a] - left[a])  # positions before lo in the first touched shard
    runs = left[a:b].copy()
    runs[0] -= skip
    runs[-1] -= int(ends[b - 1]) - hi
    return first[a:b], counts[a:b], runs, skip


def _starts(lengths: np.ndarray) -> np.ndarray:
    return np.cumsum(lengths) - lengths


def _pieces(starts: np.ndarray, runs: np.ndarray, most: int) -> np.ndarray:
    """Where each piece starts when every run (``runs`` samples from ``starts``) is cut
    into the fewest near-equal pieces of at most ``most`` samples (the first ones of a
    run one longer, as `np.array_split` cuts)."""
    cuts = -(-runs // most)  # pieces of each run
    i = np.arange(int(cuts.sum())) - np.repeat(_starts(cuts), cuts)  # piece index in its run
    size, longer = np.repeat(runs // cuts, cuts), np.repeat(runs % cuts, cuts)
    return np.repeat(starts, cuts) + i * size + np.minimum(i, longer)


def _frozen(keys: np.ndarray) -> np.ndarray:
    keys.setflags(write=False)
    return keys


def _consumed_per_shard(consumed: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Consumed keys in each shard, shards in key order (dense keys: each shard's keys
    follow the last one's), summed in place over the per-key mask."""
    out = np.zeros(len(counts), dtype=np.int64)
    full = counts > 0
    starts = (np.cumsum(counts) - counts)[full]
    if len(starts):  # reduceat sums from each start to the next: one shard each
        out[full] = np.add.reduceat(consumed.view(np.uint8), starts, dtype=np.int64)
    return out
