"""One attempt of a `raypipe.train_ddp` run on each rank, and the run's errors as the
driver raises them (`fit`).

A data error fails every attempt alike; Ray Train's ``FailureConfig(max_failures)``
restarted the group that many times (at -1 without end), each attempt reading the data
again. The first attempt that meets one records it, and the next ends at once.
"""

from __future__ import annotations

import logging

from raypipe import rayapi
from raypipe.loader.errors import data_errors, is_data_error, quiet_data_errors
from raypipe.skips.log import SkipLog
from raypipe.train.context import TrainContext

__all__ = ["fit", "rank_attempt"]


def rank_attempt(ctx: TrainContext, train_loop, skips: SkipLog):
    """What each Ray Train worker runs, every attempt: ``train_loop(ctx)``, with the
    pipeline started first and closed after. A data error (`is_data_error`) is recorded
    as what ended the run (`SkipLog.stop_with`): a group Ray Train restarts after it ends
    at once (the same data would fail alike), and `raypipe.train_ddp` raises it."""

    def per_worker(_: dict) -> None:
        quiet_data_errors(logging.getLogger(rayapi.TRAIN_ERROR_LOGGER))  # raised by fit
        if skips.stopped_by() is not None:  # a group restarted after a data error: no retry
            return  # mends it (the same data fails alike); the driver raises it
        try:
            ctx.start()  # the pool starts while the loop builds its model
            train_loop(ctx)
        except Exception as e:
            if is_data_error(e):
                skips.stop_with(e)
            raise
        finally:
            ctx.close()

    return per_worker


def fit(trainer):
    """``trainer.fit()``, where a Ctrl-C stops the run with `KeyboardInterrupt` and a
    failure of the ranks' that is all data errors (`raypipe.SkipBudgetError`,
    `raypipe.SampleError`, a transform's output) is raised as the first rank's error,
    not inside Ray Train's ``WorkerGroupError``.

    Ray Train answers a SIGINT in the driver by aborting the run, and the driver's wait
    then ends in ``SystemExit(1)`` with no message (``raypipe run`` exited 1, silently);
    its handler also stayed installed after the run. Here the run is aborted as Ray Train
    does it, then `KeyboardInterrupt` is raised, as a Ctrl-C anywhere else in Python, and
    the SIGINT handler from before the run is put back."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()  # else Ray sets none
    before = signal.getsignal(signal.SIGINT) if main else None
    try:
        return trainer.fit()
    except SystemExit as e:  # from a signal handler during the wait: Ray Train's Ctrl-C
        raise KeyboardInterrupt("the training run was stopped (Ctrl-C)") from e
    except Exception as e:  # the ranks' data errors, raised as themselves, not in Ray's wrapper
        failures = [f for _, f in sorted((getattr(e, "worker_failures", None) or {}).items())]
        if not failures or not all(isinstance(f, data_errors()) for f in failures):
            raise  # another failure too: Ray's error names every rank's
        raise failures[0] from e
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)
