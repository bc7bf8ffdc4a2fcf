"""Guarantee 4 of DESIGN.md: bad input is skipped, counted and reported, or stops the epoch
naming the file; valid but unusual input is converted; good samples are delivered once.

Most checks run the actors' own code (`Preprocessor`) in this process, on files each
test generates; the epoch-level ones run through a real local Ray, two ranks via
``streaming_split``.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, UnidentifiedImageError

from raypipe import PipelineConfig, SampleError, SkipLog, build_dataset, iter_torch_batches
from raypipe.plan.shards import list_shards
from raypipe.preprocess.actor import Preprocessor
from raypipe.preprocess.augment import Box, Plan
from raypipe.preprocess.decode import decode_crop as fast_decode_crop
from raypipe.preprocess.pillow import pillow_decode_crop
from raypipe.skips.log import SkipStore
from raypipe.skips.records import REASONS, reason_of
from tests.conftest import image_bytes, make_imagefolder, make_parquet, make_webdataset
from tests.ranks import in_threads

# --- generated inputs ------------------------------------------------------------------


def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def smooth_rgb(seed: int = 0, size=(40, 30)) -> Image.Image:
    base = np.random.default_rng(seed).integers(0, 256, (5, 5, 3), dtype=np.uint8)
    return Image.fromarray(base).resize(size, Image.Resampling.BILINEAR)


def huge_header_jpeg(side: int = 30000) -> bytes:
    """A small JPEG whose header claims side × side pixels (a decompression bomb)."""
    data = bytearray(encode(Image.new("RGB", (16, 16)), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = side.to_bytes(2, "big") * 2
    return bytes(data)


def huge_header_png(side: int = 30000) -> bytes:
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    chunk = lambda kind, body: (  # noqa: E731
        struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    )
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def jpeg_bytes(seed: int = 0) -> bytes:
    return encode(smooth_rgb(seed, (64, 48)), "JPEG", quality=90)


# name -> (file bytes, reason). Every broken kind the issue lists for single files.
BROKEN_FILES = {
    "empty.jpg": (b"", "empty_file"),
    "truncated.jpg": (jpeg_bytes()[:848], "truncated_image"),  # whole header: fast path first
    "cut_header.jpg": (jpeg_bytes()[:400], "truncated_image"),  # straight to Pillow
    "random.jpg": (np.random.default_rng(1).bytes(700), "not_an_image"),
    "text.jpg": (b"this is not an image\n" * 20, "not_an_image"),
    "bomb.jpg": (huge_header_jpeg(), "decompression_bomb"),
    "bomb.png": (huge_header_png(), "decompression_bomb"),
}


def unusual_images() -> dict[str, tuple[bytes, Image.Image]]:
    """name -> (file bytes, the RGB image they should decode to)."""
    rgb = smooth_rgb(2)
    grey = rgb.convert("L")
    rgba = rgb.convert("RGBA")
    rgba.putalpha(Image.fromarray(np.tile(np.array([0, 255], np.uint8).repeat(20), (30, 1))))
    black_left = Image.fromarray(np.where(np.asarray(rgba)[..., 3:] > 0, np.asarray(rgb), 0))
    palette = rgb.quantize(16)
    palette.info["transparency"] = 0
    pal_rgb = np.asarray(palette.convert("RGB")).copy()
    pal_rgb[np.asarray(palette) == 0] = 0
    deep = (np.asarray(grey).astype(np.uint16) << 8) | 0xAB  # 16-bit, low byte noise
    upright = smooth_rgb(3, (40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned a quarter; viewers turn it back
    return {
        "grey.jpg": (encode(grey, "JPEG", quality=95), grey.convert("RGB")),
        "cmyk.jpg": (encode(rgb.convert("CMYK"), "JPEG", quality=95), rgb),
        "rgba.png": (encode(rgba, "PNG"), black_left),
        "palette.png": (encode(palette, "PNG", transparency=0), Image.fromarray(pal_rgb)),
        "deep16.png": (encode(Image.fromarray(deep), "PNG"), grey.convert("RGB")),
        "rotated.jpg": (
            encode(upright.transpose(Image.Transpose.ROTATE_90), "JPEG", quality=95, exif=exif),
            upright,
        ),
        "png_named.jpg": (encode(rgb, "PNG"), rgb),
        "one_pixel.png": (encode(Image.new("RGB", (1, 1), (200, 30, 90)), "PNG"), None),
        "one_pixel.jpg": (encode(Image.new("RGB", (1, 1), (200, 30, 90)), "JPEG"), None),
    }


def whole(width: int, height: int) -> Plan:
    return Plan(Box(0, 0, width, height), False)


class Collected(list):
    """Stands in for a SkipLog where the Preprocessor runs in this process."""

    def add(self, records) -> None:
        self.extend(records)


@pytest.fixture
def pillow_limit():
    """The Preprocessor lifts Pillow's process-wide limit (in its actor); restore it here."""
    saved = Image.MAX_IMAGE_PIXELS
    yield
    Image.MAX_IMAGE_PIXELS = saved


def preprocess(config: PipelineConfig, fmt: str | None = None):
    """Run the actors' map over every shard in this process: (rows, skip records)."""
    listing = list_shards(config)
    skips = Collected()
    pre = Preprocessor(config, fmt or listing.format, 0, skips)
    blocks = list(pre(shard_rows(listing.shards)))
    rows = {k: np.concatenate([b[k] for b in blocks]) for k in ("image", "label", "key")}
    return rows, skips, listing


def shard_rows(shards) -> dict[str, np.ndarray]:
    """The batch of shard rows an actor call gets (nothing consumed before)."""
    return {
        "path": np.array([s.path for s in shards]),
        "first_key": np.array([s.first_key for s in shards]),
        "num_samples": np.array([s.num_samples for s in shards]),
        "label": np.array([s.label for s in shards]),
        "done": np.array([b""] * len(shards), dtype=object),
    }


