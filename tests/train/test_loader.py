"""`raypipe.Loader` in a plain ``for epoch: for batch in loader:`` loop through a real local
Ray: two ranks (threads sharing a ledger handle), exactly once and equal batches per epoch,
``len()``, leaving an epoch early, resuming from ``state_dict()``, and misuse refused."""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest
import torch

from raypipe import Loader, Pipeline, PipelineConfig
from raypipe.loader.ledger import RanksDisagree
from raypipe.train.loader import MISUSE
from raypipe.train.state import PipelineState
from tests.properties import check_exactly_once_and_equal, keys_of
from tests.ranks import in_threads

B = 4


def _config(datasets) -> PipelineConfig:
    return PipelineConfig(source=str(datasets["webdataset"]), image_size=8, batch_size=B,
                          actors=(2, 2), rows_per_block=4)  # fmt: skip


def _ranks(body, world: int = 2) -> list:
    """``body(r)`` on ``world`` threads; returns their results, raises the first error."""
    out, errors = [None] * world, []

    def rank(r: int) -> None:
        try:
            out[r] = body(r)
        except BaseException as e:
            errors.append(e)

    in_threads(rank, world, timeout=300)
    if errors:
        raise errors[0]
    return out


def test_two_ranks_two_epochs_exactly_once_equal_and_len(ray_session, datasets):
    config, ledger = _config(datasets), Pipeline.ledger(2)

    def body(r: int):
        with Loader(config, epochs=2, rank=r, world_size=2, ledger=ledger, device="cpu") as loader:
            lens = len(loader)
            epochs = []
            for epoch in range(2):
                loader.set_epoch(epoch)  # the next one anyway: nothing changes
                epochs.append([keys_of(b) for b in loader])
            return lens, epochs

    (len0, a), (len1, b) = _ranks(body)
    assert len0 == len1 == 61 // 2 // B == 7
    for epoch in range(2):
        keys = check_exactly_once_and_equal([a[epoch], b[epoch]], batch_size=B, good=range(61),
                                            left_over=2 * B - 1)  # fmt: skip
        assert len(a[epoch]) == len0
    assert [k.tolist() for k in a[0]] != [k.tolist() for k in a[1]]  # a new order per epoch
    assert len(keys) == 56


def test_leaving_an_epoch_early_then_a_whole_next_epoch(ray_session, datasets):
    config, ledger = _config(datasets), Pipeline.ledger(2)

    def body(r: int):
        loader = Loader(config, epochs=3, rank=r, world_size=2, ledger=ledger, device="cpu")
        first = []
        for batch in loader:
            first.append(keys_of(batch))
            if len(first) == 2:
                break
        after_break = loader.state_dict()  # still epoch 0: what was read of it (a saved run
        second = [keys_of(b) for b in loader]  # resumes with its rest); iter() goes on to 1
        loader.close()
        return first, after_break, second, loader.state_dict()["epoch"]

    (f0, e0, s0, n0), (f1, e1, s1, n1) = _ranks(body)
    assert len(f0) == len(f1) == 2 and e0["epoch"] == e1["epoch"] == 0 and n0 == n1 == 2
    held = [PipelineState.from_bytes(e["state"].numpy().tobytes()).consumed for e in (e0, e1)]
    both = held[0] | held[1]  # each rank holds its own keys: the ranks' OR, as a group's
    assert sorted(np.flatnonzero(both).tolist()) == sorted(np.concatenate(f0 + f1).tolist())
    keys = check_exactly_once_and_equal([s0, s1], batch_size=B, good=range(61), left_over=2 * B - 1)
    assert len(keys) == 56 and len(s0) == 7


