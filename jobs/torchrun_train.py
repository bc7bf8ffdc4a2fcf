"""torchrun entry point: DDP ranks that torchrun (or Slurm's srun) launches, fed by raypipe's
preprocessing pools on an existing Ray cluster; no Ray Train.

    export RAY_AUTH_MODE=token   # where ~/.ray/auth_token exists: the head turns token auth on
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray start --head --node-ip-address=127.0.0.1 \\
        --dashboard-host=127.0.0.1   # or a cluster
    torchrun --nproc_per_node=2 jobs/torchrun_train.py jobs/configs/torchrun.yaml \\
        --address 127.0.0.1:6379 --checkpoint demo-data/torchrun.pt

Without ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` Ray turns ``--node-ip-address=127.0.0.1``
into the machine's address and the head listens there (docs/security.md). With torchrun's
``MASTER_ADDR`` on loopback, gloo's and NCCL's sockets are kept there too
(``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME=lo``, unless set). torchrun's own rendezvous
store is not: it listens on every interface (port 29500 by default), so on a machine others
can reach, keep that port behind a firewall or run torchrun in a network namespace of its
own (as tests/torchrun_head.py does).

Each rank joins the cluster as a Ray driver, takes its rank and world size from
torch.distributed, and reads its share of every epoch through a `raypipe.Loader`; the ranks
share one ledger by a name rank 0 broadcasts. With ``--checkpoint`` the model, the
optimizer and the loader's position are saved every ``checkpoint_every`` steps, and a rerun
resumes from them mid-epoch. ``--keys-out`` writes the keys of every batch (the tests).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from raypipe import Loader, localnode
    from raypipe.cli.classify import small_cnn

    spec, config = _read(args.config)
    trainer = _trainer(spec, args.config, checkpoint=args.checkpoint)
    cuda = torch.cuda.is_available()
    device = _device(cuda)
    localnode.start(args.address, log_to_driver=False)  # this rank joins as a driver
    _loopback_only()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(config.seed)
    net = small_cnn(trainer["num_classes"]).to(device)
    model = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device] if cuda else None)
    opt = torch.optim.Adam(model.parameters(), lr=trainer["lr"])
    loader = Loader(config, epochs=trainer["epochs"], device=device)  # rank, world: dist's
    if _resuming(args.checkpoint, device):
        _resume(args.checkpoint, device, net, opt, loader)
    every = trainer.get("checkpoint_every", 0)
    with loader:
        for epoch in range(loader.epoch, trainer["epochs"]):
            loader.set_epoch(epoch)
            steps, loss_sum = 0, 0.0
            for step, batch in enumerate(loader, 1):
                loss = F.cross_entropy(model(batch["image"]), batch["label"])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                steps, loss_sum = step, loss_sum + loss.item()
                if args.keys_out:
                    _log(args.keys_out, rank, epoch, step, batch["key"].tolist())
                if args.checkpoint and every and step % every == 0:
                    _save(args.checkpoint, rank, net, opt, loader.state_dict())  # all ranks
                if args.stop_at and (epoch, step) == (0, args.stop_at):
                    return  # as if the job died here (the tests); no process group teardown
                if args.state_at and (epoch, step) == (0, args.state_at):
                    state = loader.state_dict()  # a collective: every rank calls it
                    if rank == 0:
                        _write_state(Path(args.keys_out, "state.json"), state)
            print(f"rank {rank} epoch {epoch}: {steps} steps, loss {loss_sum / max(steps, 1):.4f}",
                  flush=True)  # fmt: skip
    dist.destroy_process_group()


TRAINER_KEYS = ("num_classes", "lr", "epochs")  # and checkpoint_every (0: none)


def _read(path: str):
    """The config file and its ``data`` section's `PipelineConfig`; one line (every rank
    prints it) for a file that is missing or not YAML, or a data section that is wrong."""
    from raypipe import PipelineConfig
    from raypipe.config import load_yaml

    try:
        spec = load_yaml(path)
        if not isinstance(spec.get("data"), dict):
            raise ValueError(f"{path}: needs a data section (a PipelineConfig's fields)")
        return spec, PipelineConfig.from_dict(spec["data"])
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _trainer(spec: dict, path: str, *, checkpoint: str | None = None) -> dict:
    """The config's ``trainer`` section, checked before this rank joins anything."""
    from raypipe.config import check_keys
    from raypipe.config.checks import is_int, is_num

    trainer = spec.get("trainer")
    if not isinstance(trainer, dict):
        raise SystemExit(f"{path}: needs a trainer section with {', '.join(TRAINER_KEYS)}")
    try:
        check_keys(trainer, [*TRAINER_KEYS, "checkpoint_every"], where=f"{path}: trainer")
    except ValueError as e:  # a misspelt checkpoint_every wrote no checkpoint, unsaid
        raise SystemExit(str(e)) from None
    if missing := [k for k in TRAINER_KEYS if k not in trainer]:
        raise SystemExit(f"{path}: trainer needs {', '.join(missing)}")
    every = trainer.get("checkpoint_every", 0)
    for key, value, ok, want in (  # each failed after every rank joined, or did not at all
        ("num_classes", trainer["num_classes"], lambda v: is_int(v) and v >= 2, "an integer >= 2"),
        ("epochs", trainer["epochs"], lambda v: is_int(v) and v >= 1, "an integer >= 1"),
        ("lr", trainer["lr"], lambda v: is_num(v) and v > 0, "a number > 0"),
        ("checkpoint_every", every, lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    ):  # fmt: skip
        if not ok(value):
            raise SystemExit(f"{path}: trainer.{key}={value!r} must be {want}")
    if checkpoint and not every:  # it saved nothing, and a rerun started over
        raise SystemExit(f"{path}: --checkpoint needs trainer.checkpoint_every >= 1 (steps "
                         "between checkpoints)")  # fmt: skip
    return trainer


def _resuming(path: str | None, device) -> bool:
    """Whether every rank resumes from ``path``: found by all, or by none (then a fresh
    start); found by some only (a node-local path on several nodes) is refused, as their
    models and loaders would start apart."""
    import torch
    import torch.distributed as dist

    found = torch.tensor([int(bool(path) and os.path.exists(path))], device=device)
    dist.all_reduce(found)
    if 0 < found.item() < dist.get_world_size():
        raise SystemExit(f"--checkpoint {path}: found by {found.item()} of "
                         f"{dist.get_world_size()} ranks: put it where every rank reads it")  # fmt: skip
    return found.item() > 0


def _save(path: str, rank: int, net, opt, loader_state: dict) -> None:
    import torch

    if rank == 0:
        tmp = f"{path}.tmp"
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "loader": loader_state},
                   tmp)  # fmt: skip
        os.replace(tmp, path)


