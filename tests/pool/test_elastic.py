"""Elastic: the actor pool grows and shrinks, the Ray autoscaler adds and removes nodes,
and losing a node, a preprocessing actor or a Train worker loses no sample.

The pool tests run on the session's local Ray. The cluster tests need a Ray of their
own (a ``ray start --head`` with the fake_multinode autoscaler; a
``ray.cluster_utils.Cluster``), so each runs its driver (tests/elastic_driver.py) in a
subprocess, and the head it starts it stops by pid: its own process group, then any
process left whose command line names its temp dir.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from raypipe import PipelineConfig, PoolWatch, build_dataset, iter_torch_batches
from tests.conftest import stop_group

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
N_SLOW = 96  # samples of the slow-transform datasets


def slow_images(root: Path, n: int, *, side: int = 1024, distinct: int = 4) -> Path:
    """An image folder of ``n`` big PNGs (a slow decode: the transform outruns nothing).

    A few distinct images hard-linked under many names: cheap to make, and every file
    is its own sample with its own key.
    """
    rng = np.random.default_rng(0)
    originals = []
    for i in range(distinct):
        base = rng.integers(0, 256, (side // 8, side // 8, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(base).resize((side, side), Image.Resampling.BILINEAR).save(
            buf, format="PNG", compress_level=1
        )
        originals.append(root / f"original-{i}.png")
        originals[-1].parent.mkdir(parents=True, exist_ok=True)
        originals[-1].write_bytes(buf.getvalue())
    data = root / "folder"
    for i in range(n):
        cls = data / f"c{i % 2}"
        cls.mkdir(parents=True, exist_ok=True)
        os.link(originals[i % distinct], cls / f"{i:05d}.png")
    return data


@pytest.fixture(scope="module")
def slow_folder(tmp_path_factory) -> Path:
    return slow_images(tmp_path_factory.mktemp("slow"), N_SLOW)


def _consume(ds, watch: PoolWatch, *, pause_s: float = 0.0) -> tuple[list[int], list[int], dict]:
    """One epoch: the keys, the alive actors at each batch, and the iterator's stats."""
    keys, actors = [], []
    with iter_torch_batches(ds, batch_size=8, drop_last=False, watch=watch) as batches:
        for batch in batches:
            keys.extend(batch["key"].tolist())
            actors.append(watch.sample().actors)
            time.sleep(pause_s)  # the consumer's own work: a slow trainer
        return keys, actors, batches.stats()


def _actor_pool(source, actors: tuple[int, int]) -> PipelineConfig:
    """A Ray Data actor pool of ``actors`` over ``source``, one file a task."""
    return PipelineConfig(source=str(source), image_size=32, batch_size=8, actors=actors,
                          files_per_task=1, compute="actors")  # fmt: skip


@pytest.mark.slow
def test_pool_grows_toward_max_when_the_transform_is_slower(ray_session, slow_folder):
    _wait_for_free_cpus()  # room for the pool to grow, whatever ran before
    config = _actor_pool(slow_folder, (1, 3))
    with PoolWatch(interval_s=0.25, new_only=True) as watch:
        keys, actors, stats = _consume(build_dataset(config), watch)
    _exactly_once(keys, N_SLOW)
    pool = stats["pool"]
    assert pool["actors_min"] <= 1 < pool["actors_max"] <= 3, pool
    # the watch's own thread sampled too: more than its start and one sample a batch
    assert pool["nodes_lost"] == 0 and pool["samples"] > 1 + len(actors), pool