def test_a_loaders_options_are_checked_when_it_is_made(datasets):
    """A misspelt option, or ``drop_last="no"`` (truthy: len() counted it as True), was
    found only when the pool started, after the listing and the ranks' join."""
    config = _config(datasets)
    with pytest.raises(TypeError, match=r"\['prefetch'\], which raypipe.Pipeline does not take"):
        Loader(config, epochs=1, prefetch=4)
    with pytest.raises(ValueError, match="drop_last='no': must be true or false"):
        Loader(config, epochs=1, drop_last="no")
    with pytest.raises(ValueError, match="drop_last=None must be True or False"):
        Loader(config, epochs=1, drop_last=None)  # was len()'s False until the first next()
    # found at the first next(), after the listing and the pool's start (skips: an
    # AttributeError in the feeder)
    with pytest.raises(ValueError, match=r"progress_s=-1 must be seconds >= 0"):
        Loader(config, epochs=1, progress_s=-1)
    with pytest.raises(TypeError, match=r"skips= must be a raypipe.skips.log.SkipLog .* got str"):
        Loader(config, epochs=1, skips="x")
    Loader(config, epochs=1, prefetch_batches=4, drop_last=False, device="cpu")  # no work yet
    loader = Loader(config, epochs=3, device="cpu")
    for bad in (True, -1, 3, 1.0):  # True was taken as epoch 1 (and named True)
        with pytest.raises(ValueError, match=r"must be an integer in 0\.\.2"):
            loader.set_epoch(bad)


