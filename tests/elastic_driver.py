"""Drivers for tests/pool/test_elastic.py that need a Ray of their own, run in a subprocess.

``python -m tests.elastic_driver autoscale ADDRESS DATA OUT``: join a running head
(the real Ray autoscaler with cluster/local-autoscaling.yaml), run one epoch whose pool
needs more CPUs than the head has, then wait for the idle worker nodes to go.

``python -m tests.elastic_driver node-loss DATA OUT TEMP_DIR PORT AFTER,AFTER,.. COMPUTE CACHE``:
a ``ray.cluster_utils.Cluster`` (head + 2 worker nodes). First a one-epoch `raypipe.Pipeline`
whose transform (`stall_once`) holds the task of one sample on its first attempt until the
actor running it is killed (``os.kill``): the kill hits a task in flight for certain, and
every attempt at that sample is noted by its process id. Then one warm run of the built-in
crop, with the decoded cache CACHE (``memory``, or ``none``), with one epoch per AFTER that
loses a worker node after that batch (with the blocks of later epochs that its object store
may hold, and its cached pixels); each removed node's id, and whether Ray still lists it
alive at the end. With a cache: the removed node's cache counters just before it went, and
every alive node's at the end of each epoch.

Each writes a JSON report to OUT; the test asserts on it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from raypipe import Pipeline, PipelineConfig, PoolWatch, build_dataset, iter_torch_batches
from tests.user_transforms import STALL_KEY, stall_once

BATCH = 8

log = logging.getLogger("raypipe.test")


def _epoch(config, watch, *, on_batch=None, epoch=0) -> dict:
    """One epoch through iter_torch_batches; the keys, the stats and the time it ended."""
    keys: list[int] = []
    batches = iter_torch_batches(
        build_dataset(config, epoch=epoch), batch_size=BATCH, drop_last=False, watch=watch
    )
    with batches:
        for i, batch in enumerate(batches):
            keys.extend(int(k) for k in batch["key"])
            if on_batch is not None:
                on_batch(i)
        stats = batches.stats()
    return {"keys": keys, "stats": stats, "ended": time.monotonic() - watch._t0}


def autoscale(address: str, data: str, out: str) -> None:
    import ray

    ray.init(address=address, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    config = PipelineConfig(
        source=data,
        image_size=32,
        batch_size=BATCH,
        actors=(2, 6),
        files_per_task=2,
        compute="actors",
    )
    with PoolWatch(interval_s=0.5) as watch:
        report = _epoch(config, watch)
        deadline = time.monotonic() + 240
        while watch.sample().nodes > 1 and time.monotonic() < deadline:
            time.sleep(1)
        report["pool"] = watch.summary()
    report["nodes_after"] = len([n for n in ray.nodes() if n["Alive"]])
    report["dead_nodes"] = [
        (n.get("DeathReason"), n.get("DeathReasonMessage")) for n in ray.nodes() if not n["Alive"]
    ]
    ray.shutdown()
    _write(out, report)


def _cache_by_node(config) -> dict[str, dict]:
    """Every alive node's cache counters, by node id."""
    import ray

    from raypipe.preprocess.cache import node as node_cache

    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    return {i: node_cache.stats(config, node_id=i) for i in alive}