@pytest.mark.slow
def test_idle_actors_are_released_while_a_slow_consumer_is_still_busy(ray_session, tmp_path):
    """The pool grows (each task waits until two actors ran it), the epoch's inputs are all
    handed out early, and the pool lets its actors go while the slow consumer still has
    batches to take. It failed now and then when the pool never grew (the CPUs held by
    what ran before), or grew and shrank between two samples. (Whether Ray Data adds a
    third actor as well depends on what else its resource budget holds: not asserted.)"""
    import functools

    from tests.user_transforms import after_actors

    _wait_for_free_cpus()
    data = slow_images(tmp_path, 96, side=512)
    config = _actor_pool(data, (1, 3)).replace(
        transform=functools.partial(after_actors, str(tmp_path), 2)
    )
    keys, dropped_at = [], None
    watch = PoolWatch(interval_s=0.1, new_only=True)
    with watch, iter_torch_batches(build_dataset(config), batch_size=8, drop_last=False,
                                   watch=watch) as batches:  # fmt: skip
        for n, batch in enumerate(batches, 1):
            keys.extend(batch["key"].tolist())
            if n == 2:  # the consumer is slow: it waits here until the pool lets go
                dropped_at = _wait_for_release(watch)
        stats = batches.stats()
    _exactly_once(keys, 96)
    assert len(set((tmp_path / "pids").read_text().split())) >= 2
    assert watch.summary()["actors_max"] >= 2, watch.summary()["series"]
    assert dropped_at is not None, watch.summary()["series"]  # with 10 batches still to take
    assert stats["pool"]["actors_now"] < stats["pool"]["actors_max"]


def _wait_for_free_cpus(timeout_s: float = 60.0) -> None:
    """Until every CPU of the session's Ray is free (what earlier tests held is let go)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


def _wait_for_release(watch: PoolWatch, timeout_s: float = 60.0) -> float | None:
    """The time the watched pool fell below the most actors it had, or None by the
    deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        summary = watch.summary()
        if summary.get("actors_max", 0) > summary.get("actors_now", 0):
            return summary["series"][-1][0]
        time.sleep(0.1)
    return None


def test_pool_watch_owns_one_thread_that_close_stops(ray_session):
    watch = PoolWatch(interval_s=0.05).start()
    with pytest.raises(RuntimeError, match="already started"):
        watch.start()
    assert watch.sample().nodes >= 1
    deadline = time.monotonic() + 10  # start() sampled once, the line above once
    while len(watch.samples()) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.close()
    assert not any(t.name == "raypipe-poolwatch" for t in threading.enumerate())
    summary = watch.summary()
    assert summary["samples"] >= 3  # the thread sampled before close stopped it
    assert summary["nodes_now"] >= 1 and summary["nodes_lost"] == 0


def test_pool_watch_new_only_leaves_out_a_pool_already_running(ray_session, slow_folder):
    config = _actor_pool(slow_folder, (1, 1))
    with iter_torch_batches(build_dataset(config), batch_size=8) as batches:
        next(iter(batches))  # the pool is up, most of the epoch is ahead
        with PoolWatch() as everyone, PoolWatch(new_only=True) as fresh:
            assert len(everyone.alive()) >= 1 and everyone.summary()["actors_max"] >= 1
            assert fresh.alive() == [] and fresh.summary()["actors_max"] == 0


