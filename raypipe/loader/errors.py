"""raypipe's own errors from the actors, as the user's code should meet them.

A `SampleError`, `SkipBudgetError` or `TransformOutputError` raised in a preprocessing
actor reaches the rank inside Ray's wrappers: a ``RayTaskError`` of the map worker, and
through a ``streaming_split`` iterator another of the ``SplitCoordinator`` actor around it, whose
first line is ``ray::SplitCoordinator.get() (pid=…, ip=…, actor_id=…)``. `unwrapped` finds
the error as the actor raised it (one line naming the sample and its file), on either path.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import TypeVar

__all__ = ["collect_failed", "data_errors", "quiet_data_errors", "raising_ours", "unwrapped"]
assert __all__ == sorted(__all__)

T = TypeVar("T")


def unwrapped(error: BaseException) -> BaseException:
    """The first raypipe error in ``error``'s chain of Ray wrappers (``cause``) and Python
    causes (``__cause__``) that is not itself a Ray wrapper; ``error`` when there is none."""
    from ray.exceptions import RayTaskError

    ours = data_errors()
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ours) and not isinstance(e, RayTaskError):
            return e
        e = getattr(e, "cause", None) or e.__cause__
    return error


def data_errors() -> tuple[type[Exception], ...]:
    """raypipe's errors about the data: a bad sample (`raypipe.SampleError`), the skip
    budget spent (`raypipe.SkipBudgetError`), a transform's output (``TransformOutputError``)."""
    from raypipe.preprocess.usermap import TransformOutputError
    from raypipe.skips.budget import SkipBudgetError
    from raypipe.skips.records import SampleError

    return (SampleError, SkipBudgetError, TransformOutputError)


def quiet_data_errors(logger: logging.Logger, *, wrapped: bool = False) -> None:
    """Drop what ``logger`` logs about a data error (`data_errors`, itself: not one a
    user's error wraps), the one it is given or the one being handled: Ray Train logs a
    rank's error with its traceback through raypipe's frames, and `raypipe.train_ddp`
    raises it on the driver as itself, in one line. ``wrapped``: one in Ray's wrappers
    too (`unwrapped`), as Ray Data logs a failed task's, which the rank raises as itself."""
    keep = _no_wrapped_data_error if wrapped else _no_data_error
    if keep not in logger.filters:
        logger.addFilter(keep)


def _logged(record: logging.LogRecord) -> BaseException | None:
    return record.exc_info[1] if record.exc_info else sys.exc_info()[1]


def _no_data_error(record: logging.LogRecord) -> bool:
    return not isinstance(_logged(record), data_errors())


def _no_wrapped_data_error(record: logging.LogRecord) -> bool:
    error = _logged(record)
    return error is None or not isinstance(unwrapped(error), data_errors())


def raising_ours(items: Iterator[T]) -> Iterator[T]:
    """``items``, with a raypipe error that reaches them through Ray raised as itself."""
    try:
        yield from items
        return
    except Exception as e:
        failed, ours = e, unwrapped(e)
        if ours is e:
            raise
    # raised here, not in the handler, so that it does not carry Ray's error as its
    # context, with the failed execution's frames and pool actors (`collect_failed`)
    collect_failed(failed)
    del failed
    raise ours


def collect_failed(error: BaseException) -> None:
    """End the pool actors of the Ray Data execution that failed with ``error`` now.

    Ray Data releases a failed execution's actors to reference counting, and the handles
    sit in reference cycles and in the frames of its scheduling thread that the error's
    traceback keeps (a log handler that keeps records keeps them too): the actors and
    their CPUs stay taken until Python's cycle collector next runs, if ever, and the next
    pipeline waits for them. Clearing the finished frames' locals (the traceback's lines
    stay) and one collection free them.
    """
    import gc
    import traceback

    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
    gc.collect()
