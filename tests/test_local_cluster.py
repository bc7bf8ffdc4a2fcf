"""cluster/local.sh: the local autoscaling cluster, started, grown by the real autoscaler
by a fake CPU node, and stopped by pid: the node too (it outlives the head's processes),
and no other Ray (this test session's own) with it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raypipe.cli.localray import process_tree
from tests.pool.test_elastic import BIN, ROOT, _env, _free_ports, _pids_naming

pytestmark = pytest.mark.slow
DRIVER = """
import sys, time, ray
from ray.autoscaler.sdk import request_resources
ray.init(address=sys.argv[1])
request_resources(num_cpus=3)  # the head has 1: a fake node of 2 comes
deadline = time.monotonic() + 120
while sum(1 for n in ray.nodes() if n["Alive"]) < 2 and time.monotonic() < deadline:
    time.sleep(0.5)
print("nodes", sum(1 for n in ray.nodes() if n["Alive"]))
"""


def test_local_cluster_up_grows_a_node_and_down_stops_it_all_by_pid(ray_session, tmp_path):
    import ray

    gcs, dash = _free_ports(2)
    env = _env(PORT=str(gcs), DASHBOARD_PORT=str(dash), STATE=str(tmp_path / "state"),
               RAY=str(BIN / "ray"))  # fmt: skip
    script = str(ROOT / "cluster" / "local.sh")
    up = subprocess.run([script, "up"], env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    temp_dir = (tmp_path / "state").read_text().split()[1]
    try:
        grown = subprocess.run([sys.executable, "-c", DRIVER, f"127.0.0.1:{gcs}"], env=env,
                               capture_output=True, text=True, timeout=200)  # fmt: skip
        assert "nodes 2" in grown.stdout, grown.stdout[-2000:] + grown.stderr[-2000:]
        fake_nodes = [p for p in _pids_naming(temp_dir) if b"raylet" in _cmdline(p)]
        assert len(fake_nodes) >= 2  # the head's raylet and the fake node's
    finally:
        down = subprocess.run([script, "down"], env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    assert down.returncode == 0, down.stdout + down.stderr
    deadline = time.monotonic() + 10
    while _pids_naming(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pids_naming(temp_dir) == [] and not os.path.exists(temp_dir)
    assert ray.is_initialized() and ray.cluster_resources().get("CPU", 0) > 0  # ours lives on


WORKER = "import subprocess, sys, time; f = open(sys.argv[1]); subprocess.Popen(['sleep', '60'])\n"
WORKER += "time.sleep(60)"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_down_refuses_a_state_file_it_did_not_write(tmp_path):
    """A state naming another pid or folder (planted, or stale from elsewhere) signals and
    removes nothing."""
    victim = tmp_path / "home"
    victim.mkdir()
    state = tmp_path / "state"
    state.write_text(f"1 {victim}\n")
    env = {**os.environ, "STATE": str(state)}
    done = subprocess.run([str(ROOT / "cluster" / "local.sh"), "down"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1 and "does not hold a cluster this script started" in done.stderr
    assert victim.is_dir() and state.exists()


def test_down_stops_rays_processes_in_its_dir_and_no_other(tmp_path):
    """``down`` kills what holds its cluster's files open only where it is Ray's (a
    ``ray::`` worker of a fake node): a ``tail -f`` of the head's log, an editor, a driver
    of yours, are not its to stop. No Ray here: the head's pid in the state is gone."""
    make = ["mktemp", "-d", "/tmp/rpl-XXXXXX"]  # as `up` makes it
    temp_dir = subprocess.run(make, capture_output=True, text=True, check=True).stdout.strip()
    log = Path(temp_dir) / "session_x" / "logs" / "raylet.out"
    log.parent.mkdir(parents=True)
    log.write_text("")
    state = tmp_path / "state"
    state.write_text(f"999999999 {temp_dir}\n")
    tail = "/usr/bin/tail" if os.path.exists("/usr/bin/tail") else "/bin/tail"
    reader = subprocess.Popen([tail, "-f", str(log)])  # a user watching the log
    worker = subprocess.Popen(  # Ray's, and a tool its task started (holding nothing there)
        ["ray::IDLE", "-c", WORKER, str(log)], executable=sys.executable, start_new_session=True
    )
    try:
        time.sleep(1.0)  # both have the log open, the tool started
        tool = [p for p in process_tree(worker.pid) if p != worker.pid and b"sleep" in _cmdline(p)]
        assert len(tool) == 1
        env = {**os.environ, "STATE": str(state)}
        done = subprocess.run([str(ROOT / "cluster" / "local.sh"), "down"], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert worker.wait(timeout=10) == -9  # SIGKILL, by pid
        deadline = time.monotonic() + 10  # the tool, reparented once its worker went
        while Path(f"/proc/{tool[0]}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{tool[0]}").exists() or b"sleep" not in _cmdline(tool[0])
        assert reader.poll() is None  # still watching
        assert not os.path.exists(temp_dir) and not state.exists()
    finally:
        for p in (reader, worker):
            p.kill()
            p.wait()
