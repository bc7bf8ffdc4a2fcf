"""Property tests of the re-batching stage alone (no Ray): exact sizes, nothing lost."""

import numpy as np
import pytest

from raypipe.loader.rebatch import rebatch


def blocks_of(sizes, start=0):
    out, k = [], start
    for n in sizes:
        out.append({"key": np.arange(k, k + n), "image": np.zeros((n, 3, 2, 2), np.uint8)})
        k += n
    return out


@pytest.mark.parametrize("seed", range(30))
def test_rebatch_exact_sizes_and_order(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 40, rng.integers(1, 30)).tolist()
    batch_size = int(rng.integers(1, 33))
    total = sum(sizes)
    for drop_last in (True, False):
        out = list(rebatch(blocks_of(sizes), batch_size, drop_last=drop_last))
        lens = [len(b["key"]) for b in out]
        full = total // batch_size
        assert lens[:full] == [batch_size] * full
        assert len(out) == (full if drop_last or total % batch_size == 0 else full + 1)
        keys = np.concatenate([b["key"] for b in out]) if out else np.array([], int)
        expect = total if not drop_last else full * batch_size
        assert keys.tolist() == list(range(expect))
        assert all(b["image"].shape[0] == len(b["key"]) for b in out)


def test_rebatch_passes_exact_batches_through_without_copy():
    blocks = blocks_of([8, 8])
    out = list(rebatch(blocks, 8, drop_last=True))
    assert out[0] is blocks[0] and out[1] is blocks[1]


def test_short_batches_mid_stream_are_merged():
    # Ray can yield [8, 8, 8, 6, 8, 2] for 40 rows (issue 66085); we must give 5 × 8.
    out = list(rebatch(blocks_of([8, 8, 8, 6, 8, 2]), 8, drop_last=True))
    assert [len(b["key"]) for b in out] == [8] * 5
