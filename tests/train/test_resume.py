"""Pipeline checkpoints: the bitmap, merging ranks, filtering before decode, and real
Ray Train jobs that die mid-epoch and resume with another number of workers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from raypipe import PipelineConfig, SkipLog, build_dataset, iter_torch_batches
from raypipe.plan.rankplan import RankPlan
from raypipe.plan.ranktasks import RankTasks
from raypipe.plan.shards import Listing, Shard, list_shards
from raypipe.train.state import PipelineState, merge_states
from tests.conftest import make_imagefolder, make_parquet, make_webdataset
from tests.formats.test_storage import s3  # noqa: F401


def _state(n: int, consumed=None, **kw) -> PipelineState:
    fields = {"epoch": 3, "seed": 7, "num_samples": n, "fingerprint": "ab" * 16}
    fields.update(kw)
    return PipelineState(consumed=np.zeros(n, bool) if consumed is None else consumed, **fields)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 1_281_167])
def test_state_round_trips_in_at_most_one_bit_per_sample(tmp_path, n):
    consumed = np.random.default_rng(n).random(n) < 0.3
    state = _state(n, consumed)
    written = state.save(tmp_path / "s.bin")
    assert written == (tmp_path / "s.bin").stat().st_size
    assert written - (n + 7) // 8 < 200  # the header is a small constant
    back = PipelineState.load(tmp_path / "s.bin")
    assert (back.epoch, back.seed, back.num_samples) == (3, 7, n)
    assert back.fingerprint == state.fingerprint
    assert np.array_equal(back.consumed, consumed)


def test_a_state_consumed_in_plan_order_is_a_small_fraction_of_a_bit_per_sample(tmp_path):
    """Ranks consume their slices of the epoch in order: the bits run in long stretches."""
    from raypipe.plan.rankplan import RankPlan

    counts = np.full(1000, 1000, np.int64)  # 10⁶ samples in 10³ shards, 64 ranks
    first, n = np.cumsum(counts) - counts, int(counts.sum())
    consumed = np.zeros(n, bool)
    for rank in range(64):
        keys = RankPlan(first, counts, 7, True, rank, 64, 1).keys(2)
        consumed[keys[: len(keys) * 2 // 5 + rank]] = True  # about 40 % in, ranks apart
    written = _state(n, consumed).save(tmp_path / "s.bin")
    assert written < n / 8 / 20, written
    assert np.array_equal(PipelineState.load(tmp_path / "s.bin").consumed, consumed)


def test_state_loads_from_a_checkpoint_folder_and_refuses_other_files(tmp_path):
    _state(10).save(tmp_path / "raypipe_state.bin")
    assert PipelineState.load(tmp_path).num_samples == 10
    (tmp_path / "other.bin").write_bytes(b"not a state")
    with pytest.raises(ValueError, match="not a raypipe pipeline checkpoint"):
        PipelineState.load(tmp_path / "other.bin")
    with pytest.raises(ValueError, match="shape"):
        _state(10, np.zeros(9, bool))


def test_a_state_whose_bits_are_cut_short_is_refused_not_read_as_unconsumed():
    """A state written without deflate (the layout of the format's raw bits) and cut short:
    numpy pads the missing bits with zeros, which read as keys never delivered, and the
    resumed epoch delivered them again."""
    import json
    import struct

    header = json.dumps({"epoch": 3, "seed": 7, "num_samples": 80, "fingerprint": "ab" * 16})
    whole = _state(80, np.ones(80, bool)).to_bytes()
    raw = whole[:8] + struct.pack("<I", len(header)) + header.encode() + bytes([255]) * 10
    assert PipelineState.from_bytes(raw).consumed.all()  # the raw layout reads
    with pytest.raises(ValueError, match="damaged.*3 bytes of bits for 80 samples"):
        PipelineState.from_bytes(raw[:-7], source="the state")


def test_the_skip_budget_is_the_share_as_written_at_billions_of_samples():
    from raypipe.skips.budget import skip_limit

    assert skip_limit(3_000_000_000, 0.29) == 870_000_000  # the float product: 869,999,999
    assert skip_limit(10_000_000_000, 0.57) == 5_700_000_000
    assert skip_limit(1000, 0.05) == 50 and skip_limit(1001, 0.05) == 50
    assert skip_limit(10, 1.0) == 9 and skip_limit(10, None) == 9 and skip_limit(10, 0) == 0
    assert skip_limit(3, 1 / 3) == 1 and skip_limit(3000, 1 / 3) == 1000  # a third, not 0.333
    assert skip_limit(3_000_000_000, 1 / 3) == 1_000_000_000 and skip_limit(7, 2 / 7) == 2
    assert skip_limit(10_000_000_000, 3e-10) == 3  # a tiny share of a huge epoch, not 0


def test_a_checkpoint_in_object_storage_is_read_through_its_filesystem(tmp_path, s3,  # noqa: F811
                                                                       monkeypatch):  # fmt: skip
    """``resume_from`` naming a checkpoint folder in S3 (the loopback server): its state is
    read, and the checkpoint handed to the ranks keeps its filesystem, so the model state
    beside it (`RunPosition.restored`) is read from there too. It kept only Ray's path
    without the scheme, which no rank could open."""
    import pickle

    import boto3
    import pyarrow.fs
    import torch

    from raypipe.train import checkpoint as ckpt

    opts = s3["options"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["access_key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret_key"])
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    local = tmp_path / "checkpoint_000003"
    local.mkdir()
    state = _state(10)
    state.save(local / "raypipe_state.bin")
    torch.save({"step": 3}, local / ckpt.USER_STATE)
    client = boto3.client("s3", endpoint_url=s3["url"], region_name="us-east-1",
                          aws_access_key_id=opts["access_key"],
                          aws_secret_access_key=opts["secret_key"])  # fmt: skip
    for f in local.iterdir():
        client.upload_file(str(f), "raypipe-test", f"runs/r1/{local.name}/{f.name}")
    host = s3["url"].removeprefix("http://")
    uri = f"s3://raypipe-test/runs/r1/{local.name}?endpoint_override={host}&scheme=http&region=us-east-1"
    got, where = ckpt.load_checkpoint(uri)
    assert np.array_equal(got.consumed, state.consumed) and got.epoch == state.epoch
    assert isinstance(where.filesystem, pyarrow.fs.S3FileSystem)
    where = pickle.loads(pickle.dumps(where))  # as it reaches every rank
    assert ckpt._read(where, ckpt.USER_STATE, torch.load) == {"step": 3}
    with pytest.raises(ValueError, match="neither a raypipe checkpoint"):
        ckpt.load_checkpoint(uri.replace(local.name, "checkpoint_000009"))


def test_a_checkpoint_is_found_by_a_relative_or_home_path_or_itself(tmp_path, monkeypatch):
    """``resume_from="runs/checkpoint_000001"`` (relative), ``"~/..."``, or the Checkpoint
    ``result.checkpoint`` is: all load (a relative path is no URI to Ray Train's Checkpoint,
    and was refused)."""
    import ray.train

    from raypipe.train.checkpoint import load_checkpoint

    folder = tmp_path / "runs" / "checkpoint_000001"
    folder.mkdir(parents=True)
    _state(10).save(folder / "raypipe_state.bin")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for where in ("runs/checkpoint_000001", "~/runs/checkpoint_000001",
                  ray.train.Checkpoint(str(folder))):  # fmt: skip
        state, checkpoint = load_checkpoint(where)
        assert state.num_samples == 10 and checkpoint.path == str(folder)


def test_merge_is_the_or_of_ranks_and_base():
    base = np.zeros(20, bool)
    base[[0, 1]] = True
    ranks = [{"keys": np.array([5, 2, 9])}, {"keys": np.array([19, 3])}, {"keys": []}]
    merged = merge_states(ranks, 20, base)
    assert set(np.flatnonzero(merged)) == {0, 1, 2, 3, 5, 9, 19}
    assert not base[5]  # the base is not changed
    with pytest.raises(ValueError, match="outside 0..19"):
        merge_states([{"keys": np.array([20])}], 20)


def pending_rows(shards, consumed) -> list[dict]:
    """The shard rows the actors read of a resumed epoch (every task of a rank of one)."""
    listing = Listing("webdataset", tuple(shards))
    plan = RankPlan.of(listing, seed=0, shuffle=False, rank=0, world_size=1, per_task=64,
                       resume_epoch=0 if consumed is not None else -1, consumed=consumed)  # fmt: skip
    tasks = RankTasks.of(listing, plan, range(1))
    columns = [tasks.rows(t)[1] for t in range(len(tasks))]
    return [
        dict(zip(c, row, strict=True)) for c in columns for row in zip(*c.values(), strict=True)
    ]


def test_pending_rows_drop_consumed_shards_and_mark_consumed_members():
    shards = [Shard("a", 0, 4), Shard("b", 4, 3), Shard("c", 7, 2)]
    consumed = np.zeros(9, bool)
    consumed[[0, 1, 2, 3, 5]] = True  # a all, b one member, c none
    rows = pending_rows(shards, consumed)
    assert [r["path"] for r in rows] == ["b", "c"]
    assert np.unpackbits(np.frombuffer(rows[0]["done"], np.uint8))[:3].tolist() == [0, 1, 0]
    assert rows[1]["done"] == b""
    assert all(r["done"] == b"" for r in pending_rows(shards, None))


def test_check_refuses_other_data_and_seeds(datasets):
    listing = list_shards(PipelineConfig(source=str(datasets["parquet"])))
    good = _state(listing.num_samples, seed=0, fingerprint=listing.fingerprint)
    good.check(listing, 0)
    with pytest.raises(ValueError, match="seed=1"):
        good.check(listing, 1)
    with pytest.raises(ValueError, match="fingerprint"):
        _state(listing.num_samples, seed=0).check(listing, 0)
    with pytest.raises(ValueError, match="num_samples=5"):
        _state(5, seed=0).check(listing, 0)


def test_iterator_state_has_the_delivered_keys_only(ray_session):
    """Prefetched batches are not in state_dict(); the ones handed out are, in order."""
    import ray.data

    rows = [{"image": np.zeros((3, 2, 2), np.uint8), "label": 0, "key": k} for k in range(64)]
    ds = ray.data.from_items(rows, override_num_blocks=8)
    it = iter_torch_batches(ds, batch_size=4, device="cpu", prefetch_batches=4)
    seen = []
    for i, batch in enumerate(it):
        seen.extend(batch["key"].tolist())
        assert it.state_dict()["keys"].tolist() == seen
        if i == 2:
            break
    assert len(seen) == 12
    it.close()


def _corrupt_consumed(root, fmt, consumed):
    """Overwrite the bytes of every consumed sample: decoding one would be a skip."""
    listing = list_shards(PipelineConfig(source=str(root), format=fmt))
    for shard in listing.shards:
        done = consumed[shard.first_key : shard.first_key + shard.num_samples]
        if fmt == "imagefolder" and done[0]:
            with open(shard.path, "r+b") as f:
                f.write(b"\0" * 16)
        elif fmt == "webdataset":
            with tarfile.open(shard.path) as tar:
                jpgs = [m for m in tar.getmembers() if m.name.endswith(".jpg")]
            with open(shard.path, "r+b") as f:
                for member, is_done in zip(jpgs, done, strict=True):
                    if is_done:
                        f.seek(member.offset_data)
                        f.write(b"\0" * member.size)
        elif fmt == "parquet" and done.any():
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pq.read_table(shard.path)
            images = [
                b"\0" * 8 if d else im
                for im, d in zip(table["image"].to_pylist(), done, strict=True)
            ]
            table = table.set_column(0, "image", pa.array(images, pa.binary()))
            pq.write_table(table, shard.path, row_group_size=8)


@pytest.mark.parametrize("fmt", ["imagefolder", "webdataset", "parquet"])
def test_consumed_keys_are_neither_delivered_nor_decoded(ray_session, tmp_path, fmt):
    make = {"imagefolder": make_imagefolder, "webdataset": make_webdataset}.get(fmt, make_parquet)
    sizes = {"imagefolder": {"a": 9, "b": 8}, "webdataset": [9, 8, 10], "parquet": [20, 7]}[fmt]
    root = make(tmp_path / fmt, sizes)
    config = PipelineConfig(source=str(root), format=fmt, image_size=8, batch_size=4)
    n = list_shards(config).num_samples
    consumed = np.random.default_rng(1).random(n) < 0.5
    consumed[:9] = True  # a whole shard (and 2 whole row groups of the first parquet file)
    _corrupt_consumed(root, fmt, consumed)
    skips = SkipLog.create()
    ds = build_dataset(config, epoch=2, consumed=consumed, skips=skips)
    keys = [int(k) for b in ds.iter_batches(batch_size=None) for k in b["key"]]
    assert sorted(keys) == np.flatnonzero(~consumed).tolist()
    assert skips.counts() == {}  # no corrupt (consumed) sample was decoded


def test_a_fully_consumed_epoch_is_empty(ray_session, datasets):
    config = PipelineConfig(source=str(datasets["webdataset"]), image_size=8, batch_size=4)
    ds = build_dataset(config, consumed=np.ones(61, bool))
    assert ds.count() == 0
    with pytest.raises(ValueError, match=r"shape \(60,\)"):
        build_dataset(config, consumed=np.ones(60, bool))


def test_train_ddp_refuses_a_checkpoint_it_cannot_resume(datasets, tmp_path):
    from raypipe import train_ddp

    config = PipelineConfig(source=str(datasets["webdataset"]), image_size=8, batch_size=4)
    listing = list_shards(config)
    done = _state(61, epoch=2, seed=0, fingerprint=listing.fingerprint)
    done.save(tmp_path / "raypipe_state.bin")
    with pytest.raises(ValueError, match="is at epoch 2: epochs=2 leaves nothing"):
        train_ddp(config, lambda ctx: None, epochs=2, resume_from=tmp_path)
    with pytest.raises(ValueError, match="neither a raypipe checkpoint nor a run folder with one"):
        train_ddp(config, lambda ctx: None, resume_from=tmp_path / "nowhere")


# 101 samples in 6 tar shards, batches of 4: 2 ranks drop 5 per epoch, 1 rank drops 1.
RESUME_SHARDS = [17, 23, 9, 12, 20, 20]
B = 4


@pytest.fixture(scope="module")
def wds101(tmp_path_factory):
    return make_webdataset(tmp_path_factory.mktemp("resume") / "wds", RESUME_SHARDS)


def _killed_job(ray, spec: dict) -> None:
    """Run tests/resume_job.py in its own process until a worker SIGKILLs it."""
    spec = {**spec, "address": ray.get_runtime_context().gcs_address}
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "tests.resume_job", json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=400)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-4000:]
    for _ in range(300):  # Ray ends the dead job's actors; wait for their CPUs
        if ray.available_resources().get("CPU", 0) >= ray.cluster_resources()["CPU"]:
            break
        time.sleep(0.2)


def _lines(out: Path, tag: str, epoch: int, attempt: int | None = None) -> list[list[dict]]:
    """The batches each worker of a run delivered in ``epoch``, one list per rank and attempt."""
    pattern = f"{tag}-a{'*' if attempt is None else attempt}-e{epoch}-r*.jsonl"
    return [
        [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(out.glob(pattern))
    ]


def _keys(out: Path, tag: str, epoch: int, upto: int | None = None, attempt: int = 0) -> list:
    return [
        k
        for lines in _lines(out, tag, epoch, attempt)
        for line in lines
        if upto is None or line["step"] <= upto
        for k in line["keys"]
    ]


def _consumed(run_dir: Path) -> tuple[int, set[int]]:
    from raypipe.train.checkpoint import load_checkpoint

    state, _ = load_checkpoint(run_dir)
    return state.epoch, set(np.flatnonzero(state.consumed).tolist())


def _restored(out: Path, tag: str) -> list:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{tag}-a*-restored.json"))]


@pytest.mark.slow
def test_killed_jobs_resume_exactly_once_with_other_world_sizes(ray_session, wds101, tmp_path):
    from tests.resume_job import run

    out, runs = tmp_path / "keys", tmp_path / "runs"
    out.mkdir()
    config = {"source": str(wds101), "image_size": 8, "batch_size": B, "actors": [1, 1],
              "actor_cpus": 0.5}  # fmt: skip
    base = {"config": config, "epochs": 2, "every": 2, "out": str(out)}

    # 1: two workers, killed at epoch 0 step 5; the latest checkpoint is step 4 (32 keys)
    spec = {**base, "tag": "r1", "workers": 2, "run_dir": str(runs / "r1")}
    _killed_job(ray_session, {**spec, "crash": [0, 5], "expect": [0, 32]})
    epoch, first = _consumed(runs / "r1")
    assert epoch == 0 and first == set(_keys(out, "r1", 0, upto=4))  # not the 5th, not prefetched
    assert _restored(out, "r1") == [None]

    # 2: one worker resumes it; killed at epoch 0 step 7, latest checkpoint at step 6 (+24 keys)
    spec = {**base, "tag": "r2", "workers": 1, "run_dir": str(runs / "r2")}
    _killed_job(ray_session, {**spec, "resume_from": str(runs / "r1"), "crash": [0, 7],
                              "expect": [0, 56]})  # fmt: skip
    assert not first & set(_keys(out, "r2", 0))  # consumed keys are not delivered again
    epoch, second = _consumed(runs / "r2")
    assert epoch == 0 and second == first | set(_keys(out, "r2", 0, upto=6))
    assert _restored(out, "r2") == [{"tag": "r1"}]

    # 3: two workers resume the same epoch again and finish it. In epoch 1 a worker dies
    # twice, and Ray Train restarts the group from the run's latest checkpoint: first
    # right after the epoch-end one (step 1), then after the step-4 one (step 5)
    spec = {**base, "tag": "r3", "workers": 2, "run_dir": str(runs / "r3")}
    result = run({**spec, "resume_from": str(runs / "r2"), "fail": [[1, 1, 1, 0], [1, 5, 1, 32]],
                  "max_failures": 2})  # fmt: skip
    assert result.error is None, result.error
    epoch0 = _keys(out, "r1", 0, upto=4) + _keys(out, "r2", 0, upto=6) + _keys(out, "r3", 0)
    assert len(epoch0) == len(set(epoch0))  # exactly once over three jobs and 2 → 1 → 2 ranks
    assert set(epoch0) <= set(range(101)) and 101 - len(epoch0) == 5  # 45 left, 2×22 → 2×20
    assert not _lines(out, "r3", 0, attempt=1) and not _lines(out, "r3", 0, attempt=2)
    epoch1 = _keys(out, "r3", 1, upto=4, attempt=1) + _keys(out, "r3", 1, attempt=2)
    assert len(epoch1) == len(set(epoch1)) == 96  # whole: 32, then 69 left, 2×34 → 2×32
    assert [len(lines) for lines in _lines(out, "r3", 1, attempt=2)] == [8, 8]
    assert _restored(out, "r3") == [{"tag": "r2"}, {"tag": "r3"}, {"tag": "r3"}]

    # the same seeds as an uninterrupted run: every key's augmented image is the same
    sums = _reference_sums(PipelineConfig(**config), epochs=2)
    for tag, epoch in (("r1", 0), ("r2", 0), ("r3", 0), ("r3", 1)):
        for lines in _lines(out, tag, epoch):
            for line in lines:
                for key, s in zip(line["keys"], line["sums"], strict=True):
                    assert s == pytest.approx(sums[epoch][key], rel=1e-9, abs=1e-6), (tag, key)


def _reference_sums(config: PipelineConfig, epochs: int) -> list[dict[int, float]]:
    """Per epoch and key: the sum of the normalized image an uninterrupted run delivers."""
    import torch

    from raypipe.loader.device import normalize

    sums = []
    for epoch in range(epochs):
        found = {}
        for b in build_dataset(config, epoch=epoch).iter_batches(batch_size=None):
            image = normalize(
                {"image": torch.from_numpy(np.array(b["image"]))}, config.mean, config.std
            )
            totals = image["image"].to(torch.float64).sum(dim=(1, 2, 3))
            found.update(zip(b["key"].tolist(), totals.tolist(), strict=True))
        sums.append(found)
    return sums
