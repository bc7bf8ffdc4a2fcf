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

from raypipe import rayapi

__all__ = ["collect_failed", "data_errors", "is_data_error", "quiet_data_errors",
           "quiet_ray_data_aborts", "raising_ours", "unwrapped"]  # fmt: skip
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


def quiet_data_errors(logger: logging.Logger) -> None:
    """Drop what ``logger`` logs while a data error (`data_errors`, itself: not one a
    user's error wraps) is being handled: Ray Train logs a rank's error with its
    traceback through raypipe's frames, and `raypipe.train_ddp` raises it on the driver
    as itself, in one line. So too an error whose class says its job prints it on the
    driver in one line (``said_by_the_driver``: the LM job's `TokenIdError`)."""
    if _no_data_error not in logger.filters:
        logger.addFilter(_no_data_error)


def is_data_error(error: BaseException | None) -> bool:
    """``error`` is one of `data_errors` (itself: not one a user's error wraps), or an
    error whose class says its job prints it on the driver (``said_by_the_driver``)."""
    return isinstance(error, data_errors()) or getattr(error, "said_by_the_driver", False)


def _no_data_error(record: logging.LogRecord) -> bool:
    return not is_data_error(sys.exc_info()[1])


def quiet_ray_data_aborts() -> None:
    """Drop Ray Data's log of a failed task's data error as its execution aborts (the error
    it is given, in Ray's wrappers: `unwrapped`), in this process: the rank raises that
    error as itself (`raising_ours`, `raypipe.loader.feeder`), where Ray Data's log gave a
    traceback through Ray's frames and advice (``DataContext.max_errored_blocks``) that is
    not raypipe's. Called where an execution starts here (`raypipe.loader.blocks.execute`,
    a ``DataIterator``'s batches). What Ray Data goes on past (``max_errored_blocks`` set)
    is still logged: nothing else says those samples were lost. An execution in another
    process (a ``streaming_split``'s coordinator actor) logs as Ray Data does."""
    logger = logging.getLogger(rayapi.DATA_ERROR_LOGGER)
    if _no_aborting_data_error not in logger.filters:
        logger.addFilter(_no_aborting_data_error)


def _no_aborting_data_error(record: logging.LogRecord) -> bool:
    if not record.exc_info or rayapi.DATA_ERROR_ABORTS not in record.getMessage():
        return True
    return not isinstance(unwrapped(record.exc_info[1]), data_errors())


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
