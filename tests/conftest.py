"""Shared fixtures: one local Ray per test session, and datasets the tests generate."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import signal
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

# raypipe's own local Ray (raypipe.localnode) listens on 127.0.0.1 with nothing set; the
# `ray start` heads and the drivers that call ray.init themselves (they inherit this) need
# Ray's switch for that. tests/cli/test_loopback.py runs raypipe without it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray Train's controller looks at its workers every 2 s by Ray's default, and a run waits
# for a look at each step of its start, checkpoints and end. `raypipe run` sets 0.5 s on
# the local Ray it starts (`raypipe.cli.localray`); the tests' trainers on the heads and
# clusters they start, and those that start before the session's Ray, get it here. A
# run's outcome does not depend on it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


def pytest_runtest_logstart(nodeid, location):
    """With ``RAYPIPE_TEST_CURRENT`` set (``make test``), the test now running, in that
    file: a run whose process dies without a summary (`.ci/ray-logs`) still names it."""
    if path := os.environ.get("RAYPIPE_TEST_CURRENT"):
        Path(path).write_text(nodeid + "\n")


def stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    """Stop a ``ray start --block`` started with ``start_new_session=True``, by its pid:
    SIGTERM (it stops its node), SIGKILL after ``grace_s``, then SIGKILL to what is left
    of its process group (its group id is its pid)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def _collect_cycles(request):
    """After a test on the session's Ray, collect reference cycles: a Ray Data execution
    that a test drives itself (``build_dataset(...).materialize()``) and that fails leaves
    its pool actors, and their CPUs, in reference cycles until Python's cycle collector
    runs, and a later test may need those CPUs (raypipe's own iterators collect them:
    `raypipe.loader.errors.collect_failed`)."""
    yield
    if "ray_session" in request.fixturenames:
        gc.collect()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session: starting Ray is slow on two cores."""
    import ray

    from raypipe.cli import localray

    localray.start(  # raypipe's own local Ray, as `raypipe run` starts it
        "local",  # never join a head another test or process started
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=1 << 30,
        log_to_driver=False,
        configure_logging=False,
    )
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    localray.shutdown()  # and any worker that outlives its raylet, by pid


def checks_jpeg(size: tuple[int, int]) -> bytes:
    """A width×height JPEG of 1-pixel black and white checks (quality 100, no chroma
    subsampling): what a resize without a low-pass turns into moiré."""
    y, x = np.mgrid[: size[1], : size[0]]
    checks = np.where((x + y) % 2 == 0, 255, 0).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.repeat(checks[:, :, None], 3, axis=2)).save(
        buf, format="JPEG", quality=100, subsampling=0
    )
    return buf.getvalue()


def image_bytes(rng: np.random.Generator, fmt: str = "JPEG", size=(24, 20)) -> bytes:
    """A small random image: smooth enough that JPEG keeps it recognisable."""
    w, h = size
    base = rng.integers(0, 256, (h // 4 + 1, w // 4 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((w, h), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def make_imagefolder(root: Path, counts: dict[str, int], *, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for cls, n in counts.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            fmt = "PNG" if i % 3 == 0 else "JPEG"
            ext = "png" if fmt == "PNG" else "jpg"
            (root / cls / f"{i:04d}.{ext}").write_bytes(image_bytes(rng, fmt))
    return root


def make_webdataset(root: Path, shard_sizes: list[int], *, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for s, n in enumerate(shard_sizes):
        with tarfile.open(root / f"train-{s:05d}.tar", "w") as tar:
            for i in range(n):
                stem = f"s{s:03d}_{i:05d}"
                for ext, data in (("jpg", image_bytes(rng)), ("cls", str(i % 5).encode())):
                    info = tarfile.TarInfo(f"{stem}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return root


def make_parquet(root: Path, file_sizes: list[int], *, seed: int = 0) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for f, n in enumerate(file_sizes):
        table = pa.table(
            {
                "image": pa.array([image_bytes(rng) for _ in range(n)], pa.binary()),
                "label": pa.array([i % 7 for i in range(n)], pa.int64()),
            }
        )
        pq.write_table(table, root / f"part-{f:05d}.parquet", row_group_size=8)
    return root


# Odd sizes on purpose: totals and shard sizes that no batch size divides.
FORMAT_SIZES = {
    "imagefolder": {"cat": 23, "dog": 19, "emu": 19},  # 61 samples
    "webdataset": [17, 23, 9, 12],  # 61 samples
    "parquet": [31, 20, 10],  # 61 samples
}


@pytest.fixture(scope="session")
def datasets(tmp_path_factory) -> dict[str, Path]:
    """One small dataset per format, 61 samples each."""
    root = tmp_path_factory.mktemp("data")
    return {
        "imagefolder": make_imagefolder(root / "folder", FORMAT_SIZES["imagefolder"]),
        "webdataset": make_webdataset(root / "wds", FORMAT_SIZES["webdataset"]),
        "parquet": make_parquet(root / "pq", FORMAT_SIZES["parquet"]),
    }
