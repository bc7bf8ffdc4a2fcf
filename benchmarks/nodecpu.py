"""CPU seconds a process tree spends: each process's own, sampled until it ends.

Ray's processes and a DataLoader's workers descend from the benchmark process, so the
tree's CPU is what a path costs the node, whatever else runs on the machine. A thread
samples ``/proc`` and keeps each process's last value of its own user + system time. Not
the children's time a parent reaps (``cutime``/``cstime``): a child sampled and then
reaped within the block was counted twice that way (a driver run with ``subprocess.run``,
and the GCS and raylet it reaps, two or three times). A process that starts and ends
between two samples (``interval_s``) is missed.
"""

from __future__ import annotations

import os
import threading

from raypipe.cli.localray import process_tree

_TICK = os.sysconf("SC_CLK_TCK")


def _snapshot(root: int) -> dict[tuple[int, int], tuple[str, float]]:
    """{(pid, start time): (name, its own user + system CPU seconds)} for ``root``'s tree.

    A Ray worker renames itself for each task, so the name is not part of the identity.
    """
    return {
        (pid, int(fields[19])): (name, (int(fields[11]) + int(fields[12])) / _TICK)
        for pid, (name, fields) in process_tree(root).items()
    }


class CpuMeter:
    """``with CpuMeter() as m: ...`` then ``m.seconds``: the tree's CPU over the block.

    ``m.by_name`` splits it by process name (``python``, ``raylet``, ``ray::MapWorker``...).
    """

    def __init__(self, root: int | None = None, interval_s: float = 0.1):
        self.root = root or os.getpid()
        self.interval_s = interval_s
        self.seconds = 0.0
        self.by_name: dict[str, float] = {}
        self._first: dict[tuple[int, int], tuple[str, float]] = {}
        self._last: dict[tuple[int, int], tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def _sample(self) -> None:
        for proc, seconds in _snapshot(self.root).items():
            self._last[proc] = seconds

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> CpuMeter:
        self._first = _snapshot(self.root)
        self._last = dict(self._first)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        for proc, (name, seconds) in self._last.items():
            used = seconds - self._first.get(proc, (name, 0.0))[1]
            self.by_name[name] = self.by_name.get(name, 0.0) + used
        self.seconds = sum(self.by_name.values())
