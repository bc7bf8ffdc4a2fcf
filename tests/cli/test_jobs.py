"""Ray jobs on a real head: `raypipe submit` a training and a preprocess job; token auth.

Each head is a real ``ray start --head --block`` on loopback with its own free ports and
temp dir, so it never meets the session's local Ray or anyone else's cluster. It runs
in its own process group; the test stops it by that pid and group, never by name.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from raypipe.cli.demo import write_digits
from tests.conftest import stop_group

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
TOKEN = "raypipe-test-token-5f0c1e2d9a8b7c6d"


def _free_ports(n: int) -> list[int]:
    """Ports free now, between Ray's worker ports (10002-19999) and the ephemeral range."""
    rng, ports = random.Random(), []
    while len(ports) < n:
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def _env(**extra: str) -> dict[str, str]:
    """A clean environment: this venv first on PATH, no inherited Ray address or auth."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"  # SIGTERM stops the head at once
    env.update(extra)
    return env


class Head:
    """One ``ray start --head`` bound to 127.0.0.1, started and stopped by this test."""

    def __init__(self, env: dict[str, str], token: str | None = None):
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.temp_dir = tempfile.mkdtemp(prefix="rpj-", dir="/tmp")  # short: socket paths
        gcs, dash, client, agent = _free_ports(4)
        self.url = f"http://127.0.0.1:{dash}"
        self.log = open(os.path.join(self.temp_dir, "head.log"), "w")  # noqa: SIM115
        cmd = [
            str(BIN / "ray"), "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", f"--port={gcs}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
            f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
            "--num-cpus=4", f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = Path(self.log.name).read_text()[-3000:]
                self.stop()
                raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n{log}")
            request = urllib.request.Request(f"{self.url}/api/jobs/", headers=self.headers)
            try:  # the job manager answers: ready for submissions
                urllib.request.urlopen(request, timeout=5).close()
                return
            except OSError:
                pass
            time.sleep(1)
        log = Path(self.log.name).read_text()[-3000:]
        self.stop()
        raise RuntimeError(
            f"the head's job API at {self.url} did not come up in {timeout} s:\n{log}"
        )

    def stop(self) -> None:
        """SIGTERM the ``ray start --block`` we started (it stops its node), then its group."""
        stop_group(self.proc, grace_s=15)
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _submit(*args: str, cwd: Path, env: dict[str, str], timeout: float = 420):
    return subprocess.run(
        [str(BIN / "raypipe"), "submit", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A user's folder: configs in ``work/`` (the shipped working dir), data beside it."""
    root = tmp_path_factory.mktemp("project")
    write_digits(root / "data", val_fraction=0.2, seed=0)
    for cls in (root / "data" / "digits" / "train").iterdir():  # a subset: 120 images
        for f in sorted(cls.iterdir())[12:]:
            f.unlink()
    work = root / "work"
    work.mkdir()
    (work / "train.yaml").write_text(
        textwrap.dedent(
            """
            data:
              source: data/digits/train
              image_size: 16
              batch_size: 16
              flip: false
              actors: [1, 1]
              actor_cpus: 0.5
              mean: [0.5, 0.5, 0.5]
              std: [0.5, 0.5, 0.5]
            trainer:
              num_workers: 2
              epochs: 1
              cpus_per_worker: 0.5
              storage_path: runs
            """
        )
    )
    (work / "shards.yaml").write_text(
        "preprocess:\n  source: data/digits/train\n  out: shards\n  format: parquet\n"
        "  shards: 3\n  cpus_per_task: 0.5\n"
    )
    return root


def _start_head(env: dict[str, str], token: str | None = None, attempts: int = 3) -> Head:
    """Start a head; another process may take a probed port first, so try again."""
    for attempt in range(attempts):
        try:
            return Head(env, token)
        except RuntimeError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def head():
    h = _start_head(_env(RAY_AUTH_MODE="disabled"))
    yield h
    h.stop()


