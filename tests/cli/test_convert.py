"""Preprocess to shards: names, index, rerun skips finished shards, reads back as the folder."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import tarfile

import numpy as np
import pytest

from raypipe import PipelineConfig, build_dataset
from raypipe.cli.convert import INDEX, ShardsConfig, convert, plan, preprocess, shard_name
from raypipe.formats import Reader
from raypipe.plan.shards import list_shards
from tests.conftest import make_imagefolder
from tests.preprocess.test_region import needs_region
from tests.preprocess.test_restarts import DRI_ONE

COUNTS = {"ant": 11, "bee": 7, "cow": 9}  # 27 samples: no shard count divides it evenly


def _rows(source, fmt: str) -> dict[int, tuple[int, bytes]]:
    """key → (label, image bytes) as the pipeline delivers them (eval mode: deterministic)."""
    config = PipelineConfig(source=str(source), format=fmt, image_size=16, train=False)
    config = config.replace(actors=(1, 1), actor_cpus=0.5, files_per_task=8, shuffle_files=False)
    out = {}
    for batch in build_dataset(config).iter_batches(batch_size=None, batch_format="numpy"):
        for key, label, image in zip(batch["key"], batch["label"], batch["image"], strict=True):
            assert int(key) not in out
            out[int(key)] = (int(label), image.tobytes())
    return out


def count_samples(path: str, fmt: str) -> int:
    """Samples in a finished shard, read the way the pipeline reads it."""
    return sum(1 for _ in Reader(fmt).read(path, 0, -1))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("shards") / "folder", COUNTS, seed=3)


@pytest.fixture(scope="module")
def folder_rows(ray_session, folder):
    return _rows(folder, "imagefolder")


@pytest.mark.parametrize("fmt", ["webdataset", "parquet"])
def test_shards_read_back_as_the_folder(ray_session, folder, folder_rows, tmp_path, fmt):
    config = ShardsConfig(source=str(folder), out=str(tmp_path / "out"), format=fmt, shards=4)
    summary = convert(config)
    assert (summary.shards, summary.written, summary.reused) == (4, 4, 0)
    assert summary.samples == sum(COUNTS.values()) and not summary.skipped

    ext = ".tar" if fmt == "webdataset" else ".parquet"
    names = sorted(n for n in os.listdir(tmp_path / "out") if not n.startswith("."))
    assert names == sorted([INDEX] + [f"train-{i:05d}-of-00004{ext}" for i in range(4)])
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    assert index["complete"] and index["num_samples"] == 27
    assert index["classes"] == sorted(COUNTS)
    counts = [e["samples"] for e in index["shards"]]
    assert sum(counts) == 27 and max(counts) - min(counts) <= 1
    for e in index["shards"]:
        assert count_samples(str(tmp_path / "out" / e["name"]), fmt) == e["samples"]
    assert [e["first_key"] for e in index["shards"]] == list(np.cumsum([0] + counts[:-1]))

    got = _rows(tmp_path / "out", fmt)  # every sample once, with its label
    assert sorted(got) == sorted(folder_rows)
    assert sorted(got.values()) == sorted(folder_rows.values())
    # the class names travel in index.json: `raypipe run` takes the shards as named classes
    listing = list_shards(PipelineConfig(source=str(tmp_path / "out"), format=fmt))
    assert listing.classes == tuple(sorted(COUNTS)) and "index.json" in listing.labels
    some = list_shards(PipelineConfig(source=str(tmp_path / "out" / f"*-0000[01]-*{ext}")))
    assert some.classes == tuple(sorted(COUNTS))
    first = tmp_path / "out" / index["shards"][0]["name"]
    (tmp_path / "out" / f"other{ext}").write_bytes(first.read_bytes())  # not convert's
    assert list_shards(PipelineConfig(source=str(tmp_path / "out"), format=fmt)).classes == ()


def test_rerun_skips_finished_shards(ray_session, folder, tmp_path, capsys):
    out = tmp_path / "out"
    config = ShardsConfig(source=str(folder), out=str(out), format="webdataset", shards=3)
    convert(config)
    done = {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out) if n.endswith(".tar")}
    damaged = shard_name("train", 1, 3, "webdataset")
    (out / damaged).unlink()
    (out / shard_name("train", 2, 3, "webdataset")).write_bytes(b"not a tar")

    summary = convert(config)
    assert (summary.written, summary.reused, summary.samples) == (2, 1, 27)
    first = shard_name("train", 0, 3, "webdataset")
    assert os.stat(out / first).st_mtime_ns == done[first]
    assert "1 already finished" in capsys.readouterr().err
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    again = convert(config)
    assert (again.written, again.reused) == (0, 3)
    assert again.samples_per_s == 0  # it read 27 samples a second of nothing written
    with open(out / first, "ab") as f:  # not the file that was written: written again
        f.write(b"\0" * 1024)
    assert convert(config).written == 1


def test_a_task_bigger_than_the_local_ray_is_refused(ray_session, folder, tmp_path):
    """A task no node of this local Ray can hold: Ray's autoscaler message every 35 s."""
    config = ShardsConfig(source=str(folder), out=str(tmp_path / "o"), cpus_per_task=64)
    with pytest.raises(ValueError, match="cpus_per_task=64 is more than this local Ray's 4"):
        convert(config)


