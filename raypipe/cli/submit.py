"""`raypipe submit`: send a run or convert config to a Ray head as a Ray job.

```
 here:    check the config → pack the working dir (minus .venv, data, .git) →
          POST the job to the head's job API (JobSubmissionClient)
 head:    python -m raypipe {run|convert} CONFIG --data-root <where you submitted from>
 here:    stream the job's log until it ends → exit 0 if SUCCEEDED, else 1
          (a stream closed early, by an idle proxy or tunnel, is opened again;
          a job still running after that → exit 3)
```

The job API runs any command it is sent, so a head that anyone can reach runs
anyone's code: bind the dashboard to 127.0.0.1 (or a private network) and turn on
Ray's token authentication (``RAY_AUTH_MODE=token``) for anything shared.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TextIO

from raypipe.cli import jobspec
from raypipe.cli.jobapi import (
    SubmitError,
    call,
    client,
    gist,
    job_address,
    loopback,
    ray_job,
    token,
)
from raypipe.cli.quiet import QUIET_ENV

EXCLUDES = [
    ".venv/", "venv/", ".conda/", ".tox/", "node_modules/",  # environments: the head has its own
    "demo-data/", "benchmarks/out/", "wandb/", "lightning_logs/",  # data and run outputs
    ".git/", "__pycache__/", "*.egg-info/", ".pytest_cache/", ".ruff_cache/",
    # secrets never travel with a job: keys, tokens, cloud and SSH credentials
    "*.key", "*.pem", "*.p12", "*.pfx", "auth_token", ".env", ".env.*", ".netrc",
    ".git-credentials", ".aws/", ".ssh/", ".gnupg/", ".config/gcloud/", ".kube/", "id_rsa*",
    "id_ecdsa*", "id_ed25519*",
]  # fmt: skip
ENTRY = {"train": "run", "convert": "convert"}
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
STILL_RUNNING = (
    3  # exit code: submitted, its end not seen (the log stream kept closing or was lost)
)
REATTACH = 5  # log streams opened again in a row that bring no new line, at most
SETTLE = 10  # status polls after a stream ends: the status may lag the log a moment
POLL_S = 0.5


def entrypoint(config: Path, working_dir: Path, data_root: Path, verbose: bool = False,
               python: str = "python", resume: str | None = None) -> tuple[str, str]:  # fmt: skip
    """The job's command and the config's kind; the config must be inside the working dir.
    ``python``: the head's (this one's, where the head is on this machine: `submit`);
    ``resume``: a run's folder on the head, relative ones against ``data_root``."""
    kind = jobspec.check(config, data_root)
    if resume is not None and kind != "train":
        raise ValueError(
            f"--resume goes on with a training run; {str(config)!r} is a {kind} config"
        )
    try:
        rel = config.resolve().relative_to(working_dir.resolve())
    except ValueError:
        raise ValueError(
            f"config {str(config)!r} is outside the working dir {str(working_dir)!r} that is "
            "shipped to the cluster: move it there or pass --working-dir"
        ) from None
    if (rule := _left_out(rel, working_dir)) is not None:
        raise ValueError(f"config {str(config)!r} would not be shipped with the working dir: "
                         f"{rule} leaves it out; move it")  # fmt: skip
    args = ["-m", "raypipe", ENTRY[kind], rel.as_posix()]
    args += ["--data-root", os.path.abspath(data_root)] + ["--verbose"] * verbose  # as given
    args += ["--resume", jobspec.resolve(str(data_root), resume)] if resume else []
    if python == "python":
        return shlex.join([python, *args]), kind
    # this machine's Python, where the head has it; ``python`` where it does not (a
    # loopback URL can be a tunnel to a head elsewhere: `ray dashboard`, ssh -L)
    return f'P={shlex.quote(python)}; [ -x "$P" ] || P=python; exec "$P" {shlex.join(args)}', kind


def _left_out(rel: Path, working_dir: Path) -> str | None:
    """The rule by which Ray's upload leaves ``rel`` out: one of `EXCLUDES`, or a rule
    (file:line:pattern) of the ``.gitignore`` files inside the working dir, which it
    honours (found with git: None without it; ``.rayignore`` files are not looked at)."""
    for pattern in EXCLUDES:  # as gitignore's: a/b/ anchored, a/ a folder, a any name
        bare = pattern.rstrip("/")
        if "/" in bare:
            names = ["/".join(rel.parts[:k]) for k in range(1, len(rel.parts))]
        else:
            names = rel.parts[:-1] if pattern.endswith("/") else rel.parts
        if any(fnmatch.fnmatchcase(name, bare) for name in names):
            return f"raypipe's excludes ({pattern}: secrets, environments, data)"
    if os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") == "1":
        return None
    found = _git(working_dir, "check-ignore", "-v", "--no-index", "--", rel.as_posix())
    top = _git(working_dir, "rev-parse", "--show-toplevel") if found else None
    if not found or not top:  # not ignored, or no git (then none is honoured here either)
        return None
    source, _, rule = found.partition("\t")[0].partition(":")
    if rule.partition(":")[2].startswith("!"):  # the last rule that matched puts it back
        return None
    path, root = Path(top.strip(), source).resolve(), working_dir.resolve()
    if path.name != ".gitignore" or not path.is_relative_to(root):  # Ray reads no other
        return None
    return (f"{path.relative_to(root)}:{rule} (Ray's upload honours .gitignore files; "
            "RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1 turns that off)")  # fmt: skip