def folder(root: Path, files: dict[str, bytes], *, good: int = 3) -> Path:
    make_imagefolder(root, {"good": good})
    (root / "odd").mkdir(exist_ok=True)
    for name, data in files.items():
        (root / "odd" / name).write_bytes(data)
    return root


# --- valid but unusual input is converted ----------------------------------------------


@pytest.mark.parametrize("decode", [fast_decode_crop, pillow_decode_crop], ids=["fast", "pillow"])
@pytest.mark.parametrize("name", list(unusual_images()))
def test_unusual_image_decodes_to_its_rgb(name, decode):
    data, want = unusual_images()[name]
    seen = []
    out = decode(data, 16, lambda w, h: seen.append((w, h)) or whole(w, h))
    assert out.shape == (3, 16, 16) and out.dtype == np.uint8
    if want is None:  # 1×1: every pixel is the one colour
        assert seen == [(1, 1)]
        assert np.abs(out.reshape(3, -1).astype(int) - [[200], [30], [90]]).max() <= 6
        return
    assert seen == [want.size], "choose must see the upright size"
    ref = np.asarray(want.convert("RGB").resize((16, 16), Image.Resampling.BILINEAR))
    assert np.abs(out.transpose(1, 2, 0).astype(int) - ref).mean() < 6


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_unusual_inputs_are_delivered_not_dropped(tmp_path, on_error, pillow_limit):
    files = {name: data for name, (data, _) in unusual_images().items()}
    config = PipelineConfig(source=str(folder(tmp_path, files)), image_size=8, on_error=on_error)
    for train in (True, False):
        rows, skips, listing = preprocess(config.replace(train=train))
        assert sorted(rows["key"].tolist()) == list(range(listing.num_samples))
        assert not skips


