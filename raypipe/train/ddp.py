"""`train_ddp`: one call from a `PipelineConfig` and a train loop to DDP on Ray Train.

```
 driver: list the shards (and the held-out ones) once; one EpochLedger actor
   ▼ TorchTrainer workers, rank r of W: loop(ctx) → ctx.epochs()
 rank r: Pipeline(config, rank=r, world_size=W): its planned keys of every epoch through
   one run-long execution and one warm actor pool → (epoch, equal exact-size batches)
 rank r, ctx.eval_batches(): Pipeline(eval_config, ..., drop_last=False), warm as well:
   one pass over its share of the held-out set per epoch, nothing dropped
```

Every rank reads its own seeded slice of each epoch (`raypipe.plan.rankplan`), so the same seed
gives every rank the same samples whatever the timing; the ledger keeps batch counts
equal when bad samples are skipped. Checkpoints carry the pipeline's position
(`raypipe.train.checkpoint`): a run resumes mid-epoch, exactly once, with any number of workers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from raypipe import localnode
from raypipe.config import PipelineConfig, rank_loader
from raypipe.config.checks import check_share, is_num
from raypipe.loader.ledger import create_ledger
from raypipe.plan.rankplan import rank_pool
from raypipe.plan.shards import Listing, list_shards
from raypipe.skips.log import SkipLog, write_reports
from raypipe.train.attempt import fit, rank_attempt
from raypipe.train.checkpoint import (
    RunPosition,
    latest_state,
    load_checkpoint,
    new_run_name,
    run_folder,
    storage_uri,
)
from raypipe.train.context import TrainContext, _eval_name, _train_name

log = logging.getLogger(__name__)


def _check_resources(config, eval_config, num_workers: int, cpus_per_worker: float,
                     use_gpu: bool = False):  # fmt: skip
    """Say so when the workers and the smallest pools cannot all start on today's cluster
    (every rank's pool holds its CPUs for the whole run: the run waits for the autoscaler);
    refuse it on a local Ray this process started, which nothing adds nodes to (Ray Train
    waited for its workers, or the ranks for their pools, for ever)."""
    import ray

    def pools(actors) -> int:  # the ranks' smallest pools, together
        return sum(rank_pool(actors, num_workers, r)[0] for r in range(num_workers))

    lo = pools(config.actors)
    need = num_workers * cpus_per_worker + lo * config.actor_cpus
    if eval_config is not None:  # a warm held-out pool per rank as well
        need += pools(eval_config.actors) * eval_config.actor_cpus
    resources = ray.cluster_resources()
    gpus = resources.get("GPU", 0)
    if use_gpu and gpus < num_workers:
        why = f"use_gpu=True needs {num_workers} GPU(s), one a worker, and the cluster has {gpus:g}"
        if localnode.started_here():
            raise ValueError(f"{why}: this local Ray gets no more nodes; set use_gpu=False "
                             "or lower num_workers")  # fmt: skip
        log.warning("raypipe: %s now: it waits for GPU nodes", why)
    have = resources.get("CPU", 0)
    if need <= have:
        return
    fix = "lower num_workers, cpus_per_worker, actors or actor_cpus to fit"
    configs = [c for c in (config, eval_config) if c is not None]
    if localnode.started_here():  # nothing adds nodes: refused where it would wait for ever
        # what must run at once: every rank's smallest pools of actors (they hold their
        # CPUs for the run), or one task at a time (the ranks' tasks take turns)
        task = max(c.actor_cpus for c in configs)
        actors = any(c.compute == "actors" for c in configs)
        least = need if actors else num_workers * cpus_per_worker + task
        if least > have:
            beside = "their pools' actors" if actors else f"one {task:g}-CPU preprocessing task"
            raise ValueError(f"this run needs {least:.2f} CPUs at once ({num_workers} workers "
                             f"x {cpus_per_worker:g} and {beside}) and this local Ray has "
                             f"{have:g} and gets no more nodes; {fix}")  # fmt: skip
    why = (f"this run needs at least {need:.2f} CPUs ({num_workers} workers x "
           f"{cpus_per_worker:.2f} + {lo} actor(s) in the rank pools x {config.actor_cpus:.2f}"
           f"{' + the held-out pools' if eval_config is not None else ''}) and the cluster "
           f"has {have:.2f}")  # fmt: skip
    log.warning("raypipe: %s now: it waits for more nodes; %s", why, fix)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _check_run(*, num_workers, epochs, cpus_per_worker, checkpoint_every, keep_checkpoints,
               use_gpu, max_failures, loop_config, callbacks, ray_log_level) -> None:  # fmt: skip
    if not isinstance(use_gpu, bool):  # "no" is truthy: it asked for GPUs
        raise ValueError(f"{use_gpu=} must be True or False")
    if loop_config is not None and not isinstance(loop_config, dict):
        raise ValueError(f"{loop_config=} must be a dict (or None)")
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        raise ValueError(f"{callbacks=} must be a list of ray.train.UserCallback (or None)")
    if ray_log_level not in LOG_LEVELS:
        raise ValueError(f"{ray_log_level=} must be one of {', '.join(LOG_LEVELS)}")
    checks = [("num_workers", num_workers, 1), ("epochs", epochs, 1),
              ("checkpoint_every", checkpoint_every, 0), ("max_failures", max_failures, -1)]  # fmt: skip
    if keep_checkpoints is not None:  # None: every checkpoint kept
        checks.append(("keep_checkpoints", keep_checkpoints, 1))
    for name, value, low in checks:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    if not is_num(cpus_per_worker) or not cpus_per_worker > 0:
        raise ValueError(f"{cpus_per_worker=} must be a number > 0")


def list_sources(config: PipelineConfig, num_workers: int,
                 eval_config: PipelineConfig | None = None) -> tuple[Listing, Listing | None]:  # fmt: skip
    """The training and held-out sources' listings, on the driver before any Ray work.

    Refuses a batch no rank could fill, and a held-out set whose classes are not the
    training set's: its labels are numbered from its own classes (sorted folder names, a
    string column's values), so a set without one of them would number the rest otherwise.
    """
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
        raise ValueError(f"num_workers={num_workers!r} must be an integer >= 1")
    listing = list_shards(config)
    check_share(config, listing.num_samples, num_workers, what="workers")
    held = None if eval_config is None else list_shards(eval_config)
    if held is not None and held.classes and listing.classes and held.classes != listing.classes:
        raise ValueError(
            f"the held-out source {eval_config.source!r} has the classes {_few(held.classes)}, "
            f"the training source {_few(listing.classes)}: its labels would mean other classes "
            "(an image folder: an empty folder for each missing class)"
        )
    return listing, held


def _few(classes: tuple[str, ...]) -> str:
    shown = ", ".join(classes[:6]) + (", ..." if len(classes) > 6 else "")
    return f"({len(classes)}: {shown})"


def _resume_point(resume_from, listing: Listing, seed: int, epochs: int):
    """``(PipelineState, its ray.train.Checkpoint)`` of ``resume_from``, checked against
    this run."""
    if resume_from is None:
        return None, None
    start, start_from = load_checkpoint(resume_from)
    start.check(listing, seed)
    if start.epoch >= epochs:
        raise ValueError(f"{resume_from=} is at epoch {start.epoch}: {epochs=} leaves nothing")
    return start, start_from


def train_ddp(
    config: PipelineConfig,
    train_loop: Callable[[TrainContext], None],
    *,
    num_workers: int = 2,
    use_gpu: bool = False,
    epochs: int = 1,
    storage_path: str | None = None,
    eval_config: PipelineConfig | None = None,
    loop_config: dict[str, Any] | None = None,
    cpus_per_worker: float = 1.0,
    max_failures: int = 0,
    name: str | None = None,
    callbacks: list | None = None,
    checkpoint_every: int = 0,
    keep_checkpoints: int | None = 2,
    resume_from=None,
    ray_log_level: str = "INFO",
):
    """Run ``train_loop(ctx)`` on ``num_workers`` DDP workers fed by raypipe.

    Returns Ray Train's ``Result`` (metrics, checkpoint, error). Checkpoints go under
    ``storage_path`` (default: Ray's ``~/ray_results``). ``max_failures`` is Ray Train's
    ``FailureConfig``: a dead worker restarts the group, which resumes from the run's
    latest checkpoint; a data error (`raypipe.SkipBudgetError`, `raypipe.SampleError`, a
    transform's output, the LM job's token ids), which would fail every attempt alike, is
    not retried: the group restarted after it ends at once, and it is raised.
    ``checkpoint_every`` steps (and at each epoch's end), a checkpoint
    holds the pipeline's position and rank 0's ``state()`` given to ``ctx.epochs``; the
    latest ``keep_checkpoints`` are kept (None: every one, Ray Train's default).
    ``resume_from`` (a checkpoint folder, or a run folder for its latest checkpoint: a
    path, a storage URI, or ``result.checkpoint``) starts mid-epoch where that run
    stopped, with any ``num_workers``; a rerun with the same ``name`` and
    ``storage_path`` resumes from its own latest, both checked before work (the same
    samples and seed).
    ``callbacks`` are ``ray.train.UserCallback`` objects run on the Train controller.
    The samples each dataset skipped (``on_error="skip"``) are written to
    ``skipped_samples.json`` in the run's folder (``result.path``; after a failed run, not
    one stopped with Ctrl-C, ``storage_path/name``). ``ray_log_level`` is
    Ray Train's own (``ray.train.LoggingConfig``): ``raypipe run`` passes ``"WARNING"``.
    """
    import ray
    import ray.train
    from ray.train.constants import DEFAULT_STORAGE_PATH
    from ray.train.torch import TorchTrainer

    from raypipe.train import rendezvous

    _check_run(num_workers=num_workers, epochs=epochs, cpus_per_worker=cpus_per_worker,
               checkpoint_every=checkpoint_every, keep_checkpoints=keep_checkpoints,
               use_gpu=use_gpu, max_failures=max_failures, loop_config=loop_config,
               callbacks=callbacks, ray_log_level=ray_log_level)  # fmt: skip
    for c in (config, eval_config):  # what each rank's Pipeline takes, before any work
        if c is not None:
            rank_loader(c)
    listing, eval_listing = list_sources(config, num_workers, eval_config)
    start, start_from = _resume_point(resume_from, listing, config.seed, epochs)
    storage = storage_uri(storage_path or DEFAULT_STORAGE_PATH)
    if name is not None and (again := latest_state(run_folder(storage, name))) is not None:
        again.check(listing, config.seed)  # a rerun resumes from it: the same data and seed
        if again.epoch >= epochs:  # it would train nothing and report the run before's end
            raise ValueError(f"{name=} under {storage} is at epoch {again.epoch}: {epochs=} "
                             "leaves nothing (another name starts afresh)")  # fmt: skip
    if (problem := rendezvous.check_ray()) is not None:
        raise RuntimeError(f"raypipe cannot bind DDP's store to the node's address: {problem}")
    localnode.ensure()  # the skip logs live in an actor
    name = name or new_run_name()
    skips = SkipLog.create()
    skip_logs = {_train_name(e): skips.epoch(e) for e in range(epochs)}
    eval_skips = None
    if eval_config is not None:
        eval_skips = SkipLog.create()
        skip_logs.update({_eval_name(e): eval_skips.epoch(e) for e in range(epochs)})
    progress = RunPosition(seed=config.seed, num_samples=listing.num_samples,
                        fingerprint=listing.fingerprint, start=start, start_from=start_from)  # fmt: skip
    _check_resources(config, eval_config, num_workers, cpus_per_worker, use_gpu)
    ledger = create_ledger(num_workers) if num_workers > 1 else None
    ctx = TrainContext(config, eval_config, dict(loop_config or {}), epochs,
                       checkpoint_every=checkpoint_every, progress=progress, listing=listing,
                       skips=skips, ledger=ledger, eval_listing=eval_listing,
                       eval_skips=eval_skips)  # fmt: skip

    trainer = TorchTrainer(
        rank_attempt(ctx, train_loop, skips),
        train_loop_config={},
        torch_config=rendezvous.BoundStoreTorchConfig(),  # the store on the node's address
        scaling_config=ray.train.ScalingConfig(
            num_workers=num_workers,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": cpus_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storage,
            failure_config=ray.train.FailureConfig(max_failures=max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=keep_checkpoints),
            callbacks=callbacks or [],
            logging_config=ray.train.LoggingConfig(log_level=ray_log_level),
        ),
    )
    try:
        result = fit(trainer, skips)
    except Exception:  # a spent skip budget among them: its list is what the user needs
        _report_skips(skip_logs, run_folder(storage, name), None)
        raise
    _report_skips(skip_logs, result.path, result.filesystem)
    return result


def _report_skips(skip_logs: dict[str, SkipLog], folder: str, filesystem) -> None:
    """``skipped_samples.json`` in the run's ``folder`` (a path or storage URI, when no
    ``filesystem`` is given: a failed run's), and one line saying where, if any were."""
    import pyarrow.fs

    try:
        if filesystem is None:
            filesystem, folder = pyarrow.fs.FileSystem.from_uri(folder)
            filesystem.create_dir(folder, recursive=True)
        path, skipped = write_reports(skip_logs, folder, filesystem)
    except Exception as e:  # noqa: BLE001  (a failed run's own error is what to raise)
        log.warning("raypipe: the list of skipped samples was not written to %s: %s", folder, e)
        return
    if skipped:
        log.warning("raypipe: skipped %d bad samples; the list is in %s", skipped, path)
