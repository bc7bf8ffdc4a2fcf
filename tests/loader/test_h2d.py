"""The host-to-device ring: one code path, checked on CPU with stand-in events, and on CUDA.

`LazyOps` defers every copy until its event is synchronised (by the ring before it refills
a slot, or by the consumer before it uses a batch) and checks that the slot still holds
what it held when the copy was issued: a ring that refilled a slot early would tear it.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch

from raypipe.loader.device import resolve_device
from raypipe.loader.device_ops import SyncOps
from raypipe.loader.h2d import HostToDevice, PinnedRing
from raypipe.loader.iterator import iter_torch_batches

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class LazyEvent:
    def __init__(self, ops: LazyOps):
        self._ops = ops
        self._pending: list = []
        self._lock = threading.Lock()

    def record(self) -> None:
        with self._lock:
            self._pending, self._ops.issued = self._ops.issued, []

    def query(self) -> bool:
        return not self._pending

    def synchronize(self) -> None:
        with self._lock:
            for run in self._pending:
                run()
            self._pending = []


class LazyOps:
    """CPU stand-in for a CUDA stream whose copies happen as late as the events allow."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.issued: list = []
        self.allocs = 0
        self.sources: list[int] = []  # data_ptr of the slot buffer read by each copy
        self.torn = 0

    def alloc(self, shape, dtype):
        self.allocs += 1
        return torch.empty(shape, dtype=dtype)

    def stream(self):
        return contextlib.nullcontext()

    def copy(self, host, memory_format):
        out = torch.empty(host.shape, dtype=host.dtype, memory_format=memory_format)
        snapshot = host.clone()

        def run():
            self.torn += not torch.equal(host, snapshot)
            out.copy_(host)

        self.issued.append(run)
        self.sources.append(host.data_ptr())
        return out

    def event(self):
        return LazyEvent(self)

    def wait(self, event, tensors) -> None:
        event.synchronize()


def host_batches(n: int, rows: int = 6, *, seed: int = 0, reuse: bool = False, last: int = 0,
                 hw: tuple[int, int] = (5, 4)):  # fmt: skip
    """``n`` batches of random uint8 images (plus a ``last`` short one); with ``reuse`` every
    batch is written into the same host buffer, as a loader recycling its memory would."""
    rng = np.random.default_rng(seed)
    buf = torch.empty((rows, 3, *hw), dtype=torch.uint8)
    for i in range(n + bool(last)):
        size = last if i == n else rows
        image = torch.from_numpy(rng.integers(0, 256, (size, 3, *hw), dtype=np.uint8))
        if reuse and size == rows:
            image = buf.copy_(image)
        yield {"image": image, "key": torch.arange(i * rows, i * rows + size), "tag": f"b{i}"}


def expected(n: int, **kw) -> list[dict]:
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in b.items()}
            for b in host_batches(n, **kw)]  # fmt: skip


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys() and g["tag"] == w["tag"]
        assert torch.equal(g["image"], w["image"]) and torch.equal(g["key"], w["key"])


def no_h2d_threads() -> bool:
    return not any(t.name == "raypipe-h2d" for t in threading.enumerate())


@pytest.mark.parametrize(("prefetch", "slots"), [(1, 1), (4, 2), (2, 4), (3, None)])
@pytest.mark.parametrize("reuse", [False, True])
def test_batches_arrive_intact_and_in_order(prefetch, slots, reuse):
    ops = LazyOps()
    h2d = HostToDevice("cpu", prefetch=prefetch, slots=slots, ops=ops)
    got = list(h2d(host_batches(25, reuse=reuse, last=4)))
    assert_same(got, expected(25, reuse=reuse, last=4))
    assert ops.torn == 0
    assert no_h2d_threads()


def test_slots_are_reused_round_robin_and_allocated_once():
    ops = LazyOps()
    h2d = HostToDevice("cpu", prefetch=2, slots=3, ops=ops)
    list(h2d(host_batches(10)))
    image_reads = ops.sources[::2]  # each batch copies image, then key
    assert len(set(image_reads)) == 3
    assert image_reads == [image_reads[i % 3] for i in range(10)]
    assert ops.allocs == h2d.ring.allocations == 3 * 2
    list(h2d(host_batches(10, last=3)))  # a new shape gets a ring of its own
    assert ops.allocs == 3 * 2 * 2
    for seed in (1, 2):  # later epochs allocate nothing
        got = list(h2d(host_batches(10, seed=seed, last=3)))
        assert_same(got, expected(10, seed=seed, last=3))
    assert ops.allocs == 12 and ops.torn == 0


