"""Guarantees 1-3 of DESIGN.md as properties, through a real local Ray, for every format."""

from __future__ import annotations

import numpy as np
import pytest

from raypipe import PipelineConfig, build_dataset, iter_torch_batches
from tests.properties import check_exactly_once_and_equal
from tests.ranks import in_threads

FORMATS = ["imagefolder", "webdataset", "parquet"]
N = 61  # every generated dataset holds 61 samples


def consume_ranks(ds, world_size: int, batch_size: int, **kwargs) -> list[list[dict]]:
    """Run one epoch through streaming_split(equal=True), one thread per rank."""
    splits = ds.streaming_split(world_size, equal=True)
    out: list[list[dict]] = [[] for _ in range(world_size)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            for batch in iter_torch_batches(splits[r], batch_size=batch_size, **kwargs):
                out[r].append({k: v.numpy().copy() for k, v in batch.items()})
        except BaseException as e:  # surfaced in the main thread below
            errors.append(e)

    in_threads(rank, world_size, timeout=300)
    if errors:
        raise errors[0]
    return out


def check_split(ranks, *, batch_size: int, total: int) -> np.ndarray:
    """Exactly once over ``total`` keys, equal batches, at most drop_last's remainder left."""
    return check_exactly_once_and_equal(ranks, batch_size=batch_size, good=range(total),
                                        left_over=len(ranks) * batch_size - 1)  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("batch_size", [4, 7])
def test_exactly_once_equal_batches_two_ranks(ray_session, datasets, fmt, batch_size):
    config = PipelineConfig(
        source=str(datasets[fmt]),
        image_size=16,
        batch_size=batch_size,
        actors=(1, 2),
        files_per_task=5,
        rows_per_block=3,  # tiny odd blocks: Ray's batcher would cut short batches
    )
    ranks = consume_ranks(build_dataset(config), 2, batch_size)
    check_split(ranks, batch_size=batch_size, total=N)
    batch = ranks[0][0]
    assert batch["image"].shape == (batch_size, 3, 16, 16)
    assert batch["image"].dtype == np.float32 and batch["label"].dtype == np.int64


def test_local_shuffle_buffer_keeps_batches_equal(ray_session, datasets):
    config = PipelineConfig(
        source=str(datasets["webdataset"]), image_size=8, rows_per_block=5, actors=(2, 2)
    )
    ranks = consume_ranks(build_dataset(config), 2, 6, shuffle_buffer=9, shuffle_seed=3)
    check_split(ranks, batch_size=6, total=N)


def test_the_local_shuffle_draws_a_new_order_each_pass_and_the_same_for_the_same_seed(
    ray_session,
):
    """Each pass is an epoch: the buffer drew the same order in every one (seeded once)."""
    import ray.data

    ds = ray.data.range(64, override_num_blocks=1).map_batches(
        lambda b: {"key": b["id"], "label": b["id"] % 3}
    )

    def orders(seed: int) -> list[list[int]]:
        batches = iter_torch_batches(ds, batch_size=8, shuffle_buffer=16, shuffle_seed=seed)
        return [[k for b in batches for k in b["key"].tolist()] for _ in range(3)]

    first = orders(1)
    assert all(sorted(o) == list(range(64)) for o in first)
    assert len({tuple(o) for o in first}) == 3, "every pass drew the same order"
    assert orders(1) == first and orders(2) != first


def test_without_a_config_strings_and_ragged_rows_come_as_with_one(ray_session):
    """A LoaderConfig (or batch_size= alone) has no collate of a PipelineConfig's: a string
    column stopped the pass in torch.from_numpy."""
    import ray.data

    rows = [{"key": i, "text": f"doc {i}", "ids": np.arange(i % 3 + 1)} for i in range(8)]
    batches = list(iter_torch_batches(ray.data.from_items(rows), batch_size=4))
    assert [b["text"] for b in batches] == [[f"doc {i}" for i in range(j, j + 4)] for j in (0, 4)]
    assert batches[0]["ids"].shape == (4, 3) and batches[0]["ids_mask"].sum() == 1 + 2 + 3 + 1
    assert batches[1]["key"].tolist() == [4, 5, 6, 7]


def test_keep_partial_batch_delivers_everything_once(ray_session, datasets):
    config = PipelineConfig(source=str(datasets["parquet"]), image_size=8, rows_per_block=4)
    batches = list(iter_torch_batches(build_dataset(config), batch_size=8, drop_last=False))
    keys = np.concatenate([b["key"].numpy() for b in batches])
    assert sorted(keys.tolist()) == list(range(N))
    assert [len(b["key"]) for b in batches] == [8] * 7 + [5]


def test_stats_after_the_pass_are_the_pass_s_own(ray_session, datasets):
    """``stats()`` read after the loop's held-out pass or checkpoint counted that time as
    the loop's own: the wait share fell and ``bound`` could name the trainer for a run
    its data held back."""
    import time

    config = PipelineConfig(source=str(datasets["parquet"]), image_size=8, rows_per_block=4)
    batches = iter_torch_batches(build_dataset(config), batch_size=8, device="cpu")
    assert sum(len(b["key"]) for b in batches) == 56
    at_end = batches.stats()
    time.sleep(0.5)  # the loop's own work after the epoch
    later = batches.stats()
    assert later["elapsed_s"] == at_end["elapsed_s"] < 60 and later["samples"] == 56
    assert later["wait_fraction"] == at_end["wait_fraction"] > 0


def _images_by_key(ds) -> dict[int, bytes]:
    out = {}
    for b in ds.iter_batches(batch_size=None, batch_format="numpy"):
        for k, img in zip(b["key"], b["image"], strict=True):
            out[int(k)] = img.tobytes()
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_seed_same_keys_and_augmentation(ray_session, datasets, fmt):
    config = PipelineConfig(source=str(datasets[fmt]), image_size=12, seed=5, rows_per_block=7)
    a = _images_by_key(build_dataset(config.replace(actors=(1, 1)), epoch=1))
    for pool in ({"actors": (3, 3)}, {"actors": (2, 2), "compute": "actors"}):
        b = _images_by_key(build_dataset(config.replace(**pool), epoch=1))
        assert sorted(a) == sorted(b) == list(range(N))
        assert a == b, f"augmentation of a key changed with the pool ({pool})"
    c = _images_by_key(build_dataset(config, epoch=2))
    assert sorted(c) == list(range(N))
    assert sum(a[k] != c[k] for k in a) > N // 2, "a new epoch should re-augment"
    d = _images_by_key(build_dataset(config.replace(seed=6), epoch=1))
    assert sum(a[k] != d[k] for k in a) > N // 2, "another seed should augment otherwise"


def test_epochs_read_files_in_different_orders(ray_session, datasets):
    config = PipelineConfig(
        source=str(datasets["imagefolder"]), image_size=8, actors=(1, 1), files_per_task=61
    )

    def order(epoch):  # one actor, one task: output order is the epoch's file order
        keys = [b["key"] for b in build_dataset(config, epoch=epoch).iter_batches(batch_size=None)]
        return np.concatenate(keys).tolist()

    e0, e1 = order(0), order(1)
    assert sorted(e0) == sorted(e1) == list(range(N))
    assert e0 != e1 and e0 == order(0)


def test_eval_mode_is_deterministic_across_epochs(ray_session, datasets):
    config = PipelineConfig(source=str(datasets["parquet"]), image_size=12, train=False)
    assert _images_by_key(build_dataset(config, epoch=0)) == _images_by_key(
        build_dataset(config, epoch=3)
    )


def test_task_compute_gives_the_actor_pools_rows(ray_session, datasets):
    """``compute="tasks"``: the same keys, labels and pixels as the actor pool, two ranks."""
    config = PipelineConfig(
        source=str(datasets["imagefolder"]), image_size=8, actors=(1, 2), files_per_task=9
    )
    rows = {}
    for compute in ("actors", "tasks"):
        ds = build_dataset(config.replace(compute=compute), epoch=1)
        ranks = consume_ranks(ds, 2, 5, device="cpu", normalize=False)
        keys = check_split(ranks, batch_size=5, total=N)
        batches = [b for r in ranks for b in r]
        images = np.concatenate([b["image"] for b in batches])
        rows[compute] = {int(k): img for k, img in zip(keys, images, strict=True)}
    shared = rows["actors"].keys() & rows["tasks"].keys()
    assert len(shared) >= N - 2 * 5 * 2
    assert all(np.array_equal(rows["actors"][k], rows["tasks"][k]) for k in shared)


def test_the_config_reaches_the_iterator(ray_session, datasets):
    """One loader config: iter_torch_batches(ds, config) takes the batch size, the
    normalization, uint8 or float, and the layout from the PipelineConfig; keywords win."""
    import torch

    config = PipelineConfig(source=str(datasets["parquet"]), image_size=8, batch_size=5,
                            normalize=False, channels_last=True, prefetch_batches=1)  # fmt: skip
    ds = build_dataset(config)
    batches = list(iter_torch_batches(ds, config, device="cpu"))
    assert [len(b["key"]) for b in batches] == [5] * (N // 5)
    image = batches[0]["image"]
    assert str(image.dtype) == "torch.uint8" and image.is_contiguous(memory_format=channel_last())
    with iter_torch_batches(ds, config, normalize=True, batch_size=3) as peek:
        floats = next(iter(peek))  # closed: its copy thread ends with the test
    assert str(floats["image"].dtype) == "torch.float32" and len(floats["key"]) == 3
    # the config's own mean and std, per channel: every pixel is (x/255 - mean) / std of
    # the same key's uint8 pixel (a loader that ignored them, or the channels' order, fails)
    mean, std = (0.2, 0.5, 0.8), (0.3, 0.5, 0.7)
    own = config.replace(normalize=True, mean=mean, std=std, channels_last=False)
    got = {int(k): img for b in iter_torch_batches(ds, own.loader, device="cpu")
           for k, img in zip(b["key"], b["image"], strict=True)}  # fmt: skip
    raw = {int(k): img for b in batches for k, img in zip(b["key"], b["image"], strict=True)}
    shared = got.keys() & raw.keys()
    assert len(shared) >= N - 2 * 5
    m, s = (torch.tensor(v).view(3, 1, 1) for v in (mean, std))
    for k in shared:
        torch.testing.assert_close(got[k], (raw[k].float() / 255 - m) / s, rtol=0, atol=1e-5)


def channel_last():
    import torch

    return torch.channels_last


def test_iterator_settings_are_checked(ray_session, datasets):
    ds = build_dataset(PipelineConfig(source=str(datasets["parquet"]), image_size=8))
    with pytest.raises(TypeError, match="batch_size"):
        iter_torch_batches(ds)
    with pytest.raises(TypeError, match="unknown settings"):
        iter_torch_batches(ds, batch_size=4, batchsize=4)
    with pytest.raises(ValueError, match=r"LoaderConfig\.batch_size=0"):
        iter_torch_batches(ds, batch_size=0)
