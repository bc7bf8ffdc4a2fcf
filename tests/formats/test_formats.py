"""Data as the common tools write it: Hugging Face ``datasets`` Parquet, ``webdataset`` tar
shards with their label conventions; the skip budget; ``raypipe inspect``.

Every image is one flat gray whose level encodes its label, so a decoded batch shows that
each row's pixels and label belong to the same sample.
"""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
from PIL import Image

from raypipe import Pipeline, PipelineConfig, SkipBudgetError
from raypipe.cli import main
from raypipe.plan.shards import list_shards
from tests.conftest import image_bytes
from tests.preprocess.test_region import needs_region

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

NAMES = ["cat", "dog", "eel", "fox"]


def level(label: int) -> int:
    return 30 + 50 * label


def png(label: int, size=(12, 10)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (level(label),) * 3).save(out, "PNG")
    return out.getvalue()


def bmp(label: int, size=(12, 10)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (level(label),) * 3).save(out, "BMP")
    return out.getvalue()


def labels_of(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, len(NAMES), n).tolist()


def run_epoch(config: PipelineConfig) -> dict[int, int]:
    """One epoch through the warm pipeline: {key: label}, each key checked once, each
    row's pixels checked against its label."""
    seen: dict[int, int] = {}
    with Pipeline(config, epochs=1, device="cpu", normalize=False) as pipe:
        for _, batches in pipe.epochs():
            for b in batches:
                for key, label, image in zip(b["key"].tolist(), b["label"].tolist(), b["image"], strict=True):  # fmt: skip
                    assert key not in seen, f"key {key} twice"
                    assert abs(int(image.float().mean()) - level(label)) <= 2, (key, label)
                    seen[key] = label
    return seen


# --- Hugging Face datasets Parquet ---------------------------------------------------


def hf_parquet(root, labels: list[int], *, shards: int, string_labels=False, image="image",
               label="label"):  # fmt: skip
    """Parquet shards written by ``datasets.Dataset.to_parquet`` with an ``Image()`` column
    and a ``ClassLabel`` (or string) label column."""
    import datasets

    if string_labels:
        features = datasets.Features({image: datasets.Image(), label: datasets.Value("string")})
        values = [NAMES[v] for v in labels]
    else:
        features = datasets.Features({image: datasets.Image(), label: datasets.ClassLabel(names=NAMES)})  # fmt: skip
        values = labels
    images = [Image.open(io.BytesIO(png(v))) for v in labels]
    ds = datasets.Dataset.from_dict({image: images, label: values}, features=features)
    root.mkdir(parents=True)
    for i in range(shards):
        ds.shard(num_shards=shards, index=i, contiguous=True).to_parquet(
            str(root / f"train-{i:05d}-of-{shards:05d}.parquet")
        )
    return root


def test_hf_parquet_image_struct_and_classlabel(ray_session, tmp_path):
    labels = labels_of(37, seed=1)
    root = hf_parquet(tmp_path / "hf", labels, shards=3)
    import pyarrow.parquet as pq

    assert str(pq.read_schema(next(root.glob("*.parquet"))).field("image").type).startswith(
        "struct<bytes"
    )
    config = PipelineConfig(source=str(root), image_size=8, batch_size=4, actors=(1, 1))
    listing = list_shards(config)
    assert listing.format == "parquet" and listing.classes == tuple(NAMES)
    assert "ClassLabel" in listing.labels
    seen = run_epoch(config)
    assert len(seen) == 37 // 4 * 4  # exact batches of 4: one partial batch dropped
    assert all(seen[k] == labels[k] for k in seen)  # shards in order: key i is row i


def test_hf_parquet_string_labels_and_other_column_names(ray_session, tmp_path):
    labels = labels_of(30, seed=2)
    root = hf_parquet(tmp_path / "hf", labels, shards=2, string_labels=True, image="img", label="species")  # fmt: skip
    config = PipelineConfig(source=str(root), image_size=8, batch_size=5, actors=(1, 1),
                            image_column="img", label_column="species")  # fmt: skip
    listing = list_shards(config)
    present = sorted({NAMES[v] for v in labels})
    assert listing.classes == tuple(present)  # sorted, as recorded
    seen = run_epoch(config)
    assert len(seen) == 30
    assert all(listing.classes[seen[k]] == NAMES[labels[k]] for k in seen)


