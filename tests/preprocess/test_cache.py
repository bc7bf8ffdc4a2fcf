"""The decoded cache (`raypipe.preprocess.cache`): its stores alone, then through a real
local Ray: exactly once and equal batches, the same pixels per key whether a crop's image
came from the cache or from a fresh decode, bad samples remembered, a disk cache reused
by a later run and invalidated when its source changes, corrupt entries never served."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from raypipe import PipelineConfig, SkipLog
from raypipe.preprocess.cache import disk as disk_cache
from raypipe.preprocess.cache import node, shm
from raypipe.preprocess.cache.capped import decode_capped
from raypipe.preprocess.cache.disk import DiskStore
from raypipe.preprocess.cache.entryfile import parts
from raypipe.preprocess.cache.store import Entry
from tests.conftest import checks_jpeg, image_bytes, make_imagefolder
from tests.preprocess.test_bad_data import FOLDER_SKIPS, MIXED_FOLDER, mixed_source
from tests.properties import check_exactly_once_and_equal
from tests.ranks import run_ranks

IDENT = (100, 7)
ROOT = Path(__file__).resolve().parents[2]


def put_all(store: DiskStore, items: list[tuple[str, Entry]]) -> None:
    """Write ``items`` as a worker's task does: each at once, the budget settled after."""
    for i, entry in items:
        store.put(i, entry)
    store.settle()


