"""Real Ray Train DDP: the demo classifier on digits, 2 workers on CPU."""

from __future__ import annotations

import os
import pydoc
import re
import signal
import threading
import time

import pytest
import yaml

import raypipe
from raypipe import PipelineConfig, train_ddp
from raypipe.cli.classify import run
from raypipe.cli.demo import write_digits
from raypipe.train.state import PipelineState


def test_help_shows_the_contract():
    text = pydoc.render_doc(raypipe, renderer=pydoc.plaintext)
    for name in ("PipelineConfig", "build_dataset", "iter_torch_batches", "train_ddp"):
        assert name in text
    assert raypipe.__all__ == sorted(raypipe.__all__)


def test_the_documented_rendezvous_config_is_reached_from_the_package():
    """docs/trainers.md and docs/security.md name
    ``raypipe.train.rendezvous.BoundStoreTorchConfig`` after ``import raypipe``."""
    import subprocess
    import sys

    code = "import raypipe; print(raypipe.train.rendezvous.BoundStoreTorchConfig.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "BoundStoreTorchConfig", out.stderr
    # and only then: a preprocessing worker, which imports raypipe, does not load torch
    code = "import sys, raypipe.preprocess.actor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


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
    assert m["samples"] == 2 * 22 * 32 and m["dataset_samples"] == 1438  # 30 by drop_last
    assert result.checkpoint is not None


@pytest.mark.slow
def test_a_rerun_into_its_run_folder_on_changed_data_is_refused(ray_session, tmp_path):
    """A rerun with the run's ``name`` and ``storage_path`` resumes from its latest
    checkpoint (Ray Train's ``get_checkpoint``). On data that changed since (the same
    count, a file renamed: another fingerprint) it is refused before work, as
    ``resume_from`` is; it was resumed, its consumed keys now meaning other samples."""
    from tests.conftest import make_imagefolder

    source = make_imagefolder(tmp_path / "data", {"a": 12, "b": 12}, seed=1)
    config = PipelineConfig(source=str(source), image_size=8, batch_size=4)
    runs = str(tmp_path / "runs")

    def loop(ctx) -> None:
        for _, batches in ctx.epochs(state=dict):
            for _ in batches:
                pass

    kw = dict(num_workers=1, cpus_per_worker=0.5, name="rerun", storage_path=runs)
    first = train_ddp(config, loop, epochs=1, checkpoint_every=2, **kw)
    assert first.error is None and first.checkpoint is not None
    saved = sorted(p for p in (tmp_path / "runs" / "rerun").glob("checkpoint_*") if p.is_dir())
    # 6 steps: taken at steps 2 and 4 and at the epoch's end (its last step once, not as
    # step 6 and again as the end); the latest 2 kept
    states = [PipelineState.load(p) for p in saved]
    assert [(s.epoch, int(s.consumed.sum())) for s in states] == [(0, 16), (1, 0)], saved
    (source / "a" / "0000.png").rename(source / "a" / "0000-renamed.png")
    with pytest.raises(ValueError, match="fingerprint"):  # on the driver, before Ray Train
        train_ddp(config, loop, epochs=2, **kw)


@pytest.mark.slow
def test_the_epoch_end_checkpoint_holds_the_loops_end_of_epoch_work(ray_session, tmp_path):
    """The checkpoint at an epoch's end is saved once the loop asks for the next epoch, so
    what the loop does after its batches (a scheduler's step, a counter) is in it; it was
    saved as the batches ran out, a resumed run's schedule an epoch behind. And
    ``checkpoint_every`` with no ``state=`` is refused: its checkpoints held the data's
    position and no model, and a resume went on with a fresh one."""
    import torch

    from tests.conftest import make_imagefolder

    source = make_imagefolder(tmp_path / "data", {"a": 8, "b": 8}, seed=2)
    config = PipelineConfig(source=str(source), image_size=8, batch_size=4)
    kw = dict(num_workers=1, cpus_per_worker=0.5, storage_path=str(tmp_path / "runs"))

    def loop(ctx) -> None:
        done = {"epochs_done": 0}
        for _, batches in ctx.epochs(state=lambda: dict(done)):
            for _ in batches:
                pass
            done["epochs_done"] += 1  # the loop's own end-of-epoch work

    result = train_ddp(config, loop, epochs=2, checkpoint_every=100, name="ends", **kw)
    assert result.error is None, result.error
    saved = torch.load(f"{result.checkpoint.path}/state.pt", weights_only=False)
    assert saved == {"epochs_done": 2}
    assert PipelineState.load(result.checkpoint.path).epoch == 2

    def stateless(ctx) -> None:
        for _, batches in ctx.epochs():
            for _ in batches:
                pass

    with pytest.raises(Exception, match="without state= a resume would go on with a fresh"):
        train_ddp(config, stateless, epochs=1, checkpoint_every=2, name="bare", **kw)