def test_exif_rotation_is_applied():
    upright = smooth_rgb(3, (40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    turned = upright.transpose(Image.Transpose.ROTATE_90)
    rotated = pillow_decode_crop(encode(turned, "JPEG", exif=exif, quality=95), 16, whole)
    plain = pillow_decode_crop(encode(upright, "JPEG", quality=95), 16, whole)
    ignored = pillow_decode_crop(encode(turned, "JPEG", quality=95), 16, whole)
    assert np.abs(rotated.astype(int) - plain).mean() < 4
    assert np.abs(ignored.astype(int) - plain).mean() > 10


# --- broken input: both decoders, both policies ----------------------------------------


@pytest.mark.parametrize("decode", [fast_decode_crop, pillow_decode_crop], ids=["fast", "pillow"])
@pytest.mark.parametrize("name", [n for n in BROKEN_FILES if not n.startswith("bomb")])
def test_both_decoders_fail_with_the_same_reason(name, decode):
    """The fast path's own failures go to its Pillow fallback, which names the reason."""
    from raypipe.preprocess.decode import fast_decodable

    data, reason = BROKEN_FILES[name]
    assert fast_decodable(data) == (name == "truncated.jpg")
    with pytest.raises(OSError) as e:  # Pillow's errors, and the fast path's as Pillow's
        decode(data, 16, whole)
    if reason == "empty_file":  # told by its length (the actors refuse it before decoding)
        assert isinstance(e.value, UnidentifiedImageError) and reason_of(e.value, data) == reason
    else:  # the error alone names it
        assert reason_of(e.value) == reason


def test_a_file_that_cannot_be_read_is_unreadable_whatever_its_path_says():
    """The reason comes from the error's kind before its message: a missing file under
    ``truncated-crops/`` was reported as ``truncated_image``."""
    import errno

    where = "/data/truncated-crops/a.jpg"
    for error in (FileNotFoundError(2, "No such file", where),
                  PermissionError(13, "Permission denied", "/data/premature end/b.jpg"),
                  NotADirectoryError(errno.ENOTDIR, "Not a directory", where),
                  OSError(errno.EIO, f"I/O error reading {where}"), TimeoutError(where)):  # fmt: skip
        assert reason_of(error) == "unreadable", error
    assert (
        reason_of(OSError("image file is truncated (3 bytes not processed)")) == "truncated_image"
    )


def make_unreadable(root: Path, how: str) -> str:
    """A file the listing finds but nobody can read; returns its name."""
    (root / "odd").mkdir(parents=True, exist_ok=True)
    if how == "dangling_symlink":  # also what a file deleted after listing looks like
        (root / "odd" / "gone.jpg").symlink_to(root / "nowhere.jpg")
        return "gone.jpg"
    (root / "odd" / "locked.jpg").write_bytes(jpeg_bytes())
    (root / "odd" / "locked.jpg").chmod(0)
    if how == "chmod_000" and os.geteuid() == 0:
        pytest.skip("running as root: chmod 000 does not stop root reading a file")
    return "locked.jpg"


def deny_reading(monkeypatch, path: Path) -> None:
    """Local reads of ``path`` fail as a file without read permission does, for root too
    (root reads a chmod 000 file): EACCES from ``open`` where raypipe's storage opens it."""
    from raypipe.formats import storage

    def guarded_open(file, *args, **kwargs):
        if os.fspath(file) == str(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return open(file, *args, **kwargs)

    monkeypatch.setattr(storage, "open", guarded_open, raising=False)


@pytest.mark.parametrize("on_error", ["skip", "raise"])
@pytest.mark.parametrize(
    "name",
    [*BROKEN_FILES, "dangling_symlink", "chmod_000", "permission_denied", "over_small_limit"],
)
def test_broken_file(tmp_path, name, on_error, pillow_limit, monkeypatch):
    """Every broken or unreadable file is skipped with its reason, or raised naming it;
    ``chmod_000`` runs only as a user (root reads the file), ``permission_denied`` as
    anyone: the same file's reads fail with EACCES (`deny_reading`)."""
    config = PipelineConfig(source=str(tmp_path), image_size=8, on_error=on_error)
    files: dict[str, bytes] = {}
    if name in ("dangling_symlink", "chmod_000", "permission_denied"):
        bad_name, reason = make_unreadable(tmp_path, name), "unreadable"
        if name == "permission_denied":
            deny_reading(monkeypatch, tmp_path / "odd" / bad_name)
    elif name == "over_small_limit":  # the limit is per config, not Pillow's global
        bad_name, reason = "big.png", "decompression_bomb"
        files[bad_name] = encode(smooth_rgb(0, (50, 40)), "PNG")
        config = config.replace(max_image_pixels=1999)
    else:
        bad_name, reason = name, BROKEN_FILES[name][1]
        files[bad_name] = BROKEN_FILES[name][0]
    root = folder(tmp_path, files)
    bad = {str(root / "odd" / bad_name)}
    if on_error == "raise":
        with pytest.raises(SampleError) as e:
            preprocess(config)
        assert e.value.where in bad and e.value.reason == reason
        assert e.value.where in str(e.value) and reason in str(e.value)
        return
    rows, skips, listing = preprocess(config)
    assert {r.where for r in skips} == bad and {r.reason for r in skips} == {reason}
    good = {s.first_key for s in listing.shards if s.path not in bad}
    assert sorted(rows["key"].tolist()) == sorted(good) and len(good) == 3


def count_reasons(records) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.reason] = counts.get(r.reason, 0) + 1
    return dict(sorted(counts.items()))


def tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def broken_webdataset(root: Path, good: list[int]) -> Path:
    """Good shards plus each broken tar kind; `WDS_SKIPS` are the samples to skip."""
    make_webdataset(root, good)
    rng = np.random.default_rng(7)
    with tarfile.open(root / "odd-0.tar", "w") as tar:
        tar_member(tar, "a.jpg", image_bytes(rng))  # no a.cls
        tar_member(tar, "b.jpg", image_bytes(rng))
        tar_member(tar, "b.cls", b"cat")
        tar_member(tar, "c.jpg", b"not a jpeg")
        tar_member(tar, "c.cls", b"1")
        tar_member(tar, "d.jpg", image_bytes(rng))
        tar_member(tar, "d.cls", b"2")
    full = io.BytesIO()
    with tarfile.open(fileobj=full, mode="w") as tar:
        for i in range(3):
            tar_member(tar, f"t{i}.cls", b"3")  # label first, so the cut hits an image
            tar_member(tar, f"t{i}.jpg", image_bytes(rng, size=(60, 60)))
    with tarfile.open(fileobj=io.BytesIO(full.getvalue())) as tar:
        cut = tar.getmember("t1.jpg").offset_data + 10  # t0 whole, t1 cut, t2 lost
    (root / "odd-1.tar").write_bytes(full.getvalue()[:cut])
    (root / "odd-2.tar").write_bytes(b"garbage, not a tar")
    return root


# odd-0: a, b, c bad and d good; odd-1: t0 good, t1 cut, the lost tail; odd-2: garbage.
WDS_SKIPS = {
    "bad_label": 1,
    "missing_label": 1,
    "not_an_image": 1,
    "truncated_shard": 2,
    "unreadable_shard": 1,
}
WDS_GOOD_IN_ODD = 2


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_broken_tar_shards(tmp_path, on_error):
    root = broken_webdataset(tmp_path, [6, 5])
    config = PipelineConfig(source=str(root), image_size=8, on_error=on_error, shuffle_files=False)
    if on_error == "raise":
        with pytest.raises(SampleError) as e:
            preprocess(config)
        assert e.value.where == f"{root / 'odd-0.tar'}:a" and e.value.reason == "missing_label"
        return
    rows, skips, listing = preprocess(config)
    by_where = {r.where: r.reason for r in skips}
    odd0, odd1, odd2 = (str(root / f"odd-{i}.tar") for i in range(3))
    assert by_where[f"{odd0}:a"] == "missing_label"
    assert by_where[f"{odd0}:b"] == "bad_label"
    assert by_where[f"{odd0}:c"] == "not_an_image"
    assert by_where[odd2] == "unreadable_shard"
    assert by_where[f"{odd1}:t1"] == by_where[f"{odd1}:<end>"] == "truncated_shard"
    assert count_reasons(skips) == WDS_SKIPS
    delivered = set(rows["key"].tolist())
    assert len(delivered) == len(rows["key"]) == 6 + 5 + WDS_GOOD_IN_ODD
    assert delivered | {r.key for r in skips} == set(range(listing.num_samples))


def broken_parquet(root: Path, good: list[int]) -> Path:
    """Good files plus each broken Parquet kind; `PARQUET_SKIPS` are the samples to skip."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    make_parquet(root, good)
    good = image_bytes(np.random.default_rng(3))
    pq.write_table(
        pa.table(
            {
                "image": pa.array([good, None, good, b"text, not an image"], pa.binary()),
                "label": pa.array([1, 2, None, 4], pa.int64()),
            }
        ),
        root / "odd-0.parquet",
    )
    pq.write_table(  # the image column holds numbers
        pa.table({"image": pa.array([1, 2, 3], pa.int64()), "label": pa.array([0, 1, 2])}),
        root / "odd-1.parquet",
    )
    pq.write_table(pa.table({"label": pa.array([0, 1])}), root / "odd-2.parquet")
    (root / "odd-3.parquet").write_bytes(b"PAR1 but nothing after it")
    return root


PARQUET_SKIPS = {
    "missing_column": 2,
    "not_an_image": 1,
    "null_value": 2,
    "unreadable_shard": 1,
    "wrong_type": 3,
}


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_broken_parquet_shards(tmp_path, on_error):
    config = PipelineConfig(
        source=str(broken_parquet(tmp_path, [9])),
        image_size=8,
        on_error=on_error,
        shuffle_files=False,
    )
    if on_error == "raise":
        with pytest.raises(SampleError) as e:
            preprocess(config)
        assert e.value.where == f"{tmp_path / 'odd-0.parquet'}:row1"
        assert e.value.reason == "null_value" and "image is null" in str(e.value)
        return
    rows, skips, listing = preprocess(config)
    assert count_reasons(skips) == PARQUET_SKIPS
    assert sorted(rows["key"].tolist() + [r.key for r in skips]) == list(range(listing.num_samples))
    assert len(rows["key"]) == 9 + 1


def test_reader_dying_mid_shard_reports_every_key_it_left(tmp_path, pillow_limit):
    """A shard that changes after listing: the keys its reader cannot reach are skipped."""
    root = make_parquet(tmp_path, [12])
    config = PipelineConfig(source=str(root), image_size=8)
    listing = list_shards(config)
    make_parquet(tmp_path, [5])  # rewritten shorter; the listing still says 12
    skips = Collected()
    pre = Preprocessor(config, "parquet", 0, skips)
    blocks = list(pre(shard_rows(listing.shards)))
    assert np.concatenate([b["key"] for b in blocks]).tolist() == list(range(5))
    assert [r.key for r in skips] == list(range(5, 12))
    assert {r.reason for r in skips} == {"unreadable_shard"}


# --- the skip log ----------------------------------------------------------------------


def test_skip_store_counts_exactly_dedupes_and_caps():
    store = SkipStore(max_runs=2)
    recs = [(k, f"/d/{k}.jpg", REASONS[k % 3], "why") for k in range(50)]
    store.add("a", 5, recs[:30])
    store.add("a", 5, recs[20:])  # a retried task sends keys 20..29 again
    report = store.report("a")
    assert report["skipped"] == 50 and sum(report["by_reason"].values()) == 50
    assert len(report["records"]) == 5 and report["records_left_out"] == 45
    assert report["records"][0] == {"key": 0, "where": "/d/0.jpg", "reason": REASONS[0],
                                    "detail": "why"}  # fmt: skip
    store.add("b", 5, recs[:1])
    store.add("a", 5, recs[:1])  # "a" touched again: "b" is now the one touched longest ago
    store.add("c", 5, recs[:1])  # only the last two runs touched are kept
    assert store.counts("b") == {} and store.counts("a") != {}
    assert store.counts("c") == {REASONS[0]: 1}


def test_skip_store_keeps_every_live_run_of_hundreds_of_ranks():
    """One store per Ray job: 512 ranks of one job with a log each, 3 skips each in one
    epoch, meeting them in turn. Every run's count is exact (each rank's running total is
    what its skip budget checks): 256 runs were kept, oldest made first, so every rank's
    run was dropped and made again from zero. And train_ddp's two logs (training and
    held-out) of 200 epochs, read at the end, keep every epoch's count."""
    store = SkipStore()
    runs = [f"rank{r}/epoch0" for r in range(512)]
    totals = {}
    for i in range(3):
        for r, run in enumerate(runs):
            totals[r] = store.add(run, 1000, [(r * 10**5 + i, f"f{r}", REASONS[0], "x")])
    assert set(totals.values()) == {3}
    assert all(store.counts(run) == {REASONS[0]: 3} for run in runs)
    store = SkipStore()
    for e in range(200):
        store.add(f"train/epoch{e}", 1000, [(5, "bad.jpg", REASONS[0], "x")])
        store.add(f"eval/epoch{e}", 1000, [(9, "bad-val.jpg", REASONS[0], "x")])
    assert all(store.report(f"train/epoch{e}")["skipped"] == 1 for e in range(200))


