"""The language-model job: a small causal LM trained by DDP on packed token rows, its loss
falling; the attention mask keeps tokens inside their segment."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from raypipe.cli.causal_lm import (
    LMConfig,
    TokenIdError,
    check_token_ids,
    lm_loss,
    make_tokens,
    run,
    tiny_lm,
)

ROOT = Path(__file__).resolve().parents[2]


def test_a_token_does_not_see_other_segments():
    import torch

    torch.manual_seed(0)
    model = tiny_lm(vocab_size=16, dim=16, layers=1, heads=2, seq_len=8).eval()
    tokens = torch.randint(0, 16, (1, 8))
    segments = torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 0, 0]])
    changed = tokens.clone()
    changed[0, :3] = (tokens[0, :3] + 1) % 16  # segment 1 only
    a, b = (model(t, segments, positions) for t in (tokens, changed))
    torch.testing.assert_close(a[0, 3:6], b[0, 3:6])  # segment 2 never saw segment 1
    assert not torch.allclose(a[0, :3], b[0, :3])
    assert lm_loss(a, tokens, segments).isfinite()


def test_the_shipped_config_loads():
    cfg = LMConfig.from_yaml(ROOT / "jobs/configs/tokens-lm.yaml")
    assert cfg.data.image_column is None and cfg.data.pack == "tokens"


@pytest.mark.slow
def test_a_causal_lm_on_packed_tokens_learns(ray_session, tmp_path):
    make_tokens(tmp_path / "tokens", documents=400, files=2)
    raw = yaml.safe_load((ROOT / "jobs/configs/tokens-lm.yaml").read_text())
    raw["data"]["source"] = str(tmp_path / "tokens")
    raw["trainer"]["storage_path"] = str(tmp_path / "runs")
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = run(path, epochs=3)
    m = result.metrics
    assert m["epoch"] == 2 and m["steps_per_rank"] > 0
    assert m["loss"] < 0.7 * m["first_loss"] < 0.7 * np.log(64), m
    assert m["dropped_tokens"] < 2 * 16 * 64, "only a tail is dropped"
    # a checkpoint each epoch (the last one only, before: a restart began again from scratch)
    import torch

    saved = torch.load(f"{result.checkpoint.path}/state.pt", weights_only=False)
    assert saved["epoch"] == 2 and {"model", "optimizer"} <= set(saved)
    kept = [p for p in Path(result.checkpoint.path).parent.glob("checkpoint_*") if p.is_dir()]
    assert len(kept) == 2  # three saved, the latest keep_checkpoints=2 kept


def test_token_ids_outside_the_vocabulary_are_named():
    """An id at or past vocab_size (or below 0) failed inside nn.Embedding: "IndexError:
    index out of range in self", no word of vocab_size."""
    import torch

    check_token_ids(torch.tensor([[0, 5, 63]]), 64, "tokens")  # all in range
    check_token_ids(torch.zeros((0, 4), dtype=torch.long), 1, "tokens")  # an empty batch
    with pytest.raises(TokenIdError, match=r"token id 64 in the 'tokens' field .*vocab_size=64"):
        check_token_ids(torch.tensor([[0, 64]]), 64, "tokens")
    with pytest.raises(TokenIdError, match="token id -1 "):
        check_token_ids(torch.tensor([[-1, 3]]), 64, "tokens")


@pytest.mark.slow
def test_a_vocabulary_smaller_than_the_data_stops_the_run_in_one_line(ray_session, tmp_path):
    """The demo corpus holds ids up to 63: with ``vocab_size: 32`` every rank failed with
    an IndexError traceback; the run now raises TokenIdError, which train_lm prints as its
    one error line (exit 2)."""
    make_tokens(tmp_path / "tokens", documents=100, files=1)
    raw = yaml.safe_load((ROOT / "jobs/configs/tokens-lm.yaml").read_text())
    raw["data"]["source"] = str(tmp_path / "tokens")
    raw["trainer"]["storage_path"] = str(tmp_path / "runs")
    raw["model"]["vocab_size"] = 32
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(TokenIdError, match=r"outside model.vocab_size=32 \(ids 0..31\)"):
        run(path, epochs=1)


def test_a_ranks_token_id_error_is_not_logged_with_its_traceback():
    """Each rank logged "Error in training function" with a TokenIdError's traceback
    before the job printed its one line: the rank's filter let only raypipe's data errors
    go quiet."""
    import logging
    import sys

    from raypipe.loader.errors import quiet_data_errors

    logger = logging.getLogger("raypipe.tests.rank_errors")
    quiet_data_errors(logger)
    kept = []
    logger.addHandler(handler := logging.Handler())
    handler.emit = kept.append
    for error in (TokenIdError("token id 63 outside model.vocab_size=32"), IndexError("x")):
        try:
            raise error
        except Exception:
            logger.error("Error in training function", exc_info=sys.exc_info())
    assert [r.exc_info[1].__class__.__name__ for r in kept] == ["IndexError"]


def test_train_lm_prints_a_data_error_in_one_line(monkeypatch, capsys, tmp_path):
    """train_ddp raises a rank's spent skip budget as itself (not inside Ray Train's
    WorkerGroupError), and the job prints it as its one error line, as raypipe run does."""
    import importlib.util

    from raypipe import SkipBudgetError

    spec = importlib.util.spec_from_file_location("train_lm_job", ROOT / "jobs/train_lm.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)

    def spent(config, epochs):
        raise SkipBudgetError("epoch 0: 9 of its 10 samples skipped as bad so far\n(Ray's)", 9)

    monkeypatch.setattr(job, "_train", spent)
    (tmp_path / "lm.yaml").write_text("model: {}\n")
    assert job.main([str(tmp_path / "lm.yaml")]) == 2
    assert capsys.readouterr().err == (
        "train_lm: error: epoch 0: 9 of its 10 samples skipped as bad so far\n"
    )


@pytest.mark.slow
def test_a_resumed_lm_run_keeps_its_first_epochs_loss(ray_session, tmp_path):
    """``first_loss`` (the job's "loss A → B" line) was the first epoch this attempt ran:
    a group restarted under ``max_failures``, or a rerun into the run's folder, reported
    the resumed epoch's loss as the first. It is saved with the checkpoint now."""
    import dataclasses

    from raypipe import train_ddp
    from raypipe.cli.causal_lm import lm_loop

    make_tokens(tmp_path / "tokens", documents=400, files=2)
    raw = yaml.safe_load((ROOT / "jobs/configs/tokens-lm.yaml").read_text())
    raw["data"]["source"] = str(tmp_path / "tokens")
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = LMConfig.from_yaml(path)
    t = cfg.trainer
    kw = dict(num_workers=t.num_workers, cpus_per_worker=t.cpus_per_worker, name="lm",
              storage_path=str(tmp_path / "runs"),
              loop_config={"lr": t.lr, "model": dataclasses.asdict(cfg.model)})  # fmt: skip
    first = train_ddp(cfg.data, lm_loop, epochs=1, **kw).metrics
    again = train_ddp(cfg.data, lm_loop, epochs=2, **kw).metrics  # resumes after epoch 0
    assert again["epoch"] == 1 and again["loss"] != first["loss"]
    assert again["first_loss"] == first["first_loss"] == first["loss"]
