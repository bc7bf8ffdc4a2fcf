"""raypipe's own errors from the actors, as the user's code should meet them.

A `SampleError`, `SkipBudgetError` or `TransformOutputError` raised in a preprocessing
actor reaches the rank inside Ray's wrappers: a ``RayTaskError`` of the map worker, and
through a ``streaming_split`` iterator another of the ``SplitCoordinator`` actor around it, whose
first line is ``ray::SplitCoordinator.get() (pid=…, ip=…, actor_id=…)``. `unwrapped` finds
the error as the actor raised it (one line naming the sample and its file), on either path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

__all__ = ["raising_ours", "unwrapped"]
assert __all__ == sorted(__all__)

T = TypeVar("T")


def unwrapped(error: BaseException) -> BaseException:
    """The first raypipe error in ``error``'s chain of Ray wrappers (``cause``) and Python
    causes (``__cause__``) that is not itself a Ray wrapper; ``error`` when there is none."""
    from ray.exceptions import RayTaskError

    from raypipe.preprocess.usermap import TransformOutputError
    from raypipe.skips.budget import SkipBudgetError
    from raypipe.skips.records import SampleError

    ours = (SampleError, SkipBudgetError, TransformOutputError)
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ours) and not isinstance(e, RayTaskError):
            return e
        e = getattr(e, "cause", None) or e.__cause__
    return error


def raising_ours(items: Iterator[T]) -> Iterator[T]:
    """``items``, with a raypipe error that reaches them through Ray raised as itself."""
    try:
        yield from items
    except Exception as e:
        ours = unwrapped(e)
        if ours is e:
            raise
        raise ours from None
