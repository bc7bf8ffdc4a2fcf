"""Real Ray Train DDP: the demo classifier on digits, 2 workers on CPU."""

from __future__ import annotations

import pydoc

import pytest
import yaml

import raypipe
from raypipe import PipelineConfig, train_ddp
from raypipe.cli.classify import run
from raypipe.cli.demo import write_digits


def test_help_shows_the_contract():
    text = pydoc.render_doc(raypipe, renderer=pydoc.plaintext)
    for name in ("PipelineConfig", "build_dataset", "iter_torch_batches", "train_ddp"):
        assert name in text
    assert raypipe.__all__ == sorted(raypipe.__all__)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    write_digits(root)
    return root / "digits"


@pytest.mark.slow
def test_demo_training_reaches_90_percent(ray_session, digits, tmp_path):
    with open("jobs/configs/digits.yaml") as f:
        cfg = yaml.safe_load(f)
    cfg["data"]["source"] = str(digits / "train")
    cfg["eval"]["source"] = str(digits / "val")
    cfg["trainer"]["epochs"] = 3
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = run(path, storage_path=str(tmp_path / "runs"))
    m = result.metrics
    assert m["epoch"] == 2
    assert m["val_accuracy"] > 0.9, m
    # equal batches: 1438 train samples, 2 ranks of 32 -> 22 full steps each
    assert m["steps_per_rank"] == 1438 // 2 // 32
    assert m["samples"] == 2 * 22 * 32
    assert result.checkpoint is not None


# Equal, exactly-once batches inside real Train workers over two epochs, a worker dying on
# the way: tests/data/test_elastic.py::test_a_dead_train_worker_restarts_the_group_and_...


def test_batch_larger_than_a_rank_share_is_refused(datasets):
    config = PipelineConfig(source=str(datasets["parquet"]), batch_size=40)
    with pytest.raises(ValueError, match="larger than one rank's share"):
        train_ddp(config, lambda ctx: None, num_workers=2)
