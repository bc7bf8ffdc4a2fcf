"""The run-long Pipeline through a real local Ray: several epochs from one warm pool,
exactly once and equal batches per epoch for every rank, with skips and shuffling."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import ray
import torch

from raypipe import Pipeline, PipelineConfig, PoolWatch, SkipLog, rayapi
from tests.preprocess.test_bad_data import mixed_source
from tests.properties import check_exactly_once_and_equal
from tests.ranks import run_ranks

FORMATS = ["imagefolder", "webdataset", "parquet"]


def check_epoch(out, epoch: int, batch_size: int, good: set[int], left_over: int | None = None):
    """Exactly once and equal exact-size batches in ``epoch``, at most ``left_over`` keys of
    ``good`` not delivered (None: what ``drop_last`` leaves, ``ranks × batch_size - 1``);
    returns its keys."""
    ranks = [r[epoch] for r in out]
    left_over = len(ranks) * batch_size - 1 if left_over is None else left_over
    return check_exactly_once_and_equal(ranks, batch_size=batch_size, good=good,
                                        left_over=left_over)  # fmt: skip


def good_keys(log: SkipLog, epoch: int, total: int) -> set[int]:
    """The keys of ``epoch`` its skip log does not name: every record kept, none left out."""
    report = log.epoch(epoch).report()
    assert report["records_left_out"] == 0, "the test needs every skipped key"
    return set(range(total)) - {r["key"] for r in report["records"]}


@pytest.mark.parametrize("fmt", FORMATS)
def test_epochs_exactly_once_and_equal_with_skips_two_ranks(ray_session, tmp_path, fmt):
    source, expected = mixed_source(tmp_path, fmt)
    config = PipelineConfig(source=str(source), image_size=8, batch_size=6, actors=(2, 2),
                            files_per_task=9, rows_per_block=4)  # fmt: skip
    log = SkipLog.create()
    out, stats = run_ranks(config, 2, 3, skips=log)  # one log for both ranks
    total = stats[0][0]["planned"] + stats[1][0]["planned"]
    bad = sum(expected.values())
    for epoch in range(3):
        good_rows = [stats[r][epoch]["good"] for r in range(2)]
        assert sum(good_rows) == total - bad  # every good sample reached a rank
        good = good_keys(log, epoch, total)
        assert len(good) == total - bad
        keys = check_epoch(out, epoch, 6, good, len(good) - 12 * (min(good_rows) // 6))
        assert len(keys) == 2 * 6 * (min(good_rows) // 6)
        assert sum(stats[r][epoch]["dropped"] for r in range(2)) == total - bad - len(keys)
        # rank 0's stats() read the shared log as its epoch ended, when the other rank's
        # last records may still be on their way; once both are done it holds every one
        assert sum(stats[0][epoch]["skipped"].values()) <= bad
        assert sum(log.epoch(epoch).counts().values()) == bad  # the epoch's, over all ranks
    orders = {tuple(np.concatenate([b["key"] for b in out[0][e]])) for e in range(3)}
    assert len(orders) > 1, "epochs should read in different orders"


def test_a_lead_of_rows_keeps_epochs_exactly_once_and_equal_with_skips(ray_session, tmp_path):
    """``lead_batches``: each rank pulls rows ahead of the batch it gates and so reports
    less often; with bad samples the ranks still end every epoch at the same batch."""
    source, expected = mixed_source(tmp_path, "webdataset")
    config = PipelineConfig(source=str(source), image_size=8, batch_size=6, actors=(2, 2),
                            rows_per_block=4, lead_batches=3)  # fmt: skip
    log = SkipLog.create()
    out, stats = run_ranks(config, 2, 2, skips=log, pause_s=(0.0, 0.01))
    total = stats[0][0]["planned"] + stats[1][0]["planned"]
    bad = sum(expected.values())
    for epoch in range(2):
        good_rows = [stats[r][epoch]["good"] for r in range(2)]
        assert sum(good_rows) == total - bad
        good = good_keys(log, epoch, total)
        keys = check_epoch(out, epoch, 6, good, len(good) - 12 * (min(good_rows) // 6))
        assert len(keys) == 2 * 6 * (min(good_rows) // 6)


def test_held_ahead_yields_every_block_in_order_once_rows_ran_ahead():
    from raypipe.loader.rebatch import held_ahead

    sizes, pulled = [3, 1, 4, 1, 5], []

    def blocks():
        for i, n in enumerate(sizes):
            pulled.append(i)
            yield {"key": np.arange(n) + 10 * i}

    seen = []
    for block in held_ahead(blocks(), 5):
        i = int(block["key"][0]) // 10
        seen.append(i)
        ahead = sum(sizes[i + 1 : pulled[-1] + 1])
        assert ahead >= 5 or pulled[-1] == len(sizes) - 1  # 5 rows after it, or the end
    assert seen == [0, 1, 2, 3, 4]
    assert [int(b["key"][0]) for b in held_ahead(iter([{"key": np.arange(2)}]), 0)] == [0]


@pytest.mark.parametrize("shuffle_buffer", [0, 7])
def test_without_drop_last_every_good_sample_comes_once_per_epoch_nothing_dropped(
    ray_session, tmp_path, shuffle_buffer
):
    """Evaluation's shape: two ranks without a ledger, bad samples skipped; each epoch every
    good key reaches exactly one rank, and only a rank's last batch is short."""
    source, expected = mixed_source(tmp_path, "webdataset")
    config = PipelineConfig(source=str(source), image_size=8, batch_size=6, actors=(2, 2),
                            rows_per_block=4, shuffle_buffer=shuffle_buffer)  # fmt: skip
    log = SkipLog.create()
    out, stats = run_ranks(config, 2, 2, keys_only=True, skips=log, drop_last=False)
    total = stats[0][0]["planned"] + stats[1][0]["planned"]
    good = total - sum(expected.values())
    for epoch in range(2):
        keys = [k for r in range(2) for batch in out[r][epoch] for k in batch]
        assert len(keys) == len(set(keys)) == good
        assert set(keys) == good_keys(log, epoch, total)  # the good ones, not as many others
        for r in range(2):
            sizes = [len(batch) for batch in out[r][epoch]]
            assert sizes[:-1] == [6] * (len(sizes) - 1) and 0 < sizes[-1] <= 6, sizes
            assert stats[r][epoch]["dropped"] == 0
            assert stats[r][epoch]["batches"] == len(sizes)
        assert sum(log.epoch(epoch).counts().values()) == sum(expected.values())


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_rank_reads_every_epoch_whole(ray_session, datasets, fmt):
    config = PipelineConfig(source=str(datasets[fmt]), image_size=8, batch_size=7,
                            rows_per_block=3, files_per_task=5)  # fmt: skip
    out, stats = run_ranks(config, 1, 2)
    for epoch in range(2):
        keys = check_epoch(out, epoch, 7, set(range(61)))
        assert len(keys) == 56 and stats[0][epoch]["dropped"] == 5
        assert stats[0][epoch]["epoch"] == epoch