def test_after_len_batches_the_state_is_the_next_epochs_without_drop_last(ray_session, datasets):
    """Lightning takes ``len()`` batches and checkpoints without reaching the end of the
    iterator. With ``drop_last=False`` the state after them still named the epoch just
    read, every key consumed: a resume gave an empty epoch and shifted every later one."""
    config = _config(datasets)
    with Loader(config, epochs=2, device="cpu", drop_last=False) as loader:
        n = len(loader)
        batches = iter(loader)
        keys = [keys_of(next(batches)) for _ in range(n)]
        state = loader.state_dict()
    assert n == -(-61 // B) and sum(len(k) for k in keys) == 61
    assert state["epoch"] == 1 and loader.epoch == 1
    assert not PipelineState.from_bytes(state["state"].numpy().tobytes()).consumed.any()


def test_resume_mid_epoch_from_state_dict_with_another_world_size(ray_session, datasets):
    """Two ranks stop after 3 batches of epoch 0; their states, ORed as the all_reduce of a
    process group would, resume one rank: the rest of epoch 0 once, then a whole epoch 1."""
    config, ledger = _config(datasets), Pipeline.ledger(2)

    def body(r: int):
        loader = Loader(config, epochs=2, rank=r, world_size=2, ledger=ledger, device="cpu")
        it, seen = iter(loader), []
        for _ in range(3):
            seen.append(keys_of(next(it)))
        state = loader.state_dict()
        loader.close()
        return seen, state

    (seen0, st0), (seen1, st1) = _ranks(body)
    before = np.concatenate(seen0 + seen1)
    assert st0["epoch"] == st1["epoch"] == 0
    a, b = (PipelineState.from_bytes(s["state"].numpy().tobytes()) for s in (st0, st1))
    consumed = a.consumed | b.consumed  # what the all_reduce of a process group does
    both = PipelineState(a.epoch, a.seed, a.num_samples, a.fingerprint, consumed)
    merged = {"epoch": 0, "state": torch.frombuffer(bytearray(both.to_bytes()), dtype=torch.uint8)}
    assert sorted(np.flatnonzero(consumed).tolist()) == sorted(before.tolist())

    with Loader(config, epochs=2, world_size=1, rank=0, device="cpu") as loader:
        loader.load_state_dict(merged)
        assert loader.epoch == 0
        rest = [keys_of(b) for b in loader]
        whole = [keys_of(b) for b in loader]
        assert loader.state_dict()["epoch"] == 2
    epoch0 = np.concatenate([before, *rest])
    assert len(set(epoch0.tolist())) == len(epoch0) and 61 - len(epoch0) < B
    check_exactly_once_and_equal([whole], batch_size=B, good=range(61), left_over=B - 1)


def test_an_epoch_left_early_stays_in_the_state_after_close_until_the_next_iter(
    ray_session, datasets
):
    """A loop that breaks, leaves the ``with`` and saves: close() dropped the epoch left, and
    the state named the next one, its read keys lost to a resume."""
    with Loader(_config(datasets), epochs=2, device="cpu") as loader:
        for i, _ in enumerate(loader):
            if i == 2:
                break
        iter(loader)  # the next epoch from here on: the one left is dropped
        dropped = loader.state_dict()
        loader.set_epoch(0)
        for i, _ in enumerate(loader):
            if i == 1:
                break
    saved = loader.state_dict()  # after close()
    assert dropped["epoch"] == 1 and saved["epoch"] == 0
    consumed = PipelineState.from_bytes(saved["state"].numpy().tobytes()).consumed
    assert np.flatnonzero(consumed).size == 2 * B


def test_an_iterator_made_before_load_state_dict_reads_the_resumed_epoch(ray_session, datasets):
    """It was refused as a nested or zipped loop's, though no later iter() was made."""
    config = _config(datasets)
    with Loader(config, epochs=2, device="cpu") as loader:
        it = iter(loader)
        first = [keys_of(next(it)) for _ in range(3)]
        state = loader.state_dict()
    with Loader(config, epochs=2, device="cpu") as loader:
        early = iter(loader)
        loader.load_state_dict(state)
        rest = [keys_of(b) for b in early]
    keys = np.concatenate(first + rest).tolist()
    assert len(keys) == len(set(keys)) and 61 - len(keys) < B and loader.epoch == 1


def test_iterated_twice_at_once_is_refused(ray_session, datasets):
    with Loader(_config(datasets), epochs=3, device="cpu") as loader:
        with pytest.raises(RuntimeError, match="iterated twice at once") as refused:
            for _ in zip(loader, loader, strict=True):
                pass
        assert str(refused.value).startswith("a Loader gives one epoch at a time")
        assert MISUSE in str(refused.value)
        assert loader.epoch == 0  # neither of zip's iterators started an epoch
        stale, fresh = iter(loader), iter(loader)  # Lightning asks twice, uses the second
        assert sum(len(keys_of(b)) for b in fresh) == 60  # epoch 0, whole
        with pytest.raises(RuntimeError, match="iterated twice at once"):
            next(stale)
        for epoch in (1, 2):
            assert sum(len(keys_of(b)) for b in loader) == 60 and loader.epoch == epoch + 1
        done = iter(loader)  # Lightning asks before it sees a finished fit has nothing left
        with pytest.raises(RuntimeError, match="were all read: pass a larger epochs="):
            next(done)
        loader.set_epoch(0)  # back to the start: a new pool, a whole epoch
        assert sum(len(keys_of(b)) for b in loader) == 60
        with pytest.raises(ValueError, match="epoch=3"):
            loader.set_epoch(3)


@pytest.mark.parametrize(
    "other,match",
    [
        ({"world_size": 3}, ("rank 1 has world_size=3, the ledger's ranks 2",)),
        # named from whichever rank joined first: rank 0 usually, rank 1 on a busy machine
        (
            {"batch_size": 6},
            (
                "rank 1 has batch_size=6, rank 0 batch_size=4",
                "rank 0 has batch_size=4, rank 1 batch_size=6",
            ),
        ),
        # a state loaded, or an epoch set, on one rank only: they would read apart and wait
        # on each other for ever (the ledger never settling a batch)
        (
            {"epoch": 1},
            (
                "rank 1 has start=epoch 1, rank 0 start=epoch 0",
                "rank 0 has start=epoch 0, rank 1 start=epoch 1",
            ),
        ),
    ],
)
def test_ranks_that_disagree_fail_before_work_in_one_line(ray_session, datasets, other, match):
    config, ledger = _config(datasets), Pipeline.ledger(2)
    errors = []

    def body(r: int):
        if r == 1:
            time.sleep(0.5)  # rank 0 joins first, then waits for rank 1
        world = other.get("world_size", 2) if r == 1 else 2
        conf = config.replace(batch_size=other.get("batch_size", B)) if r == 1 else config
        loader = Loader(conf, epochs=2, rank=r, world_size=world, ledger=ledger, device="cpu")
        if r == 1 and "epoch" in other:
            loader.set_epoch(other["epoch"])
        try:
            loader.start()
        except RanksDisagree as e:
            errors.append((r, str(e)))
            assert loader._pipeline is None  # no pool was started
        finally:
            loader.close()

    _ranks(body)
    assert sorted(r for r, _ in errors) == [0, 1]
    for _, message in errors:
        assert "\n" not in message and any(m in message for m in match), message


def test_the_ranks_settings_hold_no_storage_credentials():
    """What the ranks compare (and a disagreement prints) names the storage options, never
    their values: each rank's own session token is not a disagreement, nor sent anywhere."""
    from raypipe.plan.shards import Listing, Shard
    from raypipe.train.ranks import run_settings

    listing = Listing("parquet", (Shard("s3://b/d/a.parquet", 0, 8),))
    mine, theirs = (
        run_settings(
            PipelineConfig(source="s3://b/d", storage_options={"key": "AKIA1", "secret": s}),
            epochs=1,
            listing=listing,
            drop_last=True,
        )  # fmt: skip
        for s in ("s3cr3t-0", "s3cr3t-1")
    )
    assert mine == theirs and "s3cr3t" not in repr(mine) and "key" in mine["storage_options"]


def test_set_epoch_after_iter_before_the_first_batch_reads_that_epoch(ray_session, datasets):
    """A DataLoader's sampler is read at the first ``next()``: Lightning makes the iterator,
    then sets the epoch. The Loader raised "used after a later iter()" there. Its
    ``sampler`` (what Lightning calls ``set_epoch`` on) moves it on, never back."""
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=4,
                            actors=(1, 1))  # fmt: skip

    def keys(batches) -> list[int]:
        return [k for b in batches for k in b["key"].tolist()]

    with Loader(config, epochs=3, device="cpu") as loader:
        it = iter(loader)
        loader.set_epoch(2)
        late = keys(it)
    with Loader(config, epochs=3, device="cpu") as loader:
        loader.set_epoch(2)
        assert keys(loader) == late and loader.epoch == 3  # read: the next is past the end
    with Loader(config, epochs=3, device="cpu") as loader:
        loader.sampler.set_epoch(2)  # nothing read yet (a fit resumed at an epoch's end)
        assert keys(loader) == late
    with Loader(config, epochs=3, device="cpu") as loader:
        first = keys(loader)
        loader.sampler.set_epoch(0)  # once it has read, it reads on: behind...
        loader.sampler.set_epoch(2)  # ...or ahead (a validation Loader's passes need not
        assert loader.epoch == 1 and keys(loader) != first  # match the training epochs)