def test_skip_store_keeps_counts_and_drops_the_oldest_runs_records_past_its_budget():
    """What the store holds is bounded by records, not runs: past `RECORDS_KEPT` the runs
    touched longest ago give up their last records first, as many as it is past; counts
    stay exact, a retried task's keys still count once, and report() says how many
    records it left out."""
    store = SkipStore(records_kept=100)
    records = [(k, f"/d/{k}", REASONS[1], "") for k in range(60)]
    for run in ("old", "mid", "new"):
        store.add(run, 60, records)
    assert store.report("new")["records_left_out"] == 0  # the run just added to keeps all
    old = store.report("old")
    assert old["skipped"] == 60 and len(old["records"]) == 0 and old["records_left_out"] == 60
    assert len(store.report("mid")["records"]) == 40  # only the excess went
    assert store.add("old", 60, records) == 60  # a retried task: each key once still
    assert store.counts("mid") == {REASONS[1]: 60}


def test_the_budget_error_is_one_whole_line_and_names_a_sample_only_where_one_was_kept():
    from raypipe.skips.budget import SkipBudgetError
    from raypipe.skips.records import detail_of

    detail = detail_of(ValueError("shape mismatch:\n  value array of shape (3,)"))
    assert "\n" not in detail and detail.endswith("value array of shape (3,)")
    from raypipe.skips.records import BadSample  # how a transform's error is kept

    assert detail_of(BadSample("transform_error", "ValueError: a:\n  b")) == "ValueError: a: b"
    record = {"where": "/d/x.jpg", "reason": "transform_error", "detail": "one\ntwo"}
    report = {"skipped": 30, "by_reason": {"transform_error": 30}, "records": [record]}
    error = str(SkipBudgetError.of(0, 100, 5, 0.05, report))
    assert "\n" not in error and "one two" in error and error.endswith("shows what is read")
    none_kept = str(SkipBudgetError.of(0, 100, 5, 0.05, {**report, "records": []}))
    assert "None" not in none_kept and "e.g." not in none_kept  # SkipLog(max_records=0)
    assert "transform_error 30" in none_kept


