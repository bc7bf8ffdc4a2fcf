"""The pool follows the trainer: the policy on a clock of its own, the Ray internals it
drives pinned to the Ray version, and a run whose trainer is slow and then fast."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from raypipe import PipelineConfig, rayapi
from raypipe.loader.demand import Demand
from raypipe.pool.autoscale import RAY_VERSION, check_ray
from raypipe.pool.follow import Follower
from tests.pool.test_elastic import slow_images
from tests.properties import check_exactly_once_and_equal

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(follower: Follower, clock: Clock, demand: Demand, seconds: float, *, wait: float,
        held: float, actors=None, rows: int = 1) -> list[int]:  # fmt: skip
    """Advance ``seconds`` in 0.5 s steps with the given wait and held shares, the trainer
    taking ``rows`` rows a step; the pool follows the target at once unless ``actors``
    pins it. The targets seen."""
    seen = []
    for _ in range(int(seconds / 0.5)):
        clock.t += 0.5
        demand.waited_s += 0.5 * wait
        demand.held_s += 0.5 * held
        demand.rows += rows
        seen.append(follower.decide(follower.target if actors is None else actors))
    return seen


def make(lo=1, hi=4, shrink_s=5.0):
    clock, demand = Clock(), Demand()
    f = Follower(lo, hi, demand, wait=0.05, shrink_s=shrink_s, period_s=1.0, clock=clock)
    return f, clock, demand


def test_a_held_back_trainer_that_never_waits_sheds_one_actor_per_shrink_period():
    f, clock, demand = make()
    seen = run(f, clock, demand, 30, wait=0.0, held=0.9)
    assert seen[0] == 4 and seen[-1] == 1  # down to min, never below
    drops = [i for i in range(1, len(seen)) if seen[i] < seen[i - 1]]
    assert len(drops) == 3
    assert all(b - a >= 10 for a, b in zip(drops, drops[1:], strict=False))  # >= 5 s apart


def test_a_waiting_trainer_grows_the_pool_every_period_up_to_max():
    f, clock, demand = make()
    run(f, clock, demand, 30, wait=0.0, held=0.9)
    assert f.target == 1
    seen = run(f, clock, demand, 6, wait=0.3, held=0.0)
    assert seen[1] == 2 and seen[-1] == 4 and max(seen) == 4


def test_grow_needs_the_pool_to_have_reached_the_target():
    f, clock, demand = make()
    run(f, clock, demand, 30, wait=0.0, held=0.9)
    seen = run(f, clock, demand, 6, wait=0.3, held=0.0, actors=1)  # Ray has not grown it
    assert set(seen) == {1, 2}  # one above what runs, not a runaway target


def test_a_grow_counts_from_the_actors_serving_not_those_draining():
    f, clock, demand = make(lo=1, hi=6)
    run(f, clock, demand, 16, wait=0.0, held=0.9, actors=6)  # the shed three still busy
    assert f.target == 3
    run(f, clock, demand, 1, wait=0.3, held=0.0, actors=6)  # one short wait
    assert f.target == 4  # one actor more, not the drained three back at once


def test_data_held_back_before_the_trainers_first_batch_sheds_nothing():
    f, clock, demand = make(lo=2, hi=8)  # Pipeline.start(), then a 30 s model build
    assert set(run(f, clock, demand, 30, wait=0.0, held=1.0, rows=0)) == {8}
    seen = run(f, clock, demand, 6, wait=0.0, held=0.9)  # the trainer's pace from its first batch
    assert seen[-1] == 7 and min(seen[:8]) == 8


def test_after_a_grow_the_next_shrink_waits_twice_as_long():
    f, clock, demand = make()
    run(f, clock, demand, 30, wait=0.0, held=0.9)
    run(f, clock, demand, 1, wait=0.3, held=0.0)
    assert f.target == 2
    seen = run(f, clock, demand, 9.5, wait=0.0, held=0.9)
    assert seen[-1] == 2  # 5 s would have been enough without the grow
    assert run(f, clock, demand, 1.5, wait=0.0, held=0.9)[-1] == 1


def simulated(phases, *, per_actor=1.0, queue=4.0) -> list[int]:
    """The follower over a simulated run: each actor makes ``per_actor`` batches a second,
    the trainer takes ``takes`` a second for ``seconds`` in each ``(seconds, takes)`` of
    ``phases``, a queue of ``queue`` batches between them, the pool following the target
    at once. The pool's size every 0.05 s."""
    f, clock, demand = make(lo=1, hi=6)
    q, dt, sizes = 0.0, 0.05, []
    for seconds, takes in phases:
        for _ in range(int(seconds / dt)):
            clock.t += dt
            actors = f.decide(f.target)
            q += actors * per_actor * dt
            if q > queue:
                demand.held_s, q = demand.held_s + dt, queue
            need = takes * dt
            if q >= need:
                q, demand.rows = q - need, demand.rows + 1
            else:
                demand.waited_s, q = demand.waited_s + dt * (1 - q / need), 0.0
            sizes.append(actors)
    return sizes


