"""The main job: train a small image classifier with DDP on Ray Train from a run config.

A run config is YAML with three sections::

    data:    PipelineConfig of the training set
    eval:    PipelineConfig of the held-out set (optional)
    trainer: num_workers, epochs, lr, use_gpu, cpus_per_worker, storage_path, max_failures

Each epoch prints loss, held-out accuracy, samples/s and the iterator's wait fraction.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from raypipe.config import PipelineConfig, check_keys, load_yaml
from raypipe.config.checks import is_int, is_num
from raypipe.config.loader import rank_loader
from raypipe.train.ddp import TrainContext, list_sources, train_ddp


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    num_workers: int = 2
    epochs: int = 5
    lr: float = 3e-3
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    storage_path: str | None = None
    max_failures: int = 0

    def __post_init__(self):
        def whole(value, low):
            return is_int(value) and value >= low

        checks = [("num_workers", whole(self.num_workers, 1), "an integer >= 1"),
                  ("epochs", whole(self.epochs, 1), "an integer >= 1"),
                  ("lr", is_num(self.lr) and self.lr > 0, "a number > 0"),
                  ("use_gpu", isinstance(self.use_gpu, bool), "true or false"),
                  ("cpus_per_worker", is_num(self.cpus_per_worker) and self.cpus_per_worker > 0,
                   "a number > 0"),
                  ("storage_path", self.storage_path is None or isinstance(self.storage_path, str),
                   "a path"),
                  ("max_failures", whole(self.max_failures, -1), "an integer >= -1 (-1: no limit)")]  # fmt: skip
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"trainer.{name}={getattr(self, name)!r} must be {what}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    data: PipelineConfig
    eval: PipelineConfig | None
    trainer: TrainerSettings

    @classmethod
    def from_yaml(cls, path: str | Path, raw: dict | None = None) -> RunConfig:
        """The run config in the file ``path`` (or ``raw``, what was read of it)."""
        raw = load_yaml(path) if raw is None else raw
        check_keys(raw, ["data", "eval", "trainer"], where=str(path))
        if "data" not in raw:
            raise ValueError(f"{path}: a run config needs a 'data' section")
        trainer = raw.get("trainer") or {}
        if not isinstance(trainer, dict):
            raise ValueError(f"{path}: trainer must be a mapping of settings, not {trainer!r}")
        check_keys(
            trainer, [f.name for f in dataclasses.fields(TrainerSettings)], where=f"{path}: trainer"
        )
        return cls(
            data=_section(path, "data", raw["data"]),
            eval=_section(path, "eval", raw["eval"]) if raw.get("eval") else None,
            trainer=_trainer(path, trainer),
        )


def _trainer(path, settings: dict) -> TrainerSettings:
    try:
        return TrainerSettings(**settings)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _section(path, name: str, data: Any) -> PipelineConfig:
    """A section's `PipelineConfig`, with what its ranks' Pipelines take (``prefetch_batches``
    >= 1) checked too: before Ray starts, not in ``train_ddp`` after."""
    try:
        config = PipelineConfig.from_dict(data)
        rank_loader(config)
        return config
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {name}: {e}") from None


def small_cnn(num_classes: int):
    import torch.nn as nn

    def block(cin: int, cout: int) -> nn.Sequential:
        # GroupNorm: no running statistics, so evaluation matches training from epoch 0.
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.ReLU(inplace=True)
        )

    return nn.Sequential(
        block(3, 32), nn.MaxPool2d(2),
        block(32, 64), nn.MaxPool2d(2),
        block(64, 64), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(64 * 16, 128), nn.ReLU(inplace=True), nn.Linear(128, num_classes),
    )  # fmt: skip


def classify_loop(ctx: TrainContext) -> None:
    """The per-worker loop: train, evaluate on the held-out set, report each epoch."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(ctx.config.seed)
    model = ctx.prepare_model(small_cnn(ctx.loop_config["num_classes"]))
    opt = torch.optim.Adam(model.parameters(), lr=ctx.loop_config["lr"])
    state = resumed(ctx, model, opt)
    for epoch, batches in ctx.epochs(state=state):  # with checkpoint_every: mid-epoch ones
        model.train()
        loss_sum, steps, t0 = 0.0, 0, time.perf_counter()
        for batch in batches:
            loss = F.cross_entropy(model(batch["image"]), batch["label"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item()
            steps += 1
        seconds = time.perf_counter() - t0
        it = batches.stats()
        loss_total, steps_total, samples, wait, actors = ctx.all_reduce_sum(
            [
                loss_sum,
                steps,
                it["samples"],
                it["wait_fraction"],
                it.get("pool", {}).get("actors", 0),
            ]
        )
        metrics = {
            "epoch": epoch,
            "loss": loss_total / max(steps_total, 1),
            "samples": int(samples),
            "samples_per_s": samples / seconds if seconds > 0 else 0.0,
            "wait_fraction": wait / ctx.world_size,
            "steps_per_rank": steps,
            "skipped": sum(it["skipped"].values()),  # the epoch's, over all ranks
            "dataset_samples": ctx.listing.num_samples if ctx.listing is not None else None,
            "bound": it["bound"],  # rank 0's stall view
            "actors": int(actors),  # the preprocessing pools' actors as the epoch ended
        }
        if ctx.eval_config is not None:
            metrics["val_accuracy"] = evaluate(ctx, model)
        # a checkpoint each epoch: a worker group restarted after a failure goes on from it
        ctx.report(metrics, state={**state(), "epoch": epoch})


def evaluate(ctx: TrainContext, model) -> float:
    import torch

    model.eval()
    net = _unwrap(model)
    correct = total = 0
    with torch.no_grad():
        for batch in ctx.eval_batches():
            pred = net(batch["image"]).argmax(1)
            correct += int((pred == batch["label"]).sum())
            total += len(pred)
    correct, total = ctx.all_reduce_sum([correct, total])
    return correct / max(total, 1)


def _unwrap(model):
    return getattr(model, "module", model)


def resumed(ctx: TrainContext, model, opt, saved: dict[str, Any] | None = None):
    """Load the checkpoint this run resumes from (a restart under ``max_failures``, a rerun,
    ``resume_from``) into ``model`` and ``opt``, where there is one (``saved``: its state,
    read already); returns the ``state`` that saves them, for ``ctx.epochs(state=...)`` and
    ``ctx.report``."""
    if (saved := saved or ctx.restored()) is not None:
        _unwrap(model).load_state_dict(saved["model"])
        if "optimizer" in saved:  # a checkpoint of an older version may hold none
            opt.load_state_dict(saved["optimizer"])
    return lambda: {"model": _unwrap(model).state_dict(), "optimizer": opt.state_dict()}


def format_epoch(m: dict[str, Any]) -> str:
    acc = f"  val_acc {m['val_accuracy']:.3f}" if "val_accuracy" in m else ""
    skipped = f", {m['skipped']} bad skipped" if m.get("skipped") else ""
    bound = f"  bound: {m['bound'].split(':')[0]}" if m.get("bound") else ""
    actors = f"  actors {m['actors']}" if m.get("actors") else ""
    return (
        f"epoch {m['epoch']}: loss {m['loss']:.4f}{acc}  {m['samples_per_s']:.0f} samples/s"
        f"  wait {m['wait_fraction']:.1%}{bound}{actors}  ({m['samples']} samples{skipped})"
    )


def _epoch_printer():
    """A Ray Train callback printing one line per epoch (it runs on the Train controller)."""
    import ray.train

    class EpochPrinter(ray.train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics and "epoch" in metrics[0]:
                print(format_epoch(metrics[0]), flush=True)

    return EpochPrinter()


def check_classes(run_cfg: RunConfig, config_path) -> tuple[str, ...]:
    """The training set's classes, its sources listed and checked as `train_ddp` checks
    them (`list_sources`: a bad source, batch or held-out set fails here, before Ray)."""
    listing, _ = list_sources(run_cfg.data, run_cfg.trainer.num_workers, run_cfg.eval)
    if not listing.classes:
        raise ValueError(
            f"{config_path}: the classifier job needs named classes (an image folder's class "
            f"folders, shards raypipe convert wrote, or string labels); data.source is "
            f"{listing.format} and names none (labels from {listing.labels}); `raypipe "
            "inspect SOURCE` shows what is read"
        )
    return listing.classes


def run(config_path: str | Path, *, epochs: int | None = None, storage_path: str | None = None,
        ray_log_level: str = "INFO", classes: tuple[str, ...] | None = None,
        name: str | None = None, resume_from: str | None = None):  # fmt: skip
    """Train from a run config on the Ray this process is connected to (or a local one);
    ``ray_log_level``, ``name`` and ``resume_from`` are `raypipe.train_ddp`'s;
    ``classes``: what `check_classes` gave for this config already (else it runs here)."""
    run_cfg = RunConfig.from_yaml(config_path)
    t = run_cfg.trainer
    classes = classes or check_classes(run_cfg, config_path)
    result = train_ddp(
        run_cfg.data,
        classify_loop,
        num_workers=t.num_workers,
        use_gpu=t.use_gpu,
        epochs=t.epochs if epochs is None else epochs,
        storage_path=storage_path or t.storage_path,
        eval_config=run_cfg.eval,
        loop_config={"num_classes": len(classes), "lr": t.lr},
        cpus_per_worker=t.cpus_per_worker,
        max_failures=t.max_failures,
        callbacks=[_epoch_printer()],
        ray_log_level=ray_log_level,
        name=name,
        resume_from=resume_from,
    )
    if result.error:
        raise result.error
    return result


def go_on(command: list[str], folder: str) -> str:
    """What a stopped run says: ``command`` (the ``raypipe run`` it was) going on from the
    latest checkpoint in ``folder``, where it saved one."""
    import shlex

    from raypipe.train.checkpoint import latest_state

    try:
        saved = latest_state(folder) is not None
    except Exception:  # an unreadable folder: nothing to offer
        saved = False
    if not saved:
        return "the run stopped before its first checkpoint"
    return f"go on with: {shlex.join([*command, '--resume', folder])}"
