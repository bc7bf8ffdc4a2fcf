"""What two benchmarks measure: `benchmarks/nodecpu.py`'s CPU of a process tree (a child
counted once, not again in the parent that reaps it) and `benchmarks/memory.py`'s
"every epoch exactly once" (every epoch, not the first; samples left out, not only twice)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"


def test_a_child_run_and_reaped_inside_the_meter_is_counted_once():
    """A driver started with ``subprocess.run`` (as benchmarks/follow.py runs one) is
    sampled while it runs and then reaped: its CPU was counted in its own last sample and
    again in the parent's children's time."""
    meter = _load("nodecpu")
    with meter.CpuMeter(interval_s=0.05) as m:
        subprocess.run([sys.executable, "-c", BURN], check=True)
    child = sum(v for k, v in m.by_name.items() if k.startswith("python"))
    assert 0.5 <= m.seconds < 0.95, (m.seconds, m.by_name)  # 0.6 s burnt, plus start-up
    assert child >= 0.5, m.by_name


def test_memorys_check_covers_every_epoch_and_samples_left_out():
    check = _load("memory").exactly_once
    good = [[[[0, 1], [2, 3]], [[3, 2], [1, 0]]], [[[4, 5], [6, 7]], [[5, 4], [7, 6]]]]  # 2 x 2
    assert check(good, 8, batch=2) and check(good, 9, batch=2)  # 1 left out: under a batch
    twice_later = [[[[0, 1], [2, 3]], [[3, 2], [1, 1]]], [[[4, 5], [6, 7]], [[5, 4], [7, 6]]]]
    assert not check(twice_later, 8, batch=2)  # epoch 1's duplicate (it checked epoch 0)
    lost = [[[[0, 1], [2, 3]], [[3, 2]]], [[[4, 5], [6, 7]], [[5, 4]]]]
    assert not check(lost, 8, batch=2)  # epoch 1 left out four: a whole batch a rank
    assert not check(good, 7, batch=2)  # key 7 is not one of 7 samples
