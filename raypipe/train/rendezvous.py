"""DDP's rendezvous store on rank 0's node address, not on every interface.

Ray Train's ``TorchConfig`` gives ``init_process_group`` ``MASTER_ADDR``, but torch's
``TCPStore`` server listens on all interfaces whatever the host. `BoundStoreTorchConfig`
sets up the process group as ``TorchConfig`` does, except that rank 0's store listens on a
socket raypipe binds to rank 0's node address (127.0.0.1 on the local Ray raypipe starts,
the node's address on a cluster) and hands over as ``master_listen_fd``:

```
 driver (Train controller)    rank 0 worker                    rank r worker
 execute_single(0, _listen) ─► bind (node address, free port),
                                listen; keep the socket
 execute(_join) ────────────► TCPStore(master_listen_fd=...) ◄── TCPStore client
                               init_process_group(store=...)      init_process_group(store=...)
```

On a loopback node gloo's own sockets are bound to the loopback interface too
(``GLOO_SOCKET_IFNAME``, unless set); elsewhere gloo picks its interface as it always does.

Ray internals used, through `raypipe.rayapi` and checked by `check_ray`: Ray Train's torch
backend class (its ``on_shutdown`` and the rest are kept) and the function that sets each
worker's torch.distributed variables.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

from ray.train.torch import TorchConfig

from raypipe import rayapi
from raypipe.rayapi import RAY_VERSION  # the Ray whose torch backend it replaces a step of

__all__ = ["BoundStoreTorchConfig", "RAY_VERSION", "check_ray", "loopback_sockets"]
assert __all__ == sorted(__all__)

_listening: list[socket.socket] = []  # rank 0's store socket, from _listen to _join


def check_ray() -> str | None:
    """Why `BoundStoreTorchConfig` cannot stand in for ``TorchConfig`` here (None: it can)."""
    import ray

    if ray.__version__ != RAY_VERSION:
        return f"Ray {ray.__version__} is not {RAY_VERSION}, whose torch backend it replaces"
    problems = rayapi.check_names(("rendezvous",))
    if problems:
        return "; ".join(problems)
    if TorchConfig().backend_cls is not rayapi.torch_backend():
        return "ray.train.torch.TorchConfig no longer uses the backend it replaces"
    return None


@dataclass
class BoundStoreTorchConfig(TorchConfig):
    """``TorchConfig`` whose rendezvous store listens on rank 0's node address only."""

    @property
    def backend_cls(self):
        return _BoundStoreBackend


class _BoundStoreBackend(rayapi.torch_backend()):
    def on_start(self, worker_group, backend_config: TorchConfig) -> None:
        import ray
        import torch.distributed as dist

        if not dist.is_available():
            raise RuntimeError("Distributed torch is not available.")
        backend = backend_config.backend
        if backend is None:
            backend = "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) else "gloo"
        addr, port = worker_group.execute_single(0, _listen)
        worker_group.execute(rayapi.torch_env_vars())
        n = len(worker_group)
        ray.get([
            worker_group.execute_single_async(
                rank, _join, backend=backend, world_rank=rank, world_size=n, addr=addr, port=port,
                timeout_s=backend_config.timeout_s,
            )
            for rank in range(n)
        ])  # fmt: skip


def _listen() -> tuple[str, int]:
    """On rank 0: a listening socket on this node's address and a free port, kept for `_join`."""
    import ray

    addr = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((addr, 0))
    sock.listen(socket.SOMAXCONN)
    _listening.append(sock)
    return addr, sock.getsockname()[1]


def _join(*, backend: str, world_rank: int, world_size: int, addr: str, port: int,
          timeout_s: float) -> None:  # fmt: skip
    """On every rank: the store (rank 0 serves it on its socket), then the process group."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    if backend == "nccl" and not {"TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                  "TORCH_NCCL_BLOCKING_WAIT"} & set(os.environ):  # fmt: skip
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # as TorchConfig: fail on timeouts
    for name, value in loopback_sockets(addr).items():
        os.environ.setdefault(name, value)
    timeout = timedelta(seconds=timeout_s)
    if world_rank == 0:
        fd = _listening.pop().detach()  # the store owns it from here
        store = TCPStore(addr, port, world_size, True, timeout=timeout, master_listen_fd=fd,
                         wait_for_workers=False, use_libuv=True)  # fmt: skip
    else:
        store = TCPStore(addr, port, world_size, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=world_rank, world_size=world_size,
                            timeout=timeout)  # fmt: skip


def loopback_sockets(addr: str) -> dict[str, str]:
    """The variables that keep gloo's and NCCL's sockets on the loopback interface when
    the rendezvous is on a loopback address (else each picks a non-loopback one)."""
    from raypipe.localnode import is_loopback

    lo = _loopback_interface() if is_loopback(addr) else None
    return {} if lo is None else {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)