def node_loss(data: str, out: str, temp_dir: str, port: str, kill_after: list[int],
              compute: str, cache: str) -> None:  # fmt: skip
    import ray
    from ray.cluster_utils import Cluster

    from raypipe.preprocess.cache import node as node_cache

    node = {
        "num_cpus": 2, "object_store_memory": 1 << 28, "node_ip_address": "127.0.0.1",
        "labels": {"raypipe-role": "preprocess"},
    }  # fmt: skip
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **node, "num_cpus": 1, "gcs_server_port": int(port), "temp_dir": temp_dir,
            "include_dashboard": False, "labels": {"raypipe-role": "head"},
        },
    )  # fmt: skip
    workers = [cluster.add_node(**node) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    # docs/scale.md "Keeping preprocessing actors off GPU nodes": actors only on preprocess nodes, never on the head
    context.execution_options.label_selector = {"raypipe-role": "preprocess"}
    config = PipelineConfig(
        source=data,
        image_size=32,
        batch_size=BATCH,
        actors=(2, 4),
        files_per_task=2,
        compute=compute,
    )
    report: dict = {"epochs": [], "head": cluster.head_node.node_id, "removed": []}
    cached = config.replace(cache=None if cache == "none" else cache)
    try:
        report["actor_kill"] = _actor_kill_epoch(config, Path(temp_dir) / "stall")
        report["work_nodes"] = sorted(set((Path(temp_dir) / "stall/nodes").read_text().split()))
        with PoolWatch(interval_s=0.5) as watch, Pipeline(cached, epochs=len(kill_after)) as pipe:
            for epoch, batches in pipe.epochs():
                after = kill_after[epoch]
                cluster.wait_for_nodes(timeout=120)
                keys = []
                for i, batch in enumerate(batches):
                    keys.extend(int(k) for k in batch["key"])
                    if i == after:  # a worker node goes; a new one comes, as on a real cluster
                        victim = workers.pop(0)
                        if cached.cache is not None:  # what the node's cache held and did
                            held = node_cache.stats(cached, node_id=victim.node_id)
                            report.setdefault("victim_cache", []).append(held)
                        log.warning("removing node %s after batch %d", victim.node_id, i)
                        cluster.remove_node(victim, allow_graceful=False)
                        report["removed"].append(victim.node_id)
                        workers.append(cluster.add_node(**node))
                report["epochs"].append({"kill_after": after, "keys": keys,
                                         "stats": batches.stats(),
                                         "ended": time.monotonic() - watch._t0})  # fmt: skip
                if cached.cache is not None:
                    report["epochs"][-1]["cache"] = _cache_by_node(cached)
            deadline = time.monotonic() + 120  # Ray's health checks mark a lost node dead
            while watch.summary()["nodes_lost"] < len(kill_after) < 99:
                if time.monotonic() > deadline:
                    break
                time.sleep(1)
            report["pool"] = watch.summary()
            alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
            report["removed_alive"] = [alive.get(n) for n in report["removed"]]
    finally:
        ray.shutdown()
        cluster.shutdown()
    _write(out, report)


def _actor_kill_epoch(config: PipelineConfig, folder: Path) -> dict:
    """One epoch through `stall_once`: the actor holding `STALL_KEY`'s task is SIGKILLed.
    The keys, the pool's actors' pids when the kill came, the pid killed and every pid
    that attempted `STALL_KEY`, in order."""
    folder.mkdir(parents=True)
    config = config.replace(transform=functools.partial(stall_once, str(folder)))
    killed: dict = {}
    done = threading.Event()
    with PoolWatch(interval_s=0.5) as watch, Pipeline(config, epochs=1) as pipe:
        killer = threading.Thread(target=_kill_stalled, args=(folder, watch, killed, done))
        killer.start()
        try:
            keys = [int(k) for _, batches in pipe.epochs() for b in batches for k in b["key"]]
        finally:
            done.set()
            killer.join()
    attempts = [int(p) for p in (folder / "attempts").read_text().split()]
    return {"keys": keys, **killed, "attempts": attempts}


def _kill_stalled(folder: Path, watch, killed: dict, done: threading.Event) -> None:
    """SIGKILL the process that is stalled in `STALL_KEY`'s first attempt."""
    while not done.wait(0.1):
        attempts = folder / "attempts"
        if not attempts.exists() or not attempts.read_text().strip():
            continue
        pid = int(attempts.read_text().split()[0])
        killed["pool_pids"] = sorted(int(a["Pid"]) for a in watch.alive())
        log.warning("killing preprocessing actor pid %d in the task of key %d", pid, STALL_KEY)
        os.kill(pid, signal.SIGKILL)
        killed["pid"], killed["gone"] = pid, _gone(pid, timeout_s=10)
        return


def _gone(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` ended (or is a zombie left for its parent) within the time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _write(out: str, report: dict) -> None:
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    mode, *args = sys.argv[1:]
    if mode == "autoscale":
        autoscale(*args)
    elif mode == "node-loss":
        node_loss(*args[:4], [int(a) for a in args[4].split(",")], *args[5:7])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
