"""Interleaved rounds for ``benchmarks/ingest.py``: the sweeps' finalists, measured in turn.

A sweep runs each setting once and keeps the fastest, so the winner carries the luck of
its one pass (the best of four draws beats the best of two), and on a machine whose speed
drifts over a ten-minute run, a path that ran at a better moment looks faster. Here each
path runs once per round, the order rotating from round to round; a ratio is taken
between the two paths of the same round, and the median over rounds is reported. Every
loader's sweep sends the same number of settings, its `FINALISTS` fastest (`entrants`);
of each loader's finalists, the one with the best median over the rounds leads
(`leaders`). Picking a leader after the rounds is a best-of-k draw; with the same k for
every loader, no loader gets more draws than another (before, raypipe and the
fast-transform DataLoader sent two each and the Pillow DataLoader one).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

__all__ = ["FINALISTS", "entrants", "finalists", "leaders", "rounds", "winner"]
assert __all__ == sorted(__all__)
KEYS = ("steady_img_s", "steady_run_img_s", "img_per_cpu_s")
TIE = 0.02  # sweep results this close to the fastest are level: one pass cannot tell them
FINALISTS = 2  # settings every loader's sweep sends to the rounds, the same for each


def finalists(results: list[dict], k: int = 2) -> list[int]:
    """Indices of a sweep's ``k`` fastest settings (steady rate), fastest first: one pass
    each cannot order settings a few % apart, so the rounds measure them again."""
    order = sorted(range(len(results)), key=lambda i: -results[i]["steady_img_s"])
    return order[:k]


def entrants(sweeps: dict[str, list[dict]], k: int = FINALISTS) -> dict[str, list[int]]:
    """Per loader, the indices of its sweep's ``k`` fastest settings (`finalists`): the
    same number for every loader, so that choosing each loader's leader after the rounds
    favours none. A sweep with fewer than ``k`` settings is an error, not a smaller entry."""
    if k < 1:
        raise ValueError(f"entrants: k must be at least 1, got {k}")
    short = {name: len(results) for name, results in sweeps.items() if len(results) < k}
    if short:
        raise ValueError(f"entrants: every sweep needs {k} settings; these have fewer: {short}")
    return {name: finalists(results, k) for name, results in sweeps.items()}


def leaders(out: dict, families: dict[str, list[str]]) -> dict[str, str]:
    """Per family of paths (one loader's finalists), the path with the highest median
    steady rate over the rounds of ``out`` (`rounds`' result)."""
    rate = lambda name: out["paths"][name]["steady_img_s"]["median"]  # noqa: E731
    return {family: max(names, key=rate) for family, names in families.items()}


def winner(results: list[dict], tie: float = TIE) -> int:
    """Index of a sweep's winner: of the results within ``tie`` of the fastest steady
    rate, the one with the most images per CPU-second.

    One pass per setting cannot order rates 2 % apart, but a setting that runs more
    processes than cores pays for it in CPU, which the trainer then lacks; so a near tie
    goes to the cheaper setting, the same rule for every path.
    """
    if not results:
        raise ValueError("winner: no results")
    top = max(r["steady_img_s"] for r in results)
    level = [i for i, r in enumerate(results) if r["steady_img_s"] >= (1 - tie) * top]
    return max(level, key=lambda i: results[i]["img_per_cpu_s"])


def rounds(paths: dict[str, Callable[[], dict]], n: int,
           versus: list[tuple[str, str]]) -> dict:  # fmt: skip
    """Run every path of ``paths`` once per round for ``n`` rounds.

    Each path returns ``benchmarks/ingest.py``'s ``run_epochs`` result. Returns, per path,
    every round's value of each of `KEYS` and their median; and for each ``(a, b)`` of
    ``versus``, a's rate over b's in each round and the median of those ratios.
    """
    if n < 1:
        raise ValueError(f"rounds: n must be at least 1, got {n}")
    names = list(paths)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(n):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            r = paths[name]()
            runs[name].append(r)
            print(f"  round {i + 1}/{n}, {name}: steady {r['steady_img_s']:.0f} img/s", flush=True)
    out: dict = {"rounds": n, "paths": {}, "ratios": {}}
    for name, rs in runs.items():
        out["paths"][name] = {
            key: {
                "per_round": [r[key] for r in rs],
                "median": statistics.median(r[key] for r in rs),
            }
            for key in KEYS
        }
    for a, b in versus:
        out["ratios"][f"{a}_vs_{b}"] = {
            key: _paired(runs[a], runs[b], key)
            for key in ("steady_img_s", "steady_run_img_s", "img_per_cpu_s")
        }
    return out


def _paired(a: list[dict], b: list[dict], key: str) -> dict:
    per_round = [x[key] / y[key] for x, y in zip(a, b, strict=True)]
    return {"per_round": per_round, "median": statistics.median(per_round)}