def test_skip_store_holds_few_high_keys_in_little_memory_and_many_in_a_bitmap():
    """Each epoch's run keeps its keys seen: a few skips at high keys must not cost a
    bitmap up to the highest (25 MB for one at 2·10⁸), and many skips still dedupe."""
    import tracemalloc

    store = SkipStore()
    tracemalloc.start()
    store.add("high", 5, [(k, "/d/x", REASONS[0], "") for k in (2 * 10**8, 3 * 10**8, 2 * 10**8)])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert store.report("high")["skipped"] == 2 and peak < 2**20
    rng = np.random.default_rng(2)
    keys = rng.integers(0, 5000, 20000).tolist()  # dense: the set becomes a bitmap midway
    for part in np.array_split(np.array(keys), 7):
        store.add("dense", 0, [(int(k), "/d/x", REASONS[1], "") for k in part])
    assert store.report("dense")["skipped"] == len(set(keys))
    tracemalloc.start()  # a few low keys, then one far past them: a set again
    store.add("low-then-high", 0, [(k, "/d/x", REASONS[0], "") for k in (3, 5, 3, 2 * 10**8)])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert store.report("low-then-high")["skipped"] == 3 and peak < 2**20
    store.add(
        "low-then-high", 0, [(5, "/d/x", REASONS[0], ""), (2 * 10**8, "/d/x", REASONS[0], "")]
    )
    assert store.report("low-then-high")["skipped"] == 3


# --- config validation before any Ray work ---------------------------------------------

INVALID = {
    "source": [123, "", (), ("ok", "")],
    "format": ["recordio"],
    "image_size": [0, 2.5, True],
    "train": ["yes"],
    "batch_size": [0, -1, True],
    "actors": [(0, 1), (3, 2), (1, 2, 3), (1.0, 2)],
    "seed": [-1, 1.5],
    "on_error": ["ignore", None],
    "flip": [1],
    "scale": [(0.5, 0.2), (0.0, 1.0), (0.5,)],
    "ratio": [(2.0, 1.0), (0.0, 1.0)],
    "shuffle_files": ["no"],
    "shuffle_buffer": [-3],
    "files_per_task": [0],
    "rows_per_block": [0],
    "actor_cpus": [0, -1.0, float("nan"), "1"],
    "mean": [(0.5, 0.5), ("a", 0, 0)],
    "std": [(0.2, 0.0, 0.2), (1, 1)],
    "max_image_pixels": [0, 1.5e8],
    "compute": ["threads", None],
    "storage_options": [["endpoint_url", "x"], "key=x"],
    "image_column": ["", 3],
    "label_column": ["", None],
    "label_member": ["", "a/cls", 1],
    "label_key": [""],
    "max_skipped": [-0.1, 1.5, "5%", True],
    "transform": [lambda s: s, "no_such_module:f", "nocolon", 7],
    "transform_input": ["cv2", None],
    "transform_batch": ["yes"],
    "collate": [lambda b: b, "tests.user_transforms:missing"],
    "decode": ["nvjpeg", "GPU", None],
    "follow": ["yes", 1],
    "follow_wait": [0, 1.0, -0.1, float("nan"), "5%"],
    "follow_shrink_s": [0, -1, float("inf"), "5s"],
    "follow_period_s": [0, 9.0, float("nan")],
    "normalize": ["yes", 0],
    "pin_memory": [1, None],
    "prefetch_batches": [-1, 1.5, True],
    "lead_batches": [-1, 1.5, True],
    "channels_last": ["no"],
    "bucket_by": ["", 3, "tokens"],  # "tokens": images with no transform have no lengths
    "buckets": [0, (8, 4), (0, 4), "8"],
    "bucket_window": [0, 1.5],
    "pack": ["", "tokens"],  # "tokens": no seq_len, and an image
    "seq_len": [0, 64],  # 64: without pack
    "sample_rate": [0, 16000.5],
    "cache": ["ram", "Memory", True],
    "cache_max_side": [0, 2.5],
    "cache_budget": [0, 1.5e9],
    "cache_dir": ["", 5],
    "cache_encoding": ["png", None],
}


def test_every_config_field_has_a_checked_invalid_value():
    assert set(INVALID) == {f.name for f in dataclasses.fields(PipelineConfig)}
    for field, values in INVALID.items():
        for value in values:
            kwargs = {"source": "data", field: value}
            with pytest.raises(ValueError) as e:
                PipelineConfig(**kwargs)
            assert f"PipelineConfig.{field}=" in str(e.value), (field, value)


LOADER_INVALID = {
    "batch_size": [0, True],
    "pin_memory": [1],
    "prefetch_batches": [-1],
    "drop_last": ["no"],
    "normalize": [None],
    "mean": [(0.5,)],
    "std": [(1, 0, 1)],
    "shuffle_buffer": [-1, 2.0],
    "shuffle_seed": [-1, "x"],
    "channels_last": [1],
}


def test_every_loader_setting_is_checked():
    from raypipe.config import LoaderConfig

    checked = {f.name for f in dataclasses.fields(LoaderConfig)} - {"device"}  # torch checks it
    assert set(LOADER_INVALID) == checked
    for field, values in LOADER_INVALID.items():
        for value in values:
            with pytest.raises(ValueError, match=rf"LoaderConfig\.{field}="):
                LoaderConfig(**{field: value})


