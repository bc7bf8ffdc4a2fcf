"""The decoded cache on shard formats whose labels are read per sample (WebDataset, Parquet,
TFRecord): a cached sample keeps the label its shard holds, every piece of a large record
file is cached, and what a reader reports about a sample wins over what was kept of it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from raypipe import PipelineConfig
from raypipe.formats import pieces
from raypipe.formats.sample import RawSample
from raypipe.formats.storage import Storage
from raypipe.plan.shards import list_shards
from raypipe.preprocess.cache import node, reuse
from raypipe.preprocess.cache.disk import DiskStore
from raypipe.preprocess.cache.reuse import SampleCache
from raypipe.preprocess.cache.store import Entry
from raypipe.skips.records import BadSample
from tests.conftest import image_bytes
from tests.formats.test_formats import labels_of, png
from tests.formats.test_tfrecord import tf_shards
from tests.preprocess.test_cache import settled
from tests.ranks import run_ranks


def labels_by_epoch(config: PipelineConfig, epochs: int) -> list[dict[int, int]]:
    """``{key: label}`` of each epoch of one rank."""
    out, _ = run_ranks(config, 1, epochs, drop_last=False, normalize=False)
    return [{int(k): int(label) for b in out[0][e]
             for k, label in zip(b["key"], b["label"], strict=True)}
            for e in range(epochs)]  # fmt: skip


@pytest.mark.parametrize("fmt", ["webdataset", "parquet"])
def test_cached_samples_keep_the_labels_their_shards_hold(ray_session, datasets, fmt):
    base = PipelineConfig(source=str(datasets[fmt]), image_size=8, batch_size=5,
                          rows_per_block=5)  # fmt: skip
    (want,) = labels_by_epoch(base, 1)
    assert len(want) == 61 and len(set(want.values())) > 1
    cached = base.replace(cache="memory", cache_max_side=13)  # a cache no other test has
    try:
        assert labels_by_epoch(cached, 3) == [want] * 3
        s = settled(cached, 3 * 61)
        # an epoch's read-ahead may decode a sample the one before has not kept yet
        assert s["hits"] + s["misses"] == 3 * 61 and s["hits"] >= 61
    finally:
        node.release(cached)


def test_every_piece_of_a_large_record_file_is_cached(ray_session, tmp_path, monkeypatch):
    monkeypatch.setattr(pieces, "PIECE_BYTES", 5 * len(png(0)))  # pieces of a few records
    labels = labels_of(30, seed=5)
    config = PipelineConfig(source=str(tf_shards(tmp_path / "tf", labels, per_shard=15)),
                            image_size=8, batch_size=5, rows_per_block=5, cache="memory",
                            cache_max_side=14)  # fmt: skip
    assert sum("#" in s.path for s in list_shards(config).shards) >= 4
    try:
        assert labels_by_epoch(config, 2) == [dict(enumerate(labels))] * 2
        s = settled(config, 2 * 30)
        assert s["entries"] == 30 and s["hits"] + s["misses"] == 60 and s["hits"] > 0
    finally:
        node.release(config)


# -- one worker's side, without Ray (a node with no `NodeCache`: a disk cache alone) --------


def disk_cache(tmp_path, monkeypatch, *, whole_rows: bool) -> SampleCache:
    monkeypatch.setattr(node, "lookup", lambda config: None)
    config = PipelineConfig(source=str(tmp_path), cache="disk", cache_dir=str(tmp_path / "c"),
                            cache_max_side=16)  # fmt: skip
    return SampleCache(config, Storage(), whole_rows=whole_rows)


def task(cache: SampleCache, rows: list, read) -> list:
    """One task's samples: each one's pixels, or the reason it is bad."""
    out = []
    for raw in cache.raws(rows, read):
        try:
            out.append(cache.image(raw))
        except BadSample as e:
            out.append(e.reason)
    cache.flush()
    return out


def test_what_a_reader_reports_wins_over_what_the_cache_kept(tmp_path, monkeypatch):
    """A label setting changed between runs: a sample the reader now finds unlabelled is
    bad though its pixels are cached, and a reader's verdict is never kept as the
    sample's: read again with its label, it is decoded."""
    cache = disk_cache(tmp_path, monkeypatch, whole_rows=False)
    path = tmp_path / "shard.bin"
    path.write_bytes(image_bytes(np.random.default_rng(0)))
    data, verdict = path.read_bytes(), {}

    def read(p, first, n, label, done):
        for k in range(first, first + n):
            reason = verdict.get(k)
            yield RawSample(k, 4, None if reason else data, f"{p}:{k}", reason, reason)

    rows = [(str(path), 0, 2, -1, None)]
    verdict[1] = "missing_label"
    first = task(cache, rows, read)
    assert first[1] == "missing_label" and first[0].shape[2] == 3
    verdict.clear()
    verdict[0] = "missing_label"
    second = task(cache, rows, read)
    assert isinstance(second[0], str) and second[0] == "missing_label"  # though cached
    assert np.array_equal(second[1], first[0])  # decoded: the verdict was not kept


