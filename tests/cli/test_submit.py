"""`raypipe submit` without a head: which URL gets the local token, what a closed log
stream does, which address it takes and what its help says (fake clients, no Ray, no
server)."""

from __future__ import annotations

import contextlib
import http.server
import io
import os
import re
import threading
import time
from types import SimpleNamespace

import pytest
import requests

from raypipe.cli import jobapi
from raypipe.cli import submit as sub
from raypipe.cli.parser import build_parser


@pytest.fixture
def local_token(monkeypatch):
    """A token Ray would find on this machine (``~/.ray/auth_token``), RAY_AUTH_* unset."""
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    loader = SimpleNamespace(has_token=lambda **kw: True, get_raw_token=lambda **kw: "local")
    monkeypatch.setattr("raypipe.rayapi.auth_token_loader", lambda: loader)


def _headers(monkeypatch, url: str, token_file=None) -> dict | None:
    """The headers `raypipe.cli.jobapi.client` gives Ray's client for ``url``."""
    seen = {}

    def client(address, headers=None):
        seen["headers"] = headers
        return SimpleNamespace()

    monkeypatch.setattr("ray.job_submission.JobSubmissionClient", client)
    jobapi.client(url, jobapi.token(token_file, url))
    return seen["headers"]


@pytest.mark.parametrize("url", ["http://127.0.0.1:8265", "http://localhost:8265",
                                 "http://[::1]:8265", "https://127.0.0.1:8443"])  # fmt: skip
def test_the_local_token_goes_to_a_head_on_this_machine(monkeypatch, local_token, url):
    assert _headers(monkeypatch, url) == {"Authorization": "Bearer local"}


@pytest.mark.parametrize("url", ["http://203.0.113.9:8265", "http://head.example.com:8265",
                                 "https://head.example.com"])  # fmt: skip
def test_the_local_token_never_goes_to_another_host_unless_asked(monkeypatch, local_token, url,
                                                                  tmp_path):  # fmt: skip
    """Not over https either: TLS keeps the token from the road, not from a mistyped or
    foreign head that the address names."""
    assert _headers(monkeypatch, url) is None
    token = tmp_path / "head.token"
    token.write_text("theirs\n")  # asked for: sent
    assert _headers(monkeypatch, url, token) == {"Authorization": "Bearer theirs"}
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # Ray's client adds its token itself
    assert _headers(monkeypatch, url) is None


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A loopback server that notes each request (path, Authorization) and answers 404."""

    def do_GET(self):
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _listening():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_the_head_asked_is_the_one_named_whatever_rays_variables_say(monkeypatch, local_token):
    """Ray's client took RAY_API_SERVER_ADDRESS or RAY_ADDRESS over the address it was
    given: `--address` and the token sent to a loopback head went to the variable's head
    (raypipe chose the token for the address, Ray sent it elsewhere). A bare host:port there
    (a GCS address) made Ray's client look the dashboard up for ~40 s, then a traceback."""
    with _listening() as named, _listening() as elsewhere:
        url = f"http://127.0.0.1:{named.server_port}"
        for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
            monkeypatch.setenv(var, f"http://127.0.0.1:{elsewhere.server_port}")
            with pytest.raises(jobapi.SubmitError, match=f"at {url}"):
                jobapi.client(url, jobapi.token(None, url))
            assert os.environ[var] == f"http://127.0.0.1:{elsewhere.server_port}"  # put back
            monkeypatch.delenv(var)
        assert elsewhere.seen == [] and named.seen == [("/api/version", "Bearer local")] * 2
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{named.server_port}")
        started = time.monotonic()
        with pytest.raises(jobapi.SubmitError, match="cannot reach a Ray job API|failed"):
            url = jobapi.job_address(None)
            jobapi.client(url, jobapi.token(None, url))
        assert time.monotonic() - started < 10 and len(named.seen) == 3