def _write_state(path: Path, state: dict) -> None:
    """The keys a `raypipe.Loader.state_dict()` marks consumed, as JSON (the tests)."""
    import numpy as np

    from raypipe.train.state import PipelineState

    consumed = PipelineState.from_bytes(state["state"].numpy().tobytes()).consumed
    keys = np.flatnonzero(consumed).tolist()
    path.write_text(json.dumps({"epoch": state["epoch"], "consumed": keys}))


def _log(folder: str, rank: int, epoch: int, step: int, keys: list[int]) -> None:
    with open(os.path.join(folder, f"e{epoch}-r{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "keys": keys}) + "\n")


def _loopback_only() -> None:
    """gloo's and NCCL's sockets on loopback where torchrun's MASTER_ADDR is (the ranks on
    one machine; where the Ray head is says nothing of the ranks' peers), unless set."""
    from raypipe.train.rendezvous import loopback_sockets

    for name, value in loopback_sockets(os.environ.get("MASTER_ADDR", "")).items():
        os.environ.setdefault(name, value)


def _resume(path: str, device, net, opt, loader) -> None:
    """The model, the optimizer and the loader's position saved in ``path``."""
    import torch

    saved = torch.load(path, map_location=device)
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    try:
        loader.load_state_dict(saved["loader"])
    except ValueError as e:  # another dataset, seed or epochs than the run it saved
        raise SystemExit(f"--checkpoint {path}: {e}") from None


def _device(cuda: bool):
    """This rank's device: its GPU by ``LOCAL_RANK`` (torchrun's; ``SLURM_LOCALID`` under a
    bare srun), else the CPU."""
    import torch

    if not cuda:
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID")
    if not (local or "").isdigit():
        raise SystemExit(f"LOCAL_RANK={local!r}: which of this node's GPUs is this rank's? "
                         "torchrun sets it (srun: SLURM_LOCALID); set it with RANK and WORLD_SIZE")  # fmt: skip
    return torch.device("cuda", int(local))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a YAML file with data: and trainer: sections")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   required="RAY_ADDRESS" not in os.environ,
                   help="the Ray cluster every rank joins (default: RAY_ADDRESS)")  # fmt: skip
    p.add_argument("--checkpoint", help="save to (and resume from) this file")
    p.add_argument("--keys-out", help="a folder: the keys of every batch, per epoch and rank")
    p.add_argument("--state-at", type=int, default=0,
                   help="write the loader's state at this step of epoch 0 into --keys-out")  # fmt: skip
    p.add_argument("--stop-at", type=int, default=0,
                   help="stop after this step of epoch 0, as if the job died (tests)")  # fmt: skip
    return p


if __name__ == "__main__":
    main()
