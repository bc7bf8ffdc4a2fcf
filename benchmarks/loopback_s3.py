"""moto's S3 server on 127.0.0.1 for the benchmarks, filled with many small objects.

The server runs in a child process started and stopped by its pid, as
``tests/formats/test_storage.py``'s fixture does. That process fills its bucket before it
serves: it puts the objects straight into moto's store, which is fast (10⁵ objects in a
few seconds); the same puts over HTTP run at about 200 a second on the 2-core VM.

    python benchmarks/loopback_s3.py --port P --images N [--classes C] [--tars M]

serves bucket ``raypipe-scale`` with ``images/cCCC/NNNNNNN.jpg`` (an image folder of N
one-byte files in C class folders) and ``tars/NNNNNNN.tar`` (M WebDataset shards of one
sample each).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator

BUCKET = "raypipe-scale"
REGION = "us-east-1"
KEYS = {"access_key": "bench", "secret_key": "bench"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(*, images: int = 0, classes: int = 100, tars: int = 0, latency_ms: float = 0,
                log_path: str = os.devnull) -> Iterator[str]:  # fmt: skip
    """The URL of a filled moto S3 server on loopback, for the ``with`` block; each request
    answered ``latency_ms`` late (a sleep per request, in its own server thread)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--port", str(port), "--images", str(images), "--classes", str(classes),
            "--tars", str(tars), "--latency-ms", str(latency_ms)]  # fmt: skip
    with open(log_path, "wb") as log:
        server = subprocess.Popen([sys.executable, __file__, *args], stdout=log,
                                  stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    urllib.request.urlopen(f"{url}/moto-api/", timeout=2)
                    break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise RuntimeError(f"moto server did not start on {url}") from None
                    time.sleep(0.2)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def storage_options(url: str) -> dict[str, str]:
    """`raypipe.PipelineConfig.storage_options` for the server at ``url``."""
    return {"endpoint_url": url, "region": REGION, **KEYS}


def _tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("000000.jpg", b"x"), ("000000.cls", b"0")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _serve(port: int, images: int, classes: int, tars: int, latency_ms: float = 0) -> None:
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import DomainDispatcherApplication, ThreadedMotoServer

    if latency_ms:
        answer = DomainDispatcherApplication.__call__

        def late(self, environ, start_response):
            time.sleep(latency_ms / 1e3)
            return answer(self, environ, start_response)

        DomainDispatcherApplication.__call__ = late

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    backend.create_bucket(BUCKET, REGION)
    for i in range(images):
        backend.put_object(BUCKET, f"images/c{i % classes:03d}/{i:07d}.jpg", b"x")
    shard = _tar()
    for i in range(tars):
        backend.put_object(BUCKET, f"tars/{i:07d}.tar", shard)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--images", type=int, default=0)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--tars", type=int, default=0)
    p.add_argument("--latency-ms", type=float, default=0)
    a = p.parse_args()
    _serve(a.port, a.images, a.classes, a.tars, a.latency_ms)