@pytest.mark.slow
def test_a_state_only_another_rank_reports_does_not_cost_the_epochs_end_checkpoint(
    ray_session, tmp_path
):
    """Only rank 0 writes a checkpoint: a ``ctx.report(state=...)`` of rank 1 alone at an
    epoch's end wrote none, yet counted as the epoch's end saved, and its end checkpoint
    was skipped: the run ended with none at all."""
    import ray.train
    import torch

    from tests.conftest import make_imagefolder

    source = make_imagefolder(tmp_path / "data", {"a": 8, "b": 8}, seed=2)
    config = PipelineConfig(source=str(source), image_size=8, batch_size=4)

    def loop(ctx) -> None:
        done = {"epochs_done": 0}
        rank = ray.train.get_context().get_world_rank()
        for _, batches in ctx.epochs(state=lambda: dict(done)):
            for _ in batches:
                pass
            done["epochs_done"] += 1
            ctx.report({"epoch_done": 1}, state=dict(done) if rank == 1 else None)

    result = train_ddp(config, loop, epochs=1, checkpoint_every=100, name="other", num_workers=2,
                       cpus_per_worker=0.5, storage_path=str(tmp_path / "runs"))  # fmt: skip
    assert result.error is None, result.error
    assert result.checkpoint is not None, "no checkpoint at the epoch's end"
    assert torch.load(f"{result.checkpoint.path}/state.pt", weights_only=False) == {
        "epochs_done": 1
    }


# Equal, exactly-once batches inside real Train workers over two epochs, a worker dying on
# the way: tests/pool/test_elastic.py::test_a_dead_train_worker_restarts_the_group_and_...


def test_a_held_out_set_is_checked_before_any_ray_work(datasets, tmp_path, monkeypatch):
    """``eval_config``: a missing source, and a set without one of the training classes
    (its labels, numbered from its own sorted folders, would mean other classes), are
    refused before Ray starts; the first was found only after, the second not at all."""
    import shutil

    from raypipe.train import ddp

    def started() -> None:
        raise AssertionError("Ray work started before the held-out set was checked")

    monkeypatch.setattr(ddp.localnode, "ensure", started)
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=4)
    with pytest.raises(ValueError, match="does not exist"):
        train_ddp(config, lambda ctx: None, eval_config=config.replace(source=str(tmp_path / "no")))
    held = tmp_path / "held"
    shutil.copytree(datasets["imagefolder"], held)
    shutil.rmtree(held / "dog")
    with pytest.raises(ValueError, match=r"\(2: cat, emu\).*would mean other classes"):
        train_ddp(config, lambda ctx: None, eval_config=config.replace(source=str(held)))


def test_the_run_folder_expands_a_home_relative_path(monkeypatch, tmp_path):
    import os

    from raypipe.train.checkpoint import storage_uri

    monkeypatch.setenv("HOME", str(tmp_path))
    assert storage_uri("~/runs") == str(tmp_path / "runs")
    assert storage_uri("runs") == os.path.join(os.getcwd(), "runs")
    assert storage_uri("s3://bucket/runs") == "s3://bucket/runs"


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_keep_checkpoints_is_checked_before_work(datasets, bad):
    config = PipelineConfig(source=str(datasets["parquet"]), batch_size=4)
    with pytest.raises(ValueError, match=f"keep_checkpoints={bad!r} must be an integer >= 1"):
        train_ddp(config, lambda ctx: None, keep_checkpoints=bad)