def test_an_entry_kept_with_a_readers_reason_is_a_miss_and_replaced(tmp_path, monkeypatch):
    """Versions before kept what a reader reported (``missing_column``) as the sample's in a
    disk cache, which a later run with fixed settings would still serve: such an entry is
    a miss now, decoded again and replaced."""
    cache = disk_cache(tmp_path, monkeypatch, whole_rows=True)
    path = tmp_path / "a.jpg"
    path.write_bytes(image_bytes(np.random.default_rng(2)))
    ident = Storage().stat(str(path))
    store = DiskStore(str(tmp_path / "c" / node.digest(cache.config)), 1 << 30)
    i = f"{path}\0{0}"
    store.put(i, Entry(ident, str(path), 0.01, None, "missing_column", "no column 'label'"))
    store.settle()
    read = lambda p, first, n, label, done: iter([RawSample(first, label, path.read_bytes(), p)])  # noqa: E731
    (got,) = task(cache, [(str(path), 0, 1, 0, None)], read)
    assert not isinstance(got, str) and got.shape[2] == 3
    (entry,) = store.get_many([i], [ident])
    assert entry.shape is not None and entry.reason is None


def test_a_disk_cache_keeps_nothing_of_a_file_without_a_modification_time(tmp_path,
                                                                         monkeypatch, caplog):  # fmt: skip
    """A filesystem that keeps no modification time (fsspec's in-memory one, HTTP): a later
    run could not tell the file rewritten at the same size, so a disk cache keeps none of
    its samples, and says so once."""
    import fsspec

    data = image_bytes(np.random.default_rng(3))
    fsspec.filesystem("memory").pipe("/undated/a.jpg", data)
    uri = "memory://undated/a.jpg"
    storage = Storage.for_source(uri, None)
    assert storage.stat(uri) == (len(data), None)
    monkeypatch.setattr(node, "lookup", lambda config: None)
    config = PipelineConfig(source=uri, cache="disk", cache_dir=str(tmp_path / "c"),
                            cache_max_side=16)  # fmt: skip
    cache = SampleCache(config, storage, whole_rows=True)
    read = lambda p, first, n, label, done: iter([RawSample(first, label, data, p)])  # noqa: E731
    with caplog.at_level("WARNING", logger=reuse.__name__):
        for _ in range(2):
            (got,) = task(cache, [(uri, 0, 1, 0, None)], read)
            assert not isinstance(got, str) and got.shape[2] == 3  # decoded, served
    assert cache.tally.hits == 0
    assert DiskStore(node.cache_root(config), 1 << 30).held() == (0, 0)
    assert caplog.text.count("no modification time") == 1


def test_a_failed_write_gives_the_store_up_for_that_task_only(tmp_path, monkeypatch, caplog):
    """A write that fails (a full disk for a moment) leaves the task to decode without the
    cache; the next task writes again. A file name that is not UTF-8 is cached too."""
    cache = disk_cache(tmp_path, monkeypatch, whole_rows=True)
    rng = np.random.default_rng(1)
    files = [tmp_path / name for name in ("a.jpg", "b.jpg", os.fsdecode(b"caf\xe9.jpg"))]
    for f in files:
        f.write_bytes(image_bytes(rng))
    rows = [(str(f), k, 1, 0, None) for k, f in enumerate(files)]
    read = lambda p, first, n, label, done: iter(  # noqa: E731
        [RawSample(first, label, Path(p).read_bytes(), p)]
    )
    put, calls = DiskStore.put, []

    def put_once_failing(store, i, entry):
        calls.append(i)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return put(store, i, entry)

    monkeypatch.setattr(DiskStore, "put", put_once_failing)
    with caplog.at_level("WARNING", logger="raypipe.preprocess.cache.reuse"):
        fresh = task(cache, rows[:2], read)
    assert len(calls) == 1  # the second sample of that task was not offered
    assert "keeps nothing more in this task: OSError" in caplog.text  # said, not silent
    assert DiskStore(str(tmp_path / "c" / node.digest(cache.config)), 1 << 30).held()[1] == 0
    task(cache, rows, read)
    assert len(calls) == 4  # the next task writes all three
    monkeypatch.setattr(reuse, "decode_capped", lambda *a: pytest.fail("decoded a hit"))
    hits = task(cache, rows, read)
    assert all(np.array_equal(h, f) for h, f in zip(hits[:2], fresh, strict=True))


