"""A training job for tests/train/test_resume.py: logs every delivered key; may kill its driver.

Run as ``python -m tests.resume_job SPEC_JSON`` (or call `run`). The spec names the Ray
address, the dataset, the workers, the run folder, what to resume from, and where the
job dies: at ``crash`` = [epoch, step], rank 0 waits until Ray Train registered the
checkpoint ``expect`` = [epoch, consumed], then SIGKILLs the driver process (the job
dies, not a polite stop).
With ``fail`` = [[epoch, step, epoch', consumed'], ...], rank 0 exits hard at each point
once (marker files) after checkpoint [epoch', consumed'] is registered, and Ray Train
restarts the worker group. Each attempt logs to its own files.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def loop(ctx) -> None:
    import torch

    spec = ctx.loop_config
    out = Path(spec["out"])
    attempt = len(list(out.glob(f"{spec['tag']}-failed-*")))  # restarts of this run so far
    name = f"{spec['tag']}-a{attempt}"
    if ctx.rank == 0:  # what the model would load: the state saved with the checkpoint
        (out / f"{name}-restored.json").write_text(json.dumps(ctx.restored()))
    fails = {tuple(f[:2]): f[2:] for f in spec.get("fail", [])}  # (epoch, step): expected
    for epoch, batches in ctx.epochs(state=lambda: {"tag": spec["tag"]}):
        with (out / f"{name}-e{epoch}-r{ctx.rank}.jsonl").open("a") as log:
            for step, batch in enumerate(batches, 1):
                sums = batch["image"].to(torch.float64).sum(dim=(1, 2, 3))
                line = {"step": step, "keys": batch["key"].tolist(), "sums": sums.tolist()}
                log.write(json.dumps(line) + "\n")
                log.flush()
                if ctx.rank == 0 and (epoch, step) in fails:
                    marker = out / f"{spec['tag']}-failed-{epoch}-{step}"
                    if not marker.exists():
                        _registered(spec["run_dir"], fails[epoch, step])
                        marker.touch()
                        os._exit(1)  # a worker dies; Ray Train restarts the group
                if [epoch, step] == spec.get("crash") and ctx.rank == 0:
                    _registered(spec["run_dir"], spec["expect"])
                    os.kill(spec["driver_pid"], signal.SIGKILL)
                    time.sleep(600)


def _registered(run_dir: str, expect: list[int]) -> None:
    """Wait until Ray Train registered the checkpoint at ``expect`` = [epoch, consumed]."""
    from raypipe.train.checkpoint import load_checkpoint

    for _ in range(600):
        try:
            state, _ = load_checkpoint(run_dir)
        except ValueError:
            state = None
        if state and [state.epoch, int(state.consumed.sum())] == expect:
            return
        time.sleep(0.1)


def run(spec: dict):
    from raypipe import PipelineConfig, train_ddp

    config = PipelineConfig(**spec["config"])
    loop_config = {**spec, "driver_pid": os.getpid()}
    return train_ddp(
        config,
        loop,
        num_workers=spec["workers"],
        epochs=spec["epochs"],
        cpus_per_worker=0.5,
        storage_path=os.path.dirname(spec["run_dir"]),
        name=os.path.basename(spec["run_dir"]),
        checkpoint_every=spec["every"],
        resume_from=spec.get("resume_from"),
        max_failures=spec.get("max_failures", 0),
        loop_config=loop_config,
    )


if __name__ == "__main__":
    import ray
    import ray.data

    spec = json.loads(sys.argv[1])
    ray.init(address=spec["address"], log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    result = run(spec)
    print("error:", result.error)