@pytest.mark.parametrize(("kw", "says"), [
    ({"use_gpu": "no"}, "use_gpu='no' must be True or False"),
    ({"max_failures": "2"}, "max_failures='2' must be an integer >= -1"),
    ({"loop_config": [1]}, "loop_config=[1] must be a dict"),
    ({"callbacks": print}, "callbacks=<built-in function print> must be a list"),
    ({"ray_log_level": "LOUD"}, "ray_log_level='LOUD' must be one of"),
    ({"cpus_per_worker": "2"}, "cpus_per_worker='2' must be a number > 0"),
    ({"cpus_per_worker": None}, "cpus_per_worker=None must be a number > 0"),
])  # fmt: skip
def test_train_ddp_arguments_of_the_wrong_kind_are_refused_before_ray(datasets, monkeypatch,
                                                                      kw, says):  # fmt: skip
    """Each reached Ray's start and failed there or later: ``use_gpu="no"`` (truthy) asked
    for GPUs, ``max_failures="2"`` failed at the first worker failure."""
    from raypipe.train import ddp

    def started() -> None:
        raise AssertionError("Ray work started before the arguments were checked")

    monkeypatch.setattr(ddp.localnode, "ensure", started)
    config = PipelineConfig(source=str(datasets["parquet"]), batch_size=4)
    with pytest.raises(ValueError, match=re.escape(says)):
        train_ddp(config, lambda ctx: None, **kw)


@pytest.mark.slow
def test_a_rerun_of_a_finished_run_is_refused(ray_session, tmp_path):
    """A rerun with a finished run's ``name`` and ``storage_path`` resumed from its last
    checkpoint (at epoch ``epochs``) and trained nothing, reporting the earlier run's
    metrics; ``resume_from`` such a checkpoint was refused already."""
    from tests.conftest import make_imagefolder

    source = make_imagefolder(tmp_path / "data", {"a": 8, "b": 8}, seed=3)
    config = PipelineConfig(source=str(source), image_size=8, batch_size=4)
    kw = dict(num_workers=1, cpus_per_worker=0.5, storage_path=str(tmp_path / "runs"),
              name="done", epochs=1)  # fmt: skip

    def loop(ctx) -> None:
        for _, batches in ctx.epochs(state=dict):
            for _ in batches:
                pass

    assert train_ddp(config, loop, checkpoint_every=2, **kw).error is None
    with pytest.raises(ValueError, match="is at epoch 1: epochs=1 leaves nothing"):
        train_ddp(config, loop, **kw)


@pytest.mark.slow
def test_ctrl_c_during_training_stops_the_run_with_keyboard_interrupt(ray_session, tmp_path):
    """Ray Train aborts the run on a SIGINT, and its driver's wait ended in SystemExit(1)
    with no message (`raypipe run` exited 1, silently; Ray's handler stayed installed):
    now the run stops with KeyboardInterrupt (`raypipe run`: "interrupted", exit 130),
    the SIGINT handler from before put back."""
    from tests.conftest import make_imagefolder

    source = make_imagefolder(tmp_path / "data", {"a": 8, "b": 8}, seed=4)
    config = PipelineConfig(source=str(source), image_size=8, batch_size=4)
    started = tmp_path / "started"

    def loop(ctx) -> None:
        for _, batches in ctx.epochs():
            for _ in batches:
                started.touch()
                time.sleep(0.05)

    def interrupt() -> None:  # once the loop has its first batch: Ray Train's handler is on
        deadline = time.monotonic() + 120
        while not started.exists():
            if time.monotonic() > deadline:
                return  # no batch came: the run's own failure says why
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt, match="stopped"):
        train_ddp(config, loop, num_workers=1, cpus_per_worker=0.5, epochs=200,
                  storage_path=str(tmp_path / "runs"))  # fmt: skip
    assert started.exists() and signal.getsignal(signal.SIGINT) is before


