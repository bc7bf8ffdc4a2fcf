"""Start a local Ray for raypipe, and stop it leaving none of its processes behind.

`start` is `raypipe.localnode.start` (``ray.init``; a new local Ray listens on loopback
only, with raypipe's settings, `LOCAL_SYSTEM_CONFIG`, as a `Pipeline` that starts its own
Ray gets them); an existing cluster is joined as it is configured.

``ray.shutdown()`` stops the raylet and GCS that ``ray.init()`` started as this process's
children; their workers are meant to exit with the raylet. With Ray 2.60 a pool actor's
worker now and then outlives it (adopted by init, still holding its memory). So
`shutdown` notes this process's Ray descendants first, shuts Ray down, and kills by pid
those still there after a grace period: the very processes noted, not new ones that
took their pid (``/proc`` start times are compared). Without ``/proc`` it is a plain
``ray.shutdown()``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from raypipe import localnode
from raypipe.localnode import LOCAL_SYSTEM_CONFIG

__all__ = ["LOCAL_SYSTEM_CONFIG", "TRAIN_POLL_S", "plain_prefixes", "process_tree",
           "ray_descendants", "shutdown", "start", "stop_leftovers"]  # fmt: skip
assert __all__ == sorted(__all__)

TRAIN_POLL_S = 0.5  # how often Ray Train's controller looks at its workers on a local Ray
_POLL_VAR = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
_POLL_SET: list[bool] = []  # `start` set it: `shutdown` takes it back


def start(address: str = "local", **kwargs) -> None:
    """`raypipe.localnode.start` (a new local Ray listens on loopback only, with
    `LOCAL_SYSTEM_CONFIG` and any ``system_config=`` over it), its workers' lines plain.

    On a new local Ray, Ray Train's controller looks at its workers every `TRAIN_POLL_S`
    (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, unless set): Ray's 2 s default, meant for
    clusters of many workers, made a run wait for a look at each step of its start, its
    checkpoints and its end (the digits demo: 40 s, 34-36 s with 0.5 s). A cluster joined
    keeps Ray's default; `shutdown` takes the setting back."""
    plain_prefixes(sys.stdout)
    localnode.start(address, **kwargs)
    if localnode.started_here() and _POLL_VAR not in os.environ:  # read by a trainer's fit()
        os.environ[_POLL_VAR] = str(TRAIN_POLL_S)
        _POLL_SET.append(True)


def plain_prefixes(stream) -> None:
    """Workers' lines reach ``stream`` without Ray's colour codes when it is no terminal (a
    log file, a pipe): ``RAY_COLOR_PREFIX=0``, which Ray's driver reads as it prints."""
    if not stream.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def shutdown(grace_s: float = 10.0) -> list[int]:
    """``ray.shutdown()`` (`raypipe.localnode.forget` after it), then SIGKILL to this
    process's Ray descendants (noted before it) still alive ``grace_s`` later. Returns the
    pids killed."""
    import ray

    noted = ray_descendants(os.getpid())
    ray.shutdown()
    localnode.forget()  # and RAY_AUTH_MODE=token, where its start had Ray set it
    if _POLL_SET:  # a cluster this process joins next keeps Ray's default
        os.environ.pop(_POLL_VAR, None)
        _POLL_SET.clear()
    return stop_leftovers(noted, grace_s)


def stop_leftovers(noted: dict[int, int], grace_s: float) -> list[int]:
    """SIGKILL to the processes of ``noted`` (`ray_descendants`) still alive after
    ``grace_s``; a pid now held by another process is left alone. Returns those killed."""
    deadline = time.monotonic() + grace_s
    while (alive := [p for p, t in noted.items() if _start_time(p) == t]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return alive


def ray_descendants(root: int) -> dict[int, int]:
    """``{pid: start time}`` of ``root``'s descendants that are Ray's: ``ray::`` workers,
    and the raylet, GCS and Ray's Python services (run from the ``ray`` package)."""
    tree = process_tree(root)
    return {pid: int(f[19]) for pid, (_, f) in tree.items() if pid != root and _is_ray(pid)}


def process_tree(root: int) -> dict[int, tuple[str, list[str]]]:
    """``{pid: (name, stat fields)}`` of ``root`` and its descendants, from ``/proc``
    (empty without it). The fields are those of ``/proc/<pid>/stat`` after the name:
    state is field 0, the parent 1, user and system CPU ticks 11-14, the start time 19."""
    stats: dict[int, tuple[str, list[str]]] = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if name.isdigit() and (stat := _stat(int(name))) is not None:
            stats[int(name)] = stat
    out = {}
    for pid, stat in stats.items():
        p = pid
        while p not in (0, 1, root) and p in stats:
            p = int(stats[p][1][1])
        if p == root:
            out[pid] = stat
    return out


def _stat(pid: int) -> tuple[str, list[str]] | None:
    """``/proc/<pid>/stat`` as (name, the fields after it), or None if it is gone."""
    try:
        head, tail = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
    except (OSError, ValueError):
        return None
    return head.split("(", 1)[1], tail.split()


def _start_time(pid: int) -> int | None:
    stat = _stat(pid)
    if stat is None or stat[1][0] == "Z":  # gone, or a zombie: nothing left to stop
        return None
    return int(stat[1][19])


def _is_ray(pid: int) -> bool:
    """A ``ray::`` worker, or a program of the installed ``ray`` package (raylet, GCS,
    dashboard, log monitor): not any command that merely has ``/ray/`` in a path."""
    try:
        cmd = (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return False
    return cmd.startswith("ray::") or any(folder in cmd for folder in _ray_package())


def _ray_package() -> set[str]:
    """The ``ray`` package's folder, as imported and with links resolved."""
    import ray

    folder = os.path.dirname(ray.__file__)
    return {os.path.join(f, "") for f in (folder, os.path.realpath(folder))}
