"""The Ray job entry points in jobs/ (what ``ray job submit`` runs) stop a Ray they start,
as ``raypipe run`` does; Ray's start and stop are faked here, nothing starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _job(name: str):
    spec = importlib.util.spec_from_file_location(f"jobs_{name}", ROOT / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fails", [False, True])
@pytest.mark.parametrize("running", [False, True])
def test_train_lm_stops_the_ray_it_started(monkeypatch, capsys, fails, running):
    """A Ray started by the script is shut down (`localray.shutdown`, which also kills
    leftover workers by pid) when training ends or fails; one already there is left alone."""
    calls = []
    train_lm = _job("train_lm")
    monkeypatch.setattr("ray.is_initialized", lambda: running or bool(calls))
    monkeypatch.setattr("raypipe.localnode.ensure", lambda: calls.append("start"))
    monkeypatch.setattr("raypipe.cli.localray.shutdown", lambda: calls.append("stop"))

    def run(config, epochs=None):
        calls.append("run")
        if fails:
            raise RuntimeError("training failed")
        metrics = {"first_loss": 5.0, "loss": 2.0, "epoch": 0, "tokens_per_s": 10.0}
        return SimpleNamespace(metrics=metrics)

    monkeypatch.setattr(train_lm, "run", run)
    if fails:
        with pytest.raises(RuntimeError, match="training failed"):
            train_lm.main(["lm.yaml"])
    else:
        assert train_lm.main(["lm.yaml"]) == 0
        assert "loss 5.000 → 2.000" in capsys.readouterr().out
    assert calls == ["start", "run"] + ["stop"] * (not running)
