"""Packing: documents into rows of exactly seq_len tokens, every token once over the
ranks, equal batch counts, the same packing for the same seed; the packer alone, then
through a real local Ray."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypipe import PipelineConfig
from raypipe.loader.packing import pack
from raypipe.plan.shards import list_shards
from tests.preprocess.test_samples import make_tokens
from tests.ranks import run_ranks

SEQ_LEN, BATCH = 16, 4


def check_rows(batch: dict, seq_len: int) -> None:
    """Rows of seq_len tokens; segments 1, 2, ... then padding (0); positions from 0 in
    each segment; a segment's tokens consecutive ids (the documents are runs of ids)."""
    tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["position_ids"]
    assert tokens.shape == seg.shape == pos.shape and tokens.shape[1] == seq_len
    for t, s, p in zip(tokens, seg, pos, strict=True):
        used = s[s > 0]
        assert (s[len(used) :] == 0).all() and (t[len(used) :] == 0).all(), "padding at the end"
        np.testing.assert_array_equal(np.unique(used), np.arange(1, len(np.unique(used)) + 1))
        assert (np.diff(used) >= 0).all()
        for k in np.unique(used):
            np.testing.assert_array_equal(p[s == k], np.arange((s == k).sum()))
            assert (np.diff(t[s == k]) == 1).all(), "a segment is one document's run of ids"


def test_pack_keeps_every_token_once_in_order():
    rng = np.random.default_rng(0)
    for _ in range(200):
        seq_len, batch = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        docs, start = [], 0
        for key in range(int(rng.integers(0, 12))):
            n = int(rng.integers(0, 20))
            docs.append((key, np.arange(start, start + n, dtype=np.int32)))
            start += n
        need = -(-start // seq_len)
        for drop_last in (False, True):
            rows = (need // batch if drop_last else -(-need // batch)) * batch
            counts: dict = {}
            out = list(pack(iter(docs), "tokens", seq_len=seq_len, batch_size=batch, rows=rows,
                            counts=counts))  # fmt: skip
            assert len(out) * batch == rows == counts["packed_rows"]
            got = [b["tokens"][b["segment_ids"] > 0] for b in out]
            got = np.concatenate(got) if got else np.zeros(0, np.int32)
            np.testing.assert_array_equal(got, np.arange(len(got)))
            assert counts["tokens"] == len(got) and counts["dropped_tokens"] == start - len(got)
            for b in out:
                check_rows(b, seq_len)
            if not drop_last and rows:
                assert len(got) == start
                assert [k for b in out for k in b["key"]] == [k for k, _ in docs]


def test_documents_of_two_token_types_are_packed_into_the_type_that_holds_both():
    """Files of uint16 and int32 ids (each Parquet file keeps its own): a batch begun with
    the narrow type widens, never wrapping an id past its range."""
    docs = [(0, np.array([1, 2], np.uint16)), (1, np.array([70000, 3], np.int32)),
            (2, np.array([-5, 4, 4, 4], np.int64)), (3, np.array([65535, 7], np.uint16))]  # fmt: skip
    out = list(pack(iter(docs), "tokens", seq_len=4, batch_size=1, rows=3, counts={}))
    got = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in out])
    assert got.tolist() == [1, 2, 70000, 3, -5, 4, 4, 4, 65535, 7]
    assert out[0]["tokens"].dtype == np.int32 and out[1]["tokens"].dtype == np.int64
    assert out[2]["tokens"].dtype == np.uint16  # a batch of one type keeps it


def test_an_empty_document_from_a_transforms_list_is_packed_as_empty():
    """A transform that returns Python lists makes an empty document a float64 array
    (numpy's type of ``[]``): it takes the others' type, as padding gives it, where it
    stopped the rank's run as "not a sequence of integers"."""
    from raypipe.loader.packing import documents
    from raypipe.preprocess.usermap import _to_numpy

    rows = np.empty(3, dtype=object)
    rows[:] = [_to_numpy([5, 6, 7]), _to_numpy([]), _to_numpy([8])]
    block = {"key": np.arange(3), "tokens": rows}
    out = list(pack(documents([block], "tokens"), "tokens", seq_len=4, batch_size=1, rows=1,
                    counts={}))  # fmt: skip
    assert out[0]["tokens"].tolist() == [[5, 6, 7, 8]] and list(out[0]["key"]) == [0, 1, 2]
    with pytest.raises(ValueError, match="key 1 holds float64 with 1 dims"):
        list(documents([{"key": np.arange(2), "tokens": [np.array([1]), np.array([0.5])]}],
                       "tokens"))  # fmt: skip


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    return root, make_tokens(root, seed=5)