def bad_source(root: Path, case: str) -> str:
    if case == "missing path":
        return str(root / "missing")
    if case == "glob matching nothing":
        return str(root / "nothing-*.tar")
    if case == "no images found":
        (root / "cat").mkdir()
        (root / "cat" / "notes.txt").write_text("x")
    elif case == "no class folders":
        (root / "notes.txt").write_text("x")
    elif case == "images without class folders":
        for name in ("a.png", "b.png"):
            (root / name).write_bytes(image_bytes(np.random.default_rng(0), "PNG"))
    elif case == "empty dataset":
        make_parquet(root, [0, 0])
    return str(root)


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing path", r"PipelineConfig.source: path '.*missing' does not exist"),
        ("glob matching nothing", r"PipelineConfig.source: glob .* matches nothing"),
        ("no images found", r"no images \(.*\) found under"),
        ("no class folders", "has no class sub-folders and no images"),
        ("images without class folders", r"holds 2 images but no class sub-folders: move them"),
        ("empty dataset", "hold no samples"),
    ],
)
def test_bad_sources_fail_before_ray_starts(tmp_path, case, match):
    import ray

    was_running = ray.is_initialized()
    with pytest.raises(ValueError, match=match):
        build_dataset(PipelineConfig(source=bad_source(tmp_path, case)))
    assert ray.is_initialized() == was_running


# --- whole epochs through a real Ray ---------------------------------------------------

FORMATS = ["imagefolder", "webdataset", "parquet"]
FOLDER_SKIPS = {
    "decompression_bomb": 2,
    "empty_file": 1,
    "not_an_image": 2,
    "truncated_image": 2,
    "unreadable": 1,
}


def mixed_source(root: Path, fmt: str) -> tuple[Path, dict[str, int]]:
    """About 3.5 % broken samples, of every kind the format can have, under the default
    skip budget (5 % of an epoch); the skips expected."""
    if fmt == "imagefolder":  # 8 of MIXED_FOLDER
        folder(
            root, {name: data for name, (data, _) in BROKEN_FILES.items()}, good=MIXED_FOLDER - 8
        )
        make_unreadable(root, "dangling_symlink")
        return root, FOLDER_SKIPS
    if fmt == "webdataset":  # 6 of 175
        return broken_webdataset(root, MIXED_WDS), WDS_SKIPS
    return broken_parquet(root, [120, 110]), PARQUET_SKIPS  # 9 of 250


MIXED_FOLDER = 230  # samples of the mixed image folder, 8 of them bad
MIXED_WDS = [60, 57, 50]  # the good shards of the mixed WebDataset


def run_ranks(ds, world_size: int, batch_size: int, **kwargs):
    """One epoch through streaming_split, a thread per rank: (keys, batch sizes, stats, errors)."""
    splits = ds.streaming_split(world_size, equal=True)
    keys, sizes, stats, errors = ([[] for _ in range(world_size)] for _ in range(4))

    def rank(r: int) -> None:
        batches = iter_torch_batches(splits[r], batch_size=batch_size, **kwargs)
        try:
            for batch in batches:
                keys[r].extend(batch["key"].tolist())
                sizes[r].append(len(batch["key"]))
            stats[r] = batches.stats()
        except Exception as e:
            errors[r] = e

    in_threads(rank, world_size, timeout=240)
    return keys, sizes, stats, errors


@pytest.mark.parametrize("fmt", FORMATS)
def test_mixed_epoch_skips_exactly_and_delivers_the_rest_once(ray_session, tmp_path, fmt):
    source, expected = mixed_source(tmp_path, fmt)
    config = PipelineConfig(
        source=str(source),
        image_size=8,
        files_per_task=9,
        rows_per_block=4,
        actors=(1, 2),
    )
    total = list_shards(config).num_samples
    skips = SkipLog.create()
    ds = build_dataset(config, skips=skips)
    keys, sizes, stats, errors = run_ranks(ds, 2, 5, skips=skips)
    assert errors == [[], []]
    report = skips.report()
    assert report["by_reason"] == expected and report["skipped"] == sum(expected.values())
    assert [s["skipped"] for s in stats] == [expected, expected]  # every rank sees the counts
    skipped = {r["key"] for r in report["records"]}
    assert len(skipped) == report["skipped"] and report["records_left_out"] == 0
    assert all(r["where"].startswith(str(source)) for r in report["records"])
    # equal batches, exactly once, nothing good lost beyond drop_last's remainder
    assert len(sizes[0]) == len(sizes[1]) and set(sizes[0] + sizes[1]) == {5}
    delivered = keys[0] + keys[1]
    assert len(set(delivered)) == len(delivered)
    good = set(range(total)) - skipped
    assert set(delivered) <= good and len(good) - len(delivered) <= 2 * 5 - 1


def test_the_dataset_path_holds_what_its_docs_say(ray_session, tmp_path):
    """docs/configuration.md, "The lower-level path": two reads of one epoch through
    ``streaming_split(2)`` with different pools: exactly once, equal batches, the same
    augmentation per key; every good key once without drop_last."""
    source, expected = mixed_source(tmp_path, "imagefolder")
    config = PipelineConfig(source=str(source), image_size=8, seed=4)
    total, batch = list_shards(config).num_samples, 5
    good = None
    images = []
    for actors in ((1, 1), (2, 2)):
        skips = SkipLog.create()
        ds = build_dataset(config.replace(actors=actors), epoch=1, skips=skips)
        keys, sizes, _, errors = run_ranks(ds, 2, batch, skips=skips, normalize=False)
        assert errors == [[], []]
        good = set(range(total)) - {r["key"] for r in skips.report()["records"]}
        delivered = keys[0] + keys[1]
        assert len(delivered) == len(set(delivered)) and set(delivered) <= good
        assert len(good) - len(delivered) <= 2 * batch - 1
        assert len(sizes[0]) == len(sizes[1]) and set(sizes[0] + sizes[1]) == {batch}
        kept = iter_torch_batches(ds, batch_size=batch, drop_last=False, normalize=False)
        by_key = {k: img.numpy().tobytes() for b in kept
                  for k, img in zip(b["key"].tolist(), b["image"], strict=True)}  # fmt: skip
        assert sorted(by_key) == sorted(good)  # without drop_last: every good key, once
        images.append(by_key)
    assert images[0] == images[1], "a key's augmentation changed with the pool"


