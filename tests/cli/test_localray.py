"""`raypipe.cli.localray`: raypipe's local Ray settings; Ray's processes left after
``ray.shutdown()`` are stopped by pid.

Fake workers (``sleep`` renamed ``ray::...``, as a Ray worker renames itself) stand in
for one that outlives its raylet: that case comes now and then, not on demand. The
session's own Ray is never stopped here; its GCS shows the settings `localray.start`
gives a local Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raypipe.cli import localray

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")


@pytest.fixture
def children():
    started: list[subprocess.Popen] = []

    def start(argv0: str) -> subprocess.Popen:
        started.append(subprocess.Popen(["bash", "-c", f"exec -a '{argv0}' sleep 60"]))
        return started[-1]

    yield start
    for p in started:
        p.kill()
        p.wait()


def _noted(*pids: int) -> dict[int, int]:
    """`ray_descendants` once every pid has exec'd under its new name."""
    for _ in range(100):
        found = localray.ray_descendants(os.getpid())
        if all(p in found for p in pids):
            return found
        time.sleep(0.05)
    raise AssertionError(f"{pids} not among {found}")


def test_a_ray_worker_still_there_after_the_grace_is_killed_and_nothing_else(children):
    worker = children("ray::MapWorker(MapBatches(RankPreprocessor))")
    other = children("sleep")
    noted = _noted(worker.pid)
    assert other.pid not in noted
    mine = {worker.pid: noted[worker.pid]}
    assert localray.stop_leftovers(mine, grace_s=0.2) == [worker.pid]
    assert worker.wait(timeout=10) == -9
    assert other.poll() is None


def test_ray_programs_are_told_by_rays_package_not_by_a_folder_named_ray(children):
    """The raylet and Ray's Python services run from the installed package; a user's
    program under a folder named ``ray`` (``/home/ray/...`` in Ray's images) is not Ray's,
    and `shutdown` killed it."""
    import ray

    raylet = children(os.path.join(os.path.dirname(ray.__file__), "core/src/ray/raylet/raylet"))
    user = children("/home/ray/project/.venv/bin/python train.py")
    noted = _noted(raylet.pid)
    assert user.pid not in noted


def test_a_worker_that_ends_in_the_grace_or_whose_pid_was_reused_is_left_alone(children):
    worker = children("ray::IDLE")
    noted = _noted(worker.pid)
    start = noted[worker.pid]
    reused = {worker.pid: start + 1}  # the same pid, another process's start time
    assert localray.stop_leftovers(reused, grace_s=0.2) == []
    assert worker.poll() is None
    worker.terminate()
    assert localray.stop_leftovers({worker.pid: start}, grace_s=5) == []


def _gcs_config(root: int) -> dict:
    """The system config the GCS under ``root`` was started with (``--config_list``)."""
    import base64
    import json

    for pid, (name, _) in localray.process_tree(root).items():
        if name == "gcs_server":
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            listed = [a for a in args if a.startswith(b"--config_list=")]
            return json.loads(base64.b64decode(listed[0].split(b"=", 1)[1]))
    raise AssertionError(f"no gcs_server under {root}")


def test_the_local_ray_raypipe_starts_has_its_settings_and_a_cluster_is_joined_as_is(ray_session):
    # the session's Ray came from localray.start("local"), as `raypipe run`'s does
    config = _gcs_config(os.getpid())
    for key, value in localray.LOCAL_SYSTEM_CONFIG.items():
        assert config.get(key) == value, (key, config)
    # joining that cluster passes no system config, which Ray would refuse
    gcs = ray_session.get_runtime_context().gcs_address
    # and Ray Train's controller looks at its workers every 0.5 s on a local Ray raypipe
    # started (a joined cluster keeps Ray's default), as a user's shell leaves it unset
    env = {k: v for k, v in os.environ.items() if k != "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"}
    joined = subprocess.run(
        [sys.executable, "-c", "import os, sys, ray; from raypipe.cli import localray; "
         "polls = lambda: os.environ.get('RAY_TRAIN_HEALTH_CHECK_INTERVAL_S'); "
         "localray.start(sys.argv[1], log_to_driver=False); "
         "print(ray.cluster_resources()['CPU'], polls()); ray.shutdown(); "
         "localray.start('local', num_cpus=1, include_dashboard=False, log_to_driver=False); "
         "print(polls()); localray.shutdown(); print(polls())", gcs],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert joined.returncode == 0, joined.stderr[-2000:]
    cpus, joined_polls, started_polls, after_polls = joined.stdout.split()[-4:]
    assert float(cpus) == ray_session.cluster_resources()["CPU"]
    assert (joined_polls, started_polls, after_polls) == ("None", "0.5", "None")


def test_blocks_reuse_the_store_memory_the_blocks_before_them_freed(ray_session):
    """Ray frees objects no one holds in batches, every second or every 100 objects by
    default, and until a batch is freed each new block takes store memory no block used
    yet: one after another, they walk the whole store, and every process that writes or
    reads them meets untouched pages (a page fault each 4 KiB) until it has been over all
    of it. The local Ray raypipe starts frees within 10 ms, so a stream of blocks, each
    dropped before the next is asked for, keeps to a few places."""
    import numpy as np

    @ray_session.remote
    def block(i: int) -> np.ndarray:
        return np.full(8 << 20, i % 251, dtype=np.uint8)

    places = []
    for i in range(48):
        array = ray_session.get(block.remote(i))
        assert array[0] == i % 251
        places.append(array.__array_interface__["data"][0])
        del array
    assert len(set(places)) <= 8, f"{len(set(places))} places for 48 blocks of 8 MiB"


def test_a_local_ray_a_pipeline_starts_for_itself_has_raypipes_settings(ray_session, tmp_path):
    """`Pipeline`, `Loader`, `train_ddp` and `build_dataset` start a local Ray where none is
    up (`raypipe.localnode.ensure`): it gets the settings `raypipe run`'s local Ray gets,
    not plain ``ray.init()``'s."""
    import json

    script = (
        "import json, os, sys\n"
        "from raypipe import localnode\n"
        "from raypipe.cli import localray\n"
        "from tests.cli.test_localray import _gcs_config\n"
        "localnode.ensure()\n"
        "try:\n"
        "    print(json.dumps(_gcs_config(os.getpid())))\n"
        "finally:\n"
        "    localray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180, cwd=Path(__file__).resolve().parents[2], env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads(done.stdout.strip().splitlines()[-1])
    for key, value in localray.LOCAL_SYSTEM_CONFIG.items():
        assert config.get(key) == value, (key, config)