def test_batches_of_ever_new_shapes_keep_the_rings_of_the_last_few():
    """Padded batches (each as long as its longest row) come in many shapes: the ring keeps
    host slots for the shapes used last, not for every shape seen, and a ring that goes
    waits for its copies first."""
    import gc
    import weakref

    from raypipe.loader.h2d import PinnedRing

    class CountingOps(LazyOps):
        def __init__(self):
            super().__init__()
            self.buffers: list = []

        def alloc(self, shape, dtype):
            buf = super().alloc(shape, dtype)
            self.buffers.append(weakref.ref(buf))
            return buf

    ops = CountingOps()
    h2d = HostToDevice("cpu", prefetch=2, slots=3, ops=ops)
    got, want = [], []
    for width in range(1, 31):  # 30 shapes
        got += list(h2d(host_batches(2, seed=width, hw=(2, width))))
        want += expected(2, seed=width, hw=(2, width))
    assert_same(got, want)
    assert ops.torn == 0
    gc.collect()
    alive = sum(ref() is not None for ref in ops.buffers)
    assert ops.allocs == 30 * 3 * 2 and alive <= PinnedRing.SHAPES * 3 * 2


def test_outputs_do_not_alias_slots_or_inputs():
    h2d = HostToDevice("cpu", slots=1)
    batches = list(host_batches(3))
    out = list(h2d(iter(batches)))
    slot_ptrs = {b.data_ptr() for ring in h2d.ring._rings.values() for s in ring
                 for b in s.buffers.values()}  # fmt: skip
    for src, dst in zip(batches, out, strict=True):
        assert dst["image"].data_ptr() not in slot_ptrs | {src["image"].data_ptr()}
    assert_same(out, expected(3))


def test_channels_last_and_sync_ops_on_cpu():
    h2d = HostToDevice("cpu", channels_last=True)
    assert isinstance(h2d.ops, SyncOps) and not h2d.ops.pinned
    out = list(h2d(host_batches(4)))
    assert all(b["image"].is_contiguous(memory_format=torch.channels_last) for b in out)
    assert_same(out, expected(4))


def test_early_stop_ends_thread_and_closes_upstream():
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield {"image": torch.full((2, 3, 2, 2), i % 256, dtype=torch.uint8)}
                i += 1
        finally:
            closed.set()

    h2d = HostToDevice("cpu", prefetch=2, ops=LazyOps())
    with h2d(endless()) as batches:
        for i, b in enumerate(batches):
            assert int(b["image"][0, 0, 0, 0]) == i
            if i == 4:
                break
    assert closed.is_set() and no_h2d_threads()
    assert next(batches, None) is None  # closed: ends, does not hang


def test_close_while_the_producer_waits_on_a_full_queue():
    h2d = HostToDevice("cpu", prefetch=1)
    first = h2d(host_batches(50))
    second = h2d(host_batches(50))  # a new pass closes the previous one
    assert not first.alive and second.alive
    h2d.close()
    assert no_h2d_threads()


@pytest.mark.parametrize("where", ["upstream", "copy"])
def test_errors_reach_the_consumer(where):
    class FailingOps(LazyOps):
        def copy(self, host, memory_format):
            if len(self.sources) == 6:
                raise RuntimeError("copy failed at batch 3")
            return super().copy(host, memory_format)

    def failing():
        yield from host_batches(3)
        raise ValueError("bad shard s-00003.tar")

    ops = FailingOps() if where == "copy" else LazyOps()
    source = host_batches(10) if where == "copy" else failing()
    got = []
    with pytest.raises(RuntimeError if where == "copy" else ValueError, match="3"):
        for b in HostToDevice("cpu", ops=ops)(source):
            got.append(b)
    assert_same(got, expected(3))
    assert no_h2d_threads()


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="prefetch=0"):
        HostToDevice("cpu", prefetch=0)
    with pytest.raises(ValueError, match="slots=-1"):
        PinnedRing(SyncOps(), slots=-1)
    with pytest.raises(ValueError, match="slots=0"):
        HostToDevice("cpu", slots=0)


def test_auto_device_is_cpu_outside_a_train_worker():
    assert resolve_device("auto") == torch.device("cpu")


