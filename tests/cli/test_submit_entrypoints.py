"""The Ray job entry points in jobs/ (what ``ray job submit`` runs) stop a Ray they start,
as ``raypipe run`` does, when training ends and when it fails, and leave a Ray already
running in their process alone. A real Ray each time: the script's own, started in a
process of its own with its own temporary folder, so that its processes can be told
apart from the test session's Ray by their command lines."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from raypipe.cli.causal_lm import make_tokens

ROOT = Path(__file__).resolve().parents[2]


def _job(name: str):
    spec = importlib.util.spec_from_file_location(f"jobs_{name}", ROOT / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(tmp_path: Path, source: Path) -> Path:
    """The shipped LM config, one small worker, over ``source``."""
    raw = yaml.safe_load((ROOT / "jobs/configs/tokens-lm.yaml").read_text())
    raw["data"]["source"] = str(source)
    raw["trainer"].update(num_workers=1, storage_path=str(tmp_path / "runs"))
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _processes_under(folder: str) -> set[int]:
    """Live processes whose command line names ``folder`` (Ray's session lives there)."""
    found = set()
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and folder.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                found.add(int(name))
        except OSError:
            pass
    return found


def _run_job(config: Path, marker: str) -> tuple[int, str, int, set[int], set[int]]:
    """``python jobs/train_lm.py CONFIG --epochs 1`` with Ray's temporary folder its own:
    its exit code and output, the most of that Ray's processes seen at once while it ran,
    those alive when the first line holding ``marker`` came out (the script's last words,
    its result or its error: by then it has stopped the Ray it started; Ray's own exit
    handler, which runs after, does not count), and those alive once it exited."""
    folder = tempfile.mkdtemp(prefix="rp-job-", dir="/tmp")  # Ray's socket paths stay short
    env = {**os.environ, "RAY_TMPDIR": folder, "PYTHONUNBUFFERED": "1"}
    seen, at_marker, lines = [0], [], []
    proc = subprocess.Popen([sys.executable, "jobs/train_lm.py", str(config), "--epochs", "1"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip

    def watch():
        while proc.poll() is None:
            seen[0] = max(seen[0], len(_processes_under(folder)))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if marker in line and not at_marker:
                at_marker.append(_processes_under(folder))
        proc.wait(timeout=400)
    finally:
        proc.kill()
        watcher.join()
    assert at_marker, f"no line with {marker!r}: {''.join(lines)[-3000:]}"
    return proc.returncode, "".join(lines), seen[0], at_marker[0], _processes_under(folder)


@pytest.mark.slow
def test_train_lm_stops_the_ray_it_started(tmp_path):
    make_tokens(tmp_path / "tokens", documents=120, files=2)
    code, out, seen, at_result, left = _run_job(_config(tmp_path, tmp_path / "tokens"), "loss ")
    assert code == 0, out[-3000:]
    assert re.search(r"loss \d+\.\d+ → \d+\.\d+ over 1 epochs", out), out[-3000:]
    assert seen >= 2, "the job's own Ray (its raylet, GCS, workers) was running"
    assert at_result == set(), f"Ray still ran as the job reported: {sorted(at_result)}"
    assert left == set(), f"the job's Ray left processes behind: {sorted(left)}"


@pytest.mark.slow
def test_train_lm_stops_the_ray_it_started_when_training_fails(tmp_path):
    config = _config(tmp_path, tmp_path / "no-such-corpus")
    code, out, seen, at_error, left = _run_job(config, "train_lm: error:")
    assert code == 2
    assert re.search(r"train_lm: error: .*no-such-corpus", out), out[-3000:]
    assert "Traceback" not in out, "a refused source is one line"
    assert seen >= 2, "Ray had started before the training failed"
    assert at_error == set(), f"Ray still ran as the job failed: {sorted(at_error)}"
    assert left == set(), f"the job's Ray left processes behind: {sorted(left)}"


def test_train_lm_leaves_a_running_ray_alone(ray_session, tmp_path, capsys):
    make_tokens(tmp_path / "tokens", documents=120, files=2)
    train_lm = _job("train_lm")
    before = ray_session.get_runtime_context().get_node_id()
    assert train_lm.main([str(_config(tmp_path, tmp_path / "tokens")), "--epochs", "1"]) == 0
    assert "over 1 epochs" in capsys.readouterr().out
    assert ray_session.is_initialized()
    assert ray_session.get_runtime_context().get_node_id() == before
    assert ray_session.get(ray_session.put(7)) == 7


@pytest.mark.parametrize(
    ("argv", "said"),
    [([], "give a config to train from, or --make-data DIR"),
     (["no-such.yaml"], "config 'no-such.yaml' not found"),
     (["jobs/configs/tokens-lm.yaml", "--epochs", "0"], "--epochs 0: must be >= 1")],
)  # fmt: skip
def test_train_lm_refuses_what_it_cannot_run_before_ray(monkeypatch, capsys, argv, said):
    """Refused by its parser, before `_train` starts Ray: it did nothing and exited 0 with
    no arguments, and a missing config was a traceback after Ray had started."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_:
        _job("train_lm").main(argv)
    assert exit_.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "said"),
    [({"model": {"heads": 3}}, "model.dim=64 must be a multiple of model.heads=3"),
     ({"model": {"layers": 0}}, "model.layers=0 must be an integer >= 1"),
     ({"model": {"vocab_size": "64"}}, "model.vocab_size='64' must be an integer"),
     ({"trainer": 5}, "trainer must be a mapping, not 5")],
)  # fmt: skip
def test_train_lm_refuses_a_bad_model_or_section_before_ray(monkeypatch, capsys, tmp_path,
                                                           change, said):  # fmt: skip
    """Each failed inside the training workers after Ray and training had started (a
    reshape error, an index error), or as a traceback."""
    import yaml

    spec = yaml.safe_load((ROOT / "jobs/configs/tokens-lm.yaml").read_text())
    for section, value in change.items():
        spec[section] = {**spec.get(section, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(spec))
    train_lm = _job("train_lm")

    def no_ray():
        raise AssertionError("Ray started")

    monkeypatch.setattr(train_lm.localnode, "ensure", no_ray)
    assert train_lm.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err
