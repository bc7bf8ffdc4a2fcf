"""A training job for tests/test_resume.py: logs every delivered key; may kill its driver.

Run as ``python -m tests.resume_job SPEC_JSON`` (or call `run`). The spec names the Ray
address, the dataset, the workers, the run folder, what to resume from, and where the
job dies: at ``crash`` = [epoch, step], rank 0 waits until Ray Train registered the
checkpoint it expects, then SIGKILLs the driver process (the job dies, not a polite stop).
A worker of a run with ``fail`` = [epoch, step] exits hard once (marker file) instead.
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
    if ctx.rank == 0:  # what the model would load: the state saved with the checkpoint
        (out / f"{spec['tag']}-restored-{os.getpid()}.json").write_text(json.dumps(ctx.restored()))
    for epoch, batches in ctx.epochs(state=lambda: {"tag": spec["tag"]}):
        path = out / f"{spec['tag']}-e{epoch}-r{ctx.rank}-{os.getpid()}.jsonl"
        with path.open("a") as log:
            for step, batch in enumerate(batches, 1):
                sums = batch["image"].to(torch.float64).sum(dim=(1, 2, 3))
                line = {"step": step, "keys": batch["key"].tolist(), "sums": sums.tolist()}
                log.write(json.dumps(line) + "\n")
                log.flush()
                if (
                    [epoch, step] == spec.get("fail")
                    and ctx.rank == 0
                    and not (out / "failed").exists()
                ):
                    _registered(spec)
                    (out / "failed").touch()
                    os._exit(1)  # a worker dies; Ray Train restarts the group
                if [epoch, step] == spec.get("crash") and ctx.rank == 0:
                    _registered(spec)
                    os.kill(spec["driver_pid"], signal.SIGKILL)
                    time.sleep(600)


def _registered(spec: dict) -> None:
    """Wait until Ray Train registered the checkpoint the test expects to resume from."""
    from raypipe.checkpoint import load_checkpoint

    for _ in range(600):
        try:
            state, _ = load_checkpoint(spec["run_dir"])
        except ValueError:
            state = None
        if state and [state.epoch, int(state.consumed.sum())] == spec["expect"]:
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