def test_shuffle_buffer_keeps_epochs_equal_and_is_seeded(ray_session, datasets):
    config = PipelineConfig(source=str(datasets["webdataset"]), image_size=8, batch_size=6,
                            rows_per_block=5, shuffle_buffer=9, actors=(2, 2))  # fmt: skip
    a, _ = run_ranks(config, 2, 2)
    b, _ = run_ranks(config.replace(actors=(4, 4)), 2, 2, pause_s=(0.0, 0.01))
    plain, _ = run_ranks(config.replace(shuffle_buffer=0), 2, 2)
    other, _ = run_ranks(config.replace(seed=config.seed + 1), 2, 2)

    def order(run, r, epoch):
        return [k for x in run[r][epoch] for k in x["key"].tolist()]

    for epoch in range(2):
        check_epoch(a, epoch, 6, set(range(61)))
        for r in range(2):
            assert order(a, r, epoch) == order(b, r, epoch)  # the same seed, other timing
            assert order(a, r, epoch) != order(plain, r, epoch)  # the buffer shuffles
            assert order(a, r, epoch) != order(other, r, epoch)  # by the seed
    # and by the epoch and the rank: no two (rank, epoch) draw the same permutation
    ranks = [order(a, r, e) for r in range(2) for e in range(2)]
    plains = [order(plain, r, e) for r in range(2) for e in range(2)]
    moved = [[plains[i].index(k) if k in plains[i] else -1 for k in ranks[i]] for i in range(4)]
    assert len({tuple(m) for m in moved}) == 4, moved


