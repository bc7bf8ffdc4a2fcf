"""torchrun without Ray Train: ``torchrun --nproc_per_node=2`` ranks (gloo, CPU) of
jobs/torchrun_train.py join a ``ray start --head`` the test starts, as Ray drivers, and read
two epochs through `raypipe.Loader`: equal batches per rank, exactly once, and a mid-epoch
``state_dict()`` that holds the keys of both ranks (its all_reduce over the process group).
Then the job's own checkpoints: a run stops mid-epoch, and its rerun resumes from the last
checkpoint, the interrupted epoch exactly once.

The head and the ranks run in a network namespace of their own (tests/torchrun_head.py), so
that torchrun's rendezvous store, which listens on every interface, has only loopback."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.properties import check_exactly_once_and_equal

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
B, STATE_AT = 4, 3


def _own_network_namespace() -> list[str] | None:
    """``unshare`` with the flags that give this user a network namespace: ``-n`` as root,
    ``-rn`` (a user namespace of its own, root in it) otherwise; None where neither can."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    for flags in ("-n", "-rn"):
        if subprocess.run(["unshare", flags, "true"], capture_output=True).returncode == 0:
            return ["unshare", flags]
    return None


UNSHARE = _own_network_namespace()


@pytest.mark.skipif(UNSHARE is None, reason="needs unshare -n or -rn (user namespaces), and ip")
def test_torchrun_ranks_join_a_ray_head_equal_batches_exactly_once(datasets, tmp_path):
    spec = yaml.safe_load((ROOT / "jobs/configs/torchrun.yaml").read_text())
    spec["data"].update(source=str(datasets["webdataset"]), image_size=8, batch_size=B,
                        actors=[2, 2], actor_cpus=0.5)  # fmt: skip
    for key in ("scale", "ratio", "flip"):
        spec["data"].pop(key, None)
    spec["trainer"].update(epochs=2, num_classes=5, checkpoint_every=2)
    config, out = tmp_path / "run.yaml", tmp_path / "keys"
    config.write_text(yaml.safe_dump(spec))
    out.mkdir()
    ckpt, a, b = tmp_path / "ckpt.pt", tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    resumed = ["--checkpoint", str(ckpt)]  # every checkpoint_every=2 steps
    runs = [["--keys-out", str(out), "--state-at", str(STATE_AT)],
            [*resumed, "--keys-out", str(a), "--stop-at", "5"],  # checkpoints at 2, 4
            [*resumed, "--keys-out", str(b)]]  # fmt: skip
    job = {"config": str(config), "runs": runs}
    cmd = [*UNSHARE, sys.executable, "-m", "tests.torchrun_head", json.dumps(job)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]

    for epoch in range(2):
        ranks = [[json.loads(line) for line in (out / f"e{epoch}-r{r}.jsonl").read_text().splitlines()]
                 for r in range(2)]  # fmt: skip
        batches = [[np.array(line["keys"]) for line in lines] for lines in ranks]
        keys = check_exactly_once_and_equal(batches, batch_size=B, good=range(61),
                                            left_over=2 * B - 1)  # fmt: skip
        assert len(batches[0]) == 61 // 2 // B and len(keys) == 56
        if epoch == 0:
            state = json.loads((out / "state.json").read_text())
            first = [k for lines in ranks for line in lines[:STATE_AT] for k in line["keys"]]
            assert state["epoch"] == 0
            assert sorted(state["consumed"]) == sorted(first)

    # the stopped run saved at steps 2 and 4 of epoch 0; its step 5 comes again after resume
    stopped = [k for r in range(2) for line in _lines(a, 0, r)[:4] for k in line["keys"]]
    again = [k for r in range(2) for line in _lines(b, 0, r) for k in line["keys"]]
    assert len(stopped) == 2 * 4 * B and not set(stopped) & set(again)
    assert len(set(stopped + again)) == len(stopped + again) and 61 - len(stopped + again) < 2 * B
    whole = [[np.array(line["keys"]) for line in _lines(b, 1, r)] for r in range(2)]
    check_exactly_once_and_equal(whole, batch_size=B, good=range(61), left_over=2 * B - 1)


def _lines(folder: Path, epoch: int, rank: int) -> list[dict]:
    return [
        json.loads(line) for line in (folder / f"e{epoch}-r{rank}.jsonl").read_text().splitlines()
    ]


