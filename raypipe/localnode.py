"""How raypipe starts a Ray or joins one: a Ray it starts listens on loopback only.

`start` is ``ray.init``. When the call starts a new local Ray (``address="local"``, or
no address and no cluster to join, as plain ``ray.init()`` decides) or joins one on a
loopback address, the node's address is 127.0.0.1: Ray 2.60 binds the GCS, the raylet,
every worker's gRPC server, the dashboard and its agent, the runtime-env agent and the
autoscaler monitor to the node's address, and takes the machine's address for a new node
unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, whatever ``_node_ip_address`` says
(``127.0.0.1`` is turned into the machine's address). So `start` sets that variable for
the processes the new node spawns, and Ray's own reading of it in this process, for the
length of ``ray.init``. Joining a cluster elsewhere leaves both as they were.

Ray internals used, through `raypipe.rayapi` and checked against the running Ray by
`check_ray`: Ray's own reading of that variable (read when the node's address is chosen)
and the cluster plain ``ray.init()`` would join.

With ``RAY_USE_TLS`` on, Ray reads ``RAY_TLS_SERVER_CERT``, ``RAY_TLS_SERVER_KEY`` and
``RAY_TLS_CA_CERT`` in every process it starts; `check_tls` reads them first, so that a
missing or unreadable file fails here, in one line naming it, before any Ray process starts.
"""

from __future__ import annotations

import ipaddress
import os
from types import MappingProxyType

from raypipe import rayapi
from raypipe.rayapi import RAY_VERSION

__all__ = ["CLUSTER_VAR", "LOCAL_SYSTEM_CONFIG", "LOOPBACK", "RAY_VERSION", "TLS_FILES",
           "check_ray", "check_tls", "ensure", "is_loopback", "start", "started_here"]  # fmt: skip
assert __all__ == sorted(__all__)

CLUSTER_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a new node's address is loopback
LOOPBACK = "127.0.0.1"
TLS_FILES = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")

# A new local Ray raypipe starts (`start`, and so `ensure` and `raypipe.cli.localray`):
# - drops the per-handler timing every Ray process (raylet, GCS, workers, the driver) keeps
#   of its event loops, which only Ray's own debug dumps read; on a 2-core node that CPU is
#   the actors'. Task events and metrics, which the dashboard shows, stay on.
# - frees the objects no one holds every 10 ms, not every second (or 100 objects): until
#   they are freed, each new block takes store memory no block used yet, so the blocks walk
#   the whole store and every worker, and the rank, meets a page fault each 4 KiB of them
#   until it has been over all of it (benchmarks/RESULTS.md, "Blocks in the store's same
#   pages"). Each free is also sent to every other node, which a one-node Ray has none of.
LOCAL_SYSTEM_CONFIG = MappingProxyType(
    {"event_stats": False, "free_objects_period_milliseconds": 10}
)


_STARTED = []  # this process started a new local Ray (one node: nothing adds more)


def started_here() -> bool:
    """Whether the Ray this process runs on is a local one it started (`start`)."""
    import ray

    return bool(_STARTED) and ray.is_initialized()


def start(address: str | None = None, *, system_config: dict | None = None, **kwargs) -> None:
    """``ray.init(address, **kwargs)``, on loopback when it starts a new local Ray or joins
    one on a loopback address; Ray's TLS settings are checked first (`check_tls`). A new
    local Ray gets `LOCAL_SYSTEM_CONFIG` and ``system_config`` over it; a cluster joined
    gets neither (Ray refuses a system config when joining)."""
    import ray

    check_tls()
    _STARTED.clear()
    if address == "local" or (address is None and _nothing_to_join()):
        _STARTED.append(True)  # a copy: ray.init adds its spilling settings to the dict
        config = {**LOCAL_SYSTEM_CONFIG, **(system_config or {})}
        kwargs = {**rayapi.system_config(config), **kwargs}
    if not _on_loopback(address):
        ray.init(address=address, **kwargs)
        return
    problem = check_ray()
    if problem is not None:
        raise RuntimeError(f"raypipe cannot keep a local Ray on loopback: {problem}")
    before_env = os.environ.get(CLUSTER_VAR)
    os.environ[CLUSTER_VAR] = "0"  # inherited by the raylet, GCS, agents and workers
    try:
        with rayapi.cluster_flag_off():  # read by this process when it picks the address
            ray.init(address=address, **kwargs)
    finally:  # a later ray.init in this process, to a remote cluster, chooses as Ray does
        if before_env is None:
            os.environ.pop(CLUSTER_VAR, None)
        else:
            os.environ[CLUSTER_VAR] = before_env


def ensure() -> None:
    """A Ray for this process: `start` a local one on loopback unless one is running here,
    as Ray Data and Ray Train would start one on first use (with the machine's address)."""
    import ray

    if not ray.is_initialized():
        start()


def check_tls(environ: dict[str, str] | None = None) -> None:
    """With ``RAY_USE_TLS`` on, every one of `TLS_FILES` must name a readable file;
    ValueError naming the variable and the file otherwise."""
    env = os.environ if environ is None else environ
    if env.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        return
    for var in TLS_FILES:
        path = env.get(var)
        if not path:
            raise ValueError(f"RAY_USE_TLS={env['RAY_USE_TLS']} needs {var}, which is not set")
        try:
            with open(path, "rb") as f:
                if not f.read(1):
                    raise ValueError(f"{var}={path} is empty")
        except OSError as e:
            raise ValueError(f"{var}={path} cannot be read: {e.strerror}") from None


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1, an IPv4-mapped loopback or ``localhost``."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def check_ray() -> str | None:
    """Why `start` cannot steer this Ray's choice of address (None: it can)."""
    problems = rayapi.check(("localnode",))
    return f"{'; '.join(problems)}: the Ray whose address choice it steers" if problems else None


def _nothing_to_join() -> bool:
    """Plain ``ray.init()`` starts a new Ray: no ``RAY_ADDRESS``, no cluster `ray start` left."""
    try:
        return rayapi.address_from_environment(None) is None
    except Exception:
        return False


def _on_loopback(address: str | None) -> bool:
    """Whether ``ray.init(address)`` starts a new local Ray or joins one on loopback."""
    if address is None or address == "auto":  # RAY_ADDRESS, else a cluster `ray start` left
        try:
            address = rayapi.address_from_environment(address)
        except Exception:  # "auto" and none to join: ray.init says so itself
            return False
    if address is None or address == "local":
        return True
    return "://" not in address and is_loopback(address.rsplit(":", 1)[0])
