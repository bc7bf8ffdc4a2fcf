"""One attempt of a `raypipe.train_ddp` run on each rank, and the run's errors as the
driver raises them (`fit`).

A data error fails every attempt alike; Ray Train's ``FailureConfig(max_failures)``
restarted the group that many times (at -1 without end), each attempt reading the data
again. The first attempt that meets one records it, and the next ends at once.
"""

from __future__ import annotations

import logging

from raypipe import rayapi
from raypipe.loader.errors import is_data_error, quiet_data_errors
from raypipe.skips.log import SkipLog
from raypipe.train.context import TrainContext

__all__ = ["fit", "rank_attempt"]

log = logging.getLogger(__name__)


def rank_attempt(ctx: TrainContext, train_loop, skips: SkipLog):
    """What each Ray Train worker runs, every attempt: ``train_loop(ctx)``, with the
    pipeline started first and closed after. A data error (`is_data_error`) is recorded
    as what ended the run (`SkipLog.stop_with`): a group Ray Train restarts after it ends
    at once (the same data would fail alike), and `raypipe.train_ddp` raises it."""

    def per_worker(_: dict) -> None:
        quiet_data_errors(logging.getLogger(rayapi.TRAIN_ERROR_LOGGER))  # raised by fit
        if skips.is_stopped():  # a group restarted after a data error: no retry mends it
            return  # (the same data fails alike); the driver raises it
        try:
            ctx.start()  # the pool starts while the loop builds its model
            train_loop(ctx)
        except Exception as e:
            if is_data_error(e):
                try:
                    skips.stop_with(e)
                except Exception as why:  # noqa: BLE001  (the data error is what to raise)
                    log.warning("raypipe: could not record %s as the run's end: %s", e, why)
            raise
        finally:
            ctx.close()

    return per_worker


def fit(trainer, skips: SkipLog | None = None):
    """``trainer.fit()``, where a Ctrl-C stops the run with `KeyboardInterrupt` and a
    failure of the ranks' that is all data errors (`is_data_error`: `raypipe.SkipBudgetError`,
    `raypipe.SampleError`, a transform's output, the LM job's token ids) is raised as the
    first rank's error, not inside Ray Train's ``WorkerGroupError``.

    Ray Train answers a SIGINT in the driver by aborting the run, and the driver's wait
    then ends in ``SystemExit(1)`` with no message (``raypipe run`` exited 1, silently);
    its handler also stayed installed after the run. Here the run is aborted as Ray Train
    does it, then `KeyboardInterrupt` is raised, as a Ctrl-C anywhere else in Python, and
    the SIGINT handler from before the run is put back. With ``skips``, a run in which a
    rank recorded a data error (`rank_attempt`) raises it: its restarted group returned at
    once, or could not start."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()  # else Ray sets none
    before = signal.getsignal(signal.SIGINT) if main else None
    try:
        result = trainer.fit()
    except SystemExit as e:  # from a signal handler during the wait: Ray Train's Ctrl-C
        raise KeyboardInterrupt("the training run was stopped (Ctrl-C)") from e
    except Exception as e:  # the ranks' data errors, raised as themselves, not in Ray's wrapper
        failures = [f for _, f in sorted((getattr(e, "worker_failures", None) or {}).items())]
        if failures and all(is_data_error(f) for f in failures):
            raise failures[0] from e
        if failures or skips is None or (stopped := skips.stopped_by()) is None:
            raise  # another failure too: Ray's error names every rank's
        raise stopped from e  # the group restarted after a data error could not start
    else:
        if skips is not None and (stopped := skips.stopped_by()) is not None:
            raise stopped  # the group restarted after it returned at once
        return result
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)