def test_other_plan_in_the_same_folder_is_refused(ray_session, folder, tmp_path):
    out = str(tmp_path / "out")
    convert(ShardsConfig(source=str(folder), out=out, shards=2))
    with pytest.raises(ValueError, match="another source or plan"):
        convert(ShardsConfig(source=str(folder), out=out, shards=3))


def test_unreadable_and_odd_formats(ray_session, tmp_path):
    from PIL import Image

    root = make_imagefolder(tmp_path / "f", {"a": 4, "b": 3})
    Image.new("RGB", (9, 7), (10, 200, 30)).save(root / "b" / "0100.bmp")
    os.symlink(root / "missing.jpg", root / "a" / "0099.jpg")  # dangling: unreadable
    (root / "b" / "0101.jpg").write_text("notjpeg\n")  # was stored, and read as no image
    summary = convert(ShardsConfig(source=str(root), out=str(tmp_path / "o"), shards=2))
    assert summary.samples == 8
    assert [os.path.basename(p) for p, _ in summary.skipped] == ["0099.jpg", "0101.jpg"]
    keys = _rows(tmp_path / "o", "webdataset")
    assert sorted(keys) == list(range(8))


@pytest.mark.parametrize("restart_markers", [pytest.param(True, marks=needs_region), False])
def test_jpegs_are_stored_with_restart_markers_and_their_pixels(
    ray_session, tmp_path, restart_markers
):
    """By default each JPEG is re-written with a restart marker after every MCU (region
    decoding then reads a crop's MCUs alone), its pixels unchanged; with the switch off,
    or for a JPEG libjpeg refuses (cut short here), its bytes are stored as they are."""
    from PIL import Image

    from raypipe.preprocess import region

    root = make_imagefolder(tmp_path / "f", {"a": 5, "b": 4})
    cut = root / "b" / "0001.jpg"
    cut.write_bytes(cut.read_bytes()[:-40])
    out = tmp_path / "o"
    config = ShardsConfig(source=str(root), out=str(out), shards=2,
                          restart_markers=restart_markers)  # fmt: skip
    summary = convert(config)
    stored = {}  # the name each sample keeps → its image's bytes
    for tar_name in (n for n in os.listdir(out) if n.endswith(".tar")):
        with tarfile.open(out / tar_name) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for member, data in members.items():
            stem, ext = member.split(".")
            if ext in ("jpg", "png"):
                stored[members[f"{stem}.txt"].decode()] = data
    jpegs = sorted(n for n in stored if n.endswith(".jpg"))
    assert len(stored) == 9 and len(jpegs) == 5
    restarted = 4 if restart_markers else 0  # all but the cut one
    assert summary.restarted == restarted
    assert summary.markers == (f"{restarted} JPEGs" if restarted else "off")
    assert json.loads((out / INDEX).read_text())["restart_markers"] is restart_markers
    for name in jpegs:
        source = (root / name).read_bytes()
        if restarted and name != "b/0001.jpg":
            assert DRI_ONE in stored[name] and stored[name] != source
            with Image.open(root / name) as a, Image.open(io.BytesIO(stored[name])) as b:
                assert np.array_equal(np.asarray(a), np.asarray(b))
        else:
            assert stored[name] == source, name
    if restart_markers or region.available():  # not mixed in one folder; the message says
        was = f"written with restart_markers: {str(restart_markers).lower()}: set that"
        with pytest.raises(ValueError, match=was):
            convert(dataclasses.replace(config, restart_markers=not restart_markers))