def test_the_ray_job_commands_printed_carry_the_token_sent(monkeypatch, local_token, tmp_path):
    """A token head refuses Ray's CLI without RAY_AUTH_MODE=token: the follow-up commands
    printed after a submission failed there with 401. Ray's CLI also takes
    RAY_API_SERVER_ADDRESS or RAY_ADDRESS over --address: a command that carries a token
    names its head in RAY_API_SERVER_ADDRESS, or the token would go to theirs."""
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    here, there = "http://127.0.0.1:8265", "http://head.example.com:8265"
    pin = f"RAY_API_SERVER_ADDRESS={here} "
    assert jobapi.ray_job("stop", "j1", here, None, jobapi.token(None, here)) == (
        f"{pin}RAY_AUTH_MODE=token ray job stop j1 --address {here}"
    )
    assert (
        jobapi.ray_job("stop", "j1", there, None, jobapi.token(None, there))
        == f"ray job stop j1 --address {there}"
    )
    token = tmp_path / "head token"
    token.write_text("theirs\n")
    carried = (
        f"RAY_API_SERVER_ADDRESS={there} RAY_AUTH_MODE=token "
        f"RAY_AUTH_TOKEN_PATH='{token}' ray job status j1 --address {there}"
    )
    assert jobapi.ray_job("status", "j1", there, token, jobapi.token(token, there)) == carried
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # --token-file's token still: the client sent it
    assert jobapi.ray_job("status", "j1", there, token, jobapi.token(token, there)) == carried
    assert jobapi.ray_job("status", "j1", there, None, jobapi.token(None, there)) == (
        f"RAY_API_SERVER_ADDRESS={there} ray job status j1 --address {there}"
    )
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_ADDRESS", "http://10.0.0.9:8265")  # Ray's CLI would go there
    assert jobapi.ray_job("stop", "j1", there, None, jobapi.token(None, there)) == (
        f"RAY_API_SERVER_ADDRESS={there} ray job stop j1 --address {there}"
    )
    for mode in ("token", "disabled"):  # the line printed names a path, never the token
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
        assert "theirs" not in jobapi.ray_job("status", "j1", there, token,
                                              jobapi.token(token, there))  # fmt: skip


class FakeClient:
    """Ray's JobSubmissionClient as a head answers it: each ``tail_job_logs`` replays the
    log from the top (chunks from ``streams``, one list per stream) and then closes
    normally; the job runs until the last stream has been read."""

    def __init__(self, streams: list[list[str]]):
        self.streams, self.opened = streams, 0

    def submit_job(self, **kwargs):
        self.kwargs = kwargs

    async def tail_job_logs(self, job_id):
        chunks = self.streams[min(self.opened, len(self.streams) - 1)]
        self.opened += 1
        for chunk in chunks:
            yield chunk

    def get_job_info(self, job_id):
        done = self.opened >= len(self.streams)
        status = "SUCCEEDED" if done else "RUNNING"
        return SimpleNamespace(status=status, message="Job is currently running.")


def _submit(monkeypatch, tmp_path, client: FakeClient) -> tuple[int, str]:
    monkeypatch.setattr(sub, "client", lambda url, token_file: client)
    monkeypatch.setattr(sub, "time", SimpleNamespace(sleep=lambda s: None))  # no polling waits
    (tmp_path / "run.yaml").write_text("data:\n  source: .\n")
    out = io.StringIO()
    code = sub.submit(tmp_path / "run.yaml", working_dir=tmp_path, address=jobapi.DEFAULT_ADDRESS,
                      out=out)  # fmt: skip
    return code, out.getvalue()


def test_a_closed_log_stream_is_opened_again_without_repeating_lines(monkeypatch, tmp_path):
    """An idle tunnel or proxy closes the stream after epoch 0; the job goes on."""
    client = FakeClient([["epoch 0\n"], ["epoch 0\n", "epoch 1\n", "done\n"]])
    code, out = _submit(monkeypatch, tmp_path, client)
    assert code == 0 and client.opened == 2
    assert out.count("epoch 0") == 1 and out.count("epoch 1") == 1
    assert out.rstrip().endswith(": SUCCEEDED")