def test_a_batch_no_rank_could_fill_is_refused_before_the_ranks_join(datasets):
    """61 samples over 4 ranks, batches of 16: every epoch was empty, len() 0, no word
    (train_ddp refused it); refused at the first iter(), before any rank joins."""
    config = PipelineConfig(source=str(datasets["imagefolder"]), image_size=8, batch_size=16)
    loader = Loader(config, epochs=1, rank=0, world_size=4, device="cpu")
    for use in (lambda: next(iter(loader)), lambda: len(loader)):  # len() was 0
        with pytest.raises(ValueError, match=r"batch_size=16 is larger than one rank's share "
                           r"\(61 samples / 4 ranks = 15\)"):  # fmt: skip
            use()
    loader.close()


def test_ranks_that_restart_differently_after_the_start_fail_in_one_line(ray_session, datasets):
    """Both ranks started; rank 0 then set epoch 1, rank 1 loaded a state of epoch 0: each
    gets one line naming the difference. One rank restarting alone times out in
    join_timeout_s instead of waiting for ever (its peer's epoch came up empty)."""
    config, ledger = _config(datasets), Pipeline.ledger(2)
    state = Loader(config, epochs=2, rank=0, world_size=1, device="cpu").state_dict()
    errors: list = []

    def body(r: int):
        with Loader(config, epochs=2, rank=r, world_size=2, ledger=ledger, device="cpu",
                    join_timeout_s=20) as loader:  # fmt: skip
            loader.load_state_dict(state) if r else loader.set_epoch(1)
            try:
                loader.start()
            except RanksDisagree as e:
                errors.append(str(e))

    _ranks(body)
    assert len(errors) == 2 and all("start=epoch" in m and "\n" not in m for m in errors), errors
    ledger = Pipeline.ledger(2)

    def alone(r: int):
        with Loader(config, epochs=2, rank=r, world_size=2, ledger=ledger, device="cpu",
                    join_timeout_s=5) as loader:  # fmt: skip
            if r == 1:
                loader.set_epoch(1)
                with pytest.raises(TimeoutError, match=r"1 of world_size=2 ranks restarted"):
                    loader.start()

    _ranks(alone)


