"""What raypipe's commands print: raypipe's own lines (progress, epochs, the summary), and
Ray's only when they matter; ``--verbose`` or ``RAYPIPE_VERBOSE=1`` shows all of Ray's.

Quiet, a run leaves out Ray Data's lines per execution (plan, start, finish, notices), Ray
Train's INFO lines (worker group, device moves, checkpoints) and the note that a local Ray
uses token authentication; Ray's warnings and errors stay. On a local Ray, Ray Train's
preemption watcher is off: one machine has no node to drain, and its actor logs an
error-level line at start (its constructor arguments are in the object store).

Two lines have no setting, and are dropped from the workers' output the driver prints
(`BENIGN`): Ray Data starts every pool actor with its map and context as object refs, so
each actor's core worker logs an error-level line about restarts (Ray issue 53727) in a
healthy run; and Ray Train logs every ``TrainingReport`` through a logger named by its
file, outside ``ray.train``'s level. The filter wraps the driver's log printer, a Ray
internal (`raypipe.rayapi.worker_log_handlers`) checked against the pinned Ray: with
another Ray the lines are printed as they come.
"""

from __future__ import annotations

import logging
import os
import re

from raypipe import rayapi

__all__ = ["BENIGN", "LOCAL_ENV", "QUIET_ENV", "TRAIN_LOG_LEVEL", "VERBOSE_ENV", "drop_benign",
           "filter_worker_logs", "is_verbose", "quiet_ray"]  # fmt: skip
assert __all__ == sorted(__all__)

VERBOSE_ENV = "RAYPIPE_VERBOSE"
QUIET_ENV = {"RAY_DATA_LOG_LEVEL": "ERROR"}  # for every Ray process of the run
LOCAL_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}  # a local Ray only
TRAIN_LOG_LEVEL = "WARNING"  # Ray Train's own logs (ray.train.LoggingConfig), quiet
_DRIVER_NOTES = (rayapi.AUTH_TOKEN_LOGGER,)
BENIGN = re.compile(
    r"core_worker\.cc:\d+: Actor with class name: '[^']*' and ID: '[0-9a-f]+' has constructor "
    r"arguments in the object store and max_restarts > 0"
    r"|^Reporting training result \d+: TrainingReport\("
)
_PRINTER = "ray_print_logs"  # the driver's handler of its workers' output (Ray 2.60)


def is_verbose(flag: bool) -> bool:
    """``--verbose``, or ``RAYPIPE_VERBOSE`` set to anything but empty or 0."""
    return flag or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_ray(*, local: bool) -> None:
    """Quiet this process and the Ray it is about to start (``local``) or join: the
    settings go into the environment the local Ray's processes inherit, unless set."""
    for name, value in {**QUIET_ENV, **(LOCAL_ENV if local else {})}.items():
        os.environ.setdefault(name, value)
    for name in _DRIVER_NOTES:
        logging.getLogger(name).setLevel(logging.ERROR)


def drop_benign(data: dict) -> dict | None:
    """A batch of worker output without its `BENIGN` lines; None when none is left."""
    lines = [line for line in data.get("lines", []) if not BENIGN.search(line)]
    return {**data, "lines": lines} if lines else None


def filter_worker_logs() -> bool:
    """Drop `BENIGN` lines from the workers' output this driver prints; False (and nothing
    changed) when this Ray's printer is not the one it wraps."""
    import ray

    if ray.__version__ != rayapi.RAY_VERSION:
        return False
    with rayapi.worker_log_handlers() as handlers:
        for i, (name, handle) in enumerate(handlers or []):
            if name == _PRINTER and not getattr(handle, "raypipe_filtered", False):
                handlers[i] = (name, _filtered(handle))
                return True
    return False


def _filtered(handle):
    def emit(data: dict) -> None:
        kept = drop_benign(data)
        if kept is not None:
            handle(kept)

    emit.raypipe_filtered = True
    return emit
