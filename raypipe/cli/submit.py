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
import os
import shlex
import sys
import time
import uuid
from pathlib import Path
from typing import TextIO
from urllib.parse import urlparse

from raypipe.cli import jobspec
from raypipe.cli.quiet import QUIET_ENV

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
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
WRONG_PORTS = {6379: "GCS", 10001: "Ray Client"}  # what `raypipe run --address` takes


class SubmitError(RuntimeError):
    """The head could not be reached, refused the job, or the job did not succeed."""


def job_address(address: str | None) -> str:
    """The job API URL: ``address``, else ``RAY_API_SERVER_ADDRESS``, else ``RAY_ADDRESS``
    (the order of Ray's job CLI), else the local default."""
    env = os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS")
    url = address or env or DEFAULT_ADDRESS
    if "://" not in url:
        url = f"http://{url}"
    parsed = urlparse(url)
    try:
        port = parsed.port
    except ValueError:
        port = -1
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port == -1:
        raise ValueError(
            f"address={url!r} is not a job API URL like {DEFAULT_ADDRESS} "
            "(the head's dashboard, not its GCS port)"
        )
    return url.rstrip("/")


def entrypoint(config: Path, working_dir: Path, data_root: Path, verbose: bool = False,
               python: str = "python") -> tuple[str, str]:  # fmt: skip
    """The job's command and the config's kind; the config must be inside the working dir.
    ``python``: the head's (this one's, where the head is on this machine: `submit`)."""
    kind = jobspec.check(config)
    try:
        rel = config.resolve().relative_to(working_dir.resolve())
    except ValueError:
        raise ValueError(
            f"config {str(config)!r} is outside the working dir {str(working_dir)!r} that is "
            "shipped to the cluster: move it there or pass --working-dir"
        ) from None
    args = [python, "-m", "raypipe", ENTRY[kind], rel.as_posix()]
    args += ["--data-root", os.path.abspath(data_root)] + ["--verbose"] * verbose  # as given
    return shlex.join(args), kind


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
) -> int:
    """Submit ``config`` as a Ray job; with ``wait``, stream its log and return its exit code.
    Unless ``verbose``, the job's Ray processes print only what matters (`raypipe.cli.quiet`)."""
    out = out or sys.stdout
    config = Path(config)
    working_dir = Path(working_dir) if working_dir else _repo_root()
    if not working_dir.is_dir():
        raise ValueError(f"working dir {str(working_dir)!r} is not a directory")
    url = job_address(address)  # a head on this machine runs this Python, venv or not
    python = sys.executable if _loopback(url) and sys.executable else "python"
    command, kind = entrypoint(config, working_dir, Path(data_root), verbose, python)
    client = _client(url, token_file)
    runtime_env = {"working_dir": str(working_dir), "excludes": list(EXCLUDES)}
    if not verbose:
        runtime_env["env_vars"] = dict(QUIET_ENV)
    job_id = submission_id or f"raypipe_{kind}_{uuid.uuid4().hex[:12]}"
    _call(url, lambda: _submit_once(client, job_id, command, runtime_env))
    print(f"submitted {kind} job {job_id} to {url}: {command}", file=out, flush=True)
    if not wait:
        print(f"follow it with: ray job logs --follow {job_id} --address {url}", file=out)
        return 0
    try:
        info = _follow(client, url, job_id, out)
    except Exception as e:  # the head unreachable for a moment: the job itself may be fine
        why = _gist(str(e)) if isinstance(e, SubmitError) else f"{type(e).__name__}: {e}"
        print(f"lost job {job_id} ({why}); it may still run: ray job status {job_id} "
              f"--address {url}", file=out, flush=True)  # fmt: skip
        return STILL_RUNNING  # submitted: never 2, which says it was not
    except KeyboardInterrupt:
        print(
            f"\nstopped following; job {job_id} goes on. Stop it with: "
            f"ray job stop {job_id} --address {url}",
            file=out,
        )
        return 130
    status = _status(info)
    if status not in TERMINAL:
        print(f"job {job_id}: still {status}, but its log stream keeps closing; stopped "
              f"following it. Check it with: ray job status {job_id} --address {url}",
              file=out, flush=True)  # fmt: skip
        return STILL_RUNNING
    line = f"job {job_id}: {status}"
    if status != "SUCCEEDED" and info.message:
        line += f" ({info.message.strip().splitlines()[-1]})"
    print(line, file=out, flush=True)
    return 0 if status == "SUCCEEDED" else 1


def _submit_once(client, job_id: str, command: str, runtime_env: dict, tries: int = 3) -> None:
    """Submit, trying again after a server error (a busy head); the fixed id keeps it once."""
    for attempt in range(tries):
        try:
            client.submit_job(entrypoint=command, runtime_env=runtime_env, submission_id=job_id)
            return
        except RuntimeError as e:
            if attempt > 0 and "already exists" in str(e):
                return  # an earlier try reached the head after all
            if attempt == tries - 1 or "status code 5" not in str(e):
                raise
            time.sleep(2 * (attempt + 1))