def test_a_dropped_log_stream_is_opened_again_without_repeating_lines(monkeypatch, tmp_path):
    """A connection reset mid-stream (not a clean close): the lines written before it are
    not written again (the count of them was lost with the stream)."""

    class Dropping(FakeClient):
        async def tail_job_logs(self, job_id):
            self.opened += 1
            yield "line 1\n"
            yield "line 2\n"
            if self.opened == 1:
                raise ConnectionResetError("reset by peer")
            yield "line 3\n"

        def get_job_info(self, job_id):
            status = "SUCCEEDED" if self.opened >= 2 else "RUNNING"
            return SimpleNamespace(status=status, message="")

    client = Dropping([[]])
    code, out = _submit(monkeypatch, tmp_path, client)
    assert code == 0 and client.opened == 2
    assert out.count("line 1") == out.count("line 2") == out.count("line 3") == 1, out


def test_a_job_still_running_after_the_stream_keeps_closing_exits_3(monkeypatch, tmp_path):
    client = FakeClient([["epoch 0\n"]] * 100)
    code, out = _submit(monkeypatch, tmp_path, client)
    job_id = client.kwargs["submission_id"]
    assert code == 3, out  # the old code: 1, as if the job had failed
    assert code == sub.STILL_RUNNING and client.opened == 1 + sub.REATTACH
    assert out.count("epoch 0") == 1
    assert f"ray job status {job_id} --address {jobapi.DEFAULT_ADDRESS}" in out.splitlines()[-1]
    assert re.fullmatch(r"raypipe_train_[0-9a-f]{12}", job_id)  # what --help says


def test_the_job_api_address_is_rays_job_cli_order(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # `raypipe run`'s GCS address
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:8266")
    assert jobapi.job_address(None) == "http://127.0.0.1:8266"
    assert jobapi.job_address("http://10.0.0.2:8265") == "http://10.0.0.2:8265"
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS")
    assert jobapi.job_address(None) == "http://127.0.0.1:6379"


@pytest.mark.parametrize("port,what", [(6379, "GCS"), (10001, "Ray Client")])
def test_a_gcs_or_client_port_is_named_in_the_error(port, what):
    def refused():
        raise requests.exceptions.ConnectionError("bad HTTP/2 preface")

    def failed():
        raise RuntimeError("Version check returned 404")

    for call in (refused, failed):
        with pytest.raises(jobapi.SubmitError) as e:
            jobapi.call(f"http://127.0.0.1:{port}", call)
        assert f"{port} is Ray's {what} port" in str(e.value) and "(8265)" in str(e.value)
    with pytest.raises(jobapi.SubmitError, match="is a head running there") as e:
        jobapi.call("http://127.0.0.1:8265", refused)
    # the head it suggests keeps every server on loopback (docs/security.md), not only the
    # dashboard: without the variable Ray binds the others to the machine's address
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --dashboard-host=127.0.0.1" in (
        str(e.value)
    )


def test_submit_help_says_what_the_code_does():
    (submit,) = [action.choices["submit"] for action in build_parser()._actions if action.choices]
    text = " ".join(submit.format_help().split())
    assert "Ray picks" not in text and "raypipe_{train|convert}_" in text
    assert "sent only to a head on this machine (a loopback address)" in text
    assert "3 when it was submitted but its end was not seen here" in text
    assert "130 when you stopped following it" in text and "RAY_API_SERVER_ADDRESS" in text


def test_secrets_in_the_working_dir_never_travel_with_a_job(tmp_path):
    """The job package is the working dir less `submit.EXCLUDES`, as Ray matches them: a CA
    key, a PEM file or a token left in the checkout stays behind; the code goes."""
    from ray._private.runtime_env.packaging import _get_excludes

    from raypipe.cli import submit

    secret = ("ca.key", "certs/node.key", "tls.pem", "auth_token", ".env", ".env.local",
              ".aws/credentials", ".ssh/id_ed25519", "id_rsa", ".netrc", ".git-credentials",
              ".config/gcloud/application_default_credentials.json", "venv/lib/libtorch.so",
              "wandb/run-1/files/config.yaml")  # fmt: skip
    kept = ("train.py", "ca.crt", "jobs/configs/run.yaml", "environment.yml", "src/env.py")
    for name in secret + kept:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    excluded = _get_excludes(tmp_path, list(submit.EXCLUDES))
    assert [p for p in secret if not excluded(tmp_path / p)] == []
    assert [p for p in kept if excluded(tmp_path / p)] == []


