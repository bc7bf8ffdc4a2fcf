"""`raypipe run` from a plain shell: every socket its Ray and its DDP workers listen on is
on loopback, with no ``RAY_*`` variable set.

The listeners are read from ``/proc`` (``net/tcp``, ``net/tcp6`` and each process's open
sockets) every 0.1 s while the run goes, for the run's own process tree only: another
Ray on the machine is not counted.
"""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from raypipe.cli.localray import process_tree
from raypipe.localnode import is_loopback
from tests.conftest import make_imagefolder, stop_group

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/net"), reason="reads /proc/net")
BIN = Path(sys.executable).parent
# what a healthy quiet run must not print: an error-level line of Ray's C++ or Python
# logs, Ray Train's INFO lines and report dumps, Ray Data's per-execution lines
QUIET_BREACH = re.compile(
    r" E \d+ \d+\]|\bERROR\b|Traceback|TrainingReport\(|Execution plan|Starting execution"
    r"|Started training worker group|Moving model to device|registers for logging"
)


def _listening_sockets() -> dict[str, tuple[str, int]]:
    """``{socket inode: (address, port)}`` of every TCP socket listening on this machine."""
    out = {}
    for name in ("tcp", "tcp6"):
        lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        for fields in (line.split() for line in lines):
            if fields[3] == "0A":  # LISTEN
                hexaddr, hexport = fields[1].split(":")
                raw = bytes.fromhex(hexaddr)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                out[fields[9]] = (str(ipaddress.ip_address(raw)), int(hexport, 16))
    return out


def listeners_of(root: int) -> set[tuple[str, int, str]]:
    """``(address, port, process name)`` of each socket ``root`` or a descendant listens on."""
    sockets = _listening_sockets()
    found = set()
    for pid, (name, _) in process_tree(root).items():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and (at := sockets.get(link[8:-1])) is not None:
                found.add((*at, name))
    return found


def test_the_listener_reader_sees_an_address_beyond_loopback():
    import socket

    with socket.socket(socket.AF_INET6) as wide, socket.socket() as narrow:
        wide.bind(("::", 0))
        narrow.bind(("127.0.0.1", 0))
        wide.listen()
        narrow.listen()
        seen = {(a, p) for a, p, _ in listeners_of(os.getpid())}
        assert ("::", wide.getsockname()[1]) in seen
        assert ("127.0.0.1", narrow.getsockname()[1]) in seen
    assert not is_loopback("::") and not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("::1")


def _plain_env() -> dict[str, str]:
    """A shell's environment: no Ray, torch.distributed or gloo settings at all."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "GLOO_", "MASTER_", "TORCH_"))}  # fmt: skip
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_raypipe_run_listens_on_loopback_only(tmp_path):
    folder = make_imagefolder(tmp_path / "imgs", {"a": 24, "b": 24})
    (tmp_path / "run.yaml").write_text(textwrap.dedent(f"""
        data:
          source: {folder}
          image_size: 8
          batch_size: 4
          actors: [1, 1]
          actor_cpus: 0.25
        trainer:
          num_workers: 2
          epochs: 1
          cpus_per_worker: 0.25
          storage_path: {tmp_path / "runs"}
        """))  # fmt: skip
    log = (tmp_path / "run.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "raypipe", "run", "run.yaml"], cwd=tmp_path, env=_plain_env(),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    seen: set[tuple[str, int, str]] = set()
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= listeners_of(proc.pid)
            time.sleep(0.1)
    finally:
        stop_group(proc, grace_s=20)
    log.seek(0)
    out = log.read()
    assert proc.returncode == 0, out[-3000:]
    assert "raypipe run: done" in out
    names = {name for _, _, name in seen}
    # the servers were seen: the GCS, the raylet, the DDP workers (their core worker, and
    # rank 0's rendezvous store)
    assert {"gcs_server", "raylet"} <= names, seen
    assert sum(name.startswith("ray::RayTrainWo") for _, _, name in seen) >= 3, seen
    wide = sorted(s for s in seen if not is_loopback(s[0]))
    assert not wide, f"listening beyond loopback: {wide}"
    # and quiet (raypipe.cli.quiet): raypipe's lines, no error-level line, no Ray internals
    lines = out.splitlines()
    if "Found multiple active Ray instances" in out:
        # another Ray on this machine (the test session's): Ray Train's placement-group
        # cleaner finds its Ray by scanning the machine's processes and dies with a
        # traceback, a Ray bug a run with one Ray per machine does not meet
        lines = [line for line in lines if "(PlacementGroupCleaner pid=" not in line]
    assert any("epoch 0: loss" in line for line in lines), out
    breaches = [line for line in lines if QUIET_BREACH.search(line)]
    assert not breaches, out
    assert len(lines) <= 15, out  # an epoch line and the summary


def test_a_ledger_made_before_any_ray_starts_raypipes_loopback_one(tmp_path):
    """`Pipeline.ledger` is the first Ray call of the TorchTrainer recipe (docs/trainers.md):
    with no Ray up it started Ray's own default, on the machine's address."""
    code = ("import ray, raypipe\nraypipe.Pipeline.ledger(2)\n"
            "print('node', ray.util.get_node_ip_address())\nray.shutdown()\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_plain_env(),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "node 127.0.0.1" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_spent_skip_budget_ends_raypipe_run_in_one_line(tmp_path):
    """Half the images bad: each rank's error came back inside Ray Train's
    WorkerGroupError, and the run printed ~140 lines, a traceback per rank ("Error in
    training function"), one per failed task nobody read ("Unhandled error") and the
    driver's own, exit 1. Now: the skipped samples' lines and one error line, exit 2."""
    folder = make_imagefolder(tmp_path / "imgs", {"a": 160, "b": 160})
    for bad in sorted(folder.glob("*/*"))[::2]:  # tasks fail at once: several in flight
        bad.write_bytes(b"garbage\n")
    (tmp_path / "run.yaml").write_text(textwrap.dedent(f"""
        data:
          source: {folder}
          image_size: 8
          batch_size: 4
          actor_cpus: 0.25
          files_per_task: 8
        trainer:
          num_workers: 2
          epochs: 1
          cpus_per_worker: 0.25
          storage_path: {tmp_path / "runs"}
        """))  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "raypipe", "run", "run.yaml"], cwd=tmp_path,
                          env=_plain_env(), capture_output=True, text=True, timeout=240)  # fmt: skip
    lines = [line for line in done.stderr.splitlines() if "(PlacementGroupCleaner pid=" not in line
             and "Found multiple active Ray" not in line]  # another Ray here: see above  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.fullmatch(r"raypipe run: error: epoch 0: \d+ of its 320 samples skipped as bad so "
                        r"far \(max_skipped=0\.05 allows 16\); .*", lines[-1]), lines[-1]  # fmt: skip
    others = [line for line in lines[:-1] if "raypipe: skipped " not in line]
    assert not others, done.stderr[-3000:]  # no traceback, no unhandled error: ours alone
