"""Step 4 of the per-rank iterator: host batches to the device through a ring of pinned slots.

In flight at once (one ring per batch shape, ``slots`` >= ``prefetch`` + 2 by default)::

    producer thread                   copy stream (CUDA)            consumer thread
    next(upstream)                                                  current stream
      | event[i].synchronize() <----- last copy out of slot i done
      | fill slot i (host memcpy)
      | copy_(non_blocking=True) ---> slot i -> device tensors
      | event[i].record() ----------> after those copies
      v queue (<= prefetch batches) ------------------------------> waits event[i], then
                                                                    normalize, train step

A slot is written only after the event of the copy that last read it has completed, so no
batch is ever torn; slots and events are allocated once per shape and reused every epoch.

Everything device-specific sits in an *ops* object (`raypipe.loader.device_ops`): `CudaOps` (pinned slots, a side
stream, CUDA events) or `SyncOps` (plain memory, synchronous copies, events that are
complete when recorded). The ring, the thread and the queue are one code path for both,
and tests inject their own ops to check that path without CUDA.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from raypipe.loader.device_ops import Event, Ops, default_ops

__all__ = ["HostToDevice", "PinnedRing", "Transfer"]
assert __all__ == sorted(__all__)

Batch = dict[str, Any]
_POLL_S = 0.05  # how often a producer blocked on a full queue checks for close()


class _Slot:
    def __init__(self, buffers: dict[str, Any], event: Event):
        self.buffers = buffers
        self.event = event


class PinnedRing:
    """Host slots per batch shape, allocated when the shape first appears, reused round-robin.

    ``load(batch)`` takes the shape's next slot, waits for the event of the copy that last
    read it, fills it, starts the copies to the device and records the slot's event. The
    rings of the ``SHAPES`` shapes used last are kept: batches of ever new shapes (padded
    to their longest row) free the oldest ring, once its copies are done, instead of
    holding pinned memory for every shape ever seen.
    """

    SHAPES = 8

    def __init__(self, ops: Ops, *, slots: int, channels_last: bool = False):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"{slots=} must be an integer >= 1")
        self.ops = ops
        self.slots = slots
        self.channels_last = channels_last
        self.allocations = 0  # host buffers allocated so far; flat after warm-up
        self._rings: collections.OrderedDict[tuple, list[_Slot]] = collections.OrderedDict()
        self._next: dict[tuple, int] = {}

    def load(self, batch: Batch, finish=None) -> tuple[Batch, Event]:
        """``finish``, when given, maps the batch on the device after its copies, on the
        copy stream and before the event: device work (``decode="gpu"``) the consumer's
        stream waits for like the copies."""
        import torch

        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        slot = self._acquire(tensors)
        slot.event.synchronize()  # the copy that last read this slot has finished
        for k, buf in slot.buffers.items():
            buf.copy_(tensors[k])
        with self.ops.stream():
            out = {**batch}
            out.update(
                (k, self.ops.copy(buf, self._format(buf))) for k, buf in slot.buffers.items()
            )
            if finish is not None:
                out = {k: self._laid_out(v) for k, v in finish(out).items()}
            slot.event.record()
        return out, slot.event

    def _acquire(self, tensors: dict[str, Any]) -> _Slot:
        sig = tuple((k, tuple(v.shape), v.dtype) for k, v in tensors.items())
        if sig not in self._rings:  # a new shape: all its slots at once, then never again
            while len(self._rings) >= self.SHAPES:
                old, ring = self._rings.popitem(last=False)
                self._next.pop(old, None)
                for slot in ring:  # its last copies read the slot: done before it goes
                    slot.event.synchronize()
            self._rings[sig] = [
                _Slot({k: self._alloc(v) for k, v in tensors.items()}, self.ops.event())
                for _ in range(self.slots)
            ]
        self._rings.move_to_end(sig)
        i = self._next.get(sig, 0)
        self._next[sig] = (i + 1) % self.slots
        return self._rings[sig][i]

    def _alloc(self, like):
        self.allocations += 1
        return self.ops.alloc(tuple(like.shape), like.dtype)

    def _laid_out(self, t):
        if self.channels_last and getattr(t, "dim", lambda: 0)() == 4:
            import torch

            return t.contiguous(memory_format=torch.channels_last)
        return t

    def _format(self, t):
        import torch

        if self.channels_last and t.dim() == 4:
            return torch.channels_last
        return torch.contiguous_format


_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Transfer:
    """One pass: a producer thread loads ``batches`` into the ring; iterate for device batches.

    Owns its thread and bounded queue. ``close()`` (also at the end, on an error, or when
    leaving a ``with`` block) stops the thread, drops queued batches and closes ``batches``.
    Errors raised upstream or in the copy reach the consumer from ``next()``.
    """

    def __init__(self, batches: Iterable[Batch], ring: PinnedRing, *, prefetch: int,
                 finish=None):  # fmt: skip
        self._upstream = iter(batches)
        self._ring = ring
        self._finish = finish
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._produce, name="raypipe-h2d", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            for batch in self._upstream:
                if self._stop.is_set() or not self._put(self._ring.load(batch, self._finish)):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            self._put(_Failure(e))
        else:
            self._put(_END)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise StopIteration
        item = self._queue.get()
        if item is _END or self._closed:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        batch, event = item
        self._ring.ops.wait(event, [batch[k] for k in batch if hasattr(batch[k], "record_stream")])
        return batch

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join()  # ends at its next put, or once the batch it waits for arrives
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_END)  # wakes a consumer blocked in next() on another thread
        close_upstream = getattr(self._upstream, "close", None)
        if close_upstream is not None:
            close_upstream()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> Transfer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HostToDevice:
    """Step 4: ``h2d(batches)`` returns a `Transfer` yielding the batches on ``device``.

    Args:
        device: target ``torch.device``; CUDA gets `CudaOps`, anything else `SyncOps`.
        pin_memory: pin the ring's host slots (CUDA only).
        prefetch: device batches ready ahead of the consumer (the queue bound), >= 1.
        slots: host slots per batch shape, >= 1; default ``prefetch + 2``.
        channels_last: 4-D tensors arrive in ``torch.channels_last`` (converted on the device).
        ops: the device operations to use instead of the default (tests inject stand-ins).

    The ring outlives passes: slots are allocated in the first epoch and reused after.
    One pass runs at a time; starting another closes the previous one.
    """

    def __init__(self, device: Any, *, pin_memory: bool = True, prefetch: int = 2,
                 slots: int | None = None, channels_last: bool = False,
                 ops: Ops | None = None):  # fmt: skip
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"{prefetch=} must be an integer >= 1")
        if ops is None:
            ops = default_ops(device, pin_memory)
        slots = prefetch + 2 if slots is None else slots
        self.ring = PinnedRing(ops, slots=slots, channels_last=channels_last)
        self.prefetch = prefetch
        self._running: Transfer | None = None

    @property
    def ops(self) -> Ops:
        return self.ring.ops

    def __call__(self, batches: Iterable[Batch], finish=None) -> Transfer:
        """A pass over ``batches``; ``finish`` maps each on the device (`PinnedRing.load`)."""
        self.close()
        self._running = Transfer(batches, self.ring, prefetch=self.prefetch, finish=finish)
        return self._running

    def close(self) -> None:
        if self._running is not None:
            self._running.close()
            self._running = None
