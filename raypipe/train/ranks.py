"""The ranks of a run that start themselves (`raypipe.Loader` under torchrun, a user's own
``TorchTrainer``, Lightning): who they are, and one ledger they all joined.

```
 resolve_world   rank, world size: given, else torch.distributed's, else RANK / WORLD_SIZE
 join_ranks      the ledger: a handle, a name, or a name rank 0 broadcasts over
                 torch.distributed; every rank joins it with its settings and waits for
                 the others (wait_for_ranks): one that disagrees
                 stops them all before work
 leave           a named ledger ends with the process that made it: ranks wait for each other
```
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from typing import Any

from raypipe import localnode
from raypipe.config import PipelineConfig
from raypipe.loader.ledger import NAMESPACE, EpochLedger
from raypipe.loader.waiters import concurrency
from raypipe.plan.shards import Listing

__all__ = [
    "collective_device",
    "join_ranks",
    "leave",
    "named_ledger",
    "resolve_world",
    "run_settings",
    "start_id",
    "wait_for_ranks",
]
assert __all__ == sorted(__all__)


def join_ranks(asked: Any, rank: int, world: int, *, group: str, settings: dict[str, str],
               timeout_s: float) -> tuple[Any, str, bool]:  # fmt: skip
    """``(ledger, run, named)``: the ledger ``asked`` for (a handle, a name, or None: a name
    from rank 0), once every rank joined ``run`` in it with the same ``settings``."""
    localnode.ensure()
    if asked is None or isinstance(asked, str):
        name = asked if asked is not None else _broadcast_name(world)
        ledger, run, named = named_ledger(name, world), f"{name}/{group}", True
    else:  # a handle outlives the ranks: a restarted group joins a run of its own in it
        start = start_id()
        ledger, run, named = asked, group if start is None else f"{group}/{start}", False
    wait_for_ranks(ledger, run, rank=rank, world_size=world, settings=settings,
                   timeout_s=timeout_s)  # fmt: skip
    return ledger, run, named


def run_settings(config: PipelineConfig, *, epochs: int, listing: Listing,
                 drop_last: bool) -> dict[str, str]:  # fmt: skip
    """What every rank must agree on, as text: the config, the epochs, the data. Of
    ``storage_options`` only the names: their values may be each rank's own credentials,
    which the ledger is not sent and an error never prints (the data is the listing's)."""
    out = {f.name: _text(getattr(config, f.name)) for f in dataclasses.fields(config)}
    out["storage_options"] = _text(sorted(config.storage_options or ()))
    out.update(epochs=str(epochs), dataset=listing.fingerprint, drop_last=str(drop_last))
    return out


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The asked rank and world size, else torch.distributed's, else torchrun's variables."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        found = dist.get_rank(), dist.get_world_size()
    else:
        env = {k: os.environ.get(k, "").strip() for k in ("RANK", "WORLD_SIZE")}  # "": unset
        if bad := [f"{k}={v!r}" for k, v in env.items() if v and not v.isdigit()]:
            raise ValueError(f"{', '.join(bad)} in the environment: must be an integer")
        found = int(env["RANK"] or 0), int(env["WORLD_SIZE"] or 1)
        if rank is None and found[1] > 1 and not env["RANK"]:  # every process rank 0
            raise ValueError(f"WORLD_SIZE={found[1]} but RANK is not set (a launcher's child "
                             "before init_process_group?): pass rank=, or initialize "
                             "torch.distributed first")  # fmt: skip
    rank = found[0] if rank is None else rank
    world = found[1] if world_size is None else world_size
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world_size={world!r} must be an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"{rank=} must be an integer in 0..{world - 1} (world_size={world})")
    return rank, world


def start_id() -> str | None:
    """One id for this start of the ranks, from rank 0 over torch.distributed (a group that
    Ray Train restarts gets a new one); None without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    ids = [uuid.uuid4().hex]
    dist.broadcast_object_list(ids, src=0)
    return ids[0]


def _broadcast_name(world: int) -> str:
    """A ledger name from rank 0, over torch.distributed (the ranks need no other channel)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"world_size={world} needs ledger=: a Pipeline.ledger({world}) handle or a name "
            "every rank passes, or torch.distributed initialized before the first iter()"
        )
    names = [uuid.uuid4().hex[:16]]
    dist.broadcast_object_list(names, src=0)
    return names[0]


def _text(value: Any) -> str:
    """A setting as text every process writes the same way (a callable by its name)."""
    if callable(value) and not isinstance(value, type):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return repr(value)


def leave(ledger, run: str, rank: int, timeout_s: float = 60.0) -> None:
    """Leave a named ledger and wait until every rank did: it ends with the process that
    made it, and a rank still reading needs it."""
    import ray

    deadline = time.monotonic() + timeout_s
    try:
        remaining = ray.get(ledger.leave.remote(run, rank))
        while remaining > 0 and time.monotonic() < deadline:  # each answer held (`left`)
            remaining = ray.get(ledger.left.remote(run))
    except ray.exceptions.RayActorError:  # its maker is gone: nobody waits on it
        return


def named_ledger(name: str, world_size: int):
    """The `EpochLedger` actor called ``name``, made by the first rank that asks (no CPUs).

    It belongs to that rank's process and ends with it: every rank leaves it
    (`EpochLedger.leave`) and waits for the others before its process ends (`raypipe.Loader.close` does)."""
    import ray

    if not isinstance(name, str) or not name:
        raise ValueError(f"ledger={name!r} must be a non-empty name or a Pipeline.ledger handle")
    return (
        ray.remote(EpochLedger)
        .options(
            name=f"raypipe-ledger-{name}",
            namespace=NAMESPACE,
            get_if_exists=True,
            num_cpus=0,
            max_restarts=0,
            max_concurrency=concurrency(world_size),  # answers `settle` holds
        )  # fmt: skip
        .remote(world_size)
    )


def wait_for_ranks(ledger, run: str, *, rank: int, world_size: int, settings: dict[str, str],
                   timeout_s: float, doing: str = "started") -> None:  # fmt: skip
    """Join ``run`` and return once all ``world_size`` ranks did; `RanksDisagree` (on every
    rank) when one differs, TimeoutError when they do not all come in ``timeout_s`` (what
    they were ``doing``, in its words)."""
    import ray

    count, failed = ray.get(ledger.join.remote(run, rank, world_size, settings))
    deadline = time.monotonic() + timeout_s
    while failed is None and count < world_size:  # each answer held (`joined`)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{count} of world_size={world_size} ranks {doing} in {timeout_s:.0f} s: "
                "is every rank running, with the same world size"
                + ("?" if doing == "started" else ", and did each set_epoch or load_state_dict?")
            )
        count, failed = ray.get(ledger.joined.remote(run))
    if failed is not None:
        raise failed


def collective_device():
    """Where NCCL's all_reduce of a Loader's state runs: this process's CUDA device."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
