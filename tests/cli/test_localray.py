"""`raypipe.cli.localray`: Ray's processes left after ``ray.shutdown()`` are stopped by pid.

Fake workers (``sleep`` renamed ``ray::...``, as a Ray worker renames itself) stand in
for one that outlives its raylet: that case comes now and then, not on demand. The
session's own Ray is never touched here.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from raypipe.cli import localray

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")


@pytest.fixture
def children():
    started: list[subprocess.Popen] = []

    def start(argv0: str) -> subprocess.Popen:
        started.append(subprocess.Popen(["bash", "-c", f"exec -a '{argv0}' sleep 60"]))
        return started[-1]

    yield start
    for p in started:
        p.kill()
        p.wait()


def _noted(*pids: int) -> dict[int, int]:
    """`ray_descendants` once every pid has exec'd under its new name."""
    for _ in range(100):
        found = localray.ray_descendants(os.getpid())
        if all(p in found for p in pids):
            return found
        time.sleep(0.05)
    raise AssertionError(f"{pids} not among {found}")


def test_a_ray_worker_still_there_after_the_grace_is_killed_and_nothing_else(children):
    worker = children("ray::MapWorker(MapBatches(RankPreprocessor))")
    other = children("sleep")
    noted = _noted(worker.pid)
    assert other.pid not in noted
    mine = {worker.pid: noted[worker.pid]}
    assert localray.stop_leftovers(mine, grace_s=0.2) == [worker.pid]
    assert worker.wait(timeout=10) == -9
    assert other.poll() is None


def test_a_worker_that_ends_in_the_grace_or_whose_pid_was_reused_is_left_alone(children):
    worker = children("ray::IDLE")
    noted = _noted(worker.pid)
    start = noted[worker.pid]
    reused = {worker.pid: start + 1}  # the same pid, another process's start time
    assert localray.stop_leftovers(reused, grace_s=0.2) == []
    assert worker.poll() is None
    worker.terminate()
    assert localray.stop_leftovers({worker.pid: start}, grace_s=5) == []
