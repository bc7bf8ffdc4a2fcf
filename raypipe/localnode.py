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

A new local Ray turns Ray 2.60's token authentication on where ``RAY_AUTH_MODE`` is unset
(its job API then asks for ``~/.ray/auth_token``, which Ray writes 0644 where there is
none: any user of the machine could read it and run jobs as this one). `private_token`
writes that file first, for this user alone, or makes one readable by others this user's
alone, saying so; `forget` (after ``ray.shutdown()``) takes back the ``RAY_AUTH_MODE=token``
Ray set in this process, so that a cluster it joins next is not sent this machine's token
unasked (docs/security.md).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import stat
from pathlib import Path
from types import MappingProxyType

from raypipe import rayapi
from raypipe.rayapi import RAY_VERSION

__all__ = ["AUTH_VAR", "CLUSTER_VAR", "LOCAL_SYSTEM_CONFIG", "LOOPBACK", "RAY_VERSION",
           "TLS_FILES", "check_ray", "check_tls", "ensure", "forget", "is_loopback",
           "private_token", "start", "started_here"]  # fmt: skip
assert __all__ == sorted(__all__)

log = logging.getLogger(__name__)
AUTH_VAR = "RAY_AUTH_MODE"  # unset: a new local Ray sets it to "token" in this process
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


_STARTED: list = []  # the GCS address of the new local Ray `start` started (one node)
_AUTH_SET: list[bool] = []  # that start turned RAY_AUTH_MODE=token on: `forget` takes it back


def started_here() -> bool:
    """Whether the Ray this process runs on is a local one it started (`start`), not one
    joined after a ``ray.shutdown()`` of it."""
    import ray

    if not (_STARTED and ray.is_initialized()):
        return False
    return ray.get_runtime_context().gcs_address == _STARTED[0]


def forget() -> None:
    """After ``ray.shutdown()``: this process runs no Ray `start` started, and
    ``RAY_AUTH_MODE`` is unset again where that start's ``ray.init`` set it."""
    _STARTED.clear()
    if _AUTH_SET and os.environ.get(AUTH_VAR) == "token":
        os.environ.pop(AUTH_VAR)
        rayapi.reload_config()  # Ray's own reading of it in this process
    _AUTH_SET.clear()


def private_token(home: Path | None = None) -> Path | None:
    """The token file a new local Ray will use (``~/.ray/auth_token``, where
    ``RAY_AUTH_MODE`` is unset or ``token`` and no ``RAY_AUTH_TOKEN(_PATH)`` names
    another), for this user alone: written here, mode 0600, where there is none (Ray would
    write it 0644), made 0600 where others could read it (a warning says so). None where
    Ray uses no such file."""
    named = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    if os.environ.get(AUTH_VAR, "token").lower() != "token" or named:
        return None
    path = (home or Path.home()) / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            try:
                path.chmod(mode & 0o700)
                done = f"made it {mode & 0o700:o}"
            except OSError as e:  # a read-only home, another owner's file: Ray reads it still
                done = f"could not make it {mode & 0o700:o} ({e.strerror}): chmod 600 it"
            log.warning("raypipe: %s, the token of the local Ray's job API, could be read by "
                        "other users of this machine (mode %o); %s (docs/security.md)",
                        path, mode, done)  # fmt: skip
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # 256 bits, as Ray makes one
    return path


def start(address: str | None = None, *, system_config: dict | None = None, **kwargs) -> None:
    """``ray.init(address, **kwargs)``, on loopback when it starts a new local Ray or joins
    one on a loopback address; Ray's TLS settings are checked first (`check_tls`). A new
    local Ray gets `LOCAL_SYSTEM_CONFIG` and ``system_config`` over it, and its token file
    this user's alone (`private_token`); a cluster joined gets neither (Ray refuses a
    system config when joining)."""
    import ray

    check_tls()
    if not ray.is_initialized():  # a Ray shut down without `forget`: what it left, gone
        forget()
    temp_dir = kwargs.get("_temp_dir")  # where ray.init looks for a cluster to join
    new = address == "local" or (address is None and _nothing_to_join(temp_dir))
    if new:  # a copy: ray.init adds its spilling settings to the dict
        config = {**LOCAL_SYSTEM_CONFIG, **(system_config or {})}
        kwargs = {**rayapi.system_config(config), **kwargs}
        private_token()
        auth_unset = AUTH_VAR not in os.environ
    if not _on_loopback(address, temp_dir):
        ray.init(address=address, **kwargs)
    else:
        _init_on_loopback(address, kwargs)
    if new:
        _STARTED.append(ray.get_runtime_context().gcs_address)
        if auth_unset and os.environ.get(AUTH_VAR) == "token":
            _AUTH_SET.append(True)


def _init_on_loopback(address: str | None, kwargs: dict) -> None:
    import ray

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


def _nothing_to_join(temp_dir: str | None = None) -> bool:
    """Plain ``ray.init()`` starts a new Ray: no ``RAY_ADDRESS`` (or ``RAY_ADDRESS=local``),
    no cluster `ray start` left (in ``temp_dir``, ``ray.init(_temp_dir=...)``'s, or Ray's
    default one)."""
    try:
        return rayapi.address_from_environment(None, temp_dir) in (None, "local")
    except Exception:
        return False


def _on_loopback(address: str | None, temp_dir: str | None = None) -> bool:
    """Whether ``ray.init(address, _temp_dir=temp_dir)`` starts a new local Ray or joins
    one on loopback."""
    if address is None or address == "auto":  # RAY_ADDRESS, else a cluster `ray start` left
        try:
            address = rayapi.address_from_environment(address, temp_dir)
        except Exception:  # "auto" and none to join: ray.init says so itself
            return False
    if address is None or address == "local":
        return True
    return "://" not in address and is_loopback(address.rsplit(":", 1)[0])
