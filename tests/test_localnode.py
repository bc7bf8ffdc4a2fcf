"""`raypipe.localnode`: which addresses start or join a Ray on loopback, Ray's TLS settings
checked before Ray starts, and a two-node Ray with Ray's TLS on (certificates made here)
that runs a Pipeline epoch and refuses a client without the certificate."""

from __future__ import annotations

import builtins
import datetime
import errno
import ipaddress
import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from raypipe import localnode
from tests.conftest import make_imagefolder, stop_group

ROOT = Path(__file__).resolve().parents[1]


def test_the_pinned_ray_is_the_one_it_steers():
    assert localnode.check_ray() is None


@pytest.mark.parametrize(
    "address,loopback",
    [("local", True), ("127.0.0.1:6379", True), ("localhost:6379", True), ("[::1]:6379", True),
     ("10.0.0.5:6379", False), ("head.example:6379", False), ("ray://127.0.0.1:10001", False)],
)  # fmt: skip
def test_which_addresses_are_kept_on_loopback(address, loopback):
    assert localnode._on_loopback(address) is loopback


def test_no_address_follows_ray_address_as_ray_init_does(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no cluster file: a new local Ray
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert localnode._on_loopback(None) is True
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert localnode._on_loopback(None) is False
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert localnode._on_loopback(None) is True


def test_a_cluster_left_in_ray_inits_own_temp_dir_is_what_it_joins(monkeypatch, tmp_path):
    """``ray.init(_temp_dir=D)`` looks for a cluster `ray start` left in D, not in the
    default temp dir: a stale file there named a cluster elsewhere, so `start` skipped the
    loopback switch and raypipe's settings while Ray started a new node on the machine's
    address."""
    import ray

    default, own = tmp_path / "default", tmp_path / "own"
    (default / "ray").mkdir(parents=True)
    own.mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(default))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (default / "ray" / "ray_current_cluster").write_text("10.0.0.5:6379")  # a stale one
    assert localnode._on_loopback(None, str(own)) and localnode._nothing_to_join(str(own))
    seen: dict = {}
    monkeypatch.setattr(ray, "init", lambda address=None, **kw: seen.update(
        kw, address=address, switch=os.environ.get(localnode.CLUSTER_VAR)))  # fmt: skip
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="x"))
    monkeypatch.setattr(localnode, "_STARTED", [])  # the session's Ray stays started here
    monkeypatch.setattr(localnode, "_AUTH_SET", [])
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token file written by this test
    localnode.start(None, _temp_dir=str(own))
    assert seen["switch"] == "0" and "_system_config" in seen, seen
    (own / "ray_current_cluster").write_text("10.0.0.5:6379")  # now D has one to join
    assert not localnode._on_loopback(None, str(own))
    assert not localnode._nothing_to_join(str(own))


def test_ray_address_local_starts_a_new_ray_with_raypipes_settings(monkeypatch, tmp_path):
    """``RAY_ADDRESS=local`` makes ``ray.init()`` start a new Ray: `start` took it for a
    cluster joined, so the token file was not made private, the auth mode not put back,
    `started_here` was False (refusals became waits) and raypipe's settings not applied."""
    import ray

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert localnode._nothing_to_join() and localnode._on_loopback(None)
    seen: dict = {}
    monkeypatch.setattr(ray, "init", lambda address=None, **kw: seen.update(kw, address=address))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="x"))
    monkeypatch.setattr(localnode, "_STARTED", [])
    monkeypatch.setattr(localnode, "_AUTH_SET", [])
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token file written by this test
    localnode.start(None)
    assert "_system_config" in seen and localnode._STARTED == ["x"]  # what started_here reads


