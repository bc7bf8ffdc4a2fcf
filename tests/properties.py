"""The property every multi-rank test checks: exactly once, equal exact-size batches."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def keys_of(batch) -> np.ndarray:
    """A batch's keys: a dict batch's ``key`` (numpy or torch), or the keys themselves."""
    keys = batch["key"] if isinstance(batch, dict) else batch
    return np.asarray(keys.numpy() if hasattr(keys, "numpy") else keys, dtype=np.int64)


def check_exactly_once_and_equal(
    ranks: Sequence[Sequence], *, batch_size: int, good: Iterable[int], left_over: int
) -> np.ndarray:
    """Guarantees 1 and 2 of one epoch: ``ranks[r]`` is rank r's batches (dicts with
    ``key``, or arrays of keys). Every rank got the same number of batches, every batch
    ``batch_size`` rows, no key twice, only keys in ``good``, and at most ``left_over`` of
    them not delivered (``world × batch_size - 1`` when ``drop_last`` alone leaves keys out:
    without it, ranks that delivered nothing would pass). Returns the delivered keys."""
    counts = [len(r) for r in ranks]
    assert len(set(counts)) == 1, f"ranks got different batch counts {counts}"
    sizes = {len(keys_of(b)) for r in ranks for b in r}
    assert sizes <= {batch_size}, f"batches of {sorted(sizes)} rows, not {batch_size}"
    keys = np.concatenate([keys_of(b) for r in ranks for b in r] or [np.zeros(0, np.int64)])
    assert len(np.unique(keys)) == len(keys), "a key was delivered twice"
    good = set(good)
    assert set(keys.tolist()) <= good, "a key that is not a good sample"
    assert len(good) - len(keys) <= left_over, f"{len(good) - len(keys)} good keys lost"
    return keys