@needs_region
def test_a_folder_an_older_convert_wrote_goes_on_with_restart_markers_off(ray_session, tmp_path):
    """An index from before the setting (no markers written, none in its fingerprint): the
    new default is refused with what to set, and that setting goes on with its shards."""
    from raypipe.cli import convert as convert_module

    root = make_imagefolder(tmp_path / "f", {"a": 4, "b": 4})
    out = tmp_path / "o"
    config = ShardsConfig(source=str(root), out=str(out), shards=2, restart_markers=False)
    convert(config)
    index = json.loads((out / INDEX).read_text())
    del index["restart_markers"]  # as an older convert wrote it
    (out / INDEX).write_text(json.dumps(index))
    assert convert_module._restarts() is not None
    with pytest.raises(ValueError, match="written with restart_markers: false: set that"):
        convert(dataclasses.replace(config, restart_markers=True))
    assert convert(config).reused == 2


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"format": "zip"}, "format"),
        ({"shards": 0}, "shards"),
        ({"samples_per_shard": -1}, "samples_per_shard"),
        ({"prefix": "a/b"}, "prefix"),
        ({"cpus_per_task": 0}, "cpus_per_task"),
        ({"source": "s3://bucket/imgs"}, "source"),
        ({"out": "memory://shards"}, "out"),
        ({"restart_markers": "yes"}, "restart_markers"),
    ],
)
def test_config_names_the_bad_value(changes, field):
    with pytest.raises(ValueError, match=f"convert.{field}="):
        ShardsConfig(**{"source": "x", "out": "y", **changes})


def test_config_unknown_key_suggests(tmp_path):
    with pytest.raises(ValueError, match="did you mean 'samples_per_shard'"):
        ShardsConfig.from_dict({"source": "x", "out": "y", "sample_per_shard": 3})
    with pytest.raises(ValueError, match="shards and samples_per_shard are both set"):
        ShardsConfig.from_dict({"source": "x", "out": "y", "shards": 2, "samples_per_shard": 50})


def test_the_plan_spreads_every_class_over_every_shard(folder):
    """In key order a shard held one class or two, and a shard is read in order: batches
    of one class, a model trained at chance (with `jobs/configs/digits-shards.yaml`'s
    shards, validation accuracy 0.10 against 0.86 from the folder)."""
    config = ShardsConfig(source=str(folder), out="unused", samples_per_shard=10)
    parts, classes = plan(config)
    keys = [s.key for part in parts for s in part]
    assert len(parts) == 3 and sorted(keys) == list(range(27)) and keys != list(range(27))
    assert classes == tuple(sorted(COUNTS))
    assert all(len({s.label for s in part}) == len(COUNTS) for part in parts)
    assert plan(config)[0] == parts  # one order: a rerun finds its finished shards
    inside = ShardsConfig(source=str(folder), out=str(folder / "shards"), shards=2)
    with pytest.raises(ValueError, match=r"^convert.out='.*/shards' is inside convert.source"):
        plan(inside)  # its folder, made before the shards, listed as one more class
    with pytest.raises(ValueError, match="more than the 27 samples"):
        plan(ShardsConfig(source=str(folder), out="unused", shards=28))


def test_a_folder_holding_other_files_is_not_written_into(tmp_path):
    """Without an index of its own there, convert does not know the files in ``out``: a
    Hugging Face export's ``train-00000-of-00001.parquet`` has the name convert would give
    its first shard, and was replaced without a word."""
    root = make_imagefolder(tmp_path / "data", {"a": 3}, seed=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "train-00000-of-00001.parquet").write_bytes(b"another dataset")
    config = ShardsConfig(source=str(root), out=str(out), format="parquet")
    with pytest.raises(ValueError, match="holds files and no index.json of a convert"):
        convert(config)
    assert (out / "train-00000-of-00001.parquet").read_bytes() == b"another dataset"
    from raypipe.cli import convert as convert_module

    empty = tmp_path / "empty"  # a folder holding only what file systems and desktops add
    (empty / "lost+found").mkdir(parents=True)
    (empty / ".DS_Store").write_bytes(b"")
    assert convert_module._foreign(str(empty)) == []
    assert convert_module._foreign(str(out)) == ["train-00000-of-00001.parquet"]


