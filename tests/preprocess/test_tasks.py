"""``compute="tasks"`` (`raypipe.preprocess.tasks`): the actor pool's rows, in its order."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from raypipe import Pipeline, PipelineConfig
from raypipe.preprocess import tasks as task_module


def _epochs(config: PipelineConfig, **kwargs) -> list[list[tuple[int, bytes]]]:
    """Every epoch's (key, pixels) in the order one rank of one got them."""
    with Pipeline(config, device="cpu", normalize=False, **kwargs) as pipe:
        return [[(int(k), img.numpy().tobytes()) for b in batches
                 for k, img in zip(b["key"], b["image"], strict=True)]
                for _, batches in pipe.epochs()]  # fmt: skip


@pytest.mark.parametrize("fmt", ["imagefolder", "webdataset"])
def test_tasks_give_the_actor_pools_keys_pixels_and_order(ray_session, datasets, fmt):
    config = PipelineConfig(source=str(datasets[fmt]), image_size=8, batch_size=5,
                            files_per_task=4, actors=(1, 2), seed=3)  # fmt: skip
    tasks = _epochs(config.replace(compute="tasks"), epochs=2)
    actors = _epochs(config.replace(compute="actors"), epochs=2)
    assert tasks == actors
    assert tasks[0] != tasks[1]  # the epochs' seeded orders differ
    assert len({k for k, _ in tasks[0]}) == len(tasks[0]) == 60  # 61 samples, batches of 5


def test_a_workers_block_arrays_lent_again_at_its_next_task_keep_every_blocks_pixels(
        ray_session, datasets):  # fmt: skip
    # one task slot: each pooled worker runs several of the tasks, each task several blocks
    # of 196 KB (in the object store, not inlined in the reply), in the last task's arrays
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=64, batch_size=16,
                            rows_per_block=16, files_per_task=40, actors=(1, 1), seed=5)  # fmt: skip
    tasks = _epochs(config, epochs=2)
    assert tasks == _epochs(config.replace(compute="actors"), epochs=2)
    assert [len(e) for e in tasks] == [48, 48]


def test_reused_arrays_are_the_last_tasks_each_lent_once_a_task():
    from raypipe.preprocess.imageblocks import ImageBlocks, Reused

    reused = Reused()
    first = [reused.take((2, 3)) for _ in range(3)]
    assert len({id(a) for a in first}) == 3  # three blocks of one task: three arrays
    reused.next_task()
    second = [reused.take((2, 3)), reused.take((2, 3)), reused.take((4, 3))]
    assert {id(a) for a in second[:2]} < {id(a) for a in first}
    assert second[2].shape == (4, 3)  # a shape the last task had none of: a new array
    reused.next_task()  # the array of the first task that the second did not take is let go
    third = [reused.take((2, 3)) for _ in range(3)]
    assert {id(a) for a in third} & {id(a) for a in first} == {id(a) for a in second[:2]}
    blocks = ImageBlocks(4, 2, reused)
    assert blocks.image.shape == (2, 3, 4, 4) and blocks.image.dtype == np.uint8
    reused.next_task()
    assert reused.take((2, 3, 4, 4)) is blocks.image


def test_a_window_of_one_slot_still_reads_every_epoch_in_order(ray_session, datasets):
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=4,
                            files_per_task=2, actors=(1, 1))  # fmt: skip
    assert config.compute == "tasks"  # the default
    epochs = _epochs(config, epochs=2)
    assert [len(e) for e in epochs] == [60, 60]
    assert all(len({k for k, _ in e}) == 60 for e in epochs)
    assert epochs == _epochs(config.replace(compute="actors"), epochs=2)  # the plan's order


def test_stopping_early_ends_quietly_and_never_cancels_a_task(ray_session, datasets,
                                                              monkeypatch):  # fmt: skip
    # Ray 2.60's driver aborts when a cancel meets its task's reply (`TaskStream.stop`):
    # a stopped stream drops its refs and lets the tasks in flight finish.
    import ray

    cancelled = []
    monkeypatch.setattr(ray, "cancel", lambda ref, **kw: cancelled.append(ref))
    config = PipelineConfig(source=str(datasets["parquet"]), image_size=8, batch_size=4,
                            files_per_task=1)  # fmt: skip
    for _ in range(3):
        pipe = Pipeline(config, epochs=5, device="cpu")
        for _, batches in pipe.epochs():
            next(iter(batches))
            break
        pipe.close()
        assert not pipe._feeder.failed
        assert not [t for t in threading.enumerate() if t.name == "raypipe-feeder"]
    assert cancelled == []
    assert _epochs(config, epochs=1)[0]  # the pooled workers still serve the next run


