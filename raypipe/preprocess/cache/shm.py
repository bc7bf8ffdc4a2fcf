"""The memory cache's directories in a node's shared memory (`SHM_DIR`): made and held by
the node's `raypipe.preprocess.cache.node.NodeCache` (an ``flock`` on their ``lock``
file, which the kernel lets go however its process ends), and removed by `sweep` once
nothing holds them.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import time

__all__ = ["NEW_GRACE_S", "PREFIX", "SHM_DIR", "hold", "room", "sweep"]
assert __all__ == sorted(__all__)

SHM_DIR = "/dev/shm"  # where cache="memory" keeps its files
PREFIX = "raypipe-cache-"
NEW_GRACE_S = 60.0  # a directory with no lock file yet is a cache being made, this long


def room(store_bytes: int) -> int:
    """Bytes the memory cache may take in `SHM_DIR`: what is free there, less the node's
    object store (which Ray may keep there too, and fill)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return max(0, st.f_bavail * st.f_frsize - store_bytes)


def hold(root: str) -> int:
    """Make ``root`` with its ``lock`` file held (LOCK_EX) by this process; the fd."""
    os.makedirs(root, exist_ok=True)
    fd = os.open(os.path.join(root, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def sweep(where: str | None = None) -> list[str]:
    """Remove the memory caches under ``where`` (`SHM_DIR`) whose actor is gone (their
    lock is free); returns the directories removed."""
    removed = []
    for root in glob.glob(os.path.join(where or SHM_DIR, PREFIX + "*")):
        lock = os.path.join(root, "lock")
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:  # being made, or left half made long ago
            with contextlib.suppress(OSError):
                if time.time() - os.stat(root).st_mtime > NEW_GRACE_S:
                    shutil.rmtree(root, ignore_errors=True)
                    removed.append(root)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its actor holds it
        finally:
            os.close(fd)
        shutil.rmtree(root, ignore_errors=True)
        removed.append(root)
    return removed
