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


def _cut(rows: dict, sizes) -> list[dict]:
    """``rows`` cut into blocks of ``sizes`` (cycled) rows."""
    n, out, at, i = len(rows["key"]), [], 0, 0
    while at < n:
        size = sizes[i % len(sizes)]
        out.append({k: v[at : at + size] for k, v in rows.items()})
        at, i = at + size, i + 1
    return out


@pytest.mark.parametrize("buffer, batch", [(9, 6), (0, 4), (50, 7), (500, 8)])
def test_shuffled_batches_depend_on_the_rows_not_their_blocks(buffer, batch):
    """The same rows in the same order, cut into blocks of other sizes (tasks sized from
    another machine's object store), give the same batches under the same seed; every
    row once; batches of batch_size but the last without drop_last."""
    from raypipe.loader.shuffle import shuffled

    n = 203
    rows = {"key": np.arange(n), "image": np.arange(n * 12, dtype=np.uint8).reshape(n, 2, 2, 3)}
    for drop_last in (True, False):
        runs = [
            [b["key"].tolist() for b in shuffled(iter(_cut(rows, sizes)), batch, buffer,
                                                   np.random.default_rng(3), drop_last=drop_last)]
            for sizes in ([100], [64], [1, 7, 30], [n])
        ]  # fmt: skip
        assert all(r == runs[0] for r in runs[1:])
        keys = [k for b in runs[0] for k in b]
        assert len(keys) == len(set(keys)) == (n - n % batch if drop_last else n)
        assert all(len(b) == batch for b in runs[0][: n // batch])
        assert keys != sorted(keys)
    out = list(shuffled(iter(_cut(rows, [10])), batch, buffer, np.random.default_rng(3)))
    for b in out:  # each row's fields travel together
        np.testing.assert_array_equal(b["image"], rows["image"][b["key"]])


def test_shuffled_keeps_ragged_fields_row_by_row():
    from raypipe.loader.shuffle import shuffled

    ragged = np.empty(3, dtype=object)
    ragged[:] = [np.arange(1), np.arange(2), np.arange(3)]
    blocks = [{"key": np.arange(3), "t": np.zeros((3, 2))}, {"key": np.arange(3, 6), "t": ragged}]
    out = list(shuffled(iter(blocks), 2, 2, np.random.default_rng(0), drop_last=False))
    rows = {int(k): t for b in out for k, t in zip(b["key"], b["t"], strict=True)}
    assert sorted(rows) == list(range(6))
    assert [len(rows[k]) for k in range(3, 6)] == [1, 2, 3]
    assert all(np.array_equal(rows[k], np.zeros(2)) for k in range(3))


def test_shuffled_widens_a_column_as_concatenating_its_blocks_would():
    from raypipe.loader.shuffle import shuffled

    blocks = [{"key": np.arange(0)}, {"key": np.arange(3), "t": np.array(["a", "b", "c"])},
              {"key": np.arange(3, 6), "t": np.array(["hello", "wide", "words"])}]  # fmt: skip
    blocks[0]["t"] = np.zeros(0, dtype=object)  # an empty first block says nothing
    out = list(shuffled(iter(blocks), 2, 2, np.random.default_rng(0), drop_last=False))
    rows = {int(k): str(t) for b in out for k, t in zip(b["key"], b["t"], strict=True)}
    assert rows == {0: "a", 1: "b", 2: "c", 3: "hello", 4: "wide", 5: "words"}
    nums = [
        {"key": np.arange(2), "x": np.arange(2)},
        {"key": np.arange(2, 4), "x": np.array([0.5, 1.5])},
    ]
    out = list(shuffled(iter(nums), 2, 0, np.random.default_rng(0), drop_last=False))
    assert sorted(float(x) for b in out for x in b["x"]) == [0.0, 0.5, 1.0, 1.5]


def test_blocks_whose_rows_differ_in_shape_join_as_ragged_rows():
    """Each worker stacks a field whose rows had one shape there; another worker's block may
    hold another shape (boxes per image, one shard's resolution): the rank joins them row
    by row instead of failing."""
    from raypipe.loader.rebatch import concat_column

    a, b = np.arange(12).reshape(4, 3), np.arange(16).reshape(4, 4)
    out = concat_column([a, b])
    assert out.dtype == object and len(out) == 8
    assert [r.tolist() for r in out] == [r.tolist() for r in (*a, *b)]
    same = concat_column([a, a + 1])  # one shape: stacked as before
    assert same.dtype != object and same.shape == (8, 3)


def test_signed_and_unsigned_integer_blocks_join_as_integers():
    """Two workers' blocks of one field, uint64 and int64 ids: numpy's common type is
    float64, exact to 2**53, and an id came out one off (and a label a float). They join
    as int64, as padded rows do, or fail naming the field when no integer type holds both."""
    from raypipe.loader.rebatch import concat_column
    from raypipe.loader.shuffle import shuffled

    big = 2**62 + 1
    parts = [np.array([[big, 3]], np.uint64), np.array([[1, 2]], np.int64)]
    out = concat_column(parts, "ids")
    assert out.dtype == np.int64 and out.tolist() == [[big, 3], [1, 2]]
    blocks = [{"key": np.arange(1), "ids": parts[0]}, {"key": np.arange(1, 2), "ids": parts[1]}]
    got = rebatch(iter(blocks), 2, drop_last=True)
    assert [b["ids"].tolist() for b in got] == [[[big, 3], [1, 2]]]
    mixed = list(shuffled(iter(blocks), 2, 2, np.random.default_rng(0), drop_last=False))
    assert sorted(r for b in mixed for r in b["ids"].tolist()) == [[1, 2], [big, 3]]
    assert all(b["ids"].dtype == np.int64 for b in mixed)
    with pytest.raises(ValueError, match="field 'ids' has unsigned values up to"):
        concat_column([np.array([2**63], np.uint64), np.array([-1], np.int64)], "ids")
    over = [{"key": np.arange(1), "ids": np.array([[2**63 + 5, 1]], np.uint64)}, blocks[1]]
    with pytest.raises(ValueError, match="field 'ids' has unsigned values up to"):
        list(shuffled(iter(over), 2, 2, np.random.default_rng(0), drop_last=False))