def _follow(client, url: str, job_id: str, out: TextIO):
    """Stream the job's log until the job ends; returns its last info. A stream that ends
    while the job runs on (an idle proxy, tunnel or port-forward closed it) is opened
    again, up to `REATTACH` times in a row without a new line."""
    seen, idle = [0], 0  # characters of the log written so far, kept through a dropped stream
    while True:
        before = seen[0]
        try:
            asyncio.run(_stream(client, job_id, out, seen))
        except Exception as e:  # a connection dropped mid-stream: opened again, as a closed one
            print(f"(the log stream dropped: {type(e).__name__}: {e}; opening it again)",
                  file=sys.stderr, flush=True)  # fmt: skip
        idle = idle + 1 if seen[0] <= before else 0
        info = _call(url, lambda: client.get_job_info(job_id))
        for _ in range(SETTLE):
            if _status(info) in TERMINAL:
                return info
            time.sleep(POLL_S)
            info = _call(url, lambda: client.get_job_info(job_id))
        if idle >= REATTACH:
            return info


async def _stream(client, job_id: str, out: TextIO, seen: list[int]) -> None:
    """Write the job's log past its first ``seen[0]`` characters, which earlier streams
    wrote (each stream starts at the top), counting in ``seen`` what it writes as it goes."""
    read = 0
    async for lines in client.tail_job_logs(job_id):
        new = lines[max(0, seen[0] - read) :]
        read += len(lines)
        if new:
            out.write(new)
            out.flush()
            seen[0] = read


def _status(info) -> str:
    return str(getattr(info.status, "value", info.status))


def _client(url: str, token_file: str | Path | None):
    from ray.job_submission import JobSubmissionClient

    token = _token(token_file, url)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return _call(url, lambda: JobSubmissionClient(url, headers=headers))


def _token(token_file: str | Path | None, url: str) -> str | None:
    """The auth token to send: ``token_file``'s, else the one Ray itself would use.

    With ``RAY_AUTH_MODE`` set, Ray's client decides alone (``token``: it sends
    ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``; ``disabled``:
    nothing). Unset, the token Ray finds here, if any, goes to a head on this machine
    (a loopback URL) only: a head elsewhere, https or not, gets it only when asked for
    (``--token-file``), so a mistyped or foreign address never receives it.
    """
    if token_file is not None:
        path = Path(token_file).expanduser()
        if not path.is_file():
            raise ValueError(f"token file {str(path)!r} not found")
        return path.read_text().strip()
    if os.environ.get("RAY_AUTH_MODE") or not _loopback(url):
        return None
    from raypipe import rayapi

    loader = rayapi.auth_token_loader()
    if not loader.has_token(ignore_auth_mode=True):
        return None
    return loader.get_raw_token(ignore_auth_mode=True)


def _loopback(url: str) -> bool:
    """Whether ``url`` names a head on this machine."""
    from raypipe.localnode import is_loopback

    return is_loopback(urlparse(url).hostname or "")


def _call(url: str, fn):
    """Run one job API call, turning Ray's connection and auth errors into one clear line."""
    import requests
    from ray.exceptions import AuthenticationError

    try:
        return fn()
    except AuthenticationError as e:
        first = str(e).strip().splitlines()[0]
        raise SubmitError(
            f"the head at {url} refused the request ({first}); it uses token authentication: "
            "pass --token-file, or set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN"
        ) from None
    except (ConnectionError, requests.exceptions.RequestException):
        hint = ": is a head running there? (ray start --head --dashboard-host=127.0.0.1)"
        raise SubmitError(
            f"cannot reach a Ray job API at {url}{_wrong_port(url) or hint}"
        ) from None
    except RuntimeError as e:
        raise SubmitError(
            f"the job API at {url} failed: {_gist(str(e))}{_wrong_port(url)}"
        ) from None


def _wrong_port(url: str) -> str:
    """A hint when ``url`` names Ray's GCS or client port, the address `raypipe run` takes."""
    port = urlparse(url).port
    if port not in WRONG_PORTS:
        return ""
    return (
        f": {port} is Ray's {WRONG_PORTS[port]} port (RAY_ADDRESS for raypipe run), not the "
        "dashboard's job API (8265): pass --address http://HOST:8265 or set "
        "RAY_API_SERVER_ADDRESS"
    )


def _gist(message: str) -> str:
    """One line of an error: the exception line of a server traceback, else the first line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "no message"
    head, _, _ = lines[0].partition("Traceback (most recent call last)")
    if len(lines) > 1 and head != lines[0]:
        return f"{head}{lines[-1]}"
    return lines[0]


def _repo_root() -> Path:
    """The source checkout raypipe runs from (it holds jobs/ and configs); an installed
    raypipe has none, and the folder to ship is the user's to name."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise ValueError("raypipe is installed, not run from its source checkout: pass "
                         "--working-dir, the folder to ship with the job (it must hold the config)")  # fmt: skip
    return root
