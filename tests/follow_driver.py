"""Driver for tests/pool/test_follow.py and benchmarks/follow.py, run in a subprocess: ranks of a
one-epoch `raypipe.Pipeline` whose trainers are slow for a while and then fast, with the
pool's actors and the cluster's nodes sampled from outside.

``python -m tests.follow_driver ADDRESS DATA OUT CONFIG_JSON WORLD SLOW_S PAUSE_S [MIB]``:
ADDRESS ``local`` starts a Ray of its own (4 CPUs, a 100 MiB object store), else joins
that head; MIB, when given, limits the object store Ray Data reads ahead into. CONFIG_JSON holds `PipelineConfig` fields besides ``source``. Each rank sleeps
PAUSE_S after every batch until SLOW_S after its first batch, then none. Writes to OUT
(JSON): the keys of each rank's batches, the stats, the times (seconds on the watch's clock) of each
rank's first batch and fast phase, the trainers' progress ``(t, samples read)``, the
watch's ``(t, actors, nodes)`` series and summary, where the pool's actors were and each
node's object store in use (MiB) as they changed, and the CPU-seconds of the run.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import ray

from raypipe import PipelineConfig, PoolWatch
from raypipe.cli import localray
from tests.ranks import run_ranks

STORE_MIB = 100


def main(address: str, data: str, out: str, config_json: str, world: str, slow_s: str,
         pause_s: str, store_limit_mib: str = "0") -> None:  # fmt: skip
    if address == "local":
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 object_store_memory=STORE_MIB << 20, configure_logging=False)  # fmt: skip
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    if int(store_limit_mib):  # how far ahead of the trainers Ray Data may read
        ctx.execution_options.resource_limits = ctx.execution_options.resource_limits.copy(
            object_store_memory=int(store_limit_mib) << 20
        )
    config = PipelineConfig(source=data, **json.loads(config_json))
    slow, pause = float(slow_s), float(pause_s)
    lock = threading.Lock()
    first: dict[int, float] = {}
    fast: dict[int, float] = {}
    progress: list[tuple[float, int]] = []
    read = [0]

    with PoolWatch(match="RankPreprocessor", interval_s=0.25, new_only=True) as watch:
        clock = lambda: round(time.monotonic() - watch._t0, 3)  # noqa: E731

        def trainer(rank: int, batch) -> None:
            now = clock()
            with lock:
                first.setdefault(rank, now)
                read[0] += len(batch["key"])
                progress.append((now, read[0]))
            if now - first[rank] < slow:
                time.sleep(pause)
            else:
                fast.setdefault(rank, now)

        heads = [n["NodeID"] for n in ray.nodes()
                 if n["Alive"] and "node:__internal_head__" in n["Resources"]]  # fmt: skip
        placed: list = []  # (t, {node: actors}) whenever the pool's placement changed
        stored: list = []  # (t, {node: MiB of its object store in use}) whenever it changed
        done = threading.Event()

        def where() -> None:
            while not done.wait(0.5):
                nodes: dict[str, int] = {}
                for a in watch.alive():
                    node = (a.get("Address") or {}).get("NodeID", "?")
                    nodes[node] = nodes.get(node, 0) + 1
                if not placed or placed[-1][1] != nodes:
                    placed.append((clock(), nodes))
                used = store_in_use()
                if not stored or stored[-1][1] != used:
                    stored.append((clock(), used))

        sampler = threading.Thread(target=where, daemon=True)
        sampler.start()
        cpu0 = time.process_time()
        keys, stats = run_ranks(config, int(world), 1, pause_s=(trainer,), keys_only=True)
        ended = clock()
        done.set()
        sampler.join()
        report = {
            "keys": [[[int(k) for k in b] for b in rank[0]] for rank in keys],  # batches kept
            "stats": [s[0] for s in stats],
            "first": first, "fast": fast, "ended": ended, "progress": progress,
            "series": [(s.t, s.actors, s.nodes) for s in watch.samples()],
            "pool": watch.summary(), "driver_cpu_s": time.process_time() - cpu0,
            "watch_t0": watch._t0,  # time.monotonic() at the watch's start
            "heads": heads, "placed": placed, "stored": stored,
        }  # fmt: skip
    localray.shutdown()
    Path(out).write_text(json.dumps(report))


def store_in_use() -> dict[str, int]:
    """MiB of each live node's object store in use (its total less what the GCS reports
    available): what keeps a node from being idle besides its CPUs."""
    from ray._private.state import available_resources_per_node

    free = available_resources_per_node()
    total = {n["NodeID"]: n["Resources"].get("object_store_memory", 0.0)
             for n in ray.nodes() if n["Alive"]}  # fmt: skip
    return {node: round((total[node] - free[node].get("object_store_memory", 0.0)) / 2**20)
            for node in free if node in total}  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