def test_the_pool_is_the_same_processes_in_epoch_0_and_epoch_2(ray_session, datasets):
    """A 3-epoch run starts at most its two actors, ever, and epoch 2 is served by a process
    that served epoch 0 (a dataset per epoch would start new actors, new pids, per epoch).
    The second actor may still be starting when epoch 0's first batches arrive, so each
    epoch's set is everything seen alive while it was read."""
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=4,
                            files_per_task=4, actors=(2, 2), compute="actors")  # fmt: skip
    seen: dict[int, set] = {}
    with PoolWatch(match="RankPreprocessor", interval_s=0.05, new_only=True) as watch:
        with Pipeline(config, epochs=3, device="cpu") as pipe:
            for epoch, batches in pipe.epochs():
                for _ in batches:
                    alive = {(a["ActorID"], a["Pid"]) for a in watch.alive()}
                    seen.setdefault(epoch, set()).update(alive)
                assert batches.stats()["batches"] == 61 // 4
        assert watch.summary()["actors_max"] <= 2
    ever = set().union(*seen.values())
    assert 1 <= len(ever) <= 2, ever
    assert seen[0] & seen[2], seen
    assert not watch.alive(), "the pool should end with the run"


def test_the_actor_pool_reads_every_epoch_once_from_blocks_of_several_task_ids(
    ray_session, datasets, monkeypatch
):
    """A long run's task ids come several to a block (`MAX_ID_BLOCKS`): every epoch is
    still read exactly once, in equal batches, on two ranks of the actor pool."""
    from raypipe.preprocess import datasets as rank_datasets

    monkeypatch.setattr(rank_datasets, "MAX_ID_BLOCKS", 3)
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=4,
                            files_per_task=5, actors=(1, 1), compute="actors")  # fmt: skip
    out, _ = run_ranks(config, 2, 2)
    for epoch in range(2):
        check_epoch(out, epoch, 4, set(range(61)))


def _pool_actors(name: str) -> set[str]:
    """The ids of this job's actors whose name has ``name``, in any state: a pool that
    did all its tasks and was scaled down within one look is counted too."""
    job = ray.get_runtime_context().get_job_id()
    return {i for i, a in rayapi.actor_table(None).items()
            if a["JobID"] == job and name in (a.get("ReprName") or a.get("ActorClassName"))}  # fmt: skip


def test_the_pool_starts_on_with_before_epochs_is_asked_for(ray_session, datasets):
    """``with pipeline:`` (or ``start()``) starts the pool and its first tasks, so a trainer's
    set-up overlaps them; ``start()`` again changes nothing; ``epochs()`` then gives every
    epoch once, and a second ``epochs()`` is refused.

    The pool is looked for in every state: its one actor may run both (tiny) tasks and be
    scaled down by Ray Data between two looks ("consumed all inputs"), 45 ms after it
    started in one CI run, where a watch of alive actors saw none."""
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=4,
                            actors=(1, 1), compute="actors")  # fmt: skip
    before = _pool_actors("RankPreprocessor")
    with Pipeline(config, epochs=2, device="cpu") as pipe:
        feeder = pipe._feeder
        assert feeder is not None and pipe.start() is pipe and pipe._feeder is feeder
        deadline = time.monotonic() + 60
        while not _pool_actors("RankPreprocessor") - before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pool_actors("RankPreprocessor") - before, "the pool should start before epochs()"
        counts = [sum(1 for _ in batches) for _, batches in pipe.epochs()]
        assert counts == [61 // 4] * 2
        with pytest.raises(RuntimeError, match="runs once"):
            next(pipe.epochs())


def test_every_epoch_copies_through_the_first_epochs_ring(ray_session, datasets):
    """One host-to-device ring (slots, copy stream) for the run: a ring per epoch would take
    new pinned slots and, on CUDA, new device segments for a new stream every epoch."""
    config = PipelineConfig(source=str(datasets["parquet"]), image_size=8, batch_size=4)
    rings, allocations = set(), []
    with Pipeline(config, epochs=3, device="cpu", channels_last=True) as pipe:
        for _, batches in pipe.epochs():
            for b in batches:
                assert b["image"].is_contiguous(memory_format=torch.channels_last)
            rings.add(id(batches.h2d.ring))
            allocations.append(batches.h2d.ring.allocations)
    assert len(rings) == 1
    assert allocations[0] > 0 and allocations == [allocations[0]] * 3


def test_stopping_early_ends_the_thread_and_the_pool(ray_session, datasets):
    config = PipelineConfig(source=str(datasets["parquet"]), image_size=8, batch_size=4)
    pipe = Pipeline(config, epochs=5, device="cpu")
    for epoch, batches in pipe.epochs():
        next(iter(batches))
        if epoch == 1:
            break
    pipe.close()
    assert not [t for t in threading.enumerate() if t.name == "raypipe-feeder"]


def test_an_epoch_left_unread_is_skipped_and_the_next_is_whole(ray_session, datasets):
    config = PipelineConfig(source=str(datasets["webdataset"]), image_size=8, batch_size=5)
    with Pipeline(config, epochs=3, device="cpu") as pipe:
        lens = [
            sum(len(b["key"]) for b in batches) if e != 1 else 0 for e, batches in pipe.epochs()
        ]
    assert lens == [60, 0, 60]


def test_bad_settings_name_the_value(ray_session, datasets):
    config = PipelineConfig(source=str(datasets["webdataset"]))
    with pytest.raises(ValueError, match="ledger"):
        Pipeline(config, epochs=2, rank=0, world_size=2)
    with pytest.raises(ValueError, match="drop_last='no'"):
        Pipeline(config, epochs=2, drop_last="no")
    with pytest.raises(ValueError, match="rank=2"):
        Pipeline(config, epochs=2, rank=2, world_size=2, ledger=object())
    with pytest.raises(ValueError, match="epochs=0"):
        Pipeline(config, epochs=0)
    with pytest.raises(TypeError, match="PipelineConfig"):
        Pipeline({"source": "x"}, epochs=1)


def test_a_batch_no_rank_can_fill_is_refused_as_the_loader_refuses_it(ray_session, datasets):
    """61 samples over 4 ranks: a batch of 16 would leave every epoch of every rank empty."""
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=16)
    share = r"batch_size=16 is larger than one rank's share \(61 samples / 4 ranks = 15\)"
    with pytest.raises(ValueError, match=share):
        Pipeline(config, epochs=1, rank=0, world_size=4, ledger=Pipeline.ledger(4))
    with pytest.raises(ValueError, match=r"batch_size=64 .* \(61 samples / 1 ranks = 61\)"):
        Pipeline(config.replace(batch_size=64), epochs=1)
    Pipeline(config.replace(batch_size=64), epochs=1, drop_last=False).close()  # every row