def packed(root, **kw) -> PipelineConfig:
    return PipelineConfig(source=str(root), image_column=None, pack="tokens", seq_len=SEQ_LEN,
                          batch_size=BATCH, actors=(1, 1), follow=False, seed=7, **kw)  # fmt: skip


def test_every_token_once_over_two_ranks_and_the_same_packing_for_the_same_seed(
    ray_session, tokens
):
    root, docs = tokens
    total = sum(len(d) for d in docs)
    runs = [run_ranks(packed(root), 2, 2, drop_last=False) for _ in range(2)]
    (out, stats), (again, _) = runs
    for epoch in range(2):
        ranks = [r[epoch] for r in out]
        assert len(ranks[0]) == len(ranks[1]) > 0, "equal batch counts"
        delivered = []
        for batch in (b for r in ranks for b in r):
            assert batch["tokens"].shape == (BATCH, SEQ_LEN)
            check_rows(batch, SEQ_LEN)
            delivered.append(batch["tokens"][batch["segment_ids"] > 0])
        tokens_seen = np.concatenate(delivered)
        assert len(tokens_seen) == total, "every token delivered"
        np.testing.assert_array_equal(np.sort(tokens_seen), np.arange(total))  # once each
        keys = sorted(k for r in ranks for b in r for k in b["key"])
        assert keys == list(range(len(docs))), "every document ends once"
        for r in range(2):
            s = stats[r][epoch]
            assert s["dropped_tokens"] == 0 and s["packed_rows"] == len(ranks[r]) * BATCH
        for mine, theirs in zip(ranks, (r[epoch] for r in again), strict=True):
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs, strict=True):
                np.testing.assert_array_equal(a["tokens"], b["tokens"])
                np.testing.assert_array_equal(a["segment_ids"], b["segment_ids"])
    first = np.concatenate([b["tokens"] for b in out[0][0]])
    second = np.concatenate([b["tokens"] for b in out[0][1]])
    assert not np.array_equal(first[: len(second)], second[: len(first)]), "epochs differ"


def test_drop_last_drops_only_a_counted_tail(ray_session, tokens):
    root, docs = tokens
    total = sum(len(d) for d in docs)
    out, stats = run_ranks(packed(root), 2, 1)
    ranks = [r[0] for r in out]
    assert len(ranks[0]) == len(ranks[1]) > 0
    delivered = np.concatenate([b["tokens"][b["segment_ids"] > 0] for r in ranks for b in r])
    assert len(np.unique(delivered)) == len(delivered), "no token twice"
    dropped = sum(stats[r][0]["dropped_tokens"] for r in range(2))
    assert len(delivered) + dropped == total
    per_rank = [stats[r][0]["tokens"] + stats[r][0]["dropped_tokens"] for r in range(2)]
    n = min(t // SEQ_LEN // BATCH for t in per_rank)
    assert len(ranks[0]) == n and len(delivered) == 2 * n * BATCH * SEQ_LEN, "only the tail"
    for batch in (b for r in ranks for b in r):
        assert (batch["segment_ids"] > 0).all(), "no padding rows with drop_last"


def test_pack_refuses_a_column_that_is_not_integer_sequences(tmp_path):
    table = pa.table({"tokens": pa.array([[0.5, 1.0], [2.0]], pa.list_(pa.float32()))})
    pq.write_table(table, tmp_path / "f.parquet")
    with pytest.raises(ValueError, match=r"pack='tokens'.*not a 1-D sequence of integers"):
        list_shards(packed(tmp_path))
    with pytest.raises(ValueError, match=r"pack='ids'.*has no such column"):
        list_shards(packed(tmp_path).replace(pack="ids"))


def test_a_damaged_row_group_is_planned_as_nothing_not_a_failed_listing(ray_session, tmp_path):
    """Its rows are the reader's to skip as unreadable; the listing reads the others'
    lengths (a damaged page header once stopped it with pyarrow's thrift error), and the
    run packs every token of the rest once."""
    docs = [list(range(1, 2 + i % 7)) for i in range(40)]
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))}), path,
                   row_group_size=20, compression="none", use_dictionary=False)  # fmt: skip
    start = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start : start + 12] = b"\xff" * 12  # row group 0's first page header
    path.write_bytes(bytes(raw))
    listing = list_shards(packed(tmp_path))
    assert listing.num_samples == 40
    np.testing.assert_array_equal(listing.lengths, [0] * 20 + [len(d) for d in docs[20:]])
    config = packed(tmp_path, max_skipped=None)
    (ranks, stats) = run_ranks(config, 2, 1, drop_last=False)
    keys = sorted(k for r in ranks for b in r[0] for k in b["key"])
    assert keys == list(range(20, 40)), "every readable document ends once"
    tokens_seen = sum(int((b["segment_ids"] > 0).sum()) for r in ranks for b in r[0])
    assert tokens_seen == sum(len(d) for d in docs[20:])
    skipped = [s[0]["skipped"] for s in stats]  # each rank's own
    assert sum(n for c in skipped for n in c.values()) == 20
    assert {reason for c in skipped for reason in c} == {"unreadable"}