def test_a_run_bigger_than_the_local_ray_this_process_started_is_refused(ray_session, datasets):
    """The session's Ray is a local one started here (4 CPUs): nothing adds nodes to it, so
    a run whose Train workers alone need more fails at once, naming num_workers among the
    fixes; it warned "it waits for more nodes", and Ray Train waited forever."""
    from raypipe import localnode

    assert localnode.started_here()
    config = PipelineConfig(source=str(datasets["parquet"]), batch_size=2)
    with pytest.raises(ValueError, match="and gets no more nodes; lower num_workers"):
        train_ddp(config, lambda ctx: None, num_workers=8, cpus_per_worker=1)


@pytest.mark.parametrize(("compute", "cpus_per_worker", "need"),
                         [("actors", 1, "6.00"), ("tasks", 1.5, "5.00")])  # fmt: skip
def test_pools_bigger_than_the_local_ray_this_process_started_are_refused(
    ray_session, datasets, compute, cpus_per_worker, need
):
    """The Train workers fit the session's 4 CPUs, but not with the preprocessing that
    must run beside them: every rank's pool of actors (2 x 2 CPUs), or one 2-CPU task at
    a time: the run waited for nodes a local Ray never gets (its ranks at 0 samples)."""
    config = PipelineConfig(source=str(datasets["parquet"]), batch_size=2, actors=(1, 1),
                            actor_cpus=2, compute=compute)  # fmt: skip
    with pytest.raises(ValueError, match=f"needs {need} CPUs at once .* gets no more nodes"):
        train_ddp(config, lambda ctx: None, num_workers=2, cpus_per_worker=cpus_per_worker)


def test_use_gpu_on_a_local_ray_without_gpus_is_refused(ray_session, datasets):
    """Ray Train asked for a GPU node for ever, deaf to Ctrl-C."""
    config = PipelineConfig(source=str(datasets["parquet"]), batch_size=2)
    with pytest.raises(ValueError, match=r"use_gpu=True needs 1 GPU\(s\).* has 0.*use_gpu=False"):
        train_ddp(config, lambda ctx: None, num_workers=1, use_gpu=True)


def test_batch_larger_than_a_rank_share_is_refused(datasets):
    config = PipelineConfig(source=str(datasets["parquet"]), batch_size=40)
    with pytest.raises(ValueError, match="larger than one rank's share"):
        train_ddp(config, lambda ctx: None, num_workers=2)


@pytest.mark.slow
def test_every_epoch_evaluates_every_good_held_out_sample_once_over_the_ranks(
    ray_session, datasets, tmp_path
):
    """Held-out passes from each rank's warm pipeline: per epoch, the two ranks' eval keys
    are every good sample once, nothing dropped, bad ones in the run's skip report."""
    import json
    from pathlib import Path

    from tests.preprocess.test_bad_data import (
        MIXED_WDS,
        WDS_GOOD_IN_ODD,
        WDS_SKIPS,
        broken_webdataset,
    )

    held_out = broken_webdataset(tmp_path / "held_out", MIXED_WDS)
    out = tmp_path / "keys"
    out.mkdir()
    train = PipelineConfig(source=str(datasets["parquet"]), image_size=8, batch_size=5)
    held = PipelineConfig(source=str(held_out), image_size=8, batch_size=8, train=False)
    result = train_ddp(train, _evaluating_loop(out), num_workers=2, epochs=3,
                       cpus_per_worker=0.5, eval_config=held,
                       storage_path=str(tmp_path / "runs"))  # fmt: skip
    assert result.error is None
    good = sum(MIXED_WDS) + WDS_GOOD_IN_ODD
    report = json.loads((Path(result.path) / "skipped_samples.json").read_text())
    for epoch in range(3):
        ranks = [json.loads((out / f"{r}-{epoch}.json").read_text())["keys"] for r in (0, 1)]
        keys = ranks[0] + ranks[1]
        assert len(keys) == len(set(keys)) == good, (epoch, [len(k) for k in ranks])
        bad = {r["key"] for r in report[f"eval_epoch_{epoch}"]["records"]}
        assert report[f"eval_epoch_{epoch}"]["by_reason"] == WDS_SKIPS
        assert bad.isdisjoint(keys)


