"""Device operations of the host-to-device ring: CUDA streams and events, or a stand-in.

`CudaOps` pins the ring's host slots, copies on one side stream and records CUDA events;
`SyncOps` uses plain memory, synchronous copies and events that are complete when
recorded. `raypipe.loader.h2d` runs the same ring code on either; tests inject their own.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

__all__ = ["CudaOps", "Event", "Ops", "SyncOps", "default_ops"]
assert __all__ == sorted(__all__)


class Event(Protocol):
    """The two calls the ring makes on a CUDA event (or a stand-in)."""

    def record(self) -> None: ...
    def synchronize(self) -> None: ...


class Ops(Protocol):
    """What the ring needs from a device; everything else is shared code.

    ``alloc``: one host slot buffer. ``stream()``: the context copies and records run in.
    ``copy``: host to device, asynchronous where the device allows. ``event()``: one slot's
    event. ``wait``: the consumer's stream waits for an event before using ``tensors``.
    """

    device: Any

    def alloc(self, shape: tuple[int, ...], dtype: Any) -> Any: ...
    def stream(self) -> contextlib.AbstractContextManager: ...
    def copy(self, host: Any, memory_format: Any) -> Any: ...
    def event(self) -> Event: ...
    def wait(self, event: Event, tensors: list[Any]) -> None: ...


def _empty_on(host, device, memory_format):
    import torch

    return torch.empty(host.shape, dtype=host.dtype, device=device, memory_format=memory_format)


class _Complete:
    """Event of a synchronous copy: complete as soon as it is recorded."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class SyncOps:
    """Plain host slots and synchronous copies: CPU, or any device without CUDA streams."""

    pinned = False

    def __init__(self, device: Any = "cpu"):
        import torch

        self.device = torch.device(device)

    def alloc(self, shape, dtype):
        import torch

        return torch.empty(shape, dtype=dtype)

    def stream(self):
        return contextlib.nullcontext()

    def copy(self, host, memory_format):
        return _empty_on(host, self.device, memory_format).copy_(host)

    def event(self) -> Event:
        return _Complete()

    def wait(self, event, tensors) -> None:
        event.synchronize()


class CudaOps:
    """Pinned host slots, copies on one side stream, CUDA events (stream made on first use)."""

    def __init__(self, device: Any, *, pin_memory: bool = True):
        import torch

        device = torch.device(device)
        if device.index is None:  # pin the index now: the producer thread has its own default
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.pinned = pin_memory
        self._side = None

    def alloc(self, shape, dtype):
        import torch

        return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)

    def stream(self):
        import torch

        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return torch.cuda.stream(self._side)

    def copy(self, host, memory_format):
        return _empty_on(host, self.device, memory_format).copy_(host, non_blocking=True)

    def event(self) -> Event:
        import torch

        return torch.cuda.Event()

    def wait(self, event, tensors) -> None:
        """The consumer's stream waits for the copy; the allocator learns who uses the memory."""
        import torch

        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in tensors:
            t.record_stream(current)


def default_ops(device, pin_memory: bool) -> Ops:
    """`CudaOps` for a CUDA device, `SyncOps` (no pinning, no streams) for anything else."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return CudaOps(device, pin_memory=pin_memory)
    return SyncOps(device)