def test_started_here_is_the_ray_it_started_not_one_joined_after(monkeypatch):
    import ray

    monkeypatch.setattr(localnode, "_STARTED", ["127.0.0.1:6379"])
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    gcs = SimpleNamespace(gcs_address="127.0.0.1:6379")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: gcs)
    assert localnode.started_here()
    gcs.gcs_address = "10.0.0.5:6379"  # ray.shutdown(), then ray.init("auto") elsewhere
    assert not localnode.started_here()


def test_the_token_a_new_local_ray_uses_is_this_users_alone(monkeypatch, tmp_path, caplog):
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    path = localnode.private_token(tmp_path)
    assert path == tmp_path / ".ray" / "auth_token" and stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # 256 bits, as Ray makes one
    assert localnode.private_token(tmp_path) == path and path.read_text() == token  # kept
    path.chmod(0o644)  # as Ray 2.60 writes it
    with caplog.at_level("WARNING", logger="raypipe.localnode"):
        localnode.private_token(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == token
    assert "could be read by other users" in caplog.text
    path.chmod(0o644)
    caplog.clear()

    def refuse(self, mode):  # a read-only home, a file of root's: Ray still reads it
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(type(path), "chmod", refuse)
    with caplog.at_level("WARNING", logger="raypipe.localnode"):
        assert localnode.private_token(tmp_path) == path  # the local Ray starts all the same
    assert "could not make it 600 (Operation not permitted): chmod 600 it" in caplog.text
    monkeypatch.undo()
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "mine"))  # Ray reads that one
    assert localnode.private_token(tmp_path / "other") is None
    assert not (tmp_path / "other").exists()


TOKEN_RUN = """
import os, stat, sys
from pathlib import Path
import ray
from raypipe import localnode, rayapi
from raypipe.cli import localray
localray.start("local", num_cpus=1, include_dashboard=False, log_to_driver=False)
token = Path.home() / ".ray" / "auth_token"
mode = stat.S_IMODE(token.stat().st_mode)
used = rayapi.auth_token_loader().get_raw_token(ignore_auth_mode=True) == token.read_text()
print("started", oct(mode), used, os.environ.get("RAY_AUTH_MODE"), localnode.started_here())
localray.shutdown()
from ray._raylet import AuthenticationMode, get_authentication_mode
print("after", os.environ.get("RAY_AUTH_MODE"), get_authentication_mode() == AuthenticationMode.TOKEN)
"""


def test_a_local_ray_leaves_its_token_private_and_the_auth_mode_as_it_found_it(tmp_path):
    """Ray 2.60's ``ray.init`` of a new Ray writes ``~/.ray/auth_token`` 0644 (any user of
    the machine could run jobs on the local Ray's job API as this one) and sets
    ``RAY_AUTH_MODE=token`` in the process for good (a cluster it joined next, or a
    job client to a head elsewhere, was sent this machine's token unasked)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}  # fmt: skip
    env["HOME"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", TOKEN_RUN], capture_output=True, text=True,
                          timeout=180, env=env, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith(("started", "after"))]
    assert lines == ["started 0o600 True token True", "after None False"], done.stdout


def make_certificates(folder: Path) -> dict[str, str]:
    """A CA and a certificate for 127.0.0.1 / localhost signed by it, as Ray's TLS reads
    them: ``{RAY_TLS_SERVER_CERT, RAY_TLS_SERVER_KEY, RAY_TLS_CA_CERT: path}``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(name, key, issuer, issuer_key, *, ca, sans=()):
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
             .issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))  # fmt: skip
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "raypipe test CA")])
    ca = cert("raypipe test CA", ca_key, ca_name, ca_key, ca=True)
    sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    node = cert("ray node", key, ca_name, ca_key, ca=False, sans=sans)
    pem = serialization.Encoding.PEM
    files = {
        "RAY_TLS_CA_CERT": ("ca.crt", ca.public_bytes(pem)),
        "RAY_TLS_SERVER_CERT": ("node.crt", node.public_bytes(pem)),
        "RAY_TLS_SERVER_KEY": ("node.key", key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())),
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.values():
        (folder / name).write_bytes(data)
        (folder / name).chmod(0o600)
    return {var: str(folder / name) for var, (name, _) in files.items()}