def test_every_good_sample_once_and_stats_report_skips(ray_session, tmp_path):
    source, expected = mixed_source(tmp_path, "imagefolder")
    config = PipelineConfig(source=str(source), image_size=8, files_per_task=16)
    skips = SkipLog.create()
    ds = build_dataset(config, skips=skips)
    batches = iter_torch_batches(ds, config, batch_size=16, drop_last=False, skips=skips)
    keys = [k for b in batches for k in b["key"].tolist()]
    stats = batches.stats()
    assert stats["skipped"] == expected
    records = batches.skips.report()["records"]
    assert sorted(keys + [r["key"] for r in records]) == list(range(MIXED_FOLDER))
    by_name = {Path(r["where"]).name: r["reason"] for r in records}
    assert by_name["truncated.jpg"] == "truncated_image" and by_name["gone.jpg"] == "unreadable"


def bad_places(root: Path, fmt: str) -> dict[str, str]:
    """where -> reason of each bad sample, from the actors' own code run in this process."""
    _, skips, _ = preprocess(PipelineConfig(source=str(root), image_size=8))
    return {r.where: r.reason for r in skips}


@pytest.mark.parametrize("fmt", ["imagefolder", "webdataset"])
def test_raise_names_the_file_through_ray_data(ray_session, tmp_path, fmt, pillow_limit):
    source, _ = mixed_source(tmp_path, fmt)
    places = bad_places(source, fmt)
    config = PipelineConfig(source=str(source), image_size=8, on_error="raise")
    with pytest.raises(SampleError) as e:
        build_dataset(config).materialize()
    message = str(e.value)  # Ray's RayTaskError(SampleError): still a SampleError
    named = [w for w in places if f"bad sample {w} (key " in message]
    assert named and places[named[0]] in message


def test_raise_stops_every_rank_without_a_hang(ray_session, tmp_path, pillow_limit):
    source, _ = mixed_source(tmp_path, "webdataset")
    places = bad_places(source, "webdataset")
    config = PipelineConfig(source=str(source), image_size=8, on_error="raise", rows_per_block=4)
    keys, sizes, stats, errors = run_ranks(build_dataset(config), 2, 5)
    assert all(errors), f"every rank should have stopped: {errors}"
    for error in errors:  # raypipe's own error as the actor raised it, not Ray's wrapper
        assert type(error) is SampleError, repr(error)
        assert str(error).startswith("bad sample ") and "ray::" not in str(error)
        assert any(f"bad sample {w} (key " in str(error) for w in places)


def test_raise_stops_every_pipeline_rank_with_the_actors_own_error(ray_session, tmp_path,
                                                                   pillow_limit):  # fmt: skip
    from raypipe import Pipeline

    source, _ = mixed_source(tmp_path, "webdataset")
    places = bad_places(source, "webdataset")
    config = PipelineConfig(source=str(source), image_size=8, batch_size=5, on_error="raise")
    ledger, errors = Pipeline.ledger(2), [None, None]

    def rank(r: int) -> None:
        try:
            with Pipeline(config, epochs=1, rank=r, world_size=2, ledger=ledger,
                          device="cpu") as pipe:  # fmt: skip
                for _, batches in pipe.epochs():
                    for _ in batches:
                        pass
        except Exception as e:
            errors[r] = e

    in_threads(rank, 2, timeout=240)
    assert all(errors), f"every rank should have stopped: {errors}"
    for error in errors:
        assert type(error) is SampleError, repr(error)
        assert str(error).startswith("bad sample ") and "ray::" not in str(error)
        assert any(f"bad sample {w} (key " in str(error) for w in places)


def _ray_data_errors(read) -> list[str]:
    """The messages Ray Data's logger of a failed task's error lets through at ERROR while
    ``read()`` runs (a handler on that logger sees what its filters keep)."""
    import logging

    from raypipe import rayapi

    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger(rayapi.DATA_ERROR_LOGGER)
    logger.addHandler(handler)
    try:
        read()
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in seen if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("path", ["pipeline-actors", "dataset"])
def test_ray_datas_log_of_a_data_error_is_left_to_the_error_itself(ray_session, tmp_path, path,
                                                                   pillow_limit):  # fmt: skip
    """Ray Data logged a failed task's error as its execution aborted, with a traceback
    through Ray's frames (on an actor pool: once per rank) and advice
    (``DataContext.max_errored_blocks``) that is not raypipe's, before the rank raised the
    error itself: now the error alone says it. (The default `Pipeline`, plain tasks, runs
    no Ray Data execution.)"""
    from raypipe import Pipeline, iter_torch_batches

    source, _ = mixed_source(tmp_path, "webdataset")
    config = PipelineConfig(source=str(source), image_size=8, batch_size=5, on_error="raise",
                            compute="actors")  # fmt: skip

    def read() -> None:
        with pytest.raises(SampleError):
            if path == "dataset":  # Ray Data's own tasks, read by the rank's iterator
                for _ in iter_torch_batches(build_dataset(config.replace(compute="tasks")),
                                            batch_size=5, device="cpu"):  # fmt: skip
                    pass
                return
            with Pipeline(config, epochs=1, device="cpu") as pipe:
                for _, batches in pipe.epochs():
                    for _ in batches:
                        pass

    assert _ray_data_errors(read) == []