@pytest.mark.slow
def test_a_resumed_run_evaluates_only_its_remaining_epochs(ray_session, datasets, tmp_path):
    """Resumed at epoch 2 of 3, the held-out pipeline gives one pass, that epoch's, with
    every held-out sample once over the ranks; a second pass is refused."""
    import json

    import numpy as np

    from raypipe.plan.shards import list_shards
    from raypipe.train.state import PipelineState

    train = PipelineConfig(source=str(datasets["parquet"]), image_size=8, batch_size=5)
    held = PipelineConfig(source=str(datasets["webdataset"]), image_size=8, batch_size=8,
                          train=False)  # fmt: skip
    listing = list_shards(train)
    n = listing.num_samples
    start = tmp_path / "start"
    start.mkdir()
    PipelineState(2, train.seed, n, listing.fingerprint, np.zeros(n, dtype=bool)).save(
        start / "raypipe_state.bin"
    )
    out = tmp_path / "passes"
    out.mkdir()
    result = train_ddp(train, _evaluating_loop(out), num_workers=2, epochs=3, cpus_per_worker=0.5,
                       eval_config=held, resume_from=str(start),
                       storage_path=str(tmp_path / "runs"))  # fmt: skip
    assert result.error is None
    assert sorted(p.name for p in out.iterdir()) == ["0-2.json", "1-2.json"]
    ranks = [json.loads((out / f"{r}-2.json").read_text()) for r in (0, 1)]
    keys = ranks[0]["keys"] + ranks[1]["keys"]
    assert sorted(keys) == list(range(list_shards(held).num_samples))
    refused = [r["refused"] for r in ranks]
    assert all("last epoch's (2) was already taken" in r for r in refused), refused


def _evaluating_loop(out):
    """A train loop that reads each epoch, writes this rank's keys of the epoch's held-out
    pass to ``out/<rank>-<epoch>.json``, and after the last pass asks for one more (what
    the refusal said is written too)."""
    import json

    def loop(ctx) -> None:
        for epoch, batches in ctx.epochs():
            for _ in batches:
                pass
            keys = [int(k) for b in ctx.eval_batches() for k in b["key"]]
            refused = ""
            if epoch == ctx.num_epochs - 1:
                try:
                    ctx.eval_batches()
                except RuntimeError as e:
                    refused = str(e)
            record = {"keys": keys, "refused": refused}
            (out / f"{ctx.rank}-{epoch}.json").write_text(json.dumps(record))
            ctx.report({"epoch": epoch})

    return loop


@pytest.mark.slow
def test_the_demo_loop_goes_on_from_its_checkpoint(ray_session, digits, tmp_path):
    """The classify job's loop saved its model only after the last epoch, and never read
    it back: a group restarted after a failure (max_failures) or a rerun into its run
    folder trained a fresh model on the epochs left. It checkpoints every epoch and
    restores, so a rerun's next epoch starts from the trained model."""
    from raypipe.cli.classify import RunConfig, classify_loop

    with open("jobs/configs/digits.yaml") as f:
        cfg = yaml.safe_load(f)
    cfg["data"]["source"] = str(digits / "train")
    cfg.pop("eval", None)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t = RunConfig.from_yaml(path)
    kw = dict(num_workers=2, cpus_per_worker=0.5, storage_path=str(tmp_path / "runs"),
              name="demo", loop_config={"num_classes": 10, "lr": t.trainer.lr})  # fmt: skip
    first = train_ddp(t.data, classify_loop, epochs=1, **kw)
    assert first.error is None and first.metrics["epoch"] == 0
    again = train_ddp(t.data, classify_loop, epochs=2, **kw)  # the run folder's latest: epoch 0
    assert again.error is None and again.metrics["epoch"] == 1
    assert again.metrics["loss"] < 0.7 * first.metrics["loss"], (first.metrics, again.metrics)