def test_loader_normalizes_after_the_ring_and_stops_cleanly(ray_session):
    import ray.data

    rows = [{"image": np.full((3, 4, 4), 7 * i % 256, np.uint8), "label": i % 5, "key": i}
            for i in range(40)]  # fmt: skip
    batches = iter_torch_batches(ray.data.from_items(rows), batch_size=8, channels_last=True)
    keys = []
    for b in batches:
        image = b["image"]
        assert image.dtype == torch.float32 and image.is_contiguous(
            memory_format=torch.channels_last
        )
        host = torch.stack([torch.from_numpy(rows[k]["image"]) for k in b["key"].tolist()])
        mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
        torch.testing.assert_close(image, (host.float() / 255 - mean) / std)  # written out
        keys += b["key"].tolist()
    assert sorted(keys) == list(range(40))
    for i, _ in enumerate(batches):
        if i == 1:
            break
    batches.close()
    assert no_h2d_threads()


def checksum(image: torch.Tensor) -> torch.Tensor:
    """Position-weighted: catches reordered or torn bytes, not only changed totals."""
    flat = image.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device) % 251 + 1
    return (flat * weights).sum()


ALLOCATION_STATS = (("host", "num_host_alloc"), ("device", "segment.all.allocated"))


def allocation_counts(device) -> dict[str, int]:
    """Pinned host allocations and device segments so far; a counter torch does not report
    fails here, so that two missing counters never compare equal."""
    stats = {"host": torch.cuda.host_memory_stats(), "device": torch.cuda.memory_stats(device)}
    counts = {}
    for where, name in ALLOCATION_STATS:
        value = stats[where].get(name)
        assert isinstance(value, int), f"torch reports no {where} counter {name!r}: {value!r}"
        counts[name] = value
    return counts


def test_a_missing_allocation_counter_fails_instead_of_comparing_equal(monkeypatch):
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {"num_host_alloc": 3})
    monkeypatch.setattr(
        torch.cuda, "memory_stats", lambda device=None: {"segment.all.allocated": 5}
    )
    assert allocation_counts(None) == {"num_host_alloc": 3, "segment.all.allocated": 5}
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {})
    with pytest.raises(AssertionError, match="no host counter 'num_host_alloc'"):
        allocation_counts(None)


@pytest.mark.gpu
@needs_cuda
def test_cuda_checksums_under_stress_and_no_allocations_after_warm_up():
    device = torch.device("cuda", torch.cuda.current_device())
    h2d = HostToDevice(device, prefetch=2, channels_last=True)
    busy = torch.randn(1024, 1024, device=device)
    size = (96, 96)

    def epoch(seed: int) -> None:
        got = []
        for b in h2d(host_batches(60, rows=32, seed=seed, reuse=True, last=5, hw=size)):
            for _ in range(3):  # keep the consumer's stream busy while copies run
                busy.copy_(torch.tanh(busy @ busy))
            got.append(checksum(b["image"].contiguous()))
        want = [checksum(b["image"]) for b in host_batches(60, rows=32, seed=seed, last=5, hw=size)]
        assert torch.stack(got).cpu().tolist() == torch.stack(want).tolist()

    epoch(0)
    torch.cuda.synchronize()
    before, ring_allocs = allocation_counts(device), h2d.ring.allocations
    for seed in (1, 2):
        epoch(seed)
    torch.cuda.synchronize()
    assert h2d.ring.allocations == ring_allocs
    assert allocation_counts(device) == before
    assert h2d.ops.pinned and no_h2d_threads()


def test_a_pass_over_a_feeder_that_is_closed_ends():
    """A copy thread waiting on the rank's feeder (a data-bound run) ends when the feeder
    is closed (a train loop that returned mid-epoch), and the pass closes: nothing hangs."""
    from raypipe.loader.feeder import Feeder
    from raypipe.loader.ledger import Gate
    from raypipe.plan.rankplan import RankPlan
    from raypipe.plan.shards import Listing, Shard

    stopped = threading.Event()

    def start():  # the rank's execution: one block, then no more while it runs
        def blocks():
            yield {"key": np.arange(4), "epoch": np.zeros(4, np.int64),
                   "image": np.zeros((4, 3, 2, 2), np.uint8)}  # fmt: skip
            stopped.wait()

        return blocks(), stopped.set

    listing = Listing("imagefolder", tuple(Shard(f"/d/{i}.jpg", i, 1) for i in range(64)))
    plan = RankPlan.of(listing, seed=0, shuffle=False, rank=0, world_size=1, per_task=4)
    feeder = Feeder(start, plan, Gate(None, "run", 0, 2), range(1), batch_size=2, prefetch=2)
    batches = HostToDevice("cpu", prefetch=2)(feeder.epoch(0))
    assert int(next(batches)["key"][0]) == 0
    closer = threading.Thread(target=lambda: (feeder.close(), batches.close()), daemon=True)
    closer.start()
    closer.join(timeout=5)
    assert not closer.is_alive(), "closing the feeder left the copy thread waiting on it"
    assert no_h2d_threads()