def test_a_file_name_that_is_not_utf8_is_stored_escaped(tmp_path):
    """Every shard format stores each sample's name as text: a name that is not UTF-8 keeps
    its bytes escaped, and the plan's fingerprint takes it (both raised UnicodeEncodeError)."""
    from raypipe.cli import convert as convert_module

    root = make_imagefolder(tmp_path / "data", {"a": 3}, seed=2)
    (root / "a" / "0001.jpg").rename(root / "a" / os.fsdecode(b"caf\xe9.jpg"))
    config = ShardsConfig(source=str(root), out=str(tmp_path / "out"), samples_per_shard=2)
    parts, _ = plan(config)
    names = [s.name for part in parts for s in part]
    assert "a/caf\\xe9.jpg" in names and all(n.encode() for n in names)
    assert convert_module._fingerprint(config, parts)


def test_the_old_names_still_work(tmp_path):
    """raypipe 0.1 called converting ``preprocess``: the function, the CLI subcommand and
    the YAML section keep that name for one release."""
    from raypipe.cli import jobspec

    assert preprocess is convert
    cfg = tmp_path / "old.yaml"
    cfg.write_text(f"preprocess:\n  source: {tmp_path}\n  out: o\n")
    assert jobspec.kind_of(cfg) == "convert"
    assert ShardsConfig.from_yaml(cfg).out == "o"


@needs_region
@pytest.mark.parametrize("fmt", ["parquet", "tfrecord"])
def test_every_shard_format_stores_jpegs_with_restart_markers(ray_session, tmp_path, fmt):
    root = make_imagefolder(tmp_path / "f", {"a": 3, "b": 3})  # 4 JPEGs, 2 PNGs
    out = tmp_path / "o"
    summary = convert(ShardsConfig(source=str(root), out=str(out), format=fmt, shards=2))
    datas = [raw.data for name in sorted(os.listdir(out)) if not name.endswith(".json")
             for raw in Reader(fmt).read(str(out / name), 0, -1)]  # fmt: skip
    jpegs = [d for d in datas if d[:2] == b"\xff\xd8"]
    assert len(datas) == 6 and len(jpegs) == 4
    assert summary.restarted == 4 and all(DRI_ONE in d for d in jpegs)


