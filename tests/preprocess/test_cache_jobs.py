"""Two Ray jobs on one node with the same memory-cache settings (as torchrun's ranks are,
each its own driver) share the node's cache: the second job's `NodeCache` starts beside
the first's instead of waiting for its lock, and the directory stays until both let go."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from raypipe import PipelineConfig
from raypipe.preprocess.cache import node
from raypipe.preprocess.cache.disk import DiskStore
from raypipe.preprocess.cache.store import Entry
from tests.preprocess.test_cache import IDENT, pixels, put_all

ROOT = Path(__file__).resolve().parents[2]
SECOND_JOB = """
import json, sys
import ray
from raypipe import PipelineConfig
from raypipe.preprocess.cache import node
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
config = PipelineConfig(**json.loads(sys.argv[2]))
node.ensure(config)
print(json.dumps(node.stats(config)))
node.release(config)
"""


def test_a_second_job_shares_the_memory_cache_of_the_first(ray_session, tmp_path):
    import ray

    settings = {"source": str(tmp_path), "cache": "memory", "cache_max_side": 15}
    config = PipelineConfig(**settings)
    node.ensure(config)
    try:
        root = node.cache_root(config, ray.get_runtime_context().get_node_id())
        put_all(DiskStore(root, 1 << 20), [("a", Entry.image(IDENT, "a.jpg", 0.01, pixels()))])
        second = subprocess.run(
            [sys.executable, "-c", SECOND_JOB, ray.get_runtime_context().gcs_address,
             json.dumps(settings)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert second.returncode == 0, second.stderr[-3000:]
        stats = json.loads(second.stdout.strip().splitlines()[-1])
        assert stats["entries"] == 1  # the first job's entry, in the one directory
        assert os.path.isdir(root)  # the second job let go; the first still holds it
        assert node.stats(config)["entries"] == 1
    finally:
        node.release(config)
    assert not os.path.exists(root)
