"""For tests/train/test_torchrun.py, inside a network namespace of its own (``unshare -n``):
a ``ray start --head`` on 127.0.0.1 (token authentication, a token of its own), then
``torchrun --nproc_per_node=2`` ranks that join it, once per entry of ``runs`` (the job's
arguments after the config and ``--address``).

Run as ``python -m tests.torchrun_head SPEC_JSON``. The namespace has only a loopback
interface, so neither the head nor torchrun's rendezvous store can listen beyond it. The
head is stopped by its pid and process group (`tests.conftest.stop_group`) however it ends.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import stop_group

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PORT = 6379  # the namespace is new: nothing else listens in it


def main(spec: dict) -> int:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    temp = tempfile.mkdtemp(prefix="rpt-", dir="/tmp")  # short: socket paths
    log, token = Path(temp, "head.log"), Path(temp, "auth_token")
    token.write_text(secrets.token_hex(16))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),  # the head's and ranks'
               RAY_USAGE_STATS_ENABLED="0", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")  # fmt: skip
    cmd = [
        str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
        f"--port={PORT}", "--dashboard-host=127.0.0.1", "--include-dashboard=false",
        "--num-cpus=4", f"--temp-dir={temp}", "--disable-usage-stats",
    ]  # fmt: skip
    with open(log, "w") as out:
        head = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        _wait_started(head, log, timeout_s=120)
        for args in spec["runs"]:  # one torchrun after the other, on the same head
            ranks = subprocess.run(
                [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1",
                 "--master_port=29500", "jobs/torchrun_train.py", spec["config"],
                 "--address", f"127.0.0.1:{PORT}", *args],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=spec.get("timeout_s", 300),
            )  # fmt: skip
            print(ranks.stdout[-4000:], ranks.stderr[-6000:], sep="\n", flush=True)
            if ranks.returncode != 0:
                return ranks.returncode
        return 0
    finally:
        stop_group(head, grace_s=15)
        shutil.rmtree(temp, ignore_errors=True)


def _wait_started(head: subprocess.Popen, log: Path, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text()
        if "Ray runtime started" in text:
            return
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}:\n{text[-3000:]}")
        time.sleep(0.5)
    raise RuntimeError(f"the head did not start in {timeout_s} s:\n{log.read_text()[-3000:]}")


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
