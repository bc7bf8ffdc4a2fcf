"""Length bucketing: less padding than plain batches, with exactly once, equal batch counts
and the same batches for the same seed; the bucketer alone, then through a local Ray."""

from __future__ import annotations

import numpy as np
import pytest

from raypipe import PipelineConfig
from raypipe.loader.buckets import bucket_ids, bucketed, lengths_of
from tests.preprocess.test_samples import make_tokens
from tests.properties import check_exactly_once_and_equal
from tests.ranks import run_ranks

BATCH = 4


def ragged(lengths) -> np.ndarray:
    column = np.empty(len(lengths), dtype=object)
    column[:] = [np.zeros(n, np.int32) for n in lengths]
    return column


def padding(batches, field: str = "tokens") -> int:
    """Pad elements the batches need: rows × longest row, less the rows' own lengths."""
    total = 0
    for b in batches:
        if f"{field}_mask" in b:  # a collated batch
            total += int((~b[f"{field}_mask"]).sum())
        else:
            n = lengths_of(b[field])
            total += len(n) * int(n.max()) - int(n.sum())
    return total


def test_bucket_ids_from_edges_or_a_count():
    lengths = np.array([1, 4, 5, 9, 10, 30])
    np.testing.assert_array_equal(bucket_ids(lengths, (5, 10)), [0, 0, 1, 1, 2, 2])
    assert len(set(bucket_ids(lengths, 3).tolist())) == 3
    assert set(bucket_ids(lengths, 1).tolist()) == {0}
    np.testing.assert_array_equal(lengths_of(ragged([3, 0, 2])), [3, 0, 2])
    np.testing.assert_array_equal(lengths_of(np.zeros((2, 7))), [7, 7])
    clips = np.empty(3, dtype=object)  # audio is (channels, frames), features (frames, dims)
    clips[:] = [np.zeros((2, 16000)), np.zeros((1, 90)), np.zeros((300, 80))]
    np.testing.assert_array_equal(lengths_of(clips), [16000, 90, 300])  # not the channels
    # 80-bin mel features shorter than 80 frames: their frames, where the longest side
    # (80, every row) put every row in one bucket
    clips[:] = [np.zeros((40, 80)), np.zeros((60, 80)), np.zeros((20, 80))]
    np.testing.assert_array_equal(lengths_of(clips), [40, 60, 20])


def test_bucketed_keeps_every_row_and_cuts_exact_batches():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, 203)
    blocks = [{"key": np.arange(a, min(a + 17, 203)), "tokens": ragged(lengths[a : a + 17])}
              for a in range(0, 203, 17)]  # fmt: skip
    for drop_last in (True, False):
        out = list(bucketed(iter(blocks), "tokens", BATCH, window=8, buckets=6,
                            rng=np.random.default_rng(1), drop_last=drop_last))  # fmt: skip
        sizes = [len(b["key"]) for b in out]
        keys = np.concatenate([b["key"] for b in out])
        assert len(np.unique(keys)) == len(keys)
        assert sizes == [BATCH] * (203 // BATCH) + ([] if drop_last else [203 % BATCH])
        again = list(bucketed(iter(blocks), "tokens", BATCH, window=8, buckets=6,
                              rng=np.random.default_rng(1), drop_last=drop_last))  # fmt: skip
        assert all(np.array_equal(a["key"], b["key"]) for a, b in zip(out, again, strict=True))
    plain = list(_plain(blocks))
    assert padding(out) < padding(plain) / 2
    with pytest.raises(ValueError, match=r"^PipelineConfig.bucket_by='tokns': the samples have "
                       r"no such field \(they have \['tokens'\]\)$"):  # fmt: skip
        list(bucketed(iter(blocks), "tokns", BATCH, window=8, buckets=6,
                      rng=np.random.default_rng(1), drop_last=True))  # fmt: skip


def _plain(blocks):
    from raypipe.loader.rebatch import rebatch

    return rebatch(iter(blocks), BATCH, drop_last=False)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("bucketed")
    return root, make_tokens(root, [60, 45, 35], seed=9, max_len=64)


def test_buckets_over_two_ranks_less_padding_same_seed_same_batches(ray_session, tokens):
    root, docs = tokens
    base = PipelineConfig(source=str(root), image_column=None, batch_size=BATCH, actors=(1, 1),
                          follow=False, seed=11)  # fmt: skip
    bucketed_config = base.replace(bucket_by="tokens", buckets=4, bucket_window=4)
    runs = [run_ranks(c, 2, 1)[0] for c in (bucketed_config, bucketed_config, base)]
    first, second, plain = ([r[0] for r in run] for run in runs)
    for ranks in (first, plain):
        check_exactly_once_and_equal(ranks, batch_size=BATCH, good=range(len(docs)),
                                     left_over=2 * BATCH - 1)  # fmt: skip
    for mine, again in zip(first, second, strict=True):
        assert [b["key"].tolist() for b in mine] == [b["key"].tolist() for b in again]
    for batch in (b for r in first for b in r):
        for row, mask, key in zip(batch["tokens"], batch["tokens_mask"], batch["key"],
                                  strict=True):  # fmt: skip
            np.testing.assert_array_equal(row[mask], docs[key])
    flat = [b for r in first for b in r]
    assert padding(flat) < 0.6 * padding([b for r in plain for b in r])