def test_pool_watch_checks_its_arguments():
    with pytest.raises(ValueError, match="interval_s=0"):
        PoolWatch(interval_s=0)
    with pytest.raises(ValueError, match="max_samples=0"):
        PoolWatch(max_samples=0)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_MODE="disabled",
        # loopback for every node, the fake ones too (their raylets ask this host's IP)
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        # a node's SIGTERM stops it at once (Ray 2.60 drains for up to 30 s by default)
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def _driver(*args: str, timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.elastic_driver", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _exactly_once(keys: list[int], total: int) -> None:
    assert len(keys) == len(set(keys)), "a key was delivered twice"
    assert sorted(keys) == list(range(total)), f"{total - len(set(keys))} keys missing"


class AutoscalingHead:
    """``RAY_FAKE_CLUSTER=1 ray start --head --block`` with cluster/local-autoscaling.yaml.

    Loopback only, free ports, its own temp dir and process group. ``stop()`` ends it by
    pid: SIGTERM to ``ray start``, SIGKILL to its group, then to any process whose
    command line names the temp dir (the fake nodes the autoscaler started).
    """

    def __init__(self):
        self.temp_dir = tempfile.mkdtemp(prefix="rpe-", dir="/tmp")  # short: socket paths
        gcs, dash, client, agent = _free_ports(4)
        self.address = f"127.0.0.1:{gcs}"
        config = yaml.safe_load((ROOT / "cluster" / "local-autoscaling.yaml").read_text())
        config["provider"]["gcs_address"] = self.address  # not the default port 6379
        config["idle_timeout_minutes"] = 0.1  # an idle worker node goes after ~6 s
        config_path = os.path.join(self.temp_dir, "autoscaling.yaml")
        Path(config_path).write_text(yaml.safe_dump(config))
        self.log = open(os.path.join(self.temp_dir, "head.log"), "w")  # noqa: SIM115
        cmd = [
            str(BIN / "ray"), "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=1",
            f"--autoscaling-config={config_path}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
            f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
            "--object-store-memory=268435456", f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]  # fmt: skip
        self.env = _env(
            RAY_FAKE_CLUSTER="1",
            AUTOSCALER_UPDATE_INTERVAL_S="1",
            # the driver's Ray Data asks for CPUs every 2 s (not 10), up to 8x (not 2x) its
            # use: nodes come within a short epoch
            RAY_DATA_MIN_GAP_BETWEEN_AUTOSCALING_REQUESTS="2",
            RAY_DATA_DEFAULT_CLUSTER_SCALING_UP_FACTOR="8",
        )
        self.proc = subprocess.Popen(
            cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def stop(self) -> None:
        stop_group(self.proc, grace_s=60)
        _kill_naming(self.temp_dir)
        self.log.close()

    def remove(self) -> None:
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def monitor_log(self, name: str = "monitor.*") -> str:
        logs = list(Path(self.temp_dir).glob(f"session_*/logs/{name}"))
        return "\n".join(p.read_text(errors="replace") for p in logs)

    def status_changes(self) -> list[str]:
        """The autoscaler's status, one line each time it changed: the time, the CPUs and
        object store in use, and the standing `request_resources` demands (what keeps
        nodes up besides work)."""
        out, last, when, usage, asks = [], None, "", [], []
        for line in self.monitor_log("monitor.log").splitlines():  # .out repeats its status
            if "autoscaler.py" in line and " -- " in line:
                when = line.split(",")[0][-8:]  # HH:MM:SS
            elif line.endswith((" CPU", " object_store_memory")) and "/" in line:
                usage.append(line.strip())
            elif "from request_resources()" in line:
                asks.append(line.strip())
            elif line.startswith("Pending Demands:") and usage:
                now = (tuple(usage), tuple(asks) or ("no request",))
                if now != last:
                    out.append(f"{when} {' '.join(now[0])}; {' '.join(now[1])}")
                last, usage, asks = now, [], []
        return out


def _pids_naming(text: str) -> list[int]:
    """Processes of this user whose command line contains ``text``, or that hold a file
    under it open: a Ray worker renames its command line (``ray::MapWorker(...)``) but
    keeps its logs in the head's temp dir open, and one has outlived its node's raylet."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline or _holds_open(entry, text):
            pids.append(int(entry.name))
    return pids


def _kill_naming(text: str, timeout_s: float = 10.0) -> None:
    """SIGKILL `_pids_naming` ``text`` until none is left (a killed process lingers a moment
    before its files close), for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (pids := _pids_naming(text)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def _holds_open(proc: Path, prefix: str) -> bool:
    """Whether the process at ``proc`` (/proc/PID) has a file under ``prefix`` open."""
    try:
        fds = list((proc / "fd").iterdir())
    except OSError:  # gone meanwhile, or another user's
        return False
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(fd).startswith(prefix):
                return True
    return False


N_AUTOSCALE = 200


def _changes(series: list, column: int) -> list:
    """The samples where ``column`` (1 actors, 2 nodes) changed: a timeline to print."""
    return [s for i, s in enumerate(series) if i == 0 or s[column] != series[i - 1][column]]


@pytest.mark.slow
def test_autoscaler_adds_cpu_nodes_for_the_pool_and_removes_them_idle(tmp_path):
    """Head of 1 CPU, worker type of 2 CPUs (max 3), pool (2, 6) of 1-CPU actors: the
    pool needs more than the head has, worker nodes come, then go once idle."""
    data = slow_images(tmp_path, N_AUTOSCALE)
    head = AutoscalingHead()
    try:
        out = tmp_path / "report.json"
        _driver("autoscale", head.address, str(data), str(out), timeout=540, env=head.env)
        report = json.loads(out.read_text())
    finally:
        monitor = head.monitor_log()
        head.stop()
    assert not _pids_naming(head.temp_dir), "a process of the head outlived stop()"
    head.remove()
    pool = report["pool"]
    print(json.dumps({k: v for k, v in pool.items() if k != "series"}))
    print("node count changes (s, actors, nodes):", _changes(pool["series"], 2))
    print("actor count changes (s, actors, nodes):", _changes(pool["series"], 1))
    print(f"epoch ended at {report['ended']:.1f} s")
    _exactly_once(report["keys"], N_AUTOSCALE)
    assert pool["nodes_max"] > 1, f"no worker node was added:\n{monitor[-3000:]}"
    assert pool["actors_max"] >= 2, "the pool never outgrew the head's one CPU"
    assert report["nodes_after"] == 1, "idle worker nodes were not removed"
    assert pool["nodes_removed"] == pool["nodes_max"] - 1 and pool["nodes_lost"] == 0, pool


KILL_AFTER = (0, 5, 10)  # batches (of 12) after which a worker node goes


@pytest.mark.slow
@pytest.mark.parametrize(("compute", "cache"), [("tasks", "memory"), ("actors", "none")])
def test_losing_worker_nodes_and_a_preprocessing_process_loses_no_sample(tmp_path, compute,
                                                                         cache):  # fmt: skip
    """Head + 2 worker nodes. The process preprocessing one sample (a pool actor's, or
    with ``compute="tasks"``, the default, a pooled worker's) is SIGKILLed while its task is
    in flight (the task of that sample stalls until then); then each epoch of a warm run
    loses a worker node after a different batch (a new one joins). No sample is lost.

    With ``compute="tasks"`` the warm run has ``cache="memory"`` on: the nodes lost in
    epochs 1 and 2 held pixels cached in the epochs before (a node that joins gets a cache
    at the next epoch), and the samples they held are decoded again on the other nodes.
    (The uncached tasks' own warm run, 42 s of the suite, was left out: the cached run's
    epoch 0 reads and decodes every sample, as an uncached run does, and loses a node
    after its first batch; the process kill runs uncached. No uncached run loses a node
    later in an epoch.)"""
    data = slow_images(tmp_path, 96, side=512)
    temp_dir = tempfile.mkdtemp(prefix="rpn-", dir="/tmp")
    out = tmp_path / "report.json"
    try:
        _driver(
            "node-loss", str(data), str(out), temp_dir, str(_free_ports(1)[0]),
            ",".join(map(str, KILL_AFTER)), compute, cache, timeout=540,
            # the GCS calls a node dead after 3 failed health checks 1 s apart (Ray's
            # default: 5 checks 3 s apart): the lost node's objects are rebuilt sooner
            env=_env(RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3"),
        )  # fmt: skip
    finally:
        _kill_naming(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    report = json.loads(out.read_text())
    assert [e["kill_after"] for e in report["epochs"]] == list(KILL_AFTER)
    for epoch in report["epochs"]:
        _exactly_once(epoch["keys"], 96)
        assert epoch["stats"]["batches"] == 12
    # the nodes went: Ray lists every removed node dead, and the watch saw each loss
    assert len(set(report["removed"])) == len(KILL_AFTER), report["removed"]
    assert report["removed_alive"] == [False] * len(KILL_AFTER), report["removed_alive"]
    kill = report["actor_kill"]
    # the process killed ran the stalled sample's first attempt (with actors: a pool
    # actor's); the sample was tried again in another process and the epoch is whole
    if compute == "actors":
        assert kill.get("pid") in kill.get("pool_pids", []), kill
    assert kill["gone"] and len(kill["attempts"]) >= 2, kill  # it died; tried again
    assert kill["pid"] not in kill["attempts"][1:], kill
    _exactly_once(kill["keys"], 96)
    pool = report["pool"]
    print(json.dumps({k: v for k, v in pool.items() if k != "series"}))
    assert pool["nodes_lost"] == len(KILL_AFTER), pool  # the loss shows in the stats
    # the label selector kept every actor, or task, off the head (which has a CPU free)
    assert report["work_nodes"] and report["head"] not in report["work_nodes"]
    if cache != "none":
        _check_cache_after_node_loss(report)


def _check_cache_after_node_loss(report: dict) -> None:
    """The lost nodes held cached pixels, and the nodes left decoded samples again in every
    epoch after one was lost (a node's counters go with it: the nodes alive at both ends of
    an epoch, and those that joined, count what the epoch did; a node removed by then, late
    in the epoch, may still be listed alive at its end, its counters out of reach)."""
    held = report["victim_cache"]
    print("lost nodes' caches:", json.dumps(held))
    assert all(h["entries"] > 0 and h["bytes"] > 0 for h in held[1:]), held
    assert any(h["hits"] > 0 for h in held[1:]), held  # a later epoch cropped from them
    epochs = report["epochs"]
    for e in range(1, len(epochs)):
        before, gone = epochs[e - 1]["cache"], set(report["removed"][: e + 1])
        misses = {n: s["misses"] - before.get(n, {"misses": 0})["misses"]
                  for n, s in epochs[e]["cache"].items() if n not in gone}  # fmt: skip
        print(f"epoch {e}: misses by node {misses}")
        assert sum(misses.values()) > 0, (e, misses)


@pytest.mark.slow
def test_a_dead_train_worker_restarts_the_group_and_the_run_succeeds(
    ray_session, datasets, tmp_path
):
    """Inside real Train workers, 2 epochs: rank 0 exits its process mid-epoch on the
    first attempt; max_failures=1 restarts the worker group, the epoch starts over, and in
    every epoch both ranks get the same number of batches with every key once."""
    from raypipe import TrainContext, train_ddp

    marker, out = tmp_path / "died-once", tmp_path / "keys"
    out.mkdir()

    def loop(ctx: TrainContext) -> None:
        for epoch, batches in ctx.epochs():
            keys = []
            for batch in batches:
                keys.extend(int(k) for k in batch["key"])
                if ctx.rank == 0 and not marker.exists():
                    marker.write_text(str(os.getpid()))
                    os._exit(1)  # the worker process dies, as on a lost GPU node
            (out / f"{epoch}-{ctx.rank}.json").write_text(json.dumps(keys))
            ctx.report({"epoch": epoch})

    config = PipelineConfig(source=str(datasets["webdataset"]), image_size=8, batch_size=5)
    result = train_ddp(
        config, loop, num_workers=2, epochs=2, cpus_per_worker=0.5, max_failures=1,
        storage_path=str(tmp_path / "runs"),
    )  # fmt: skip
    assert marker.exists(), "the worker never died"
    assert result.error is None, result.error
    for epoch in (0, 1):
        ranks = [json.loads((out / f"{epoch}-{r}.json").read_text()) for r in (0, 1)]
        assert len(ranks[0]) == len(ranks[1]) == 30  # 61 rows -> 30 per rank: 6 batches of 5
        keys = ranks[0] + ranks[1]
        assert len(set(keys)) == len(keys) and set(keys) <= set(range(61))
