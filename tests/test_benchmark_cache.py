"""`benchmarks/cache.py`'s summary: each later epoch of the memory cache over the same
round's uncached later rate, on rounds whose rates the test chooses."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def cache_bench():
    sys.path.insert(0, str(_BENCHMARKS))  # cache.py imports ingest.py as a sibling
    try:
        spec = importlib.util.spec_from_file_location("cache_bench", _BENCHMARKS / "cache.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(_BENCHMARKS))


def _run(epochs: list[float]) -> dict:
    later = sorted(epochs[1:])[len(epochs[1:]) // 2]
    return {"epoch_img_s": epochs, "steady_img_s": later, "first_epoch_img_s": epochs[0],
            "img_per_cpu_s": later / 2}  # fmt: skip


def test_each_later_epoch_is_taken_over_its_own_rounds_uncached_rate(cache_bench):
    # the machine runs 10x faster in round 1: ratios within a round stay the same
    rounds = [
        {"uncached": _run([1, 100, 100, 100]), "cached": _run([1, 150, 200, 300])},
        {"uncached": _run([1, 1000, 1000, 1000]), "cached": _run([1, 1500, 2000, 3000])},
        {"uncached": _run([1, 100, 100, 100]), "cached": _run([1, 170, 240, 250])},
    ]
    out = cache_bench.summary(rounds)
    assert out["by_epoch_cached_vs_uncached"] == pytest.approx([1.5, 2.0, 3.0])
    assert out["later_cached_vs_uncached"] == pytest.approx(2.0)


def test_without_both_runs_no_epoch_ratios(cache_bench):
    rounds = [{"cached": _run([1, 150, 200])}, {"cached": _run([1, 160, 210])}]
    assert "by_epoch_cached_vs_uncached" not in cache_bench.summary(rounds)