def test_where_region_decoding_was_not_built_no_jpeg_is_re_written(ray_session, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    """The default asks for restart markers; without the extension none are written, and
    the index and summary say so (the index claimed them, and a later run on a machine
    with the extension would have written the rest of the folder with them)."""
    from raypipe.preprocess import region

    monkeypatch.setattr(region, "_jpegregion", None)
    root = make_imagefolder(tmp_path / "f", {"a": 3, "b": 3})
    out = tmp_path / "o"
    summary = convert(ShardsConfig(source=str(root), out=str(out), shards=1))
    assert (summary.restarted, summary.markers) == (0, "off (region decoding was not built)")
    assert json.loads((out / INDEX).read_text())["restart_markers"] is False
    with tarfile.open(next(out.glob("*.tar"))) as tar:
        stored = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    sources = {p.read_bytes() for p in root.rglob("*.jpg")}
    assert {d for n, d in stored.items() if n.endswith(".jpg")} == sources


def _odd_images(root) -> list[str]:
    """Images convert stores as PNG whose pixels need more than Pillow's plain RGB (a
    transparent GIF, an RGBA TIFF, a 16-bit grey TIFF), and a TIFF its EXIF tag turns."""
    from PIL import Image

    root.mkdir()
    gif = Image.new("P", (12, 9), 0)
    gif.putpalette([255, 255, 255, 200, 30, 40] + [0] * 762)
    gif.paste(1, (3, 2, 9, 7))
    gif.save(root / "clear.gif", transparency=0)
    rgba = np.zeros((9, 12, 4), dtype=np.uint8)
    rgba[..., :3], rgba[2:7, 3:9, 3] = (250, 240, 230), 255
    Image.fromarray(rgba, "RGBA").save(root / "rgba.tiff")
    grey = (np.arange(9 * 12, dtype=np.uint16).reshape(9, 12) * 600).astype(np.uint16)
    Image.fromarray(grey).save(root / "deep.tiff")  # mode I;16
    turned = Image.fromarray(np.arange(9 * 12 * 3, dtype=np.uint8).reshape(9, 12, 3))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90° clockwise to show it upright
    turned.save(root / "turned.tiff", exif=exif)
    return [str(root / n) for n in ("clear.gif", "rgba.tiff", "deep.tiff", "turned.tiff")]


@pytest.mark.parametrize("fmt", ["webdataset", "parquet", "tfrecord"])
def test_images_convert_stores_as_png_keep_the_pixels_the_folder_gives(tmp_path, fmt):
    """What the pipeline decodes from a converted shard equals what it decodes from the
    folder's file: convert's PNG dropped transparency (the hidden colour showed: white
    where the folder gives black) and clipped 16-bit grey to white."""
    from raypipe.formats.writer import Sample, write_shard
    from raypipe.preprocess.cache.capped import decode_capped

    paths = _odd_images(tmp_path / "src")
    samples = [Sample(k, 0, p, os.path.basename(p)) for k, p in enumerate(paths)]
    (tmp_path / "out").mkdir()
    written = write_shard(samples, str(tmp_path / "out"), shard_name("s", 0, 1, fmt), fmt)
    stored = [raw.data for raw in Reader(fmt).read(str(tmp_path / "out" / written.name), 0, -1)]
    assert len(stored) == len(paths)
    for path, data in zip(paths, stored, strict=True):
        with open(path, "rb") as f:
            want = decode_capped(f.read(), 4096, None)
        np.testing.assert_array_equal(decode_capped(data, 4096, None), want, err_msg=path)


def test_a_rerun_removes_what_interrupted_writes_left(ray_session, folder, tmp_path, capsys):
    """A task killed mid-write (out of memory, its node lost) leaves its shard's hidden
    temporary file, and each rerun writes under another process id: those of this plan's
    shards untouched for `LEFTOVER_S` are removed; a fresh one (a write under way) and
    other hidden files stay."""
    import time

    from raypipe.cli.convert import LEFTOVER_S

    out = tmp_path / "out"
    config = ShardsConfig(source=str(folder), out=str(out), format="webdataset", shards=3)
    convert(config)
    (out / shard_name("train", 1, 3, "webdataset")).unlink()
    stale = [out / f".{shard_name('train', i, 3, 'webdataset')}.{4000 + i}.tmp" for i in (0, 1)]
    fresh = out / f".{shard_name('train', 2, 3, 'webdataset')}.4002.tmp"
    others = [out / ".DS_Store", out / ".other-00000-of-00003.tar.4003.tmp"]
    for path in [*stale, fresh, *others]:
        path.write_bytes(b"\0" * 4096)
    past = time.time() - LEFTOVER_S - 60
    for path in [*stale, *others]:
        os.utime(path, (past, past))
    capsys.readouterr()
    assert convert(config).written == 1
    assert [p.exists() for p in stale] == [False, False]
    assert fresh.exists() and all(p.exists() for p in others)
    assert "removed 2 temporary files interrupted writes left (0.0 MiB)" in capsys.readouterr().err


def test_an_image_over_pillows_pixel_limit_is_left_out_not_decoded(tmp_path, monkeypatch):
    """convert decodes the formats it stores as PNG, several tasks at once: one over
    Pillow's limit (a decompression bomb) is skipped, named, before it is decoded."""
    from PIL import Image

    from raypipe.formats.writer import Sample, write_shard

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # a 40x40 image is over twice it
    paths = []
    for ext in ("bmp", "gif", "ppm"):
        paths.append(str(tmp_path / f"big.{ext}"))
        Image.new("RGB", (40, 40), (9, 99, 199)).save(paths[-1])
    samples = [Sample(k, 0, p, os.path.basename(p)) for k, p in enumerate(paths)]
    (tmp_path / "out").mkdir()
    written = write_shard(samples, str(tmp_path / "out"), shard_name("s", 0, 1, "webdataset"),
                          "webdataset")  # fmt: skip
    assert written.samples == 0
    assert [(os.path.basename(p), why.split(":")[0]) for p, why in written.skipped] == [
        ("big.bmp", "DecompressionBombError"), ("big.gif", "DecompressionBombError"),
        ("big.ppm", "DecompressionBombError")]  # fmt: skip