def test_a_released_memory_cache_is_let_go_at_the_workers_next_task(ray_session, tmp_path):
    """A pooled worker keeps a finished run's `Preprocessor`, and with it the mappings of
    its memory cache's entries. Once the run releases the cache, the worker's next task
    (of any run) closes them, so the removed files' memory goes back to the node. It once
    stayed taken: a later cached run on 16,384 photos then kept fewer entries and decoded
    some samples again (benchmarks/RESULTS.md, "Many entries on a node")."""
    import ray

    from raypipe.plan.rankplan import RankPlan
    from raypipe.plan.ranktasks import RankTasks
    from raypipe.plan.shards import list_shards
    from raypipe.preprocess.cache import node
    from tests.conftest import make_imagefolder

    source = make_imagefolder(tmp_path / "data", {"a": 12}, seed=3)
    config = PipelineConfig(source=str(source), image_size=8, batch_size=4, files_per_task=12,
                            rows_per_block=4, cache="memory", cache_max_side=12)  # fmt: skip
    listing = list_shards(config)
    plan = RankPlan.of(listing, seed=0, shuffle=True, rank=0, world_size=1, per_task=12)
    tasks = RankTasks.of(listing, plan, range(1))

    def args(c):
        return [ray.put({"config": c, "reader": listing.reader, "tasks": tasks})]

    cache = task_module._PREPROCESSORS
    cache.clear()
    node.ensure(config)
    try:
        task_module._preprocess("cached", args(config), 0)  # this process as the worker
        root = ray.get(node.lookup(config).where.remote())[0]

        def mapped() -> list[str]:
            with open("/proc/self/maps") as f:
                return [line for line in f if root in line]

        assert len(mapped()) == 12  # every entry it wrote, kept mapped
        node.release(config)
        assert not os.path.exists(root) and mapped()  # removed, and still held
        task_module._preprocess("next", args(config.replace(cache=None)), 0)
        assert mapped() == []
        assert list(cache) == ["cached", "next"]  # the run's Preprocessor itself is kept
    finally:
        node.release(config)
        cache.clear()


def test_a_worker_keeps_one_preprocessor_per_run_and_only_the_last_few(ray_session, datasets):
    import ray

    from raypipe.plan.rankplan import RankPlan
    from raypipe.plan.ranktasks import RankTasks
    from raypipe.plan.shards import list_shards

    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=4,
                            files_per_task=8, rows_per_block=4)  # fmt: skip
    listing = list_shards(config)
    plan = RankPlan.of(listing, seed=0, shuffle=True, rank=0, world_size=1, per_task=8)
    tasks = RankTasks.of(listing, plan, range(1))
    kwargs = [ray.put({"config": config, "reader": listing.reader, "tasks": tasks})]
    cache = task_module._PREPROCESSORS
    cache.clear()
    blocks = task_module._preprocess("a", kwargs, 0)
    first = cache["a"]
    assert task_module._preprocess("a", kwargs, 1) and cache["a"] is first
    assert [len(b["key"]) for b in blocks] == [4, 4] and all(b["epoch"][0] == 0 for b in blocks)
    assert np.array_equal(np.concatenate([b["key"] for b in blocks]), plan.keys(0)[:8])
    later = [f"r{i}" for i in range(task_module.RUNS_PER_WORKER)]
    for run in later:
        task_module._preprocess(run, kwargs, 0)
    assert list(cache) == later  # RUNS_PER_WORKER, the oldest gone
    cache.clear()


def test_a_nodes_ranks_taking_turns_on_a_worker_keep_their_preprocessors_and_one_listing(
        ray_session, datasets):  # fmt: skip
    """8 ranks (a node's GPUs) whose tasks take turns on one pooled worker: each rank's
    `Preprocessor` is built once, where a worker kept 4 and rebuilt one on every task
    (fetching the rank's whole listing again), and the ranks' listings are one in memory."""
    import ray

    from raypipe.plan.rankplan import RankPlan
    from raypipe.plan.ranktasks import RankTasks
    from raypipe.plan.shards import list_shards

    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=2,
                            files_per_task=2, rows_per_block=2)  # fmt: skip
    listing = list_shards(config)
    kwargs = {}
    consumed = np.zeros(listing.num_samples, dtype=bool)
    consumed[:5] = True  # a resumed epoch 0
    for r in range(8):
        plan = RankPlan.of(listing, seed=0, shuffle=True, rank=r, world_size=8, per_task=2,
                           resume_epoch=0, consumed=consumed)  # fmt: skip
        tasks = RankTasks.of(listing, plan, range(1))
        kwargs[r] = [ray.put({"config": config, "reader": listing.reader, "tasks": tasks})]
    cache = task_module._PREPROCESSORS
    cache.clear()
    try:
        built = {}
        for t in range(2):
            for r in range(8):
                task_module._preprocess(f"rank{r}", kwargs[r], t)
                built.setdefault(r, cache[f"rank{r}"])
                assert cache[f"rank{r}"] is built[r], f"rank {r} rebuilt at task {t}"
        paths = {id(cache[f"rank{r}"].tasks.paths) for r in range(8)}
        assert len(paths) == 1
        masks = {id(cache[f"rank{r}"].tasks.plan.consumed) for r in range(8)}
        assert len(masks) == 1  # a resume's consumed keys: one mask for the node's ranks
    finally:
        cache.clear()