def test_tls_settings_are_checked_naming_the_file(tmp_path, monkeypatch):
    certs = make_certificates(tmp_path / "certs")
    localnode.check_tls({"RAY_USE_TLS": "0"})  # off: nothing read
    localnode.check_tls({"RAY_USE_TLS": "1", **certs})
    for var in localnode.TLS_FILES:
        missing = {"RAY_USE_TLS": "1", **certs, var: str(tmp_path / "gone.pem")}
        with pytest.raises(ValueError, match=rf"^{var}=.*gone\.pem cannot be read"):
            localnode.check_tls(missing)
        unset = {"RAY_USE_TLS": "true", **{k: v for k, v in certs.items() if k != var}}
        with pytest.raises(ValueError, match=rf"needs {var}, which is not set"):
            localnode.check_tls(unset)
    (tmp_path / "empty.pem").write_bytes(b"")
    with pytest.raises(ValueError, match=r"RAY_TLS_CA_CERT=.*empty\.pem is empty"):
        localnode.check_tls({"RAY_USE_TLS": "1", **certs, "RAY_TLS_CA_CERT": str(tmp_path / "empty.pem")})  # fmt: skip
    key = Path(certs["RAY_TLS_SERVER_KEY"])
    key.chmod(0)
    if os.geteuid() == 0:  # root reads any file: the key is refused as it is to others
        real_open = open

        def refusing(path, *args, **kwargs):
            if str(path) == str(key):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", refusing)
    with pytest.raises(ValueError, match=r"RAY_TLS_SERVER_KEY=.*node\.key cannot be read"):
        localnode.check_tls({"RAY_USE_TLS": "1", **certs})


def test_raypipe_run_with_a_missing_certificate_fails_in_one_line_before_ray(tmp_path):
    folder = make_imagefolder(tmp_path / "imgs", {"a": 2})
    (tmp_path / "run.yaml").write_text(
        f"data:\n  source: {folder}\n  batch_size: 1\ntrainer:\n  epochs: 1\n"
    )
    certs = make_certificates(tmp_path / "certs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(certs, RAY_USE_TLS="1", RAY_TLS_SERVER_CERT=str(tmp_path / "nope.crt"))
    done = subprocess.run([sys.executable, "-m", "raypipe", "run", "run.yaml"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"raypipe run: error: RAY_TLS_SERVER_CERT={tmp_path / 'nope.crt'} cannot be read: "
        "No such file or directory"
    ]
    assert "Started a local Ray instance" not in done.stdout + done.stderr


def test_a_two_node_ray_with_tls_runs_an_epoch_and_refuses_a_client_without_the_certificate(
    tmp_path,
):
    n = 40
    data = make_imagefolder(tmp_path / "imgs", {"a": n // 2, "b": n // 2})
    certs = make_certificates(tmp_path / "certs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    with tempfile.TemporaryDirectory(prefix="rp-tls-", dir="/tmp") as ray_tmp:  # short paths
        env.update(certs, RAY_USE_TLS="1", RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
        log = (tmp_path / "driver.log").open("w+")
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.tls_driver", str(data), str(tmp_path / "out.json")],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=240)
        finally:
            stop_group(proc, grace_s=20)  # the driver and any Ray process left in its group
    log.seek(0)
    assert proc.returncode == 0, log.read()[-5000:]
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["nodes"] == 2
    keys = report["keys"]  # one rank: every key once, less what drop_last leaves (< a batch)
    assert len(keys) == len(set(keys)) and set(keys) <= set(range(n)) and len(keys) > n - 4
    assert report["calls"] == {
        "plain": "UNAVAILABLE",
        "tls_without_certificate": "UNAVAILABLE",
        "tls_with_certificate": "ok",
    }