# --- webdataset shards ---------------------------------------------------------------


def wds_shards(root, labels: list[int], member: str, *, per_shard: int = 8, nested=False):
    """Tar shards written by ``webdataset.TarWriter`` with the label in ``member``."""
    import webdataset as wds

    root.mkdir(parents=True)
    for s in range(-(-len(labels) // per_shard)):
        with wds.TarWriter(str(root / f"shard-{s:04d}.tar")) as sink:
            for i in range(s * per_shard, min(len(labels), (s + 1) * per_shard)):
                key = f"dir.{s}/sample{i:05d}" if nested else f"sample{i:05d}"
                value = {"json": {"label": labels[i], "source": "gen"}, "cls": labels[i],
                         "txt": str(labels[i])}[member]  # fmt: skip
                sink.write({"__key__": key, "png": png(labels[i]), member: value})
    return root


@pytest.mark.parametrize("member", ["json", "txt", "cls"])
def test_webdataset_label_members(ray_session, tmp_path, member):
    labels = labels_of(21, seed=3)
    root = wds_shards(tmp_path / "wds", labels, member)
    config = PipelineConfig(source=str(root), image_size=8, batch_size=3, actors=(1, 1))
    seen = run_epoch(config)
    assert len(seen) == 21 and all(seen[k] == labels[k] for k in seen)


def test_webdataset_keys_follow_webdataset_grouping(tmp_path):
    """Our samples are webdataset's samples, in its order: the key is the member path up
    to the first dot of its base name (dots in folder names do not count)."""
    import webdataset as wds

    labels = labels_of(12, seed=4)
    root = wds_shards(tmp_path / "wds", labels, "json", per_shard=6, nested=True)
    config = PipelineConfig(source=str(root))
    listing = list_shards(config)
    ours = [raw.where.split(":", 1)[1] for s in listing.shards
            for raw in listing.reader.read(s.path, s.first_key, -1)]  # fmt: skip
    theirs = [
        sample["__key__"]
        for shard in sorted(root.glob("*.tar"))
        for sample in wds.WebDataset(str(shard), shardshuffle=False, empty_check=False)
    ]
    assert ours == theirs and len(ours) == 12


def test_a_tar_that_repeats_a_key_holds_a_sample_for_each(tmp_path):
    """``0001.jpg 0001.cls 0001.jpg 0001.cls``: two samples, with their own images and
    labels (the second overwrote the first, which was lost without a skip)."""
    import io
    import tarfile

    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:
        for stem, label in (("0001", 2), ("0001", 3), ("0002", 4)):
            for ext, data in (("jpg", png(label)), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"{stem}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    listing = list_shards(PipelineConfig(source=str(path)))
    raws = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert listing.num_samples == 3 and [r.label for r in raws] == [2, 3, 4]
    assert raws[0].data == png(2) and raws[1].data == png(3)
    assert [r.where.split(":", 1)[1] for r in raws] == ["0001", "0001", "0002"]


def test_hidden_members_of_a_tar_are_no_samples(tmp_path):
    """A tar made on macOS holds an AppleDouble ``._0001.jpg`` beside members: no sample
    (each made one, a skip; webdataset keys it by its folder, ``a/``, between the halves of
    the sample it splits)."""
    import io
    import tarfile

    path = tmp_path / "mac.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in (("a/0001.jpg", png(2)), ("a/._0001.jpg", b"\0\5\26\7"),
                           ("a/0001.cls", b"2"), ("a/0002.jpg", png(4)), ("a/0002.cls", b"4"),
                           ("a/._0002.cls", b"\0\5\26\7"), (".hidden.jpg", png(5))):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    listing = list_shards(PipelineConfig(source=str(path)))
    raws = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert [r.where.split(":", 1)[1] for r in raws] == ["a/0001", "a/0002"]
    assert [r.label for r in raws] == [2, 4] and listing.num_samples == 2


def test_a_damaged_parquet_page_loses_its_row_group_only(tmp_path):
    """A page that cannot be read skips the rest of its row group, each row naming it; the
    row groups after it are read (they were all lost with it, as one unreadable shard)."""
    import pyarrow.parquet as pq

    from tests.conftest import make_parquet

    root = make_parquet(tmp_path / "pq", [32])  # 4 row groups of 8
    (path,) = sorted(root.glob("*.parquet"))
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    at = chunk.data_page_offset
    data[at : at + 16] = b"\xff" * 16  # the page header of row group 1's images
    path.write_bytes(bytes(data))
    for image_column in ("image", None):  # image samples, and samples as their fields
        listing = list_shards(PipelineConfig(source=str(root), image_column=image_column))
        raws = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
        assert [r.key for r in raws] == list(range(32))
        bad = [r.key for r in raws if r.reason is not None]
        assert bad == list(range(8, 16)) and {r.reason for r in raws if r.reason} == {"unreadable"}
        assert "row group 1" in raws[8].error
        assert all(r.data or r.extras for r in raws if r.reason is None)


def test_webdataset_label_settings_and_reasons(tmp_path):
    labels = labels_of(6, seed=5)
    root = wds_shards(tmp_path / "wds", labels, "json")
    other = PipelineConfig(source=str(root), label_key="class")
    reasons = {raw.reason for s in list_shards(other).shards
               for raw in list_shards(other).reader.read(s.path, s.first_key, -1)}  # fmt: skip
    assert reasons == {"missing_label"}
    only_cls = PipelineConfig(source=str(root), label_member="cls")
    listing = list_shards(only_cls)
    raws = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert {r.reason for r in raws} == {"missing_label"} and ".cls" in raws[0].error


def test_a_bad_header_in_the_middle_of_a_tar_is_reported_not_dropped(tmp_path):
    """A member header whose checksum is wrong ends Python's tar listing quietly: the
    samples before it are read, and the rest of the shard is one reported skip, counted
    in the listing as the reader yields it."""
    import tarfile

    labels = labels_of(10, seed=3)
    root = wds_shards(tmp_path / "wds", labels, "cls", per_shard=10)
    (shard,) = sorted(root.glob("*.tar"))
    with tarfile.open(shard) as tar:
        at = [m.offset for m in tar.getmembers()][10]  # the sixth sample's first member
    data = bytearray(shard.read_bytes())
    data[at + 148 : at + 156] = b"0000000\0"  # its header's checksum field
    shard.write_bytes(bytes(data))
    listing = list_shards(PipelineConfig(source=str(root)))
    raws = list(listing.reader.read(str(shard), 0, -1))
    assert listing.num_samples == len(raws) == 6
    assert [r.reason for r in raws] == [None] * 5 + ["truncated_shard"]
    assert f"byte {at}" in raws[-1].error


# --- the skip budget ------------------------------------------------------------------


def parquet_with_bad_rows(root, n: int, bad: set[int], *, files: int):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    labels = labels_of(n, seed=6)
    rows = [(b"not an image" if i in bad else png(labels[i]), labels[i]) for i in range(n)]
    per = -(-n // files)
    for f in range(files):
        part = rows[f * per : (f + 1) * per]
        table = pa.table({"image": [r[0] for r in part], "label": [r[1] for r in part]})
        pq.write_table(table, root / f"part-{f:03d}.parquet")
    return root


def test_a_few_bad_rows_pass_the_default_budget_and_fail_a_tighter_one(ray_session, tmp_path):
    root = parquet_with_bad_rows(tmp_path / "pq", 100, {7, 50, 93}, files=4)
    config = PipelineConfig(source=str(root), image_size=8, batch_size=4, actors=(1, 1))
    assert len(run_epoch(config)) == 96  # 3 % skipped < 5 %: 97 good, 24 batches of 4
    with pytest.raises(SkipBudgetError) as e:
        run_epoch(config.replace(max_skipped=0.01))
    message = str(e.value)
    assert "of its 100 samples" in message and "max_skipped=0.01 allows 1" in message
    assert "not_an_image" in message and str(root) in message


def test_all_bad_stops_at_the_first_blocks_naming_the_cause(ray_session, tmp_path):
    """A misnamed image column: every row is skipped; the run stops after a few shards,
    not after the epoch, and says which column is missing."""
    root = hf_parquet(tmp_path / "hf", labels_of(400, seed=7), shards=20, image="picture")
    config = PipelineConfig(source=str(root), image_size=8, batch_size=8, actors=(1, 1))
    with pytest.raises(SkipBudgetError) as e:
        run_epoch(config)
    err = e.value
    assert err.by_reason.keys() == {"missing_column"}
    assert 400 * 0.05 < err.skipped < 400, err.skipped  # stopped early, past the limit
    assert "no 'image' column" in str(err) and "picture" in str(err) and "\n" not in str(err)


def test_no_budget_still_fails_when_every_sample_is_bad(ray_session, tmp_path):
    root = parquet_with_bad_rows(tmp_path / "pq", 24, set(range(24)), files=2)
    config = PipelineConfig(source=str(root), image_size=8, batch_size=4, max_skipped=None)
    with pytest.raises(SkipBudgetError) as e:
        run_epoch(config)
    assert e.value.skipped == 24 and "max_skipped=None" in str(e.value)


# --- raypipe inspect ------------------------------------------------------------------


def test_inspect_says_how_jpegs_are_decoded_and_plans_drawn(tmp_path, capsys, monkeypatch):
    from raypipe.preprocess import augment, region

    root = hf_parquet(tmp_path / "hf", labels_of(4, seed=8), shards=1)
    assert main(["inspect", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["jpeg_decoding"] == ("region" if region.available() else "whole")
    assert report["crop_plans"] == ("compiled" if augment.plans_compiled() else "numpy")
    monkeypatch.setattr(region, "_jpegregion", None)
    monkeypatch.setattr(augment, "_draws", None)
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "whole images: region decoding was not built" in out
    assert "drawn through NumPy: the compiled plans were not built" in out


@needs_region
def test_inspect_counts_the_jpegs_read_by_mcu(tmp_path, capsys):
    """Which JPEGs take region decoding's MCU path (restart markers, as convert writes
    them): a folder of plain JPEGs says none, until some are re-written."""
    from raypipe.preprocess import region
    from tests.conftest import make_imagefolder

    root = make_imagefolder(tmp_path / "f", {"a": 6, "b": 6}, seed=2)  # 8 JPEGs, 4 PNGs
    assert main(["inspect", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["jpegs_by_mcu"] == [0, 8]
    for path in sorted(root.glob("a/*.jpg")):
        path.write_bytes(region.with_restarts(path.read_bytes()))
    exif = Image.Exif()
    exif[0x0112] = 6  # a rotated photo: decoded whole (Pillow turns it), markers or not
    rotated = io.BytesIO()
    Image.new("RGB", (40, 30), (9, 90, 200)).save(rotated, format="JPEG", exif=exif.tobytes())
    (root / "b" / "0001.jpg").write_bytes(region.with_restarts(rotated.getvalue()))
    assert main(["inspect", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["jpegs_by_mcu"] == [4, 8]
    assert main(["inspect", str(root)]) == 0
    assert "4 of the 8 JPEGs looked at by MCU" in capsys.readouterr().out


def test_inspect_reports_format_labels_and_skips(tmp_path, capsys):
    root = hf_parquet(tmp_path / "hf", labels_of(40, seed=8), shards=4)
    assert main(["inspect", str(root), "--samples", "8"]) == 0
    out = capsys.readouterr().out
    assert "parquet (inferred)" in out and "40" in out and "cat, dog, eel, fox" in out
    assert "ClassLabel" in out and "8 good, 0 would be skipped" in out and "12x10 RGB" in out

    bad = parquet_with_bad_rows(tmp_path / "bad", 10, set(range(10)), files=1)
    assert main(["inspect", str(bad), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["good"] == 0 and report["skipped_by_reason"] == {"not_an_image": 10}

    assert main(["inspect", str(root), "--image-column", "picture"]) == 1
    assert "skip: missing_column" in capsys.readouterr().out


def test_a_folder_of_two_formats_is_refused_not_read_as_one(tmp_path, capsys):
    """Parquet beside a tar: the tar was read and the Parquet's rows left out unsaid."""
    from tests.conftest import make_parquet, make_webdataset

    root = make_parquet(tmp_path / "mixed", [10])
    make_webdataset(tmp_path / "wds", [6])
    for shard in (tmp_path / "wds").glob("*.tar"):
        shard.rename(root / shard.name)
    with pytest.raises(ValueError, match="holds shards of more than one format: .*parquet.*"
                                         "webdataset|webdataset.*parquet"):  # fmt: skip
        list_shards(PipelineConfig(source=str(root)))
    assert list_shards(PipelineConfig(source=str(root), format="parquet")).num_samples == 10
    import pyarrow as pa
    import pyarrow.parquet as pq

    laion = make_webdataset(tmp_path / "laion", [3, 3])  # img2dataset: metadata beside each
    for shard in laion.glob("*.tar"):
        meta = pa.table({"url": ["u"], "caption": ["c"], "status": ["success"]})
        pq.write_table(meta, shard.with_suffix(".parquet"))
    assert list_shards(PipelineConfig(source=str(laion))).format == "webdataset"
    assert main(["inspect", str(root)]) == 2
    assert "--format on raypipe inspect" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("not data")
    assert main(["inspect", str(tmp_path / "notes.txt")]) == 2
    assert "cannot infer the format" in (err := capsys.readouterr().err) and "--format" in err
    assert main(["inspect", str(root), "--storage-option", "anon=true"]) == 2
    err = capsys.readouterr().err
    assert "--storage-option on raypipe inspect) are for remote sources only" in err


def test_inspect_names_the_columns_a_parquet_source_has(tmp_path, capsys):
    """Hugging Face shards whose image and label columns have other names: every sample is
    skipped, and the command says which options name the files' own columns, which work."""
    root = hf_parquet(tmp_path / "hf", labels_of(8, seed=3), shards=1, image="photo",
                      label="target")  # fmt: skip
    assert main(["inspect", str(root)]) == 1
    err = capsys.readouterr().err
    assert "add --image-column photo --label-column target (the files' own columns)" in err
    assert main(["inspect", str(root), "--image-column", "photo", "--label-column", "target"]) == 0
    assert "8 good, 0 would be skipped" in capsys.readouterr().out
    (root / "a-damaged.parquet").write_bytes(b"PAR1 but nothing after it")  # listed first
    assert main(["inspect", str(root)]) == 1  # reported, not a traceback
    assert "skip: missing_column" in capsys.readouterr().out


def test_inspect_of_samples_with_no_image_suggests_image_column_none(tmp_path, capsys):
    """Token rows and a label, no column an image could be in: every sample was skipped
    as missing_column and the command said "check the format and the label settings";
    it names ``--image-column none``, with which they are read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "tok").mkdir()
    tokens = [list(range(i % 5 + 2)) for i in range(12)]
    pq.write_table(pa.table({"tokens": pa.array(tokens, pa.list_(pa.int32())),
                             "label": list(range(12))}), tmp_path / "tok" / "p.parquet")  # fmt: skip
    assert main(["inspect", str(tmp_path / "tok")]) == 1
    err = capsys.readouterr().err
    assert "add --image-column none (no column holds images" in err
    assert main(["inspect", str(tmp_path / "tok"), "--image-column", "none"]) == 0
    assert "12 good, 0 would be skipped" in capsys.readouterr().out


def test_a_label_outside_the_named_classes_is_a_bad_label_skip(tmp_path):
    """A ``ClassLabel`` column whose integers run past its names (or below -1): those rows
    were delivered as targets the loss failed on mid-run; now bad_label skips. -1 is "no
    label" (an unlabelled test split's): delivered as it is."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    labels = [0, 1, -1, 3, 2, 1]
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=NAMES)})  # fmt: skip
    images = [Image.open(io.BytesIO(png(3 * i))) for i in range(len(labels))]
    ds = datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)
    root = tmp_path / "hf"
    root.mkdir()
    path = root / "test-00000-of-00001.parquet"
    ds.to_parquet(str(path))
    table = pq.read_table(path)  # 7 and -2: what no ClassLabel lets one write
    bad = pa.array([0, 1, -1, 7, -2, 1], table.schema.field("label").type)
    table = table.set_column(table.schema.get_field_index("label"), "label", bad)
    pq.write_table(table.replace_schema_metadata(pq.read_schema(path).metadata), path)
    listing = list_shards(PipelineConfig(source=str(root)))
    assert listing.classes == tuple(NAMES)
    got = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert [r.reason for r in got] == [None, None, None, "bad_label", "bad_label", None]
    assert [r.label for r in got if r.reason is None] == [0, 1, -1, 1]
    assert f"label 7 is outside the {len(NAMES)} named classes" in got[3].error


def test_a_parquet_file_whose_name_is_not_utf8_is_read_whole(tmp_path):
    """A Latin-1 'café.parquet' (an old archive, a Windows share): its name reaches pyarrow
    escaped, which it could not take as a path, so its rows were one unreadable_shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"image": pa.array([png(i) for i in range(5)], pa.binary()),
                      "label": list(range(5))})  # fmt: skip
    with open(os.path.join(os.fsencode(str(tmp_path)), b"caf\xe9.parquet"), "wb") as f:
        pq.write_table(table, f)
    listing = list_shards(PipelineConfig(source=str(tmp_path)))
    assert listing.num_samples == 5
    got = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert [(r.reason, r.label) for r in got] == [(None, i) for i in range(5)]


def test_a_webdataset_sample_with_two_image_members_names_the_one_to_read(tmp_path):
    """A segmentation shard: ``rgb.jpg`` and ``mask.png`` per sample, written in sorted
    order, so the mask came first and every sample trained on its mask. Now such samples
    are skipped naming the members until ``image_column`` names one; a plain ``.jpg``
    beside ``mask.png`` is the image."""
    import webdataset as wds

    root = tmp_path / "seg"
    root.mkdir()
    with wds.TarWriter(str(root / "seg-0000.tar")) as sink:
        for i in range(3):
            sink.write({"__key__": f"s{i}", "rgb.jpg": image_bytes(np.random.default_rng(i)),
                        "mask.png": png(1), "cls": i})  # fmt: skip

    def read(**settings) -> list:
        listing = list_shards(PipelineConfig(source=str(root), **settings))
        return [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]

    got = read()
    assert [r.reason for r in got] == ["missing_column"] * 3
    assert "image members .mask.png, .rgb.jpg" in got[0].error and "image_column" in got[0].error
    got = read(image_column="rgb.jpg")
    assert [(r.reason, r.label) for r in got] == [(None, 0), (None, 1), (None, 2)]
    assert all(Image.open(io.BytesIO(r.data)).format == "JPEG" for r in got)


def test_inspect_reads_samples_with_no_image(tmp_path, capsys):
    """``--image-column none``: a token Parquet source is inspected as its samples (it was
    every row a missing_column skip, and ``none`` looked for a column named so)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokens = pa.array([list(range(n)) for n in (3, 5, 4, 2)], pa.list_(pa.int32()))
    pq.write_table(pa.table({"tokens": tokens, "label": [0, 1, 0, 1]}), tmp_path / "t.parquet")
    assert main(["inspect", str(tmp_path), "--image-column", "none"]) == 0
    out = capsys.readouterr().out
    assert "4 good, 0 would be skipped" in out and "tokens int32 (1-D)" in out, out


def test_a_webdataset_sample_without_its_image_is_a_counted_skip_never_another_image(tmp_path):
    """A sample whose image member is missing (a writer stopped mid-sample) was left out of
    the count, unseen; one stored as .bmp too; and with ``image_column="depth.png"`` a
    sample lacking its depth map was read from its .jpg instead."""
    root = tmp_path / "wds"
    root.mkdir()
    members = [("s0.jpg", png(0)), ("s0.depth.png", png(10)), ("s0.cls", b"0"),
               ("s1.cls", b"1"), ("s1.json", b'{"label": 1}'),
               ("s2.bmp", bmp(2)), ("s2.cls", b"2"),
               ("s3.jpg", png(3)), ("s3.cls", b"3")]  # fmt: skip
    with tarfile.open(root / "a.tar", "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

    def read(**settings) -> list:
        listing = list_shards(PipelineConfig(source=str(root), **settings))
        got = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
        assert listing.num_samples == len(got) == 4
        return got

    got = read()
    assert [(r.reason, r.label) for r in got] == [(None, 0), ("missing_column", -1),
                                                  (None, 2), (None, 3)]  # fmt: skip
    assert "no image (.jpg," in got[1].error and "it has .cls, .json" in got[1].error
    assert got[2].data == bmp(2)
    got = read(image_column="depth.png")
    assert [r.reason for r in got] == [None, "missing_column", "missing_column", "missing_column"]
    assert got[0].data == png(10) and "no .depth.png member" in got[3].error


def test_a_hugging_face_image_stored_by_path_only_says_so(tmp_path):
    """``datasets``' to_parquet of images loaded from files keeps ``{bytes: None, path}``:
    every row was "image is null", with the path right there; fields of no-image samples
    passed through as dicts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raypipe.preprocess.samples.fields import decode_member
    from raypipe.skips.records import BadSample

    image = pa.array([{"bytes": None, "path": "/data/img0.png"}, {"bytes": png(1), "path": None}],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))  # fmt: skip
    pq.write_table(pa.table({"image": image, "label": [0, 1]}), tmp_path / "hf.parquet")
    listing = list_shards(PipelineConfig(source=str(tmp_path)))
    got = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert [r.reason for r in got] == ["null_value", None] and got[1].data == png(1)
    assert "'image' holds only the path '/data/img0.png', not the bytes" in got[0].error
    with pytest.raises(BadSample, match="'audio' holds only the path 'a.wav'"):
        decode_member("audio", {"bytes": None, "path": "a.wav"})


def test_parquet_view_types_are_images_and_labels(tmp_path):
    """``binary_view`` images and ``string_view`` labels (Arrow's view types, kept in the
    stored schema by newer writers) failed every row as wrong_type."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"image": pa.array([png(0), png(1)], pa.binary_view()),
                      "label": pa.array(["dog", "cat"], pa.string_view())})  # fmt: skip
    pq.write_table(table, tmp_path / "views.parquet")
    listing = list_shards(PipelineConfig(source=str(tmp_path)))
    got = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert listing.classes == ("cat", "dog")
    assert [(r.reason, r.label, r.data) for r in got] == [(None, 1, png(0)), (None, 0, png(1))]


def test_a_string_field_that_is_not_utf8_loses_its_row_only(tmp_path):
    """Samples without an image: one value of a string column that is not UTF-8 (no page
    CRC catches it) made its whole read of rows, up to a row group, ``unreadable``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "pq" / "t.parquet"
    path.parent.mkdir()
    table = pa.table({"text": [f"line{i:03d}" for i in range(20)], "n": list(range(20))})
    pq.write_table(table, path, row_group_size=10, compression="none", use_dictionary=False)
    data = bytearray(path.read_bytes())
    at = data.index(b"line013") + 1
    data[at : at + 2] = b"\xff\xfe"  # not UTF-8
    path.write_bytes(bytes(data))
    listing = list_shards(PipelineConfig(source=str(path.parent), image_column=None))
    raws = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert [r.key for r in raws] == list(range(20))
    assert [(r.key, r.reason) for r in raws if r.reason] == [(13, "bad_record")]
    assert "'text'" in raws[13].error and raws[12].extras["text"] == "line012"


def test_a_damaged_string_label_loses_its_row_group_only_and_lists(tmp_path):
    """pyarrow checks no page CRC: a flipped byte in a string label is invalid UTF-8,
    whose UnicodeDecodeError escaped the damaged-page handling: the listing of the source
    failed, naming no file, and a read lost the intact row groups after it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "pq" / "s.parquet"
    path.parent.mkdir()
    names = [f"class{i % 3}xyz" for i in range(40)]
    table = pa.table({"image": [png(i % 7) for i in range(40)], "label": names})
    pq.write_table(table, path, row_group_size=10, compression="none", use_dictionary=False)
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(2).column(1).data_page_offset
    at = data.index(b"\x09\x00\x00\x00class", start) + 4  # row 20's value (not statistics')
    data[at + 1 : at + 3] = b"\xff\xfe"  # not UTF-8
    path.write_bytes(bytes(data))
    listing = list_shards(PipelineConfig(source=str(path.parent)))
    raws = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert [r.key for r in raws] == list(range(40))
    assert [r.key for r in raws if r.reason] == list(range(20, 30))
    assert {r.reason for r in raws if r.reason} == {"unreadable"} and "row group 2" in raws[
        20
    ].error