def _opencv_out_of_memory():
    """OpenCV's error as its resize raises it when an allocation fails (code -4;
    `tests/preprocess/test_bad_data.py` makes a real one)."""
    import cv2

    error = cv2.error("OpenCV(5.0.0) alloc.cpp:73: error: (-4:Insufficient memory) Failed "
                      "to allocate 4800000000 bytes in function 'OutOfMemoryError'")  # fmt: skip
    error.code = -4
    return error


@pytest.mark.parametrize("error", [MemoryError, _opencv_out_of_memory])
def test_a_worker_out_of_memory_is_not_the_samples_verdict(tmp_path, monkeypatch, error):
    """A decode that ran out of memory (Python's MemoryError, or OpenCV's own error when
    the cap's resize cannot allocate) fails that sample for that task, and is not kept as
    its "decode_error": a later task decodes it (it was kept, and skipped in every later
    run while the file stayed the same)."""
    cache = disk_cache(tmp_path, monkeypatch, whole_rows=True)
    path = tmp_path / "a.jpg"
    path.write_bytes(image_bytes(np.random.default_rng(4)))
    rows = [(str(path), 0, 1, 0, None)]
    read = lambda p, first, n, label, done: iter([RawSample(first, label, path.read_bytes(), p)])  # noqa: E731
    real = reuse.decode_capped

    def out_of_memory(*args):
        raise error()

    monkeypatch.setattr(reuse, "decode_capped", out_of_memory)
    with pytest.raises(Exception, match="(?s)^$|Insufficient memory"):
        task(cache, rows, read)
    cache.flush()
    decodes = []
    monkeypatch.setattr(reuse, "decode_capped", lambda *a: decodes.append(1) or real(*a))
    (got,) = task(cache, rows, read)
    assert not isinstance(got, str) and got.shape[2] == 3 and decodes == [1]


def test_a_damaged_header_is_a_corrupt_entry_not_the_end_of_the_store(tmp_path, monkeypatch):
    """A header whose numbers JSON reads as infinite raised out of the lookup, which then
    gave the store up for the task, every task that met the entry, run after run: it is a
    corrupt entry, decoded again and replaced."""
    import json
    import struct

    cache = disk_cache(tmp_path, monkeypatch, whole_rows=True)
    rng = np.random.default_rng(6)
    files = [tmp_path / f"{k}.jpg" for k in range(3)]
    for f in files:
        f.write_bytes(image_bytes(rng))
    rows = [(str(f), k, 1, 0, None) for k, f in enumerate(files)]
    read = lambda p, first, n, label, done: iter([RawSample(first, label, Path(p).read_bytes(), p)])  # noqa: E731
    task(cache, rows, read)
    store = DiskStore(str(tmp_path / "c" / node.digest(cache.config)), 1 << 30)
    damaged = Path(store.path(f"{files[0]}\0{0}"))
    data = damaged.read_bytes()
    (n,) = struct.unpack("<I", data[8:12])
    head = json.loads(data[12 : 12 + n]) | {"crc": float("inf")}
    text = json.dumps(head).encode()
    damaged.write_bytes(data[:8] + struct.pack("<I", len(text)) + text + data[12 + n :])
    task(cache, rows, read)
    assert cache.store is not None  # kept: the other two entries were hits
    (entry,) = store.get_many([f"{files[0]}\0{0}"], [Storage().stat(str(files[0]))])
    assert entry is not None and entry.shape is not None  # decoded again, replaced
    assert store.held()[1] == 3


def test_a_jpeg_cache_keeps_a_panorama_no_jpeg_holds_as_its_pixels(tmp_path, monkeypatch):
    """``cache_encoding="jpeg"``: a 70,000 x 24 PNG (its short side under the cap, so not
    downscaled) has a side no JPEG holds; it was skipped as bad every epoch, which the
    uncached path reads. It is served and kept as raw pixels."""
    import io

    from PIL import Image

    monkeypatch.setattr(node, "lookup", lambda config: None)
    config = PipelineConfig(source=str(tmp_path), cache="disk", cache_dir=str(tmp_path / "c"),
                            cache_max_side=32, cache_encoding="jpeg")  # fmt: skip
    rgb = np.random.default_rng(7).integers(0, 256, (24, 70_000, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    path = tmp_path / "wide.png"
    path.write_bytes(buf.getvalue())
    read = lambda p, first, n, label, done: iter([RawSample(first, label, path.read_bytes(), p)])  # noqa: E731
    rows = [(str(path), 0, 1, 0, None)]
    (fresh,) = task(SampleCache(config, Storage(), whole_rows=True), rows, read)
    assert not isinstance(fresh, str) and np.array_equal(fresh, rgb)
    monkeypatch.setattr(reuse, "decode_capped", lambda *a: pytest.fail("decoded a hit"))
    (hit,) = task(SampleCache(config, Storage(), whole_rows=True), rows, read)
    assert np.array_equal(hit, rgb)
