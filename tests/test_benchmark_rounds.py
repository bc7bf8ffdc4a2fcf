"""`benchmarks/ingest_rounds.py`: every path once per round in a rotating order, and
ratios taken within a round, on paths whose rate the test chooses."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "ingest_rounds", Path(__file__).resolve().parents[1] / "benchmarks" / "ingest_rounds.py"
)
ingest_rounds = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ingest_rounds)
rounds = ingest_rounds.rounds


def _path(name: str, rates: list[float], log: list[str]):
    """A path whose i-th run reports ``rates[i]`` img/s (and half that per CPU-second)."""
    runs = iter(rates)

    def run() -> dict:
        log.append(name)
        rate = next(runs)
        return {"steady_img_s": rate, "steady_run_img_s": rate, "img_per_cpu_s": rate / 2}

    return run


def test_each_round_runs_every_path_once_starting_one_further_along():
    log: list[str] = []
    paths = {name: _path(name, [1.0] * 3, log) for name in "abc"}
    rounds(paths, 3, [])
    assert log == list("abc" + "bca" + "cab")


def test_ratios_pair_the_runs_of_a_round_and_take_their_median():
    # a machine that speeds up 4x over the run, b always 10 % behind a: every round's
    # ratio is 1.11, though b's fastest round is far ahead of a's slowest
    log: list[str] = []
    a, b = [100.0, 200.0, 400.0], [90.0, 180.0, 360.0]
    out = rounds({"a": _path("a", a, log), "b": _path("b", b, log)}, 3, [("a", "b")])
    ratio = out["ratios"]["a_vs_b"]["steady_img_s"]
    assert ratio["per_round"] == pytest.approx([100 / 90] * 3)
    assert ratio["median"] == pytest.approx(100 / 90)
    assert out["paths"]["b"]["steady_img_s"] == {"per_round": b, "median": 180.0}
    assert out["ratios"]["a_vs_b"]["img_per_cpu_s"]["median"] == pytest.approx(100 / 90)
    # rounds whose ratios differ: the median of the ratios (1.11), not the ratio of the
    # medians (200 / 250 = 0.8)
    b2 = [90.0, 250.0, 300.0]
    out = rounds({"a": _path("a", a, []), "b": _path("b", b2, [])}, 3, [("a", "b")])
    ratio = out["ratios"]["a_vs_b"]["steady_img_s"]
    assert ratio["per_round"] == pytest.approx([100 / 90, 200 / 250, 400 / 300])
    assert ratio["median"] == pytest.approx(100 / 90)


def test_no_rounds_is_an_error():
    with pytest.raises(ValueError, match="at least 1, got 0"):
        rounds({}, 0, [])


def test_a_sweep_is_won_by_the_fastest_unless_a_cheaper_setting_is_level_with_it():
    winner = ingest_rounds.winner
    fast_but_dear = {"steady_img_s": 1000.0, "img_per_cpu_s": 400.0}
    level_and_cheap = {"steady_img_s": 990.0, "img_per_cpu_s": 450.0}
    slow_and_cheaper = {"steady_img_s": 900.0, "img_per_cpu_s": 600.0}
    assert winner([slow_and_cheaper, fast_but_dear]) == 1
    assert winner([fast_but_dear, level_and_cheap, slow_and_cheaper]) == 1
    assert winner([fast_but_dear, level_and_cheap], tie=0.0) == 0
    with pytest.raises(ValueError, match="no results"):
        winner([])


def test_finalists_are_the_fastest_settings_and_leaders_the_best_medians():
    sweep = [{"steady_img_s": r} for r in (900.0, 1000.0, 950.0)]
    assert ingest_rounds.finalists(sweep) == [1, 2]
    assert ingest_rounds.finalists(sweep, k=1) == [1]
    log: list[str] = []
    paths = {
        "a2": _path("a2", [10.0, 30.0, 20.0], log),  # median 20
        "a3": _path("a3", [25.0, 21.0, 5.0], log),  # median 21
        "b": _path("b", [1.0, 1.0, 1.0], log),
    }
    out = rounds(paths, 3, [("a2", "b"), ("a3", "b")])
    assert ingest_rounds.leaders(out, {"a": ["a2", "a3"], "b": ["b"]}) == {"a": "a3", "b": "b"}


def test_every_loader_sends_the_same_number_of_finalists():
    """A leader picked after the rounds is the best of its loader's finalists: a loader
    sending two gets two draws against one, so each sweep sends the same number."""
    sweeps = {
        "pillow": [{"steady_img_s": r} for r in (1000.0, 1100.0, 1050.0, 900.0)],
        "fast": [{"steady_img_s": r} for r in (1600.0, 1700.0, 1650.0, 1500.0)],
        "raypipe_warm": [{"steady_img_s": r} for r in (1750.0, 1740.0)],
    }
    picked = ingest_rounds.entrants(sweeps)
    assert picked == {"pillow": [1, 2], "fast": [1, 2], "raypipe_warm": [0, 1]}
    assert {len(v) for v in picked.values()} == {ingest_rounds.FINALISTS}
    assert ingest_rounds.entrants(sweeps, k=1) == {"pillow": [1], "fast": [1], "raypipe_warm": [0]}
    with pytest.raises(ValueError, match=r"needs 3 settings.*'raypipe_warm': 2"):
        ingest_rounds.entrants(sweeps, k=3)
    with pytest.raises(ValueError, match="at least 1, got 0"):
        ingest_rounds.entrants(sweeps, k=0)