def test_a_closed_loader_starts_no_pool_and_says_so(ray_session, datasets):
    loader = Loader(_config(datasets), epochs=1, rank=0, world_size=1, device="cpu")
    loader.close()
    for use in (loader.start, loader.__enter__, lambda: iter(loader)):
        with pytest.raises(RuntimeError, match="the Loader is closed"):
            use()
    assert loader._pipeline is None


def test_iterators_made_before_close_end_with_it(ray_session, datasets):
    """An iterator made before ``close()`` built a new pool at its first ``next()`` that no
    later ``close()`` stopped; one half read ended as if its epoch were over; and the closed
    Loader kept its host-to-device ring (pinned memory on CUDA) while it lived."""
    config = _config(datasets)
    loader = Loader(config, epochs=2, rank=0, world_size=1, device="cpu")
    unstarted = iter(loader)
    loader.close()
    with pytest.raises(RuntimeError, match="the Loader is closed"):
        next(unstarted)
    assert loader._pipeline is None
    loader = Loader(config, epochs=2, rank=0, world_size=1, device="cpu")
    half = iter(loader)
    next(half)
    batches = weakref.ref(loader._running.batches)  # holds the ring
    loader.close()
    state = loader.state_dict()  # after close() too: where the run stands
    consumed = PipelineState.from_bytes(bytes(state["state"].numpy())).consumed
    assert state["epoch"] == 0 and consumed.sum() == B
    with pytest.raises(RuntimeError, match="the Loader is closed"):
        next(half)
    del half
    gc.collect()
    assert batches() is None


def test_set_epoch_within_an_epochs_loop_ends_it_saying_why(ray_session, datasets):
    """``set_epoch(epoch)`` at every step (a training loop's hook) restarted the pool at
    that epoch, and the loop then failed as "nested or zipped loops". It still ends the
    loop (the next ``iter()`` reads that epoch whole, as a DistributedSampler's would),
    and now says why."""
    with Loader(_config(datasets), epochs=2, rank=0, world_size=1, device="cpu") as loader:
        seen = []
        with pytest.raises(RuntimeError, match=r"^set_epoch\(0\) was called while epoch 0 "
                           r"was being read: .* set the epoch before the loop"):  # fmt: skip
            for batch in loader:
                loader.set_epoch(0)
                seen.append(batch)
        assert len(seen) == 1
        assert sum(len(keys_of(b)) for b in loader) == 60 and loader.epoch == 1


