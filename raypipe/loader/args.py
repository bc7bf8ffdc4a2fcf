"""`raypipe.Pipeline`'s own arguments, checked before any work (the config checks itself):
`check_args`, all of them, and `check_options`, the ones a `raypipe.Loader` checks when it
is made, before its rank and ledger are known."""

from __future__ import annotations

from typing import Any

from raypipe.skips.log import SkipLog

__all__ = ["check_args", "check_options"]
assert __all__ == sorted(__all__)


def check_options(*, progress_s: Any = None, skips: Any = None, drop_last: Any = True) -> None:
    """ValueError or TypeError naming the option: found at the first batch, a bad one came
    after the listing, the ranks' join and the pool's start (``skips``: an AttributeError)."""
    if not isinstance(drop_last, bool):
        raise ValueError(f"{drop_last=} must be True or False")
    seconds = isinstance(progress_s, (int, float)) and not isinstance(progress_s, bool)
    if progress_s is not None and not (seconds and progress_s >= 0):
        raise ValueError(f"{progress_s=} must be seconds >= 0 (0: no progress lines)")
    if skips is not None and not isinstance(skips, SkipLog):
        raise TypeError(f"skips= must be a raypipe.skips.log.SkipLog (a run's shared log) or "
                        f"None, got {type(skips).__name__}")  # fmt: skip


def check_args(*, epochs, rank, world_size, ledger, progress_s, skips, start, drop_last) -> None:
    """`Pipeline`'s arguments; ValueError (TypeError: ``skips``) naming one."""
    for name, value, low in (("epochs", epochs, 1), ("world_size", world_size, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"{rank=} must be an integer in 0..{world_size - 1}")
    check_options(progress_s=progress_s, skips=skips, drop_last=drop_last)
    if world_size > 1 and ledger is None and drop_last:
        raise ValueError(f"{world_size=} needs ledger=Pipeline.ledger({world_size}) for equal "
                         "batches (or drop_last=False)")  # fmt: skip
    if world_size > 1 and drop_last and (made := _world_of(ledger)) != world_size:
        raise ValueError(f"ledger= was made for {made} ranks, this run has {world_size=}")
    if start is not None and not 0 <= start.epoch < epochs:
        raise ValueError(f"the resume state is at epoch {start.epoch}: {epochs=} leaves nothing")


def _world_of(ledger) -> int:
    import ray

    return ray.get(ledger.size.remote())