def test_the_trainer_section_is_checked_before_a_rank_joins_anything(tmp_path):
    """A misspelt ``checkpoint_every`` was ignored (no checkpoint written, nothing said); a
    missing ``lr`` a KeyError after every rank had joined Ray and the process group; values
    of the wrong kind failed there too (``checkpoint_every: "20"``), or did not at all
    (``-1`` saved every step; none with ``--checkpoint`` saved nothing)."""
    spec = yaml.safe_load((ROOT / "jobs/configs/torchrun.yaml").read_text())
    for change, said in ((("checkpoint_evry", 20), "'checkpoint_evry' (did you mean "
                          "'checkpoint_every'?)"), (("lr", None), "trainer needs lr"),
                         (("checkpoint_every", "20"), "trainer.checkpoint_every='20' must be"),
                         (("checkpoint_every", -1), "trainer.checkpoint_every=-1 must be"),
                         (("epochs", "3"), "trainer.epochs='3' must be an integer"),
                         (("lr", -1), "trainer.lr=-1 must be a number > 0"),
                         (("num_classes", 0), "trainer.num_classes=0 must be"),
                         (("checkpoint_every", 0), "--checkpoint needs trainer.checkpoint_every"),
                         ):  # fmt: skip
        trainer = dict(spec["trainer"])
        key, value = change
        if value is None:
            trainer.pop(key)
        else:
            trainer[key] = value
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump({**spec, "trainer": trainer}))
        assert said in _refused(str(path), "--checkpoint", str(tmp_path / "c"))
    # the file and its data section: each a traceback on every rank before
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "nodata.yaml").write_text(yaml.safe_dump({"trainer": spec["trainer"]}))
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump({**spec, "data": {"batchsize": 3}}))
    sci = {**spec, "trainer": {**spec["trainer"], "lr": "LR", "checkpoint_every": 0}}
    (tmp_path / "sci.yaml").write_text(yaml.safe_dump(sci).replace("LR", "2e-3"))  # a float
    for name, said in (("missing", "config file not found"), ("empty", "the file is empty"),
                       ("nodata", "needs a data section"), ("typo", "did you mean 'batch_size'"),
                       ("sci", "--checkpoint needs trainer.checkpoint_every")):  # fmt: skip
        assert said in _refused(str(tmp_path / f"{name}.yaml"), "--checkpoint", str(tmp_path / "c"))
    # as a rank's process meets it: exit 1, no traceback
    done = subprocess.run([sys.executable, str(ROOT / "jobs/torchrun_train.py"),
                           str(tmp_path / "nodata.yaml"), "--address", "127.0.0.1:9"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "needs a data section" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def _refused(*argv: str) -> str:
    """What ``jobs/torchrun_train.py ARGV`` exits with before it joins anything (it would
    join a Ray at the unused 127.0.0.1:9 next, and fail there)."""
    spec = importlib.util.spec_from_file_location("torchrun_job", ROOT / "jobs/torchrun_train.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    with pytest.raises(SystemExit) as exited:
        job.main([*argv, "--address", "127.0.0.1:9"])
    return str(exited.value.code)


def _job():
    spec = importlib.util.spec_from_file_location("torchrun_job", ROOT / "jobs/torchrun_train.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job


def test_a_gpu_rank_takes_its_gpu_from_local_rank_or_slurm_and_says_when_neither(monkeypatch):
    """Started with RANK, WORLD_SIZE and MASTER_ADDR/PORT set by hand (docs/trainers.md's
    Slurm way), a GPU rank ended in ``KeyError: 'LOCAL_RANK'``."""
    import torch

    job = _job()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    assert job._device(False) == torch.device("cpu")
    with pytest.raises(SystemExit, match=r"LOCAL_RANK=None: which of this node's GPUs"):
        job._device(True)
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert job._device(True) == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert job._device(True) == torch.device("cuda", 0)


def test_a_checkpoint_of_another_run_is_refused_in_one_line(tmp_path):
    """A loader state the Loader refuses (another dataset, seed or epochs) ended every rank
    in a traceback; the job's other refusals are one line."""
    import torch

    class Refusing:
        def load_state_dict(self, state):
            raise ValueError("the state is of another dataset")

    net = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(net.parameters())
    path = tmp_path / "run.pt"
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "loader": {}}, path)
    with pytest.raises(SystemExit, match=r"^--checkpoint .*run.pt: the state is of another"):
        _job()._resume(str(path), "cpu", net, opt, Refusing())
