"""Shards of a counted format are counted several at once, and listed as if one by one."""

import threading
import time

from raypipe import PipelineConfig
from raypipe.formats import Reader
from raypipe.plan import shards as shards_module
from raypipe.plan.shards import list_shards
from tests.conftest import make_webdataset


def test_counting_in_threads_lists_what_counting_one_by_one_does(tmp_path, monkeypatch):
    sizes = [(i * 7) % 11 + 1 for i in range(40)]
    config = PipelineConfig(source=str(make_webdataset(tmp_path / "wds", sizes)))
    at_once, most = set(), [0]
    lock = threading.Lock()
    count = Reader.count

    def slow_count(self, path):  # a remote header: a round trip per shard
        with lock:
            at_once.add(path)
            most[0] = max(most[0], len(at_once))
        time.sleep(0.01 * (hash(path) % 3))  # out of order: later shards finish first
        try:
            return count(self, path)
        finally:
            with lock:
                at_once.discard(path)

    monkeypatch.setattr(Reader, "count", slow_count)
    threaded = list_shards(config)
    monkeypatch.setattr(shards_module, "COUNT_THREADS", 1)
    most_threaded, most[0] = most[0], 0
    one_by_one = list_shards(config)
    assert most_threaded > 1 and most[0] == 1
    assert threaded == one_by_one
    assert [s.num_samples for s in threaded.shards] == sizes
    assert [s.first_key for s in threaded.shards] == [sum(sizes[:i]) for i in range(40)]
