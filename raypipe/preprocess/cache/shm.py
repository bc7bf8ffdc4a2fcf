"""The memory cache's directories in a node's shared memory (`SHM_DIR`): made and held by
the node's `raypipe.preprocess.cache.node.NodeCache` (a shared ``flock`` on their ``lock``
file, which the kernel lets go however its process ends), and removed once nothing holds
them: by `sweep`, or by `let_go` when the last holder ends.

Holders share the lock, so runs on one node with the same settings share one cache: each
rank that `torchrun` starts is a Ray job of its own, with its own `NodeCache` of the same
directory. A directory is removed only by a process that takes its lock alone, and while
it holds it; a `hold` that meanwhile locked the file being removed makes a new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import time

__all__ = ["NEW_GRACE_S", "PREFIX", "SHM_DIR", "hold", "let_go", "room", "sweep"]
assert __all__ == sorted(__all__)

SHM_DIR = "/dev/shm"  # where cache="memory" keeps its files
PREFIX = "raypipe-cache-"
NEW_GRACE_S = 60.0  # a directory with no lock file yet is a cache being made, this long


def room(store_bytes: int) -> int:
    """Bytes the memory cache may take in `SHM_DIR`: what is free there, less the node's
    object store where Ray may keep it there too, and fill it (not where `SHM_DIR` is
    smaller than the store: Ray then keeps it in /tmp, as under Docker's 64 MiB)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return max(0, free - store_bytes) if size >= store_bytes else free


def hold(root: str) -> int:
    """Make ``root`` with its ``lock`` file, held (shared) by this process: the fd."""
    lock = os.path.join(root, "lock")
    while True:
        os.makedirs(root, exist_ok=True)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:  # removed by a sweep since it was made: again
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                return fd
        os.close(fd)  # removed by a sweep between the open and the lock: made again


def let_go(root: str, fd: int) -> bool:
    """Stop holding ``root`` (``fd`` from `hold`) and remove it if no other process holds
    it; True when removed."""
    os.close(fd)
    return _remove_if_free(root)


def sweep(where: str | None = None) -> list[str]:
    """Remove the memory caches under ``where`` (`SHM_DIR`) that nothing holds (their
    holders gone, however they ended); returns the directories removed."""
    return [root for root in glob.glob(os.path.join(where or SHM_DIR, PREFIX + "*"))
            if _remove_if_free(root)]  # fmt: skip


def _remove_if_free(root: str) -> bool:
    lock = os.path.join(root, "lock")
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:  # being made, or left half made long ago
        with contextlib.suppress(OSError):
            if time.time() - os.stat(root).st_mtime > NEW_GRACE_S:
                shutil.rmtree(root, ignore_errors=True)
                return True
        return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False  # held
    try:  # removed while locked: a `hold` waiting on this lock finds its file gone
        shutil.rmtree(root, ignore_errors=True)
    finally:
        os.close(fd)
    return True