def test_world_size_without_rank_is_refused_and_a_damaged_state_is_one_line(datasets, monkeypatch):
    from raypipe.train.ranks import resolve_world

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="WORLD_SIZE=2 but RANK is not set"):
        resolve_world(None, None)
    assert resolve_world(1, None) == (1, 2)
    monkeypatch.setenv("RANK", "1")
    assert resolve_world(None, None) == (1, 2)
    monkeypatch.setenv("RANK", "")  # an empty export is no rank (int('') named neither)
    with pytest.raises(ValueError, match="WORLD_SIZE=2 but RANK is not set"):
        resolve_world(None, None)
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match=r"^RANK='one' in the environment: must be an integer"):
        resolve_world(None, None)
    monkeypatch.setenv("RANK", "1")
    loader = Loader(_config(datasets), epochs=2, rank=0, world_size=1, device="cpu")
    good = PipelineState(0, 0, 60, "f" * 32, np.zeros(60, bool)).to_bytes()
    for data in (good[:20], torch.frombuffer(bytearray(good[:30]), dtype=torch.uint8)):
        with pytest.raises(ValueError, match=r"^the Loader state is a damaged raypipe pipeline"):
            loader.load_state_dict({"state": data})
    for data in ("abc", torch.zeros(3), [1, 300]):  # "invalid literal for int()", or bytes made
        with pytest.raises(ValueError, match=r"^not a Loader.state_dict\(\): its 'state' is \w+"):
            loader.load_state_dict({"state": data})


@pytest.mark.timeout(180)
def test_after_a_data_error_each_iter_reads_the_next_epoch_and_says_its_own(ray_session,
                                                                            tmp_path):  # fmt: skip
    """A data error (a file no decoder reads, ``on_error="raise"``) ends the epoch's loop
    as itself; the next ``iter()`` reads the next epoch from a new pool, as a DataLoader's
    next iterator would. The pool that had stopped was kept: the next ``iter()`` waited
    for ever on it."""
    from raypipe import SampleError
    from tests.conftest import make_imagefolder

    source = make_imagefolder(tmp_path / "data", {"a": 6, "b": 6}, seed=4)
    (source / "a" / "0001.jpg").write_bytes(b"no image at all")
    config = PipelineConfig(source=str(source), image_size=8, batch_size=2, on_error="raise",
                            actors=(1, 1))  # fmt: skip
    with Loader(config, epochs=3, rank=0, world_size=1, device="cpu") as loader:
        for epoch in range(3):
            with pytest.raises(SampleError, match="0001.jpg"):
                for _ in loader:
                    pass
            assert loader.epoch == epoch + 1
        with pytest.raises(RuntimeError, match="epochs=3 were all read"):
            next(iter(loader))


def test_load_state_dict_within_an_epochs_loop_ends_it_saying_why(ray_session, datasets):
    """``load_state_dict`` during an epoch's loop ends that loop (the next ``iter()``
    resumes at the state), and says so, where it blamed nested or zipped loops."""
    with Loader(_config(datasets), epochs=2, rank=0, world_size=1, device="cpu") as loader:
        state = loader.state_dict()
        with pytest.raises(RuntimeError, match=r"^load_state_dict\(\) was called while "
                           r"epoch 0 was being read"):  # fmt: skip
            for _ in loader:
                loader.load_state_dict(state)
        assert sum(len(keys_of(b)) for b in loader) == 60 and loader.epoch == 1


def test_an_error_of_the_loops_own_keeps_the_pool(ray_session, datasets):
    """A collate's own error (not the pool's) ends the epoch's loop; the next ``iter()``
    reads the next epoch from the same pool, which every rank still shares (a new pool on
    one rank of several waited at its restart for peers that never restarted)."""
    from tests import user_transforms

    user_transforms.COLLATED[0] = 0
    config = _config(datasets).replace(collate="tests.user_transforms:fails_once_collate")
    with Loader(config, epochs=2, rank=0, world_size=1, device="cpu") as loader:
        with pytest.raises(RuntimeError, match="a collate bug"):
            for _ in loader:
                pass
        pipeline = loader._pipeline
        assert sum(len(b["key"]) for b in loader) == 60 and loader._pipeline is pipeline
