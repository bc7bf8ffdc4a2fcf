"""Talking to a Ray head's job API for `raypipe.cli.submit`: its URL (`job_address`), the
client and the token it sends (`client`), each call's errors as one line (`call`), and the
``ray job`` commands to run here later (`ray_job`).

Ray's ``JobSubmissionClient`` takes ``RAY_API_SERVER_ADDRESS`` or ``RAY_ADDRESS`` over the
address it is given; `client` makes it with neither set, so that the head it talks to is
the one `job_address` chose and the token goes only where `token` allows.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path
from urllib.parse import urlparse

__all__ = ["DEFAULT_ADDRESS", "SubmitError", "call", "client", "gist", "job_address",
           "loopback", "ray_job", "token"]  # fmt: skip
assert __all__ == sorted(__all__)

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
WRONG_PORTS = {6379: "GCS", 10001: "Ray Client"}  # what `raypipe run --address` takes
ADDRESS_VARS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")  # the order of Ray's job CLI


class SubmitError(RuntimeError):
    """The head could not be reached, refused the job, or the job did not succeed."""


def job_address(address: str | None) -> str:
    """The job API URL: ``address``, else ``RAY_API_SERVER_ADDRESS``, else ``RAY_ADDRESS``
    (the order of Ray's job CLI), else the local default."""
    env = next((os.environ[v] for v in ADDRESS_VARS if os.environ.get(v)), None)
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


def client(url: str, sent: str | None):
    """Ray's job client for ``url`` and no other head, sending ``sent`` (`token`'s)."""
    from ray.job_submission import JobSubmissionClient

    headers = {"Authorization": f"Bearer {sent}"} if sent else None
    with _without(ADDRESS_VARS):  # Ray's client would take them over ``url``
        return call(url, lambda: JobSubmissionClient(url, headers=headers))


@contextlib.contextmanager
def _without(names):
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def token(token_file: str | Path | None, url: str) -> str | None:
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
    if os.environ.get("RAY_AUTH_MODE") or not loopback(url):
        return None
    from raypipe import rayapi

    loader = rayapi.auth_token_loader()
    if not loader.has_token(ignore_auth_mode=True):
        return None
    return loader.get_raw_token(ignore_auth_mode=True)


def ray_job(verb: str, job_id: str, url: str, token_file: str | Path | None,
            sent: str | None) -> str:  # fmt: skip
    """``ray job VERB ID --address URL``, to run here later, with the token ``sent``
    (`token`'s; named by its file's path, never itself): Ray's CLI sends one only with
    ``RAY_AUTH_MODE=token``. With a token, or with Ray's address variables set here, the
    command names its head in ``RAY_API_SERVER_ADDRESS`` too: Ray's CLI takes that
    variable, or ``RAY_ADDRESS``, over ``--address``, and would send the token there."""
    auth = "RAY_AUTH_MODE=token " if sent else ""
    if sent and token_file is not None:
        auth += f"RAY_AUTH_TOKEN_PATH={shlex.quote(str(Path(token_file).expanduser().resolve()))} "
    sends = auth or os.environ.get("RAY_AUTH_MODE") == "token"  # else Ray's client's own
    if sends or any(os.environ.get(v) for v in ADDRESS_VARS):
        auth = f"RAY_API_SERVER_ADDRESS={shlex.quote(url)} {auth}"
    return f"{auth}ray job {verb} {job_id} --address {url}"


def loopback(url: str) -> bool:
    """Whether ``url`` names a head on this machine."""
    from raypipe.localnode import is_loopback

    return is_loopback(urlparse(url).hostname or "")


def call(url: str, fn):
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
        hint = (": is a head running there? (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start "
                "--head --dashboard-host=127.0.0.1: all its servers on this machine's loopback)")  # fmt: skip
        raise SubmitError(
            f"cannot reach a Ray job API at {url}{_wrong_port(url) or hint}"
        ) from None
    except RuntimeError as e:
        raise SubmitError(
            f"the job API at {url} failed: {gist(str(e))}{_wrong_port(url)}"
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


def gist(message: str) -> str:
    """One line of an error: the exception line of a server traceback, else the first line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "no message"
    head, _, _ = lines[0].partition("Traceback (most recent call last)")
    if len(lines) > 1 and head != lines[0]:
        return f"{head}{lines[-1]}"
    return lines[0]