def _git(folder: Path, *args: str) -> str | None:
    """``git -C folder ARGS``'s output; None when it fails or there is no git."""
    try:
        done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True,
                              timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def submit(
    config: str | Path,
    *,
    address: str | None = None,
    working_dir: str | Path | None = None,
    data_root: str | Path = ".",
    wait: bool = True,
    token_file: str | Path | None = None,
    submission_id: str | None = None,
    out: TextIO | None = None,
    verbose: bool = False,
    resume: str | None = None,
) -> int:
    """Submit ``config`` as a Ray job; with ``wait``, stream its log and return its exit code.
    Unless ``verbose``, the job's Ray processes print only what matters (`raypipe.cli.quiet`).
    ``resume``: the run goes on from that run folder on the head (``raypipe run --resume``)."""
    out = out or sys.stdout
    config = Path(config)
    working_dir = Path(working_dir) if working_dir else _repo_root()
    if not working_dir.is_dir():
        raise ValueError(f"working dir {str(working_dir)!r} is not a directory")
    url = job_address(address)  # a head on this machine runs this Python, venv or not
    python = sys.executable if loopback(url) and sys.executable else "python"
    command, kind = entrypoint(config, working_dir, Path(data_root), verbose, python, resume)
    sent = token(token_file, url)
    api = client(url, sent)
    runtime_env = {"working_dir": str(working_dir), "excludes": list(EXCLUDES)}
    if not verbose:
        runtime_env["env_vars"] = dict(QUIET_ENV)
    job_id = submission_id or f"raypipe_{kind}_{uuid.uuid4().hex[:12]}"
    call(url, lambda: _submit_once(api, job_id, command, runtime_env))
    print(f"submitted {kind} job {job_id} to {url}: {command}", file=out, flush=True)
    later = lambda verb: ray_job(verb, job_id, url, token_file, sent)  # noqa: E731
    if not wait:
        print(f"follow it with: {later('logs --follow')}", file=out)
        return 0
    try:
        info = _follow(api, url, job_id, out)
    except Exception as e:  # the head unreachable for a moment: the job itself may be fine
        why = gist(str(e)) if isinstance(e, SubmitError) else f"{type(e).__name__}: {e}"
        print(f"lost job {job_id} ({why}); it may still run: "
              f"{later('status')}", file=out, flush=True)  # fmt: skip
        return STILL_RUNNING  # submitted: never 2, which says it was not
    except KeyboardInterrupt:
        print(
            f"\nstopped following; job {job_id} goes on. Stop it with: {later('stop')}",
            file=out,
        )
        return 130
    status = _status(info)
    if status not in TERMINAL:
        print(f"job {job_id}: still {status}, but its log stream keeps closing; stopped "
              f"following it. Check it with: {later('status')}",
              file=out, flush=True)  # fmt: skip
        return STILL_RUNNING
    line = f"job {job_id}: {status}"
    if status != "SUCCEEDED" and info.message:
        line += f" ({info.message.strip().splitlines()[-1]})"
    print(line, file=out, flush=True)
    return 0 if status == "SUCCEEDED" else 1


def _submit_once(api, job_id: str, command: str, runtime_env: dict, tries: int = 3) -> None:
    """Submit, trying again after a server error (a busy head); the fixed id keeps it once."""
    for attempt in range(tries):
        try:
            api.submit_job(entrypoint=command, runtime_env=runtime_env, submission_id=job_id)
            return
        except RuntimeError as e:
            if attempt > 0 and "already exists" in str(e):
                return  # an earlier try reached the head after all
            if attempt == tries - 1 or "status code 5" not in str(e):
                raise
            time.sleep(2 * (attempt + 1))


def _follow(api, url: str, job_id: str, out: TextIO):
    """Stream the job's log until the job ends; returns its last info. A stream that ends
    while the job runs on (an idle proxy, tunnel or port-forward closed it) is opened
    again, up to `REATTACH` times in a row without a new line."""
    seen, idle = [0], 0  # characters of the log written so far, kept through a dropped stream
    while True:
        before = seen[0]
        try:
            asyncio.run(_stream(api, job_id, out, seen))
        except Exception as e:  # a connection dropped mid-stream: opened again, as a closed one
            print(f"(the log stream dropped: {type(e).__name__}: {e}; opening it again)",
                  file=sys.stderr, flush=True)  # fmt: skip
        idle = idle + 1 if seen[0] <= before else 0
        info = call(url, lambda: api.get_job_info(job_id))
        for _ in range(SETTLE):
            if _status(info) in TERMINAL:
                return info
            time.sleep(POLL_S)
            info = call(url, lambda: api.get_job_info(job_id))
        if idle >= REATTACH:
            return info


async def _stream(api, job_id: str, out: TextIO, seen: list[int]) -> None:
    """Write the job's log past its first ``seen[0]`` characters, which earlier streams
    wrote (each stream starts at the top), counting in ``seen`` what it writes as it goes."""
    read = 0
    async for lines in api.tail_job_logs(job_id):
        new = lines[max(0, seen[0] - read) :]
        read += len(lines)
        if new:
            out.write(new)
            out.flush()
            seen[0] = read


def _status(info) -> str:
    return str(getattr(info.status, "value", info.status))


def _repo_root() -> Path:
    """The source checkout raypipe runs from (it holds jobs/ and configs); an installed
    raypipe has none, and the folder to ship is the user's to name."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise ValueError("raypipe is installed, not run from its source checkout: pass "
                         "--working-dir, the folder to ship with the job (it must hold the config)")  # fmt: skip
    return root
