"""`raypipe.Loader` inside a user's own Ray Train ``TorchTrainer`` (no `train_ddp`): the ranks
share a ledger passed in ``train_loop_config``, take rank and world size from the process
group Ray Train set up, and put the loader's state into their Ray Train checkpoints; a
second run with one worker resumes from it, the interrupted epoch exactly once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from raypipe import Pipeline
from raypipe.train.state import PipelineState
from tests.properties import check_exactly_once_and_equal

pytestmark = pytest.mark.slow
B, AT = 4, 3  # batch size; rank 0 checkpoints after this step of epoch 0, then stops


def user_loop(cfg: dict) -> None:
    """A user's train function: the loader in a plain loop, its state in the checkpoints."""
    import os
    import tempfile

    import ray.train
    import ray.train.torch
    import torch

    from raypipe import Loader, PipelineConfig

    rank = ray.train.get_context().get_world_rank()
    died = Path(cfg["out"], "died")  # cfg["die"]: rank 1 dies once, Ray Train restarts both
    tag = f"{cfg['tag']}{int(died.exists())}" if cfg.get("die") else cfg["tag"]
    loader = Loader(PipelineConfig(**cfg["data"]), epochs=2, ledger=cfg["ledger"], device="cpu")
    if cfg.get("resume"):
        loader.load_state_dict(torch.load(Path(cfg["resume"], "loader.pt")))
    model = ray.train.torch.prepare_model(torch.nn.Linear(3 * 8 * 8, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = Path(cfg["out"])
    with loader:
        for epoch in range(loader.epoch, 2):
            for step, batch in enumerate(loader, 1):
                loss = torch.nn.functional.cross_entropy(model(batch["image"].flatten(1)),
                                                         batch["label"] % 5)  # fmt: skip
                opt.zero_grad()
                loss.backward()
                opt.step()
                with (out / f"{tag}-e{epoch}-r{rank}.jsonl").open("a") as f:
                    f.write(json.dumps(batch["key"].tolist()) + "\n")
                if cfg.get("die") and rank == 1 and (epoch, step) == (0, 2) and not died.exists():
                    died.touch()
                    os._exit(1)
                if cfg.get("stop") and (epoch, step) == (0, AT):
                    state = loader.state_dict()  # a collective: every rank calls it
                    with tempfile.TemporaryDirectory() as tmp:
                        checkpoint = None
                        if rank == 0:
                            torch.save(state, Path(tmp, "loader.pt"))
                            checkpoint = ray.train.Checkpoint.from_directory(tmp)
                        ray.train.report({"step": step}, checkpoint=checkpoint)
                    return  # as if the job died here


def _fit(loop_config: dict, workers: int, storage: Path, name: str, max_failures: int = 0):
    import ray.train
    from ray.train.torch import TorchTrainer

    from raypipe.train.rendezvous import BoundStoreTorchConfig

    trainer = TorchTrainer(
        user_loop,
        train_loop_config=loop_config,
        torch_config=BoundStoreTorchConfig(),  # DDP's store on the node's address only
        scaling_config=ray.train.ScalingConfig(
            num_workers=workers, resources_per_worker={"CPU": 0.5}
        ),  # fmt: skip
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=str(storage),
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
        ),  # fmt: skip
    )
    result = trainer.fit()
    assert result.error is None, result.error
    return result


def _lines(out: Path, tag: str, epoch: int) -> list[list[np.ndarray]]:
    return [
        [np.array(json.loads(line)) for line in path.read_text().splitlines()]
        for path in sorted(out.glob(f"{tag}-e{epoch}-r*.jsonl"))
    ]


def test_own_torchtrainer_shares_a_ledger_checkpoints_and_resumes(ray_session, datasets,
                                                                  tmp_path):  # fmt: skip
    out = tmp_path / "keys"
    out.mkdir()
    data = {"source": str(datasets["webdataset"]), "image_size": 8, "batch_size": B,
            "actors": (2, 2), "actor_cpus": 0.5}  # fmt: skip
    base = {"data": data, "out": str(out)}
    first = _fit({**base, "tag": "a", "stop": True, "ledger": Pipeline.ledger(2)}, 2,
                 tmp_path / "runs", "a")  # fmt: skip
    ranks = _lines(out, "a", 0)
    assert [len(r) for r in ranks] == [AT, AT]
    before = check_exactly_once_and_equal(
        ranks, batch_size=B, good=range(61), left_over=61 - 2 * AT * B
    )  # stopped at step AT
    state_dir = first.checkpoint.path
    state = torch.load(Path(state_dir, "loader.pt"))
    consumed = PipelineState.from_bytes(state["state"].numpy().tobytes()).consumed
    assert state["epoch"] == 0
    assert sorted(np.flatnonzero(consumed).tolist()) == sorted(before.tolist())

    # one worker resumes: the rest of epoch 0, then a whole epoch 1
    _fit({**base, "tag": "b", "resume": state_dir, "ledger": None}, 1, tmp_path / "runs", "b")
    (rest,) = _lines(out, "b", 0)
    epoch0 = np.concatenate([before, *rest])
    assert len(set(epoch0.tolist())) == len(epoch0) and 61 - len(epoch0) < B
    check_exactly_once_and_equal(_lines(out, "b", 1), batch_size=B, good=range(61),
                                 left_over=B - 1)  # fmt: skip


def test_a_restarted_group_joins_its_shared_ledger_again(ray_session, datasets, tmp_path):
    """docs/trainers.md: the ranks share one ``Pipeline.ledger`` handle from
    ``train_loop_config``, and Ray Train restarts a group that lost a worker
    (``FailureConfig``). The restarted ranks join that ledger again under their new process
    group's id, and read both epochs exactly once; every retry was refused as "two ranks
    have rank=0" of one run."""
    out = tmp_path / "keys"
    out.mkdir()
    data = {"source": str(datasets["webdataset"]), "image_size": 8, "batch_size": B,
            "actors": (1, 1), "actor_cpus": 0.5}  # fmt: skip
    cfg = {"data": data, "out": str(out), "tag": "c", "die": True, "ledger": Pipeline.ledger(2)}
    _fit(cfg, 2, tmp_path / "runs", "c", max_failures=1)
    assert (out / "died").exists() and len(_lines(out, "c0", 0)) == 2  # the first attempt
    for epoch in (0, 1):
        check_exactly_once_and_equal(_lines(out, "c1", epoch), batch_size=B, good=range(61),
                                     left_over=2 * B - 1)  # fmt: skip


def test_gloo_and_nccl_keep_to_loopback_when_the_rendezvous_does():
    """NCCL picks a non-loopback interface unless told: a run on 127.0.0.1 tells it."""
    from raypipe.train.rendezvous import loopback_sockets

    assert loopback_sockets("127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert loopback_sockets("10.0.0.5") == {}