def pixels(seed: int = 0, shape=(12, 14, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


# -- the stores alone ----------------------------------------------------------------------


def test_a_store_is_first_come_within_its_budget_then_sends_nothing(tmp_path):
    one = Entry.image(IDENT, "a.jpg", 0.01, pixels())
    size = disk_cache.footprint(sum(len(part) for part in parts(one)))  # a page: 504 pixels
    store = DiskStore(str(tmp_path / "c"), budget=2 * size + 100)
    for i in range(3):
        store.put(f"f{i}", Entry.image(IDENT, f"{i}.jpg", 0.01, pixels(i)))
    assert store.full  # the task sends no more
    store.settle()
    assert not store.full  # the next task tries again
    got = store.get_many(["f0", "f1", "f2"], [IDENT] * 3)
    assert [g is not None for g in got] == [True, True, False]  # the third did not fit
    held = store.held()
    assert store.tally.refused == 1 and held[1] == 2
    assert held[0] == 2 * size == 2 * disk_cache.BLOCK  # what the files take of the node
    assert np.array_equal(got[1].pixels, pixels(1))
    assert store.get_many(["f0"], [(101, 7)]) == [None]  # the file changed: a miss
    put_all(store, [("f0", Entry.image((101, 7), "0.jpg", 0.01, pixels(5)))])  # replaced
    assert store.held()[1] == 2
    assert np.array_equal(store.get_many(["f0"], [(101, 7)])[0].pixels, pixels(5))


def test_two_processes_stores_never_pass_the_budget_and_count_exactly_their_files(tmp_path):
    """Two processes' stores of one node write every entry at once, never hold more than
    the budget between them, and the usage file counts exactly the files there, at every
    step (a store refused once takes entries again at its next task)."""
    from raypipe.preprocess.cache import disk

    size = disk.footprint(sum(len(p) for p in parts(Entry.image(IDENT, "k.jpg", 0.01, pixels()))))
    root = str(tmp_path / "m")
    stores = [DiskStore(root, budget=120 * size, mapped=True) for _ in range(2)]

    def on_disk():
        files = [f for f in Path(root).rglob("*") if f.is_file() and f.name != "usage"]
        return sum(disk.footprint(f.stat().st_size) for f in files), len(files)

    for n in range(150):
        stores[n % 2].put(f"k{n:03d}", Entry.image(IDENT, f"k{n:03d}.jpg", 0.01, pixels(n)))
        assert stores[0].held() == on_disk() and on_disk()[0] <= 120 * size
    assert on_disk() == (120 * size, 120) and sum(s.tally.refused for s in stores) == 30
    assert all(s.full for s in stores)
    for store in stores:
        store.settle()
    assert not any(s.full for s in stores)
    got = DiskStore(root, budget=120 * size).get_many(
        [f"k{n:03d}" for n in range(150)], [IDENT] * 150
    )
    assert [g is not None for g in got] == [n < 120 for n in range(150)]
    assert all(np.array_equal(g.pixels, pixels(n)) for n, g in enumerate(got) if g is not None)


def test_two_processes_writing_one_entry_at_once_leave_one_file_counted_once(tmp_path,
                                                                            monkeypatch):  # fmt: skip
    """An epoch's task and the next epoch's read-ahead can decode one sample at once: both
    find no file, both write it. The node keeps one file (the first placed: the second
    writer's copy is dropped, not kept mapped beside the first), and the usage file counts
    one entry of one file's bytes (it counted two; a deleted copy still mapped held twice
    the budget in shared memory)."""
    from raypipe.preprocess.cache import mapped

    monkeypatch.setattr(mapped, "PROCESS", mapped.Mappings())
    root = str(tmp_path / "m")
    first, second = (DiskStore(root, budget=1 << 20, mapped=True) for _ in range(2))
    later, placed = second._written, {}

    def meanwhile(f, entry, offset):  # the first process writes the entry in between
        from raypipe.preprocess.cache import disk

        with monkeypatch.context() as m:  # another process: a temporary file of its own
            m.setattr(disk.os, "getpid", lambda: 1)
            first.put("k", Entry.image(IDENT, "k.jpg", 0.01, pixels(1)))
        placed["inode"] = os.stat(first.path("k")).st_ino
        placed["mapping"] = mapped.PROCESS.get(first._root_id, "k")
        return later(f, entry, offset)

    monkeypatch.setattr(second, "_written", meanwhile)
    second.put("k", Entry.image(IDENT, "k.jpg", 0.01, pixels(1)))  # the same decode
    first.settle()
    second.settle()
    files = [f for f in Path(root).rglob("*") if f.is_file() and f.name != "usage"]
    assert len(files) == 1 and first.held() == (disk_cache.footprint(files[0].stat().st_size), 1)
    assert files[0].stat().st_ino == placed["inode"]  # the first placed, kept
    assert mapped.PROCESS.get(first._root_id, "k") is placed["mapping"] is not None
    (got,) = DiskStore(root, budget=1 << 20).get_many(["k"], [IDENT])
    assert np.array_equal(got.pixels, pixels(1))


def test_a_different_entry_in_the_way_is_replaced_and_its_bytes_given_back(tmp_path):
    """What a write finds in its place that is not its entry (its source changed, the
    file damaged, a record an older version kept) is replaced in one counted step."""
    root = str(tmp_path / "c")
    store = DiskStore(root, budget=1 << 20)
    store.put("k", Entry(IDENT, "k.jpg", 0.01, None, "missing_column", "no column"))
    small = store.held()
    store.put("k", Entry.image(IDENT, "k.jpg", 0.01, pixels(3, (40, 40, 3))))
    big = store.held()
    assert big[1] == 1 and big[0] > small[0]
    Path(store.path("k")).write_bytes(Path(store.path("k")).read_bytes()[:-5])  # cut short
    store.put("k", Entry.image(IDENT, "k.jpg", 0.01, pixels(3, (40, 40, 3))))
    assert store.held() == big
    (got,) = store.get_many(["k"], [IDENT])
    assert np.array_equal(got.pixels, pixels(3, (40, 40, 3)))


def test_a_write_that_fails_leaves_no_file_and_nothing_counted(tmp_path, monkeypatch):
    store = DiskStore(str(tmp_path / "m"), budget=1 << 20, mapped=True)
    store.put("a", Entry.image(IDENT, "a.jpg", 0.01, pixels(1)))

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_place", full)
    with pytest.raises(OSError):
        store.put("b", Entry.image(IDENT, "b.jpg", 0.01, pixels(2)))
    monkeypatch.undo()
    store.settle()
    files = [f for f in (tmp_path / "m").rglob("*") if f.is_file() and f.name != "usage"]
    assert [f.name for f in files] == [Path(store.path("a")).name]  # no .tmp left
    assert store.held() == (disk_cache.footprint(files[0].stat().st_size), 1)


KILLED_WRITER = """
import os, signal, sys
import numpy as np
from raypipe.preprocess.cache import disk
from raypipe.preprocess.cache.store import Entry
disk.DiskStore._place = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # killed right there
pixels = np.full((12, 14, 3), 7, np.uint8)
disk.DiskStore(sys.argv[1], budget=1 << 20).put("a", Entry.image((1, 2), "a.jpg", 0.01, pixels))
"""


def test_a_writer_killed_while_replacing_an_entry_leaves_the_count_true(tmp_path):
    """An entry whose source changed is replaced in one step: a writer killed before it
    leaves the old entry in place and counted (a miss for the new source, replaced by the
    next write) and its temporary file, uncounted, which the next run's look for
    leftovers removes."""
    root = str(tmp_path / "c")
    put_all(DiskStore(root, budget=1 << 20), [("a", Entry.image(IDENT, "a.jpg", 0.01, pixels(1)))])
    before = DiskStore(root, budget=1 << 20).held()
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, root], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL
    files = sorted(f.name for f in Path(root).rglob("*") if f.is_file() and f.name != "usage")
    assert len(files) == 2 and files[1].endswith(".tmp") and before[1] == 1
    assert DiskStore(root, budget=1 << 20).held() == before
    assert DiskStore(root, budget=1 << 20).drop_leftovers(older_than_s=0) == 1
    assert DiskStore(root, budget=1 << 20).held() == before
    assert DiskStore(root, budget=1 << 20).get_many(["a"], [(1, 2)]) == [None]


def test_a_disk_caches_next_run_removes_what_writers_killed_mid_write_left(tmp_path):
    """A writer killed before placing its file leaves the temporary file (nothing counts
    it); the next run's `NodeCache` removes it, the count unchanged. A temporary file young
    enough to be a live writer's stays."""
    root = tmp_path / "c"
    store = DiskStore(str(root), budget=1 << 20)
    put_all(store, [("a", Entry.image(IDENT, "a.jpg", 0.01, pixels(1)))])
    kept = store.held()
    body = Path(store.path("a")).read_bytes()
    dead, live = Path(store.path("b") + ".4242.tmp"), Path(store.path("c") + ".4343.tmp")
    for tmp in (dead, live):  # as `put` leaves them: written, not placed
        tmp.parent.mkdir(exist_ok=True)
        tmp.write_bytes(body)
    old = time.time() - 2 * disk_cache.LEFTOVER_S
    os.utime(dead, (old, old))
    node.NodeCache("disk", 1 << 20, str(root))  # looks for them beside the run
    deadline = time.monotonic() + 10
    while dead.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not dead.exists() and live.exists()
    assert store.held() == kept and Path(store.path("a")).exists()


def test_a_disk_store_counts_in_place_and_opens_its_usage_file_once_a_task(tmp_path,
                                                                          monkeypatch):  # fmt: skip
    """A disk cache takes its budget per entry: each count rewrites the usage file in place
    (no truncation) through one open file, until the task's settle. A usage file written
    the old way, longer than the new count's digits, is read and wholly replaced."""
    from raypipe.preprocess.cache import usage

    root = tmp_path / "d"
    root.mkdir()
    (root / "usage").write_bytes(b"0000000000000000000000000001000 3")  # 1000 bytes, 3 entries
    opened = []
    real_open = usage.os.open
    monkeypatch.setattr(usage.os, "open", lambda p, *a: opened.append(p) or real_open(p, *a))
    store = DiskStore(str(root), budget=1 << 20)
    items = [(f"k{n}", Entry.image(IDENT, f"k{n}.jpg", 0.01, pixels(n))) for n in range(5)]
    put_all(store, items)
    assert [Path(p).name for p in opened] == ["usage"]
    sizes = sum(disk_cache.footprint(sum(len(part) for part in parts(e))) for _, e in items)
    assert store.held() == (1000 + sizes, 3 + 5)
    more = Entry.image(IDENT, "k5.jpg", 0.01, pixels(5))
    put_all(store, [("k5", more)])  # the next task: the file opened again
    assert len(opened) == 2
    assert store.held() == (1000 + sizes + disk_cache.footprint(sum(map(len, parts(more)))), 3 + 6)


def test_a_store_whose_directory_was_cleared_writes_nothing_more(tmp_path):
    """A memory cache cleared under a store: the next write
    raises (its worker then gives the store up) and makes nothing again, where it once
    made the cleared directory anew and wrote an entry no usage file counted."""
    import shutil

    root = tmp_path / "m"
    store = DiskStore(str(root), budget=1 << 30, mapped=True)
    store.put("a", Entry.image(IDENT, "a.jpg", 0.01, pixels(1)))
    shutil.rmtree(root)
    with pytest.raises(FileNotFoundError):
        store.put("b", Entry.image(IDENT, "b.jpg", 0.01, pixels(2)))
    assert not root.exists()


def test_a_mapped_store_checks_an_entry_once_then_serves_its_mapping(tmp_path, monkeypatch):
    from raypipe.preprocess.cache import mapped

    monkeypatch.setattr(mapped, "PROCESS", mapped.Mappings())  # the writer's process
    root = str(tmp_path / "m")
    writer = DiskStore(root, budget=1 << 20, mapped=True)
    put_all(writer, [(k, Entry.image(IDENT, f"{k}.jpg", 0.01, pixels(n))) for n, k in
                     enumerate("ab")])  # fmt: skip
    damaged = bytearray(Path(writer.path("b")).read_bytes())
    damaged[-1] ^= 0xFF
    Path(writer.path("b") + ".new").write_bytes(bytes(damaged))
    os.replace(writer.path("b") + ".new", writer.path("b"))  # as a store replaces a file
    writer_process = mapped.PROCESS
    monkeypatch.setattr(mapped, "PROCESS", mapped.Mappings())  # another process of the node
    store = DiskStore(root, budget=1 << 20, mapped=True)
    a, b = store.get_many(["a", "b"], [IDENT, IDENT])
    assert np.array_equal(a.pixels, pixels(0)) and b is None and store.tally.corrupt == 1
    assert not a.pixels.flags.writeable  # the file's pages, not a copy
    os.unlink(store.path("a"))  # gone from the directory: the mapping still serves it
    (again,) = store.get_many(["a"], [IDENT])
    assert again is a
    assert store.get_many(["a"], [(1, 2)]) == [None]  # another source: never the mapping
    # the writer kept what it wrote mapped: served without reading the files again
    monkeypatch.setattr(mapped, "PROCESS", writer_process)
    assert np.array_equal(writer.get_many(["b"], [IDENT])[0].pixels, pixels(1))
    assert writer.tally.corrupt == 0


def test_reads_count_the_entries_a_process_read_from_their_files(tmp_path, monkeypatch):
    """``reads``: a mapped store's process reads and checks an entry once (none that it
    wrote itself); an unmapped store reads its file at every hit; a damaged entry is
    ``corrupt``, not a read."""
    from raypipe.preprocess.cache import mapped

    monkeypatch.setattr(mapped, "PROCESS", mapped.Mappings())  # the writer's process
    root = str(tmp_path / "m")
    writer = DiskStore(root, budget=1 << 20, mapped=True)
    put_all(writer, [(k, Entry.image(IDENT, f"{k}.jpg", 0.01, pixels(n))) for n, k in
                     enumerate("abc")])  # fmt: skip
    assert all(writer.get_many(["a", "b", "c"], [IDENT] * 3)) and writer.tally.reads == 0
    damaged = bytearray(Path(writer.path("c")).read_bytes())
    damaged[-1] ^= 0xFF
    Path(writer.path("c") + ".new").write_bytes(bytes(damaged))
    os.replace(writer.path("c") + ".new", writer.path("c"))
    monkeypatch.setattr(mapped, "PROCESS", mapped.Mappings())  # another process of the node
    other = DiskStore(root, budget=1 << 20, mapped=True)
    for _ in range(3):
        a, b, c = other.get_many(["a", "b", "c"], [IDENT] * 3)
        assert a is not None and b is not None and c is None
    assert (other.tally.reads, other.tally.corrupt) == (2, 3)
    unmapped = DiskStore(root, budget=1 << 20)
    for _ in range(3):
        unmapped.get_many(["a", "b"], [IDENT] * 2)
    assert unmapped.tally.reads == 6


def test_a_process_keeps_the_newest_mappings_up_to_half_what_the_kernel_allows(tmp_path,
                                                                               monkeypatch):  # fmt: skip
    """Up to `MAPPED` entries stay mapped in a process (the newest met); one past it is read
    again from its file. `MAPPED` is half of ``vm.max_map_count``, not the old fixed 8,192:
    later epochs of 16,384 photos ran 1.23x faster with it (benchmarks/RESULTS.md, "Many
    entries on a node")."""
    import resource

    from raypipe.preprocess.cache import mapped

    with open("/proc/sys/vm/max_map_count") as f:
        allowed = int(f.read())
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limit = mapped.MAPPED
    assert limit == max(64, min(allowed // 2, max(files // 2, files - mapped.SPARE_FILES)))
    monkeypatch.setattr(mapped, "MAPPED", 3)
    monkeypatch.setattr(mapped, "PROCESS", mapped.Mappings())  # this test's process
    root = str(tmp_path / "m")
    store = DiskStore(root, budget=1 << 20, mapped=True)
    keys = [f"k{n}" for n in range(5)]
    put_all(store, [(k, Entry.image(IDENT, f"{k}.jpg", 0.01, pixels(n))) for n, k in
                    enumerate(keys)])  # fmt: skip
    # every file replaced by another process (a new inode each: removed, then written
    # anew): a mapping still serves the pixels it maps, a read finds the new ones
    with monkeypatch.context() as m:
        m.setattr(mapped, "PROCESS", mapped.Mappings())
        for k in keys:
            os.unlink(store.path(k))
        put_all(DiskStore(root, budget=1 << 20, mapped=True),
                [(k, Entry.image(IDENT, f"{k}.jpg", 0.01, pixels(10 + n))) for n, k in
                 enumerate(keys)])  # fmt: skip
    newest_first = keys[::-1]  # so that no read evicts a mapping before it is asked for
    got = store.get_many(newest_first, [IDENT] * 5)
    served = [next(s for s in (n, 10 + n) if np.array_equal(g.pixels, pixels(s)))
              for n, g in zip((4, 3, 2, 1, 0), got, strict=True)]  # fmt: skip
    assert served == [4, 3, 2, 11, 10]  # the two oldest written were no longer mapped


def test_stores_of_one_process_share_its_mappings_and_let_go_of_a_cleared_cache(tmp_path,
                                                                                monkeypatch):  # fmt: skip
    """Two stores of one directory in one process (a worker serving two ranks' runs) map
    each entry once between them, where each once kept its own mappings, up to `MAPPED`
    each, and so could pass the kernel's limit together. A directory removed, or made anew
    in its place, is another cache: `drop_cleared` closes its mappings."""
    import shutil

    from raypipe.preprocess.cache import mapped

    monkeypatch.setattr(mapped, "PROCESS", mapped.Mappings())
    root = tmp_path / "m"
    first, second = (DiskStore(str(root), budget=1 << 20, mapped=True) for _ in range(2))
    put_all(first, [(f"k{n}", Entry.image(IDENT, f"k{n}.jpg", 0.01, pixels(n)))
                    for n in range(4)])  # fmt: skip
    for n in range(4):
        os.unlink(second.path(f"k{n}"))  # served from the mappings, never read
    got = second.get_many([f"k{n}" for n in range(4)], [IDENT] * 4)
    assert all(np.array_equal(g.pixels, pixels(n)) for n, g in enumerate(got))
    assert len(mapped.PROCESS) == 4
    mapped.PROCESS.drop_cleared()
    assert len(mapped.PROCESS) == 4  # the directory is still there: kept
    shutil.rmtree(root)
    root.mkdir()  # made anew, as a later run's memory cache of the same settings is
    later = DiskStore(str(root), budget=1 << 20, mapped=True)
    assert later.get_many(["k0"], [IDENT]) == [None]  # not the old cache's mapping
    mapped.PROCESS.drop_cleared()
    assert len(mapped.PROCESS) == 0


def test_a_memory_cache_lives_in_shared_memory_as_long_as_its_actor(tmp_path, monkeypatch):
    """`NodeCache` holds its directory's lock; `clear` removes it; a directory whose holder
    is gone (its lock free, however it ended) is swept by the next cache to start."""
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    config = PipelineConfig(source=str(tmp_path), cache="memory")
    first = node.NodeCache("memory", 1 << 20, node.cache_root(config, "n1"), store_bytes=0)
    root, limit = first.where()
    assert root.startswith(str(tmp_path / shm.PREFIX)) and limit == 1 << 20
    put_all(DiskStore(root, limit), [("a", Entry.image(IDENT, "a.jpg", 0.01, pixels()))])
    assert shm.sweep(str(tmp_path)) == []  # held: left alone
    assert first.stats().entries == 1 and first.stats().bytes > pixels().nbytes
    # an actor killed hard: its lock goes with its process, here closed by hand
    os.close(first._lock)
    first._lock = None
    second = node.NodeCache("memory", 1 << 20, node.cache_root(config, "n2"), store_bytes=0)
    assert not os.path.exists(root) and os.path.isdir(second.root)  # swept at its start
    second.clear()
    assert not os.path.exists(second.root)
    huge = node.NodeCache("memory", 1 << 60, node.cache_root(config, "n3"), store_bytes=0)
    assert huge.info()["budget"] == huge.info()["room"] < 1 << 60  # what /dev/shm holds
    huge.clear()


def test_disk_store_round_trips_and_refuses_damaged_files(tmp_path):
    store = DiskStore(str(tmp_path / "c"), budget=1 << 20)
    bad = Entry(IDENT, "b.jpg", 0.02, None, "not_an_image", "it is text")
    put_all(store, [("a", Entry.image(IDENT, "a.jpg", 0.01, pixels())), ("b", bad)])
    a, b = store.get_many(["a", "b"], [IDENT, IDENT])
    assert np.array_equal(a.pixels, pixels()) and a.where == "a.jpg"
    assert (b.pixels, b.reason, b.detail) == (None, "not_an_image", "it is text")
    assert store.held() == (
        sum(disk_cache.footprint(os.path.getsize(store.path(i))) for i in "ab"),
        2,
    )
    entry = Path(store.path("a"))
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0xFF
    entry.write_bytes(bytes(data))
    assert store.get_many(["a"], [IDENT]) == [None] and store.tally.corrupt == 1
    entry.write_bytes(bytes(data[:40]))  # truncated
    assert store.get_many(["a"], [IDENT]) == [None] and store.tally.corrupt == 2
    assert store.get_many(["b"], [(1, 1)]) == [None]  # the source changed: a miss
    small = DiskStore(str(tmp_path / "d"), budget=100)
    small.put("a", Entry.image(IDENT, "a.jpg", 0.01, pixels()))
    assert small.tally.refused == 1 and small.held() == (0, 0) and small.full


@pytest.mark.parametrize("mapped", [False, True])
def test_a_changed_header_or_no_entry_file_is_a_counted_miss_and_the_store_goes_on(
    tmp_path, mapped
):
    """A byte changed anywhere in the header (a bad sample's detail, where an image came
    from, what it saved) is a corrupt entry: it was served, the header checked only for
    the pixels' shape. A header that is JSON but no object, a directory or a zero-byte file
    in an entry's place: each a miss counted as corrupt, and the store keeps writing (they
    once gave the store up for the rest of the task, every epoch, the file never replaced)."""
    import json
    import struct

    from raypipe.preprocess.cache import mapped as mapped_entries
    from raypipe.preprocess.cache.entryfile import MAGIC

    store = DiskStore(str(tmp_path / "c"), budget=1 << 20, mapped=mapped)
    bad = Entry(IDENT, "b.jpg", 0.02, None, "not_an_image", "ValueError: x")
    put_all(store, [("a", Entry.image(IDENT, "a.jpg", 0.01, pixels())), ("b", bad)])
    for i, old, new in (("b", b"ValueError: x", b"ValueError: y"), ("a", b"a.jpg", b"q.jpg")):
        path = Path(store.path(i))
        path.write_bytes(path.read_bytes().replace(old, new))
    mapped_entries.PROCESS = mapped_entries.Mappings()  # another worker: nothing mapped yet
    reader = DiskStore(str(tmp_path / "c"), budget=1 << 20, mapped=mapped)
    assert reader.get_many(["a", "b"], [IDENT, IDENT]) == [None, None]
    assert reader.tally.corrupt == 2
    blockers = {"list": "json", "dir": "dir", "empty": "empty"}
    for i, kind in blockers.items():
        path = Path(store.path(i))
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "dir":
            path.mkdir()
        elif kind == "empty":
            path.write_bytes(b"")
        else:
            path.write_bytes(MAGIC + struct.pack("<I", 2) + json.dumps([]).encode())
    assert reader.get_many(list(blockers), [IDENT] * 3) == [None] * 3
    assert reader.tally.corrupt == 5
    put_all(reader, [(i, Entry.image(IDENT, f"{i}.jpg", 0.01, pixels(1))) for i in blockers])
    put_all(reader, [("z", Entry.image(IDENT, "z.jpg", 0.01, pixels(2)))])  # a store still
    got = reader.get_many([*blockers, "z"], [IDENT] * 4)
    assert [g is not None for g in got] == [True, False, True, True]  # the directory stays
    assert np.array_equal(got[-1].pixels, pixels(2))


def test_a_run_start_counts_again_what_entries_cut_short_left_counted(tmp_path):
    """An entry cut short (a crash before its pages reached the disk) was counted whole;
    replacing it gave back only what was left, so the count kept the difference for good.
    A disk cache's start counts the files again (`drop_leftovers`)."""
    store = DiskStore(str(tmp_path / "c"), budget=1 << 20)
    put_all(store, [(f"e{i}", Entry.image(IDENT, f"{i}.jpg", 0.01, pixels(i, (40, 60, 3))))
                    for i in range(3)])  # fmt: skip
    Path(store.path("e1")).write_bytes(b"")  # what a crash can leave
    assert store.get_many(["e1"], [IDENT]) == [None]
    put_all(store, [("e1", Entry.image(IDENT, "1.jpg", 0.01, pixels(1, (40, 60, 3))))])
    files = [store.path(f"e{i}") for i in range(3)]
    actual = sum(disk_cache.footprint(os.path.getsize(f)) for f in files)
    assert store.held() == (actual + disk_cache.footprint(os.path.getsize(files[1])), 3)
    os.mkdir(Path(files[0]).with_name("in-the-way"))  # not an entry file: not counted
    assert store.drop_leftovers() == 0
    assert store.held() == (actual, 3)


def test_entries_name_their_checksum_and_an_older_crc32_entry_is_still_checked(tmp_path):
    """New entries carry CRC32C where the CPU has it (the `crc32c` package's hardware path);
    a disk cache written before, whose headers name no checksum, is checked with zlib's
    CRC32 as it was written: served when sound, never when damaged."""
    import json
    import struct
    import zlib

    import crc32c

    from raypipe.preprocess.cache import store as cache_store
    from raypipe.preprocess.cache.entryfile import MAGIC

    fresh = Entry.image(IDENT, "a.jpg", 0.01, pixels())
    assert fresh.check == ("crc32c" if crc32c.hardware_based else "crc32") + "+shape"
    crc = cache_store.CHECKS[fresh.check.partition("+")[0]]
    assert fresh.crc == crc(struct.pack("<3q", 12, 14, 3), crc(pixels().data))
    st = DiskStore(str(tmp_path / "old"), budget=1 << 20)
    head = {"ident": list(IDENT), "where": "o.jpg", "seconds": 0.01, "reason": None,
            "detail": None, "crc": zlib.crc32(pixels(3).data), "shape": [12, 14, 3],
            "encoding": "raw"}  # fmt: skip
    text = json.dumps(head).encode()
    path = Path(st.path("o"))
    path.parent.mkdir(parents=True)
    path.write_bytes(MAGIC + struct.pack("<I", len(text)) + text + pixels(3).tobytes())
    (old,) = st.get_many(["o"], [IDENT])
    assert old is not None and old.check == "crc32" and np.array_equal(old.pixels, pixels(3))
    damaged = bytearray(path.read_bytes())
    damaged[-5] ^= 0x01
    path.write_bytes(bytes(damaged))
    assert st.get_many(["o"], [IDENT]) == [None] and st.tally.corrupt == 1


def test_a_header_whose_shape_was_changed_is_not_served(tmp_path):
    """The checksum covers the shape too: a header that says 14 x 12 of a 12 x 14 image
    (the same bytes, another image) is a corrupt entry, decoded again; it was served."""
    import json
    import struct

    st = DiskStore(str(tmp_path / "c"), budget=1 << 20)
    put_all(st, [("a", Entry.image(IDENT, "a.jpg", 0.01, pixels()))])
    path = Path(st.path("a"))
    data = path.read_bytes()
    (n,) = struct.unpack("<I", data[8:12])
    head = json.loads(data[12 : 12 + n]) | {"shape": [14, 12, 3]}
    text = json.dumps(head).encode()
    path.write_bytes(data[:8] + struct.pack("<I", len(text)) + text + data[12 + n :])
    assert DiskStore(str(tmp_path / "c"), budget=1 << 20).get_many(["a"], [IDENT]) == [None]


def ramp(height: int = 40, width: int = 60) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.ascontiguousarray(np.stack([x * 4, y * 6, (x + y) * 2], axis=-1).astype(np.uint8))


def test_a_jpeg_entry_round_trips_smaller_and_a_damaged_one_is_not_served(tmp_path):
    """A ``cache_encoding="jpeg"`` entry comes back as its JPEG (the checksum covers its
    bytes), which decodes to the pixels the first crop came from; one byte changed in it
    and it is refused."""
    from raypipe.preprocess.cache.capped import Stored, encode_stored

    rgb = ramp()
    stored = encode_stored(rgb)
    data, served = stored.data, stored.pixels()
    assert served.shape == rgb.shape and np.abs(served.astype(int) - rgb).mean() < 3
    store = DiskStore(str(tmp_path / "j"), budget=1 << 20)
    put_all(store, [("a", Entry.stored(IDENT, "a.jpg", 0.01, data, served.shape))])
    (got,) = store.get_many(["a"], [IDENT])
    assert got.pixels is None and got.encoded == data
    assert np.array_equal(Stored(got.encoded, *got.shape[:2]).pixels(), served)
    assert os.path.getsize(store.path("a")) < rgb.nbytes / 2
    path = store.path("a")
    damaged = bytearray(Path(path).read_bytes())
    damaged[-40] ^= 0x5A
    Path(path).write_bytes(bytes(damaged))
    assert store.get_many(["a"], [IDENT]) == [None] and store.tally.corrupt == 1


def test_a_jpeg_entry_written_before_its_bytes_were_checked_is_still_checked(tmp_path):
    """A disk cache's jpeg entry from before (the checksum of its decoded pixels, no "of" in
    its header) is decoded and checked as it was written: served when sound, not when its
    JPEG was changed."""
    import json
    import struct

    from raypipe.preprocess.cache.capped import encode_stored
    from raypipe.preprocess.cache.entryfile import MAGIC
    from raypipe.preprocess.cache.store import CHECK, CHECKS

    stored = encode_stored(ramp())
    data, served = stored.data, stored.pixels()
    check = CHECK.partition("+")[0]  # as they were written: the pixels' bytes alone
    head = {"ident": list(IDENT), "where": "o.jpg", "seconds": 0.01, "reason": None,
            "detail": None, "crc": CHECKS[check](served.data), "check": check,
            "shape": list(served.shape), "encoding": "jpeg"}  # fmt: skip
    text = json.dumps(head).encode()
    st = DiskStore(str(tmp_path / "old"), budget=1 << 20)
    path = Path(st.path("o"))
    path.parent.mkdir(parents=True)
    path.write_bytes(MAGIC + struct.pack("<I", len(text)) + text + data)
    (old,) = st.get_many(["o"], [IDENT])
    assert old is not None and np.array_equal(old.pixels, served)
    damaged = bytearray(path.read_bytes())
    damaged[-40] ^= 0x5A
    path.write_bytes(bytes(damaged))
    assert st.get_many(["o"], [IDENT]) == [None]


@pytest.mark.parametrize("train", [True, False])
def test_a_crop_of_a_stored_jpeg_is_the_crop_of_its_whole_decode(train):
    """The crop from `region_of` (the crop's region decoded, where region decoding was
    built) has the pixels `crop_chw` gives from the whole decode, for random-resized and
    center crops of several sizes, flipped or not."""
    from raypipe.preprocess.augment import plan, sample_rng
    from raypipe.preprocess.cache.capped import Stored, encode_stored, region_of
    from raypipe.preprocess.decode import crop_chw

    rng = np.random.default_rng(3)
    for height, width in ((240, 320), (320, 427), (97, 131)):
        noisy = np.clip(ramp(height, width) + rng.integers(0, 40, (height, width, 3)), 0, 255)
        stored = encode_stored(noisy.astype(np.uint8))
        assert stored == Stored(stored.data, height, width)
        whole = stored.pixels()
        for key in range(24):
            p = plan(width, height, train=train, rng=sample_rng(0, 1, key), scale=(0.08, 1.0),
                     ratio=(3 / 4, 4 / 3), flip=True)  # fmt: skip
            for size in (32, 224):
                expected = np.ascontiguousarray(crop_chw(whole, p, size))
                got = np.ascontiguousarray(crop_chw(*region_of(stored, p), size))
                assert np.array_equal(got, expected), (height, width, key, size, p)


def test_a_jpeg_hit_counts_its_decode_against_what_it_saved(tmp_path):
    """A cached JPEG is decoded when it is cropped, after its lookup: that decode comes off
    ``saved_s`` as a lookup does; a just-encoded one's (a miss) does not."""
    from raypipe.preprocess.augment import Box, Plan
    from raypipe.preprocess.cache.capped import Stored, encode_stored
    from raypipe.preprocess.cache.reuse import SampleCache

    cache = SampleCache(PipelineConfig(source=str(tmp_path), cache="memory"), None)
    fresh = encode_stored(ramp(240, 320))
    p = Plan(Box(10, 20, 100, 90), False)
    cache.region(fresh, p)
    cache.whole(fresh)
    assert cache.tally.saved_s == 0
    hit = Stored(*fresh[:3], hit=True)
    rgb, q = cache.region(hit, p)
    after_crop = cache.tally.saved_s
    whole = cache.whole(hit)
    assert after_crop < 0 and cache.tally.saved_s < after_crop
    assert rgb.shape[0] < 240 and q.box != p.box and whole.shape == (240, 320, 3)


def test_a_disk_cache_is_kept_apart_by_its_pixel_settings_and_decoder_versions(tmp_path,
                                                                              monkeypatch):  # fmt: skip
    """A later run reuses a disk cache only where the same bytes would give the same
    pixels: not after an upgrade of the libraries that decode and cap them."""
    config = PipelineConfig(source=str(tmp_path), cache="disk", cache_dir=str(tmp_path / "c"))
    root = node.cache_root(config)
    assert root.startswith(str(tmp_path / "c")) and node.cache_root(config) == root
    assert node.cache_root(config.replace(cache_max_side=config.cache_max_side + 1)) != root
    assert node.cache_root(config.replace(cache_encoding="jpeg")) != root
    assert node.cache_root(config.replace(batch_size=config.batch_size + 1)) == root  # not pixels
    assert "opencv" in node.decoders() and "simplejpeg" in node.decoders()
    monkeypatch.setattr(node, "decoders", lambda: "simplejpeg 0, opencv 0, pillow 0")
    assert node.cache_root(config) != root


def test_decode_capped_keeps_the_short_side_at_most_the_cap():
    rng = np.random.default_rng(0)
    for fmt in ("JPEG", "PNG"):
        data = image_bytes(rng, fmt, size=(400, 300))
        assert decode_capped(data, 120, None).shape == (120, 160, 3)
        assert decode_capped(data, 1000, None).shape == (300, 400, 3)  # never upscaled
    tall = image_bytes(rng, "JPEG", size=(90, 200))
    assert decode_capped(tall, 45, None).shape == (100, 45, 3)


@pytest.mark.parametrize("size", [(500, 375), (640, 480), (1600, 1200)])
def test_the_cap_is_low_passed_and_resized_as_every_crop_is(size):
    """Above the cap, the image is low-passed and resized bilinearly (`crop_resize`): close
    to Pillow's resize of the same decode; where it shrinks by 1.5 or more, 1-pixel checks,
    which a bilinear resize alone keeps as moiré, come out as grey as Pillow's."""
    import simplejpeg
    from PIL import Image

    w, h = size
    k = next((k for k in (8, 4, 2) if min(-(-w // k), -(-h // k)) >= 320), 1)
    for name, data in (("noise", image_bytes(np.random.default_rng(1), "JPEG", size=size)),
                       ("checks", checks_jpeg(size))):  # fmt: skip
        capped = decode_capped(data, 320, None)
        whole = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-h // k),
                                       min_width=-(-w // k))  # fmt: skip
        assert capped.shape == (320, round(320 * w / h), 3) and capped.flags.c_contiguous
        pillow = np.asarray(Image.fromarray(whole).resize(capped.shape[1::-1], Image.BILINEAR))
        if name == "noise":
            assert np.abs(capped.astype(int) - pillow.astype(int)).mean() < 3
        elif min(whole.shape[:2]) >= 1.5 * 320:  # just above the cap the low-pass is slight
            assert capped.std() < pillow.std() + 8, (capped.std(), pillow.std())


def test_bad_cache_settings_fail_in_one_line(tmp_path):
    src = str(tmp_path)
    (tmp_path / "file").write_text("x")
    cases = {
        "cache='ram'": dict(cache="ram"),
        "is below one block": dict(  # the pixels' bytes, but not the pages their files take
            cache="memory", batch_size=8, cache_max_side=100, cache_budget=8 * 3 * 100 * 100
        ),  # fmt: skip
        "in 4096-byte pages": dict(  # 75 pages of pixels at 320, and the header's page
            cache="memory", batch_size=8, cache_budget=8 * 3 * 320 * 320
        ),  # fmt: skip
        "must be a node-local directory": dict(cache="disk"),
        "the default, 2147483648 bytes with cache='disk', is below one block": dict(
            cache="disk", cache_dir=src, cache_max_side=4096
        ),  # 12.9 GB a block of 256 rows
        "is not a directory": dict(cache="disk", cache_dir=str(tmp_path / "file" / "sub")),
        "cache_max_side=0": dict(cache="memory", cache_max_side=0),
        "cache_encoding='png'": dict(cache="memory", cache_encoding="png"),
    }
    for words, fields in cases.items():
        with pytest.raises(ValueError, match=words) as info:
            PipelineConfig(source=src, **fields)
        assert "\n" not in str(info.value) and "PipelineConfig.cache" in str(info.value)
    PipelineConfig(source=src, cache="disk", cache_dir=str(tmp_path / "new" / "dir"))
    PipelineConfig(source=src, cache="memory", batch_size=8, cache_max_side=100,
                   cache_budget=8 * disk_cache.footprint(3 * 100 * 100))  # fmt: skip
    entry = parts(Entry.image(IDENT, str(tmp_path / "a.jpg"), 0.01, pixels(shape=(320, 320, 3))))
    one = disk_cache.footprint(sum(map(len, entry)))
    PipelineConfig(source=src, cache="memory", batch_size=8, cache_budget=8 * one)


def test_an_unwritable_cache_dir_is_refused(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere: the check is shown what others get
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: str(p) != str(locked) and access(p, mode))
    with pytest.raises(ValueError, match=f"cannot be written \\({locked} is not writable"):
        PipelineConfig(source=str(tmp_path), cache="disk", cache_dir=str(locked / "c"))
    PipelineConfig(source=str(tmp_path), cache="disk", cache_dir=str(tmp_path / "free" / "c"))


def test_a_relative_cache_dir_is_refused_and_a_home_one_expanded(tmp_path, monkeypatch):
    """Every node's workers resolve ``cache_dir``, each in its own working folder (where
    ``ray start`` ran): a relative one is refused; ``~`` is the home folder."""
    with pytest.raises(ValueError, match="cache_dir.*must be an absolute path"):
        PipelineConfig(source=str(tmp_path), cache="disk", cache_dir="relative/cache")
    monkeypatch.setenv("HOME", str(tmp_path))
    config = PipelineConfig(source=str(tmp_path), cache="disk", cache_dir="~/rp-cache")
    assert node.cache_root(config).startswith(str(tmp_path / "rp-cache") + os.sep)


def test_the_progress_line_shows_the_cache():
    import io

    from raypipe.loader.demand import Demand
    from raypipe.loader.progress import ProgressLine

    counts = {"hits": 9216, "bytes": 812 << 20, "saved_s": 14.2}
    p = ProgressLine(3600, rank=0, demand=Demand(), planned=lambda e: 0, out=io.StringIO(),
                     cache=lambda: counts)  # fmt: skip
    try:
        assert p.line().endswith("cache 9,216 hits 812 MiB saved 14 s")
        counts["refused"] = 3100  # the budget is full: say what it costs
        assert p.line().endswith(
            "cache 9,216 hits 812 MiB saved 14 s, 3,100 decoded past its budget"
        )
    finally:
        p.close()


# -- through a real local Ray ----------------------------------------------------------------


def by_key(out, epoch: int) -> dict[int, np.ndarray]:
    """``{key: image}`` over every rank's batches of ``epoch``."""
    return {int(k): b["image"][i] for r in out for b in r[epoch] for i, k in enumerate(b["key"])}


def settled(pipe_config, want: int, timeout_s: float = 30.0) -> dict:
    """The cache's counters once ``hits + misses`` reached ``want`` (the actors' counts
    arrive without being waited for)."""
    from raypipe.preprocess.cache import node

    deadline = time.monotonic() + timeout_s
    while True:
        s = node.stats(pipe_config)
        if s["hits"] + s["misses"] >= want or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def test_memory_cache_exactly_once_equal_and_bad_samples_remembered(ray_session, tmp_path):
    source, expected = mixed_source(tmp_path / "data", "imagefolder")
    config = PipelineConfig(source=str(source), image_size=8, batch_size=6, actors=(2, 2),
                            files_per_task=9, rows_per_block=4, cache="memory",
                            cache_max_side=12)  # fmt: skip
    out, stats = run_ranks(config, 2, 3, normalize=False, skips=SkipLog.create())
    total, bad = MIXED_FOLDER, sum(expected.values())
    for epoch in range(3):
        good_rows = [stats[r][epoch]["good"] for r in range(2)]
        assert sum(good_rows) == total - bad
        keys = check_exactly_once_and_equal([r[epoch] for r in out], batch_size=6,
                                            good=range(total),
                                            left_over=total - 12 * (min(good_rows) // 6))  # fmt: skip
        assert len(keys) == 2 * 6 * (min(good_rows) // 6)
    s = settled(config, 3 * total)
    assert s["hits"] + s["misses"] == 3 * total
    assert s["hits"] >= total  # epochs 1 and 2 from the cache, mostly
    assert 0 <= s["reads"] <= s["hits"]  # hits on entries another process wrote, once each
    # remembered as bad: every bad sample but the unreadable one (a read error may pass)
    remembered = bad - FOLDER_SKIPS["unreadable"]
    assert s["bad_hits"] >= remembered
    assert s["entries"] == total - FOLDER_SKIPS["unreadable"] and s["bytes"] > 150 * 12 * 12 * 3
    assert stats[0][2]["cache"]["mode"] == "memory"


def test_a_memory_budget_shared_memory_has_no_room_for_is_refused_before_work(ray_session,
                                                                             datasets):  # fmt: skip
    from raypipe import Pipeline

    config = PipelineConfig(source=str(datasets["imagefolder"]), cache="memory",
                            cache_budget=1 << 50, batch_size=8)  # fmt: skip
    with pytest.raises(ValueError, match="shared memory .* has room for") as e:
        Pipeline(config, epochs=1, device="cpu").start()
    assert "\n" not in str(e.value)
    assert not [p for p in os.listdir(shm.SHM_DIR) if p.startswith(node._name(config, ""))]


def test_a_node_cache_that_dies_mid_run_costs_decodes_not_samples(ray_session, tmp_path):
    """The node's `NodeCache` actor dies at the run's first batch, its pixels with it (as
    on a lost node): the lookups that fail decode instead, puts and counts sent to it are
    dropped, every epoch is still exactly once with equal batches, its counters answer
    (without it), the next epoch starts a new cache that fills again, and release ends
    it."""
    import ray

    from raypipe.preprocess.cache import node

    source = make_imagefolder(tmp_path / "data", {"a": 30, "b": 25}, seed=4)  # 55 samples
    config = PipelineConfig(source=str(source), image_size=8, batch_size=5, actors=(2, 2),
                            files_per_task=7, rows_per_block=5, cache="memory",
                            cache_max_side=12)  # fmt: skip
    killed: list = []
    lock = threading.Lock()

    def kill_once(rank, batch) -> None:
        with lock:
            if not killed:
                killed.append(node.lookup(config))
                ray.kill(killed[0])

    out, stats = run_ranks(config, 2, 3, pause_s=(kill_once,), normalize=False)
    for epoch in range(3):
        keys = check_exactly_once_and_equal([r[epoch] for r in out], batch_size=5,
                                            good=range(55), left_over=2 * 5 - 1)  # fmt: skip
        assert len(keys) == 50  # 5 batches of 5 per rank, 5 samples left over
        assert all(stats[r][epoch]["cache"]["mode"] == "memory" for r in range(2))
    now = node.lookup(config)
    assert killed[0] is not None and now is not None
    assert now._actor_id != killed[0]._actor_id  # a new actor, started by the next epoch
    deadline = time.monotonic() + 10  # the puts arrive without being waited for
    while node.stats(config)["entries"] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert node.stats(config)["entries"] > 0  # filled again
    node.release(config)
    node.release(config)  # nothing left: no error
    deadline = time.monotonic() + 10
    while node.lookup(config) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert node.lookup(config) is None
    assert node.stats(config)["entries"] == 0


def test_same_seed_same_pixels_per_key_cached_or_freshly_decoded(ray_session, tmp_path):
    """One run with a budget of one block (nearly every crop from a fresh decode) and one
    with room for all (epochs 1+ from the cache): the same pixels per key and epoch; and in
    eval mode (one crop per key), epoch 0 (decoded) equals epochs 1 and 2 (cached)."""
    source = make_imagefolder(tmp_path / "data", {"a": 30, "b": 25}, seed=3)
    base = PipelineConfig(source=str(source), image_size=8, batch_size=5, actors=(2, 2),
                          files_per_task=7, rows_per_block=5, cache="memory",
                          cache_max_side=12)  # fmt: skip
    small = base.replace(cache_budget=5 * disk_cache.BLOCK)  # 5 rows of a page each
    fresh, _ = run_ranks(small, 1, 2, normalize=False)
    held = settled(small, 2 * 55)
    assert 0 < held["bytes"] <= small.cache_budget and held["refused"] > 0  # the budget holds
    cached, _ = run_ranks(base, 1, 2, normalize=False)
    again, _ = run_ranks(base, 1, 2, normalize=False)  # its epoch 0 from the cache too
    assert settled(base, 4 * 55)["hits"] >= 55
    for epoch in range(2):
        a, b, c = by_key(fresh, epoch), by_key(cached, epoch), by_key(again, epoch)
        assert a.keys() == b.keys() == c.keys() and len(a) == 55
        for k in a:
            assert np.array_equal(a[k], b[k]) and np.array_equal(a[k], c[k]), (epoch, k)
    uncached, _ = run_ranks(base.replace(cache=None), 1, 1, normalize=False)
    u = by_key(uncached, 0)
    assert any(not np.array_equal(u[k], by_key(fresh, 0)[k]) for k in u)  # crops differ
    evals, _ = run_ranks(base.replace(train=False, seed=1), 1, 3, normalize=False)
    first = by_key(evals, 0)
    for epoch in (1, 2):
        later = by_key(evals, epoch)
        assert all(np.array_equal(first[k], later[k]) for k in first)


def test_a_jpeg_cache_gives_every_epoch_the_pixels_of_its_first(ray_session, tmp_path):
    """``cache_encoding="jpeg"``: one crop per key (eval mode), so epoch 0 (decoded,
    re-encoded) and epochs 1-2 (from the cache) give each key the same pixels; the cache
    holds no more than the raw one of the same images (a page an entry at this size: the
    saving on photos is `test_a_jpeg_entry_round_trips_smaller_and_a_damaged_one_is_not_served`'s)."""
    source = make_imagefolder(tmp_path / "data", {"a": 14, "b": 12}, seed=4)
    base = PipelineConfig(source=str(source), image_size=8, batch_size=2, rows_per_block=2,
                          actors=(1, 1), train=False, cache="memory", cache_max_side=16)  # fmt: skip
    jpeg = base.replace(cache_encoding="jpeg")
    out, _ = run_ranks(jpeg, 1, 3, normalize=False)
    first = by_key(out, 0)
    assert len(first) == 26
    for epoch in (1, 2):
        assert all(np.array_equal(first[k], by_key(out, epoch)[k]) for k in first)
    held = settled(jpeg, 3 * 26)
    assert held["hits"] >= 26 and held["entries"] == 26
    run_ranks(base, 1, 1, normalize=False)
    raw = settled(base, 26)
    assert raw["entries"] == 26 and held["bytes"] == raw["bytes"] == 26 * disk_cache.BLOCK


def test_a_jpeg_cache_gives_a_key_the_same_crops_fresh_or_cached(ray_session, tmp_path):
    """``cache_encoding="jpeg"`` with random crops: a run whose budget keeps almost nothing
    (each crop decoded by region from a freshly encoded JPEG) and one that keeps all (epoch 1
    by region from the cached JPEGs) give the same pixels per key and epoch."""
    source = make_imagefolder(tmp_path / "data", {"a": 14, "b": 12}, seed=6)
    base = PipelineConfig(source=str(source), image_size=8, batch_size=2, rows_per_block=2,
                          actors=(1, 1), cache="memory", cache_encoding="jpeg",
                          cache_max_side=16)  # fmt: skip
    small = base.replace(cache_budget=2 * disk_cache.BLOCK)  # one block: two small JPEGs
    fresh, _ = run_ranks(small, 1, 2, normalize=False)
    assert settled(small, 2 * 26)["refused"] > 0
    cached, _ = run_ranks(base, 1, 2, normalize=False)
    assert settled(base, 2 * 26)["hits"] >= 26
    for epoch in range(2):
        a, b = by_key(fresh, epoch), by_key(cached, epoch)
        assert a.keys() == b.keys() and len(a) == 26
        assert all(np.array_equal(a[k], b[k]) for k in a), epoch
    assert any(not np.array_equal(by_key(cached, 0)[k], by_key(cached, 1)[k]) for k in a)


def test_disk_cache_is_reused_by_a_later_run_and_invalidated_by_a_change(ray_session, tmp_path):
    source = make_imagefolder(tmp_path / "data", {"a": 12, "b": 9}, seed=5)
    config = PipelineConfig(source=str(source), image_size=8, batch_size=3, actors=(1, 1),
                            files_per_task=4, rows_per_block=3, cache="disk",
                            cache_dir=str(tmp_path / "cache"), cache_max_side=12)  # fmt: skip
    first, _ = run_ranks(config, 1, 1, normalize=False)
    s1 = settled(config, 21)
    assert (s1["hits"], s1["misses"]) == (0, 21) and s1["bytes"] > 0
    second, stats = run_ranks(config, 1, 1, normalize=False)
    s2 = settled(config, 42)
    assert (s2["hits"], s2["misses"]) == (21, 21)  # the later run decoded nothing
    assert stats[0][0]["cache"]["mode"] == "disk"
    a, b = by_key(first, 0), by_key(second, 0)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # the source of key 0 changes: only it is decoded again, and its new pixels are served
    changed = sorted((source / "a").iterdir())[0]
    changed.write_bytes(image_bytes(np.random.default_rng(99), "PNG"))
    os.utime(changed, ns=(time.time_ns(), time.time_ns() + 10**9))
    third, _ = run_ranks(config, 1, 1, normalize=False)
    s3 = settled(config, 63)
    assert (s3["hits"] - s2["hits"], s3["misses"] - s2["misses"]) == (20, 1)
    c = by_key(third, 0)
    assert not np.array_equal(a[0], c[0]) and all(np.array_equal(a[k], c[k]) for k in a if k)
    # every entry damaged on disk: decoded again from the source, never served
    for root, _, files in os.walk(tmp_path / "cache"):
        for name in files:
            if name != "usage":
                path = Path(root, name)
                data = bytearray(path.read_bytes())
                data[-5] ^= 0x55
                path.write_bytes(bytes(data))
    fourth, _ = run_ranks(config, 1, 1, normalize=False)
    s4 = settled(config, 84)
    assert s4["corrupt"] - s3["corrupt"] == 21 and s4["misses"] - s3["misses"] == 21
    d = by_key(fourth, 0)
    assert all(np.array_equal(c[k], d[k]) for k in c)


def test_a_transform_gets_the_capped_image_cached_or_not(ray_session, datasets):
    """Cache what is before the user's map: the transform sees the capped image, the same
    in the epoch that decoded it and in the epochs that found it cached."""
    config = PipelineConfig(source=str(datasets["webdataset"]), batch_size=5, rows_per_block=5,
                            transform="tests.user_transforms:image_shape", cache="memory",
                            cache_max_side=10)  # fmt: skip
    out, _ = run_ranks(config, 1, 2)
    rows = [{int(k): (tuple(hw), int(t)) for b in out[0][e]
             for k, hw, t in zip(b["key"], b["hw"], b["total"], strict=True)} for e in (0, 1)]  # fmt: skip
    assert rows[0] == rows[1] and len(rows[0]) == 60
    assert {hw for hw, _ in rows[0].values()} == {(10, 12)}  # 24×20 images, short side 10


def test_a_resumed_epoch_is_exactly_once_with_the_same_pixels_from_the_cache(ray_session,
                                                                              datasets):  # fmt: skip
    """A run resumed in epoch 1 with 40 % of its keys consumed, its cache filled by an
    earlier run (tar shards: read for their labels, their cached samples not decoded),
    against the same resume with an empty cache: the keys left, once each, with the same
    pixels."""
    from raypipe.plan.shards import list_shards
    from raypipe.train.state import PipelineState

    config = PipelineConfig(source=str(datasets["webdataset"]), image_size=8, batch_size=4,
                            rows_per_block=4, cache="memory", cache_max_side=11)  # fmt: skip
    listing = list_shards(config)
    consumed = np.random.default_rng(7).random(61) < 0.4
    state = PipelineState(1, config.seed, 61, listing.fingerprint, consumed)
    run_ranks(config, 1, 1, drop_last=False, normalize=False)  # fills the cache
    warm, _ = run_ranks(config, 1, 2, drop_last=False, normalize=False, start=state)
    cold, _ = run_ranks(config.replace(cache_budget=1 << 20), 1, 2, drop_last=False,
                        normalize=False, start=state)  # fmt: skip
    a, b = by_key(warm, 1), by_key(cold, 1)
    assert sorted(a) == sorted(b) == np.flatnonzero(~consumed).tolist()
    assert sum(len(batch["key"]) for batch in warm[0][1]) == len(a)  # no key twice
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert settled(config, 61 + len(a))["hits"] >= len(a)  # the resumed epoch, from the cache


def test_a_pool_that_sheds_slots_for_a_slow_trainer_keeps_the_cache_whole(ray_session,
                                                                          tmp_path):  # fmt: skip
    """The follower (on by default) sheds a slot while a slow trainer never waits, with the
    memory cache on: each epoch still gives every key once, in equal batches, and the
    epochs after the first come from the cache whatever slot decoded a key first."""
    from raypipe import Pipeline

    n = 96
    source = make_imagefolder(tmp_path / "data", {"a": n // 2, "b": n // 2})
    # the follower's own defaults
    config = PipelineConfig(source=str(source), image_size=8, batch_size=4, actors=(1, 2),
                            files_per_task=4, rows_per_block=4, cache="memory",
                            cache_max_side=12)  # fmt: skip
    node.release(config)  # a cache of these settings an earlier test left: counts from 0
    epochs = []
    try:
        with Pipeline(config, epochs=3, device="cpu", normalize=False) as pipe:
            for _, batches in pipe.epochs():
                keys = []
                for batch in batches:
                    keys.extend(int(k) for k in batch["key"])
                    time.sleep(0.25)  # the trainer: slower than the data, past the 5 s
                    # the follower waits (follow_shrink_s) before it sheds a slot
                epochs.append(keys)
                pool = batches.stats()["pool"]
        s = settled(config, 3 * n)
    finally:
        node.release(config)
    assert [sorted(e) for e in epochs] == [list(range(n))] * 3
    targets = [point[2] for point in pool["series"]]
    assert (pool["min"], pool["max"]) == (1, 2) and targets[0] == 2 and 1 in targets, pool
    assert s["misses"] == n and s["hits"] == 2 * n, s


def test_the_dataset_path_keeps_the_cache_and_its_batches_report_it(ray_session, datasets):
    """`build_dataset` + `iter_torch_batches` with the cache on: epoch 1 comes from what
    epoch 0 kept, and the batches' ``stats()["cache"]`` says so."""
    from raypipe import build_dataset, iter_torch_batches
    from raypipe.plan.shards import list_shards

    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=4,
                            rows_per_block=4, cache="memory", cache_max_side=10)  # fmt: skip
    listing = list_shards(config)
    node.release(config)  # a cache of these settings an earlier test left: counts from 0
    try:
        for epoch in range(2):
            batches = iter_torch_batches(build_dataset(config, epoch=epoch, listing=listing),
                                         config, device="cpu", drop_last=False)  # fmt: skip
            keys = sorted(int(k) for b in batches for k in b["key"])
            assert keys == list(range(61))
        s = settled(config, 2 * 61)
        assert s["misses"] == 61 and s["hits"] == 61, s
        assert batches.stats()["cache"]["hits"] == 61
    finally:
        node.release(config)


def test_a_worker_maps_no_more_entries_than_it_may_hold_files_open():
    """Each mapped entry keeps its file's descriptor: a worker whose open-file limit is
    low keeps at most half its files' worth mapped (1,024 files spare, for a high one)."""
    script = (
        "import resource; hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (400, hard)); "
        "from raypipe.preprocess.cache import mapped; print(mapped.MAPPED)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert int(out.stdout) == 200


def test_a_plain_task_lets_go_of_released_caches_first(monkeypatch):
    """`build_dataset`'s tasks run on Ray's pooled workers, which outlive the run: each task
    closes this worker's mappings of memory caches released since (their pages go back)."""
    from raypipe.preprocess import actor
    from raypipe.preprocess.cache import mapped

    calls = []
    monkeypatch.setattr(mapped.PROCESS, "drop_cleared", lambda: calls.append("dropped"))
    monkeypatch.setattr(actor, "Preprocessor", lambda **kw: calls.append("built") or (lambda b: []))
    assert list(actor.preprocess_task({"id": np.array([0])})) == []
    assert calls == ["dropped", "built"]


def test_a_cache_that_cannot_start_stops_the_run_it_was_dropped_from(ray_session, datasets):
    """A cache_dir the node cannot write, which the config check passes as root (/proc):
    the cache actor died in its creation, the workers went on without it, every epoch
    decoded whole and stats() said nothing."""
    from raypipe import Pipeline

    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=8,
                            cache="disk", cache_dir="/proc/raypipe-cache-test")  # fmt: skip
    with pytest.raises(ValueError, match=r"cache='disk': a node's cache could not start: .*"
                       r"/proc/raypipe-cache-test") as e:  # fmt: skip
        Pipeline(config, epochs=1, device="cpu").start()
    assert "\n" not in str(e.value)


def test_shared_memory_room_leaves_out_a_store_ray_could_not_have_put_there():
    """Under Docker's 64 MiB /dev/shm Ray keeps its store in /tmp; the room for a memory
    cache was /dev/shm's free space less the whole store: 0, and every entry refused."""
    st = os.statvfs(shm.SHM_DIR)
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    assert shm.room(size + 1) == pytest.approx(free, rel=0.01)
    assert shm.room(1 << 20) == pytest.approx(free - (1 << 20), rel=0.01)


def test_a_cap_below_the_crop_size_is_warned_about():
    with pytest.warns(UserWarning, match=r"cache_max_side=320 is below image_size=384"):
        PipelineConfig(source="x", cache="memory", image_size=384)