def test_packed_batches_are_not_held_to_the_documents_share(tmp_path):
    """With ``pack`` a batch is rows of ``seq_len`` tokens, more of them than documents when
    the documents are long: 8 documents of 4,096 tokens fill 4 batches of 16 rows of 256 on
    each of 2 ranks, which the documents-per-rank check refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raypipe.train.ddp import list_sources

    tokens = pa.array([list(range(4096))] * 8, pa.list_(pa.int32()))
    pq.write_table(pa.table({"tokens": tokens}), tmp_path / "t.parquet")
    config = PipelineConfig(source=str(tmp_path), image_column=None, pack="tokens",
                            seq_len=256, batch_size=16)  # fmt: skip
    listing, _ = list_sources(config, 2)
    assert listing.num_samples == 8
    with pytest.raises(ValueError, match="larger than one rank's share"):
        list_sources(config.replace(pack=None, seq_len=None), 2)


def test_a_memory_cache_is_gone_when_train_ddp_returns(ray_session, datasets, tmp_path):
    """Ray Train ends its workers without their exit hooks: the memory cache each worker's
    process started stayed in /dev/shm after the run (and after the driver exited)."""
    import os

    from raypipe.preprocess.cache import node, shm

    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=4,
                            cache="memory", cache_max_side=16)  # fmt: skip

    def loop(ctx):
        for _, batches in ctx.epochs():
            for _ in batches:
                pass
        assert [p for p in os.listdir(shm.SHM_DIR) if p.startswith(node._name(config, ""))]

    result = train_ddp(config, loop, num_workers=1, cpus_per_worker=0.5, epochs=2,
                       storage_path=str(tmp_path / "runs"))  # fmt: skip
    assert result.error is None
    assert not [p for p in os.listdir(shm.SHM_DIR) if p.startswith(node._name(config, ""))]


def test_the_ranks_data_errors_are_raised_as_themselves_and_nothing_else_is():
    """Every failed rank's error a data error (a spent skip budget): the first rank's,
    as itself (it came inside Ray Train's WorkerGroupError). Another failure beside one
    (a rank out of memory): Ray's error, which names every rank's, not the data error
    alone, which would hide it."""
    from ray.train.v2.api.exceptions import WorkerGroupError

    from raypipe import SkipBudgetError
    from raypipe.train.attempt import fit as _fit

    class Failing:
        def __init__(self, failures):
            self.failures = failures

        def fit(self):
            raise WorkerGroupError("snippets", self.failures)

    spent = [SkipBudgetError(f"epoch 0: rank {r}'s view", 9) for r in range(2)]
    with pytest.raises(SkipBudgetError, match="rank 0's view") as e:
        _fit(Failing({1: spent[1], 0: spent[0]}))
    assert isinstance(e.value.__cause__, WorkerGroupError)
    with pytest.raises(WorkerGroupError):
        _fit(Failing({0: RuntimeError("CUDA out of memory"), 1: spent[1]}))
    wrapped = RuntimeError("the user's own words")
    wrapped.__cause__ = spent[0]
    with pytest.raises(WorkerGroupError):  # the user's error, as they raised it
        _fit(Failing({0: wrapped}))


@pytest.mark.slow
def test_a_data_error_is_not_retried_under_max_failures(ray_session, tmp_path):
    """A spent skip budget (a file no decoder reads, none may be skipped) fails every
    attempt alike: under ``max_failures`` Ray Train restarted the group that many times
    (without end at -1), each attempt reading the data again. The group restarted after
    it now ends at once, and `train_ddp` raises the error as itself."""
    from raypipe import SkipBudgetError
    from tests.conftest import make_imagefolder

    source = make_imagefolder(tmp_path / "data", {"a": 6, "b": 6}, seed=4)
    (source / "a" / "0001.jpg").write_bytes(b"no image at all")
    config = PipelineConfig(source=str(source), image_size=8, batch_size=4, max_skipped=0.0)
    attempts = tmp_path / "attempts"

    def loop(ctx) -> None:
        with open(attempts, "a") as f:
            f.write("attempt\n")
        for _, batches in ctx.epochs():
            for _ in batches:
                pass

    with pytest.raises(SkipBudgetError):
        train_ddp(config, loop, num_workers=1, cpus_per_worker=0.5, max_failures=2,
                  storage_path=str(tmp_path / "runs"))  # fmt: skip
    assert attempts.read_text().count("attempt") == 1


class _NeedsTwo(Exception):
    """An error that pickles but does not unpickle (its args are not its __init__'s)."""

    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


class _HoldsALock(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def test_a_recorded_data_error_is_raised_as_itself_or_at_least_its_text(ray_session):
    """The run's first data error stays; one that does not unpickle on the driver (or
    does not pickle on the rank) comes back as a RuntimeError of its text, where a rank
    restarted after it would have failed unpickling it before any work, again and again."""
    from raypipe import SampleError
    from raypipe.skips.log import SkipLog, SkipStore

    log = SkipLog.create()
    assert not log.is_stopped() and log.stopped_by() is None
    log.stop_with(SampleError("f.jpg", 3, "unreadable", "gone"))
    log.stop_with(SampleError("g.jpg", 4, "unreadable", "gone"))
    first = log.stopped_by()
    assert log.is_stopped() and type(first) is SampleError and first.where == "f.jpg"
    assert not SkipLog.create().is_stopped()  # another run's log
    for error, text in (
        (_NeedsTwo(1, 2), "_NeedsTwo: 1 and 2"),
        (_HoldsALock("x"), "_HoldsALock: x"),
    ):
        other = SkipLog.create()
        other.stop_with(error)
        back = other.stopped_by()
        assert type(back) is RuntimeError and str(back) == text
    store = SkipStore(max_runs=2)
    for name in "abc":
        store.stop(name, b"", name)
    assert [store.is_stopped(r) for r in "abc"] == [False, True, True]


def test_fit_raises_a_recorded_data_error_when_the_restart_after_it_fails():
    """The group restarted after a data error could not start (Ray's controller error, no
    rank's failures): the data error, not Ray's; a rank's error the LM job says on the
    driver (``said_by_the_driver``) is raised as itself too, as at max_failures=0."""
    from ray.train.v2.api.exceptions import WorkerGroupError

    from raypipe import SkipBudgetError
    from raypipe.train.attempt import fit

    class Failing:
        def __init__(self, error):
            self.error = error

        def fit(self):
            raise self.error

    class Recorded:
        def __init__(self, error):
            self.error = error

        def stopped_by(self):
            return self.error

    spent = SkipBudgetError("epoch 0: 9 of its 10 samples skipped", 9)
    with pytest.raises(SkipBudgetError, match="9 of its 10") as e:
        fit(Failing(RuntimeError("worker group startup timed out")), Recorded(spent))
    assert "timed out" in str(e.value.__cause__)
    with pytest.raises(RuntimeError, match="timed out"):  # nothing recorded: Ray's error
        fit(Failing(RuntimeError("worker group startup timed out")), Recorded(None))

    class TokenIds(ValueError):
        said_by_the_driver = True

    with pytest.raises(TokenIds):
        fit(Failing(WorkerGroupError("snippets", {0: TokenIds("token id 70")})))


@pytest.mark.slow
def test_a_run_a_spent_skip_budget_ends_leaves_the_list_of_skipped_samples(ray_session, tmp_path):
    """The list was written only after a run that returned: the one run whose error points
    at it (a spent skip budget) left none."""
    import json

    from raypipe import SkipBudgetError
    from tests.conftest import make_imagefolder

    source = make_imagefolder(tmp_path / "data", {"a": 6, "b": 6}, seed=4)
    (source / "a" / "0001.jpg").write_bytes(b"no image at all")
    config = PipelineConfig(source=str(source), image_size=8, batch_size=4, max_skipped=0.0)

    def loop(ctx) -> None:
        for _, batches in ctx.epochs():
            for _ in batches:
                pass

    with pytest.raises(SkipBudgetError):
        train_ddp(config, loop, num_workers=1, cpus_per_worker=0.5, name="spent",
                  storage_path=str(tmp_path / "runs"))  # fmt: skip
    report = json.loads((tmp_path / "runs" / "spent" / "skipped_samples.json").read_text())
    wheres = [r["where"] for epoch in report.values() for r in epoch["records"]]
    assert len(wheres) == 1 and wheres[0].endswith("0001.jpg"), report
