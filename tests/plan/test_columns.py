"""A listing's shards as columns: the same sequence of `Shard` to read, compact to hold and
to pickle (every rank gets the listing; its tasks carry the paths to the workers)."""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import numpy as np
import pytest

from raypipe.plan.columns import Paths, Shards
from raypipe.plan.rankplan import RankPlan
from raypipe.plan.ranktasks import RankTasks
from raypipe.plan.shards import Listing, Shard

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def folder(n: int, prefix: str = "/data/train") -> tuple[Shard, ...]:
    return tuple(Shard(f"{prefix}/c{i % 7}/img_{i:07d}.jpg", i, 1, i % 7) for i in range(n))


def test_a_listing_reads_as_the_shards_it_was_made_from():
    shards = (*folder(5), Shard("/data/s/ünïcode.tar", 5, 40), Shard("/data/s/\udcff.tar", 45, 3))
    listing = Listing("imagefolder", shards)
    assert isinstance(listing.shards, Shards)
    assert list(listing.shards) == list(shards) and len(listing.shards) == 7
    assert listing.shards[-1] == shards[-1] and listing.shards[5].path == "/data/s/ünïcode.tar"
    assert list(listing.shards[2:6]) == list(shards[2:6])
    assert listing == Listing("imagefolder", list(shards)) and listing.shards == Shards.of(shards)
    assert listing.shards != shards  # a tuple equals tuples: list(listing.shards) == ...
    assert listing != Listing("imagefolder", shards[:-1] + (Shard("/data/s/x.tar", 45, 3),))
    assert listing.num_samples == 48 and isinstance(listing.num_samples, int)
    with pytest.raises(IndexError):
        listing.shards[7]
    with pytest.raises(ValueError, match="read-only"):  # a rank's plan holds these arrays
        listing.shards.first_key[0] = 1
    with pytest.raises(TypeError):
        listing.shards[1.7]
    again = pickle.loads(pickle.dumps(listing))
    assert again == listing and list(again.shards) == list(shards)
    older = dict(listing.__dict__, shards=tuple(shards))  # pickled as a tuple, before
    made = Listing.__new__(Listing)
    made.__setstate__(older)
    assert isinstance(made.shards, Shards) and made == listing and made.num_samples == 48
    assert again.fingerprint == listing.fingerprint


def test_paths_round_trip_any_file_name():
    names = ["", "/a", "/b/ü", "/c/\udce9x", "/d/" + "z" * 300]
    paths = Paths.of(names)
    assert list(paths) == names and [paths[i] for i in range(-5, 5)] == names * 2
    assert paths == Paths.of(names) and paths != Paths.of(names[:-1]) and paths != "".join(names)
    assert list(paths[1:4]) == names[1:4]


def test_a_large_listing_unpickles_to_its_bytes_not_an_object_per_shard(tmp_path):
    """100,000 image files, through `benchmarks/listing.py`: the rank's copy takes about
    the bytes sent (a tuple of `Shard` objects took four times that, and seconds to
    unpickle at ImageNet's size)."""
    spec = importlib.util.spec_from_file_location("listing_bench", BENCHMARKS / "listing.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--shards", "100000", "--rounds", "1", "--out", str(tmp_path)])
    assert result["held_mib"] < 1.1 * result["median"]["pickled_mib"], result
    assert (tmp_path / "listing.json").exists()


def test_a_ranks_tasks_read_the_listings_columns():
    """`RankTasks` carries the listing's own path and label columns to the workers (no
    list of a string per shard), and turns a task into the same shard rows."""
    listing = Listing("imagefolder", folder(64))
    plan = RankPlan.of(listing, seed=3, shuffle=True, rank=1, world_size=2, per_task=8)
    tasks = RankTasks.of(listing, plan, range(2))
    assert tasks.paths is listing.shards.paths and tasks.labels is listing.shards.label
    epoch, rows = tasks.rows(len(tasks) - 1)
    by_path = {s.path: s for s in listing.shards}
    assert epoch == 1 and rows["path"]
    for path, first, label in zip(rows["path"], rows["first_key"], rows["label"], strict=True):
        assert (by_path[path].first_key, by_path[path].label) == (first, label)
    got = pickle.loads(pickle.dumps(tasks))
    assert got.paths == tasks.paths and np.array_equal(got.labels, tasks.labels)