def test_a_row_group_damaged_past_its_first_pages_lists_the_rows_the_reader_gets(tmp_path):
    """The reader delivers a damaged group's rows up to the page that fails: each of those
    has its length listed (the whole group listed as 0 once stopped the run mid-epoch,
    packing refusing a document 'not as long as listed')."""
    docs = [list(range(1, 2 + i % 7)) for i in range(1024)]
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))}), path,
                   row_group_size=1024, compression="gzip", use_dictionary=False,
                   data_page_size=256, write_batch_size=64)  # fmt: skip
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(0)
    raw = bytearray(path.read_bytes())
    at = chunk.data_page_offset + chunk.total_compressed_size - 60  # a late page
    raw[at : at + 12] = b"\xff" * 12
    path.write_bytes(bytes(raw))
    listing = list_shards(packed(tmp_path))
    shard = listing.shards[0]
    got = list(listing.reader.read(shard.path, shard.first_key, shard.label))
    read = [r.key for r in got if r.reason is None]
    assert 0 < len(read) < 1024 and {r.reason for r in got if r.reason} == {"unreadable"}
    np.testing.assert_array_equal(listing.lengths[read], [len(docs[k]) for k in read])
    assert not listing.lengths[len(read) :].any()


def test_iter_torch_batches_refuses_packing():
    from raypipe import iter_torch_batches

    class Source:  # what iter_torch_batches checks a source for
        def iter_batches(self, **kwargs):
            return iter(())

    config = PipelineConfig(source="d", image_column=None, pack="tokens", seq_len=8)
    with pytest.raises(ValueError, match=r"PipelineConfig.pack='tokens': packing and bucketing"):
        iter_torch_batches(Source(), config)


def test_a_resumed_epoch_packs_the_documents_it_had_left_once(ray_session, tokens):
    from raypipe.plan.shards import list_shards
    from raypipe.train.state import PipelineState

    root, docs = tokens
    config = packed(root)
    listing = list_shards(config)
    consumed = np.random.default_rng(3).random(len(docs)) < 0.4  # keys a run delivered
    state = PipelineState(0, config.seed, len(docs), listing.fingerprint, consumed)
    out, stats = run_ranks(config, 2, 1, drop_last=False, start=state)
    ranks = [r[0] for r in out]
    assert len(ranks[0]) == len(ranks[1])
    delivered = np.concatenate([b["tokens"][b["segment_ids"] > 0] for r in ranks for b in r])
    left = np.concatenate([docs[k] for k in np.flatnonzero(~consumed)])
    np.testing.assert_array_equal(np.sort(delivered), np.sort(left))
    assert (
        sorted(k for r in ranks for b in r for k in b["key"]) == np.flatnonzero(~consumed).tolist()
    )


def test_a_loader_over_packed_rows_counts_their_batches(ray_session, tokens):
    """`raypipe.Loader` with packing: ``len()`` is the batches it yields, and its state names
    the epoch until the last of them: rows of seq_len tokens outnumber the documents here,
    so counting documents ended the epoch early and a resume skipped the rest."""
    from raypipe import Loader

    root, docs = tokens
    with Loader(packed(root), epochs=1, device="cpu") as loader:
        n, epochs = len(loader), []
        for _ in loader:
            epochs.append(loader.state_dict()["epoch"])
    assert len(epochs) == n > len(docs) // BATCH
    assert epochs == [0] * (n - 1) + [1]


def test_short_documents_are_sized_as_documents_not_images(ray_session, tmp_path):
    """Blocks of packed documents are sized from the documents' stored size: 5,000
    documents of 1-7 tokens fill a batch of 16 rows of 1,024 tokens with 4,096 documents a
    block, which as 224² images (the old sizing) would be 588 MiB, more than a rank's share
    of the session's store: the run was refused naming an image_size it does not have."""
    docs = make_tokens(tmp_path, [5000], seed=3, max_len=7)
    config = PipelineConfig(source=str(tmp_path), image_column=None, pack="tokens",
                            seq_len=1024, batch_size=16, seed=7)  # fmt: skip
    out, _ = run_ranks(config, 2, 1, drop_last=False)
    delivered = np.concatenate([b["tokens"][b["segment_ids"] > 0] for r in out for b in r[0]])
    np.testing.assert_array_equal(np.sort(delivered), np.arange(sum(len(d) for d in docs)))