def test_a_resume_state_of_other_data_or_another_seed_is_refused(ray_session, datasets):
    from raypipe.plan.shards import list_shards
    from raypipe.train.state import PipelineState

    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=7)
    fingerprint, consumed = list_shards(config).fingerprint, np.arange(61) < 10
    for state, match in (
        (PipelineState(0, 999, 61, fingerprint, consumed), "seed=999"),
        (PipelineState(0, config.seed, 61, "0" * 32, consumed), "fingerprint '0000"),
        (PipelineState(0, config.seed, 60, fingerprint, consumed[:60]), "num_samples=60"),
    ):
        with pytest.raises(ValueError, match=match):
            Pipeline(config, epochs=1, start=state)
    pipe = Pipeline(config, epochs=1, device="cpu", progress_s=0,
                    start=PipelineState(0, config.seed, 61, fingerprint, consumed))  # fmt: skip
    keys = [k for _, batches in pipe.epochs() for b in batches for k in b["key"].tolist()]
    assert len(keys) == 49 and min(keys) >= 10  # 51 left, whole batches of 7


def test_an_epochs_batches_name_their_epoch_before_the_first_batch(ray_session, datasets):
    """A checkpoint taken between epochs, from the next epoch's batches, names that epoch
    with nothing consumed (it named the one before, whose keys it then read again)."""
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=7)
    for epoch, batches in Pipeline(config, epochs=3, device="cpu", progress_s=0).epochs():
        state = batches.state_dict()
        assert batches.stats()["epoch"] == state["epoch"] == epoch and len(state["keys"]) == 0
        assert sum(1 for _ in batches) == 8
        assert batches.stats()["epoch"] == batches.state_dict()["epoch"] == epoch


@pytest.mark.timeout(180)
def test_after_a_data_error_the_next_epoch_says_the_pipeline_stopped(ray_session, tmp_path):
    """A data error (``on_error="raise"``) ends its epoch's loop as itself; a loop that
    caught it and asked for the next epoch waited for ever on the pool that had stopped.
    It is told at once why, and what goes on instead."""
    from raypipe import SampleError
    from tests.conftest import make_imagefolder

    source = make_imagefolder(tmp_path / "data", {"a": 6, "b": 6}, seed=4)
    (source / "a" / "0001.jpg").write_bytes(b"no image at all")
    config = PipelineConfig(source=str(source), image_size=8, batch_size=2, on_error="raise",
                            actors=(1, 1))  # fmt: skip
    with Pipeline(config, epochs=3, device="cpu") as pipe:
        epochs = pipe.epochs()
        _, batches = next(epochs)
        with pytest.raises(SampleError, match="0001.jpg"):
            for _ in batches:
                pass
        _, batches = next(epochs)
        with pytest.raises(RuntimeError, match=r"^the pipeline stopped in epoch 0 with "
                           r"SampleError: .*make a new Pipeline") as stopped:  # fmt: skip
            next(iter(batches))
        assert isinstance(stopped.value.__cause__, SampleError)
