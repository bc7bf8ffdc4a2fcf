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
import subprocess
import sys
import tempfile
from pathlib import Path

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