def test_an_installed_raypipe_asks_which_folder_to_ship(monkeypatch, tmp_path):
    """Outside a source checkout the working dir was the current folder (a home folder
    went whole, data and secrets with it): it must be named."""
    monkeypatch.setattr(sub, "__file__", str(tmp_path / "site-packages/raypipe/cli/submit.py"))
    (tmp_path / "run.yaml").write_text("data:\n  source: .\n")
    with pytest.raises(ValueError, match="pass --working-dir, the folder to ship"):
        sub.submit(tmp_path / "run.yaml", address=jobapi.DEFAULT_ADDRESS)


def test_a_job_whose_status_cannot_be_read_after_submission_exits_3(monkeypatch, tmp_path):
    """Submitted, then the head unreachable for the status: 3 (its end not seen), never 2
    (not submitted), which a wrapper could take as a cue to submit it again."""

    class Unreachable(FakeClient):
        def get_job_info(self, job_id):
            raise requests.exceptions.ConnectionError("connection reset")

    client = Unreachable([["epoch 0\n"]])
    code, out = _submit(monkeypatch, tmp_path, client)
    assert code == sub.STILL_RUNNING == 3 and "submission_id" in client.kwargs
    assert "it may still run: " in out and f"ray job status {client.kwargs['submission_id']}" in out


def test_submit_resolves_data_paths_against_its_data_root(monkeypatch, tmp_path):
    client = FakeClient([["done\n"]])
    monkeypatch.setattr(sub, "client", lambda url, token_file: client)
    monkeypatch.setattr(sub, "time", SimpleNamespace(sleep=lambda s: None))
    (tmp_path / "run.yaml").write_text("data:\n  source: .\n")
    code = sub.submit(tmp_path / "run.yaml", working_dir=tmp_path, data_root="/shared/data",
                      address=jobapi.DEFAULT_ADDRESS, out=io.StringIO())  # fmt: skip
    assert code == 0 and client.kwargs["entrypoint"].endswith("--data-root /shared/data")


def test_a_relative_cache_dir_is_checked_where_the_job_finds_it(monkeypatch, tmp_path):
    """A disk cache's relative ``cache_dir`` is joined onto ``--data-root``, as ``source``
    is (docs/jobs.md): the check before the job read it unjoined and refused it as
    relative, for `raypipe submit` and `raypipe run` alike."""
    from raypipe.cli import jobspec

    client = FakeClient([["done\n"]])
    monkeypatch.setattr(sub, "client", lambda url, token_file: client)
    monkeypatch.setattr(sub, "time", SimpleNamespace(sleep=lambda s: None))
    (tmp_path / "run.yaml").write_text("data:\n  source: .\n  cache: disk\n  cache_dir: c\n")
    code = sub.submit(tmp_path / "run.yaml", working_dir=tmp_path, data_root=tmp_path,
                      address=jobapi.DEFAULT_ADDRESS, out=io.StringIO())  # fmt: skip
    assert code == 0 and client.kwargs["entrypoint"].endswith(f"--data-root {tmp_path}")
    assert jobspec.check(tmp_path / "run.yaml", tmp_path) == "train"
    assert jobspec.resolve_paths(tmp_path / "run.yaml", tmp_path)["data"]["cache_dir"] == str(
        tmp_path / "c"
    )
    (tmp_path / "c").write_text("a file")  # what the job would find there is checked
    with pytest.raises(ValueError, match=r"cache_dir=.*/c'.* is not a directory"):
        jobspec.check(tmp_path / "run.yaml", tmp_path)