def changes_after(sizes: list[int], t: float) -> list[tuple[float, int]]:
    return [(i * 0.05, sizes[i]) for i in range(1, len(sizes))
            if sizes[i] != sizes[i - 1] and i * 0.05 > t]  # fmt: skip


def test_a_trainer_between_two_pool_sizes_does_not_flap_for_the_whole_run():
    """A trainer that needs 2.5 actors: 3 is more than it takes, 2 less. The pool shrank
    to 2 after 10 s at 3, grew back within seconds, and again, every 26 s of a 600 s run
    (each time an actor ended and another started, the trainer short meanwhile): a grow
    that undoes a shrink doubles the wait before the next one."""
    sizes = simulated([(600, 2.5)])
    changes, late = changes_after(sizes, 0), changes_after(sizes, 300)
    assert len(changes) <= 20 and len(late) <= 6, (len(changes), len(late))  # 47 and 22
    assert min(sizes[len(sizes) // 2 :]) >= 2  # never below what the trainer needs


def test_a_trainer_that_gets_slower_after_a_flapping_phase_is_followed_within_minutes():
    """The back-off is bounded, and a shrink that holds halves it: after 600 s between two
    sizes, a trainer that needs half an actor has the pool at its min within 120 s."""
    sizes = simulated([(600, 2.5), (300, 0.5)])
    down = [t for t, n in changes_after(sizes, 600) if n == 1]
    assert down and down[0] <= 720, changes_after(sizes, 600)


@pytest.mark.parametrize(("wait", "held"), [(0.0, 0.2), (0.02, 0.9), (0.3, 0.9)])
def test_no_shrink_unless_the_data_is_held_back_and_the_trainer_never_waits(wait, held):
    f, clock, demand = make()
    seen = run(f, clock, demand, 30, wait=wait, held=held)
    assert min(seen) == 4


def test_a_pause_in_the_held_back_time_restarts_the_shrink_clock():
    f, clock, demand = make()
    run(f, clock, demand, 4, wait=0.0, held=0.9)
    run(f, clock, demand, 1, wait=0.0, held=0.0)
    assert run(f, clock, demand, 4, wait=0.0, held=0.9)[-1] == 4
    assert run(f, clock, demand, 1.5, wait=0.0, held=0.9)[-1] == 3


def test_summary_holds_the_series_of_actors_target_and_wait():
    f, clock, demand = make()
    run(f, clock, demand, 12, wait=0.0, held=0.9)
    s = f.summary()
    assert (s["min"], s["max"], s["target"], s["changes"]) == (1, 4, 2, 2)  # at 5 s, 10 s
    assert len(s["series"]) == 12 and s["series"][-1][2] == 2
    times = [p[0] for p in s["series"]]
    assert times == sorted(times) and all(p[3] == 0.0 for p in s["series"])


def test_the_ray_internals_it_drives_are_there():
    """Fails when Ray changes what `raypipe.pool.follow` reaches into: bump RAY_VERSION only
    after checking the new executor (the names below and the run test)."""
    import ray
    from ray.data._internal.actor_autoscaler import (
        ActorAutoscaler,
        ActorPoolScalingRequest,
        AutoscalingActorPool,
    )
    from ray.data._internal.actor_autoscaler.autoscaling_actor_pool import (
        AutoscalingActorConfig,
    )
    from ray.data._internal.execution.operators.actor_pool_map_operator import (
        _ActorPool,
        _ActorState,
    )
    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    assert ray.__version__ == RAY_VERSION and check_ray() is None
    assert {"min_size", "max_size", "initial_size"} <= {
        f.name for f in dataclasses.fields(AutoscalingActorConfig)
    }
    assert {"num_tasks_in_flight", "actor_location"} <= {
        f.name for f in dataclasses.fields(_ActorState)
    }
    assert list(inspect.signature(_ActorPool.select_actors).parameters) == [
        "self", "bundle", "actor_locality_enabled",
    ]  # fmt: skip
    assert "force" in inspect.signature(ActorPoolScalingRequest.downscale).parameters
    assert list(inspect.signature(_ActorPool._release_running_actor).parameters) == [
        "self", "actor",
    ]  # fmt: skip
    init = inspect.getsource(_ActorPool.__init__)
    for name in ("_alive_actors_to_in_flight_tasks_heap", "_alive_node_to_actor_heap",
                 "_running_actors"):  # fmt: skip
        assert f"self.{name}" in init, name
    assert "self._config = config" in inspect.getsource(AutoscalingActorPool.__init__)
    start = inspect.getsource(StreamingExecutor)
    assert "self._actor_autoscaler = create_actor_autoscaler(" in start
    assert "self._actor_autoscaler.try_trigger_scaling()" in start
    assert "self._topology = topology" in inspect.getsource(ActorAutoscaler.__init__)
    assert "self._cluster_autoscaler = create_cluster_autoscaler(" in start
    from ray.data._internal.cluster_autoscaler import (
        DefaultClusterAutoscalerV2,
        RateBasedClusterAutoscaler,
    )

    for cls in (RateBasedClusterAutoscaler, DefaultClusterAutoscalerV2):
        params = list(inspect.signature(cls._send_resource_request).parameters)
        assert params == ["self", "resource_request"], (cls, params)


def test_the_placement_group_cluster_autoscaler_is_left_alone():
    """Its resource request holds a placement group's bundles: withdrawing it (as the pool
    does when it follows a slower trainer) would leave the group unscheduled."""
    from ray.data._internal.cluster_autoscaler import RateBasedClusterAutoscaler
    from ray.data._internal.cluster_autoscaler.placement_group_cluster_autoscaler import (
        PlacementGroupClusterAutoscaler,
    )

    group = object.__new__(PlacementGroupClusterAutoscaler)
    assert hasattr(group, "_send_resource_request")  # what once made it look like the rest
    assert rayapi.cluster_autoscaler(SimpleNamespace(_cluster_autoscaler=group)) is None
    rate = object.__new__(RateBasedClusterAutoscaler)
    assert rayapi.cluster_autoscaler(SimpleNamespace(_cluster_autoscaler=rate)) is rate


def test_bad_thresholds_name_field_and_value():
    with pytest.raises(ValueError, match=r"PipelineConfig.follow_wait=1.5"):
        PipelineConfig(source="x", follow_wait=1.5)
    with pytest.raises(ValueError, match=r"follow_period_s=10.0: must be <= follow_shrink_s"):
        PipelineConfig(source="x", follow_period_s=10.0)


def drive(address: str, data: Path, out: Path, config: dict, world: int, slow_s: float,
          pause_s: float, *, store_limit_mib=0, env=None, timeout=300) -> dict:  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "tests.follow_driver", address, str(data), str(out),
         json.dumps(config), str(world), str(slow_s), str(pause_s), str(store_limit_mib)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def exactly_once_and_equal(report: dict, n: int, batch_size: int, world: int) -> None:
    check_exactly_once_and_equal(report["keys"], batch_size=batch_size, good=range(n),
                                 left_over=world * batch_size - 1)  # fmt: skip


def first_drop(series, after: float):
    """(t, actors) of the first sample after ``after`` with fewer actors than the most
    seen since ``after``; None if the pool never shrank."""
    most = 0
    for t, actors, _ in series:
        if t < after:
            continue
        if actors < most:
            return t, actors
        most = max(most, actors)
    return None


def shed_then_grew(targets: list[int], lo: int, hi: int) -> bool:
    """The follower's targets went down to ``lo`` and, after that, back up to ``hi``."""
    return lo in targets and hi in targets[targets.index(lo) + 1 :]


def test_shed_then_grew_needs_the_target_back_up_after_it_went_down():
    assert shed_then_grew([2, 2, 1, 1, 2], 1, 2)
    assert not shed_then_grew([2, 2, 1, 1, 1], 1, 2)  # never grew back
    assert not shed_then_grew([2, 2, 2], 1, 2)  # never shed
    assert not shed_then_grew([1, 1], 1, 2)


# 1,200 PNGs of 1024² decoded to 256² (192 KiB a row); a 100 MiB store holds ~530 rows,
# so the pool can never read far ahead of a slow trainer: it is held back, not finished.
N_FOLLOW = 1200
FOLLOW = {"image_size": 256, "batch_size": 8, "actors": (2, 4), "files_per_task": 8,
          "actor_cpus": 1.0, "shuffle_files": False,
          "compute": "actors"}  # fmt: skip


@pytest.mark.slow
def test_the_pool_sheds_actors_for_a_slow_trainer_and_grows_back_when_it_speeds_up(tmp_path):
    """2 ranks, each with a pool of (1, 2) actors; 1 s a batch of 8 for 24 s (far below
    what one actor decodes, on a loaded machine too), then as fast as the data comes. An actor goes while the trainers are slow, with at least a fifth of
    the data still to be read, and the pool grows again within 15 s of the fast phase;
    every key once, equal batches per rank."""
    data = slow_images(tmp_path, N_FOLLOW, side=1024)
    report = drive("local", data, tmp_path / "r.json", FOLLOW, 2, 24.0, 1.0)
    series = report["series"]
    exactly_once_and_equal(report, N_FOLLOW, 8, 2)
    for stats in report["stats"]:  # each rank's follower: down to 1 while slow, then 2 again
        pool = stats["pool"]
        targets = [p[2] for p in pool["series"]]
        assert (pool["min"], pool["max"]) == (1, 2) and shed_then_grew(targets, 1, 2), pool
    start, fast = min(report["first"].values()), max(report["fast"].values())
    drop = first_drop(series, start)
    # the follower decides within seconds (typically 5 s in); the actor goes once Ray Data
    # has drained it, which takes longer on a loaded machine: bound it by the data instead
    assert drop is not None and drop[0] < fast, (start, fast, series)
    read_by_drop = max((n for t, n in report["progress"] if t <= drop[0]), default=0)
    # what the trainers read (16 a second), plus all a full store could hold, is under
    # four fifths: the pool shrank with a fifth of the epoch still to be decoded
    assert read_by_drop + 530 <= 0.8 * N_FOLLOW, (read_by_drop, drop)
    low = min(a for t, a, _ in series if drop[0] <= t <= fast)
    assert any(a > low for t, a, _ in series if fast < t <= fast + 15.0), (fast, low, series)


N_NODES = 800  # 50 s of a 16 img/s trainer; the worker node goes at 29-32 s (its blocks read
# by 22-26 s, then the idle timeout). It stayed to the end, in 2 of 22 runs, while the
# execution held its first block and that block had been made on the worker node.


@pytest.mark.slow
def test_a_worker_node_goes_while_the_trainer_is_slow(tmp_path):
    """The fake multinode autoscaler (head of 1 CPU, workers of 2): one rank, pool (1, 3)
    of 1-CPU actors, a trainer slower than one actor. The pool starts at its max (a worker
    node comes for it); the follower sheds the actors the trainer cannot use, worker
    nodes first, and the worker node goes once the blocks it made are read, while the pool
    is still reading: within the run, not at its end."""
    from tests.pool.test_elastic import AutoscalingHead, _pids_naming

    data = slow_images(tmp_path, N_NODES, side=1024)
    head = AutoscalingHead()
    try:
        config = {**FOLLOW, "actors": (1, 3), "image_size": 512}  # 768 KiB rows
        # Ray Data reads at most 64 MiB ahead: the worker's blocks are read soon after
        # its actors go, and the node is idle after that, well before the input runs out
        report = drive(head.address, data, tmp_path / "r.json", config, 1, 1e9, 0.5,
                       store_limit_mib=64, env=head.env, timeout=400)  # fmt: skip
    finally:
        head.stop()
    assert not _pids_naming(head.temp_dir), "a process of the head outlived stop()"
    # what the autoscaler said of the worker node, for a failure's message
    monitor = [line for line in head.monitor_log().splitlines()
               if ("idle" in line.lower() or "terminat" in line.lower())
               and "non-terminated" not in line][-12:]  # fmt: skip
    status = head.status_changes()[-16:]
    head.remove()
    exactly_once_and_equal(report, N_NODES, 8, 1)
    series = report["series"]
    nodes = [n for _, _, n in series]
    assert max(nodes) > 1, series
    peak = nodes.index(max(nodes))
    removed = next((t for t, _, n in series[peak:] if n < max(nodes)), None)
    # Ray Data lets the pool go once every input is handed out: the node went before that
    reading = max(t for t, a, _ in series if a > 0)
    changes = [x for i, x in enumerate(series) if i == 0 or x[1:] != series[i - 1][1:]]
    placed = report["placed"]
    # a string, not a tuple: pytest would cut each item of a tuple short
    why = "\n".join([f"removed at {removed}, reading until {reading}", f"series {changes}",
                     f"placed {placed}", f"object store MiB in use {report['stored']}",
                     "the autoscaler's last idle/terminate lines:", *monitor,
                     "its status as it changed:", *status])  # fmt: skip
    assert removed is not None and removed < reading, why
    heads = set(report["heads"])
    last = placed[-2][1]  # where the pool's actors were at the end of reading
    assert set(last) <= heads, placed  # the head's actor stayed, workers' went
    assert report["pool"]["nodes_lost"] == 0


def test_progress_lines_count_the_epoch_the_rate_the_wait_and_the_pool():
    import io
    import threading

    from raypipe.loader.progress import ProgressLine

    f, clock, demand = make()
    run(f, clock, demand, 2, wait=0.0, held=0.9)
    out = io.StringIO()
    p = ProgressLine(0.05, rank=1, demand=demand, planned=lambda e: 100 * (e + 1), follower=f,
                 out=out)  # fmt: skip
    demand.epoch, demand.epoch_rows, demand.rows = 1, 64, 164
    demand.waited_s += 10.0  # more than the interval: capped at 100 %
    line = p.line()
    assert line.startswith("raypipe rank 1 epoch 1: 64/200 samples ") and "wait 100%" in line
    assert line.endswith("actors 4 (target 4 of 1-4)")
    assert p.line().split("samples/s")[0].endswith(" 0 ")  # nothing since the last line
    threading.Event().wait(0.2)
    p.close()
    printed = out.getvalue().splitlines()
    assert len(printed) >= 2 and all(x.startswith("raypipe rank 1 epoch 1") for x in printed)
    assert not any(t.name == "raypipe-progress" for t in threading.enumerate())


def test_the_progress_line_comes_once_under_ray_trains_print(monkeypatch):
    """In a Ray Train worker ``print`` is Ray's `redirected_print`: to a stderr that is not
    the process's own it both writes the line and logs it (to stderr again there), and
    the driver showed every progress line twice."""
    import builtins
    import io
    import logging
    import threading

    from ray.train.v2._internal.logging.patch_print import redirected_print

    from raypipe.loader.progress import ProgressLine

    f, clock, demand = make()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.setattr(builtins, "print", redirected_print)
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.INFO)  # as Train configures its workers'
    root.addHandler(handler)
    try:

        class Counted(ProgressLine):
            made = 0

            def line(self) -> str:
                Counted.made += 1
                return super().line()

        p = Counted(0.05, rank=0, demand=demand, planned=lambda e: 100, follower=f)
        threading.Event().wait(0.18)
        p.close()
    finally:
        root.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines and all(x.startswith("raypipe rank 0") for x in lines)
    assert len(lines) == Counted.made, lines  # each line once


def test_a_follower_that_cannot_take_over_shows_no_target(ray_session, tmp_path, monkeypatch):
    """Where this Ray cannot be driven (another version, its executor changed), Ray Data's
    own autoscaler sizes the pool: stats() and the progress line show no follower's
    target (they showed "actors 0 (target 2 of 1-2)", a pool that never was)."""
    import io

    from raypipe import Pipeline
    from raypipe.loader.progress import ProgressLine
    from raypipe.pool import autoscale
    from tests.conftest import make_imagefolder

    monkeypatch.setattr(autoscale, "check_ray", lambda: "Ray 0.0 is not " + RAY_VERSION)
    f, _, demand = make(lo=1, hi=2)
    assert autoscale.follow(object(), f) is False and not f.in_charge
    line = ProgressLine(60, rank=0, demand=demand, planned=lambda e: 0, follower=f,
                        out=io.StringIO()).line()  # fmt: skip
    assert "actors" not in line and "target" not in line
    root = make_imagefolder(tmp_path / "d", {"a": 8, "b": 8})
    config = PipelineConfig(source=str(root), image_size=16, batch_size=4, compute="actors",
                            actors=(1, 2))  # fmt: skip
    keys = []
    with Pipeline(config, epochs=1, device="cpu", normalize=False) as p:
        for _, batches in p.epochs():
            keys += [k for b in batches for k in b["key"].tolist()]
            stats = batches.stats()
        assert p.follower is not None and not p.follower.in_charge
    assert sorted(keys) == list(range(16)) and "pool" not in stats, stats.get("pool")
