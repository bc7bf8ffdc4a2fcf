"""The memory cache's directory in shared memory: held by every run on the node with the
same settings, and removed only by a process that finds no other holder."""

from __future__ import annotations

import fcntl
import os
import shutil
import threading

from raypipe import PipelineConfig
from raypipe.preprocess.cache import node, shm
from raypipe.preprocess.cache.disk import DiskStore
from raypipe.preprocess.cache.store import Entry
from tests.preprocess.test_cache import IDENT, pixels, put_all


def started(root: str, timeout_s: float = 10.0) -> node.NodeCache:
    """A `NodeCache` of ``root``, made in a thread: one that waits for another's lock fails
    the test instead of hanging it."""
    made: list[node.NodeCache] = []
    t = threading.Thread(target=lambda: made.append(node.NodeCache("memory", 1 << 20, root)),
                         daemon=True)  # fmt: skip
    t.start()
    t.join(timeout_s)
    assert made, f"a second NodeCache of {root} waited {timeout_s} s for the first's lock"
    return made[0]


def test_two_runs_with_the_same_settings_share_the_cache_and_the_last_removes_it(
    tmp_path, monkeypatch
):
    """Each of torchrun's ranks is a Ray job with a `NodeCache` of its own for one
    directory: the second starts beside the first, and the directory stays until both
    let go of it."""
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    root = node.cache_root(PipelineConfig(source=str(tmp_path), cache="memory"), "n1")
    first = started(root)
    second = started(root)
    put_all(DiskStore(root, 1 << 20), [("a", Entry.image(IDENT, "a.jpg", 0.01, pixels()))])
    first.clear()
    assert os.path.isdir(root) and second.stats().entries == 1
    assert shm.sweep(str(tmp_path)) == []  # still held
    second.clear()
    assert not os.path.exists(root)


def test_a_second_holder_counts_what_the_cache_holds_as_room(tmp_path, monkeypatch):
    """The room a memory cache may take is what the node's shared memory has free beside
    its object store; for a run joining a cache another run holds, what that cache keeps
    there is room too, so an explicit budget the first run got is not refused the second."""
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(shm, "room", lambda store_bytes: 1000)  # free beside the store
    root = node.cache_root(PipelineConfig(source=str(tmp_path), cache="memory"), "n1")
    first = started(root)
    put_all(DiskStore(root, 1 << 20), [("a", Entry.image(IDENT, "a.jpg", 0.01, pixels()))])
    held = first.stats().bytes
    second = started(root)
    assert first.info()["room"] == 1000 and second.info()["room"] == 1000 + held
    first.clear()
    second.clear()


def test_a_hold_whose_lock_file_is_swept_before_it_locks_makes_it_again(tmp_path, monkeypatch):
    """A sweep may remove a directory between a new holder's open and its lock: the holder
    then holds a file no path names, and makes the directory again."""
    root = str(tmp_path / (shm.PREFIX + "x"))
    lock, swept = fcntl.flock, []

    def flock(fd, op):
        if not swept:
            swept.append(fd)
            shutil.rmtree(root)  # what a sweep that took the lock first removed
        return lock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    fd = shm.hold(root)
    monkeypatch.setattr(fcntl, "flock", lock)
    assert swept and os.path.samestat(os.fstat(fd), os.stat(os.path.join(root, "lock")))
    assert shm.sweep(str(tmp_path)) == []  # held
    assert shm.let_go(root, fd) and not os.path.exists(root)