def test_a_data_error_ray_data_goes_on_past_is_still_logged(ray_session, tmp_path, pillow_limit):
    """With ``DataContext.max_errored_blocks`` set, Ray Data drops a failed task's block
    and goes on: its log is all that says those samples were lost, so it stays."""
    import ray.data

    from raypipe import iter_torch_batches

    source, _ = mixed_source(tmp_path, "webdataset")
    config = PipelineConfig(source=str(source), image_size=8, batch_size=5, on_error="raise",
                            rows_per_block=4)  # fmt: skip
    context = ray.data.DataContext.get_current()
    before = context.max_errored_blocks
    context.max_errored_blocks = -1  # every failed block: dropped, and the run goes on
    try:
        ds = build_dataset(config)

        def read() -> None:
            for _ in iter_torch_batches(ds, batch_size=5, device="cpu"):
                pass

        logged = _ray_data_errors(read)
    finally:
        context.max_errored_blocks = before
    assert logged and all("Ignoring this exception" in m for m in logged), logged


def test_a_failed_pipeline_frees_its_cpus_while_its_error_is_kept(ray_session, tmp_path,
                                                                   pillow_limit):  # fmt: skip
    """Ray Data releases a failed execution's pool actors to reference counting, and they
    sit in reference cycles: with no collection they would keep their CPUs for as long as
    the error is kept, and the next pipeline would wait for them."""
    import gc
    import logging
    import time

    import ray

    from raypipe import Pipeline

    source, _ = mixed_source(tmp_path, "webdataset")
    config = PipelineConfig(source=str(source), image_size=8, batch_size=5, on_error="raise")
    cpus = ray.cluster_resources()["CPU"]
    # pytest keeps every log record, and Ray Data logs the failure with its traceback,
    # whose frames hold the actors: a user's process, whose handlers write and forget
    # records, keeps none of them
    logging.disable(logging.ERROR)
    gc.collect()
    gc.disable()  # only what raypipe collects itself is collected
    try:
        with pytest.raises(SampleError) as kept, Pipeline(config, epochs=1, device="cpu") as pipe:
            for _, batches in pipe.epochs():
                for _ in batches:
                    pass
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
            time.sleep(0.1)
        free = ray.available_resources().get("CPU", 0)
        assert free == cpus, f"{cpus - free} CPUs still held with the error kept"
        assert str(kept.value).startswith("bad sample ")
    finally:
        gc.enable()
        logging.disable(logging.NOTSET)


# --- through Ray Train: the report the job writes, and the error the trainer sees -------


@pytest.mark.slow
def test_train_ddp_writes_the_skip_report_and_every_rank_sees_the_counts(ray_session, tmp_path):
    import json

    from raypipe import train_ddp

    source = broken_webdataset(tmp_path / "data", MIXED_WDS)
    out = tmp_path / "ranks"
    out.mkdir()

    def loop(ctx) -> None:
        for epoch, batches in ctx.epochs():
            keys = [int(k) for b in batches for k in b["key"]]
            stats = batches.stats()
            (out / f"{ctx.rank}.json").write_text(json.dumps([keys, stats["skipped"]]))
            ctx.report({"epoch": epoch})

    config = PipelineConfig(source=str(source), image_size=8, batch_size=5, rows_per_block=4)
    result = train_ddp(
        config, loop, num_workers=2, cpus_per_worker=0.5, storage_path=str(tmp_path / "runs")
    )
    assert result.error is None
    (keys0, skipped0), (keys1, skipped1) = (
        json.loads((out / f"{r}.json").read_text()) for r in (0, 1)
    )
    assert skipped0 == skipped1 == WDS_SKIPS
    assert len(keys0) == len(keys1) and not set(keys0) & set(keys1)
    report = json.loads((Path(result.path) / "skipped_samples.json").read_text())
    assert report["train_epoch_0"]["by_reason"] == WDS_SKIPS
    assert {r["key"] for r in report["train_epoch_0"]["records"]}.isdisjoint(keys0 + keys1)


@pytest.mark.slow
def test_train_ddp_raise_reaches_the_trainer_naming_the_file(ray_session, tmp_path):
    from raypipe import train_ddp

    root = folder(tmp_path / "data", {"truncated.jpg": BROKEN_FILES["truncated.jpg"][0]}, good=20)
    bad = str(root / "odd" / "truncated.jpg")

    def loop(ctx) -> None:
        for epoch, batches in ctx.epochs():
            for _ in batches:
                pass
            ctx.report({"epoch": epoch})

    config = PipelineConfig(source=str(root), image_size=8, batch_size=2, on_error="raise")
    try:
        result = train_ddp(
            config, loop, num_workers=2, cpus_per_worker=0.5, storage_path=str(tmp_path / "runs")
        )
        error = result.error
    except Exception as e:  # Ray Train may raise instead of returning the error
        error = e
    assert error is not None
    assert f"bad sample {bad} (key " in str(error) and "truncated_image" in str(error)


def test_a_skip_log_needs_a_running_ray():
    """SkipLog.create() starts nothing behind the caller's back."""
    code = "from raypipe import SkipLog; SkipLog.create()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs a running Ray" in proc.stderr, proc.stderr[-2000:]


def test_running_out_of_memory_is_told_from_damage():
    """`out_of_memory` knows OpenCV's own allocation failure (a real one, in a child
    process limited to 2 GiB of address space) and Python's, and nothing else: the
    decoded cache remembers no sample as bad for either."""
    from raypipe.skips.records import out_of_memory

    child = (
        "import resource, numpy as np, cv2\n"
        "from raypipe.skips.records import out_of_memory, reason_of\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "try:\n"
        "    cv2.resize(np.zeros((8, 8, 3), np.uint8), (40000, 40000))\n"
        "except cv2.error as e:\n"
        "    print(out_of_memory(e), reason_of(e))\n"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.split() == ["True", "decode_error"]
    import cv2

    with pytest.raises(cv2.error) as bad_arguments:  # OpenCV's error, not of memory
        cv2.resize(np.zeros((8, 8, 3), np.uint8), (0, 0))
    assert not out_of_memory(bad_arguments.value)
    assert out_of_memory(MemoryError())
    assert not out_of_memory(ValueError("Insufficient memory"))