def test_submit_training_job(head, project):
    done = _submit(
        "work/train.yaml", "--address", head.url, "--working-dir", "work",
        cwd=project, env=_env(),
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "submitted train job" in out and out.rstrip().endswith("SUCCEEDED")
    assert "epoch 0:" in out and "raypipe run: done" in out
    assert list((project / "runs").glob("*/checkpoint_*/state.pt"))


def test_a_submitted_run_goes_on_from_its_run_folder(head, project):
    """``raypipe submit --resume RUN`` (``raypipe run`` had it, submit did not): the job
    trains only the epochs the run's checkpoint left, here epoch 1 of 2."""
    if not list((project / "runs").glob("*/checkpoint_*")):  # run alone: make one
        made = _submit("work/train.yaml", "--address", head.url, "--working-dir", "work",
                       cwd=project, env=_env())  # fmt: skip
        assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    (run,) = {c.parent for c in (project / "runs").glob("*/checkpoint_*")}
    longer = project / "work" / "train2.yaml"
    longer.write_text(
        (project / "work" / "train.yaml").read_text().replace("epochs: 1", "epochs: 2")
    )
    done = _submit(
        "work/train2.yaml", "--address", head.url, "--working-dir", "work",
        "--resume", str(run.relative_to(project)), cwd=project, env=_env(),
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert f"--resume {run}" in out.splitlines()[0]  # against --data-root: the head's path
    assert "epoch 1:" in out and "epoch 0:" not in out, out


def test_submit_preprocess_job(head, project):
    done = _submit(
        "work/shards.yaml", "--address", head.url, "--working-dir", "work",
        cwd=project, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "raypipe convert: done" in done.stdout
    # a head on this machine runs the job with this Python: a bare `python` was whichever
    # came first on the head's PATH (the system's, without raypipe, outside the venv)
    python = done.stdout.split(f"{head.url}: P=")[1].split("; ")[0]  # python where it is not
    assert Path(python).parent == BIN and Path(python).name.startswith("python"), python
    index = json.loads((project / "shards" / "index.json").read_text())
    assert index["complete"] and index["num_samples"] == 120
    assert [e["name"] for e in index["shards"]] == [
        f"train-{i:05d}-of-00003.parquet" for i in range(3)
    ]
    assert all((project / "shards" / e["name"]).is_file() for e in index["shards"])


def test_failed_job_fails_the_command(head, project):
    bad = project / "work" / "too_big.yaml"
    bad.write_text(
        (project / "work" / "train.yaml").read_text().replace("16\n  flip", "4096\n  flip")
    )
    done = _submit(
        "work/too_big.yaml", "--address", head.url, "--working-dir", "work",
        cwd=project, env=_env(),
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED" in done.stdout and "larger than one rank's share" in done.stdout


def test_no_wait_returns_at_once(head, project):
    config = project / "work" / "later.yaml"
    config.write_text(
        (project / "work" / "shards.yaml").read_text().replace("out: shards", "out: later")
    )
    done = _submit(
        "work/later.yaml", "--address", head.url, "--working-dir", "work", "--no-wait",
        cwd=project, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "ray job logs --follow" in done.stdout
    job_id = done.stdout.split("submitted convert job ")[1].split()[0]
    assert _wait_for_job(head.url, job_id) == "SUCCEEDED"
    assert (project / "later" / "index.json").is_file()


def _wait_for_job(url: str, job_id: str, headers: dict | None = None, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(f"{url}/api/jobs/{job_id}", headers=headers or {})
    while time.monotonic() < deadline:
        with urllib.request.urlopen(request, timeout=10) as r:
            status = json.loads(r.read())["status"]
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} still running after {timeout} s")


@pytest.fixture(scope="module")
def auth_head(tmp_path_factory):
    token = tmp_path_factory.mktemp("auth") / "token"
    token.write_text(TOKEN)
    h = _start_head(_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token)), TOKEN)
    h.token = token
    yield h
    h.stop()


def test_token_auth_refuses_without_token_and_runs_with_it(auth_head, project, tmp_path):
    args = ["work/shards.yaml", "--address", auth_head.url, "--working-dir", "work"]
    anonymous = _submit(*args, cwd=project, env=_env(RAY_AUTH_MODE="disabled"))
    assert anonymous.returncode == 2
    assert "refused" in anonymous.stderr and "Traceback" not in anonymous.stderr
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    refused = _submit(*args, "--token-file", str(wrong), cwd=project, env=_env())
    assert refused.returncode == 2 and "refused" in refused.stderr

    shutil.rmtree(project / "shards", ignore_errors=True)
    done = _submit(*args, "--token-file", str(auth_head.token), cwd=project, env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "raypipe convert: done" in done.stdout
    # Ray's own client mechanism (RAY_AUTH_MODE=token and the token's path), and raypipe's
    # default with RAY_AUTH_MODE unset (the token Ray finds, as ray.init does): accepted.
    # Both jobs find every shard finished already, so they are short.
    for mode in ({"RAY_AUTH_MODE": "token"}, {}):
        env = _env(RAY_AUTH_TOKEN_PATH=str(auth_head.token), **mode)
        queued = _submit(*args, "--no-wait", cwd=project, env=env)
        assert queued.returncode == 0, queued.stderr
        job_id = queued.stdout.split("submitted convert job ")[1].split()[0]
        assert _wait_for_job(auth_head.url, job_id, auth_head.headers) == "SUCCEEDED"
