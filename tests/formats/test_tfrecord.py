"""TFRecord shards as the ``tfrecord`` package's ``TFRecordWriter`` writes them (the framing
and ``tf.train.Example`` of TensorFlow's own writer), read without TensorFlow: both label
conventions and any feature names, CRC failures and truncation as skips naming the byte
offset, GZIP and ``.index`` files, a large shard read by several tasks, ``raypipe convert``
and ``inspect``. Images are flat grays whose level encodes the label (`test_formats`)."""

from __future__ import annotations

import gzip
import shutil

import numpy as np
import pytest

from raypipe import PipelineConfig, SampleError, SkipBudgetError, SkipLog, build_dataset
from raypipe.cli import main
from raypipe.formats import pieces
from raypipe.formats.storage import Storage
from raypipe.formats.tfrecord import scan
from raypipe.plan.rankplan import RankPlan
from raypipe.plan.shards import list_shards
from tests.formats.test_formats import labels_of, png, run_epoch
from tests.formats.test_storage import BUCKET, keys_and_labels, s3  # noqa: F401 (a fixture)
from tests.properties import check_exactly_once_and_equal
from tests.ranks import run_ranks

NAMES = {
    "imagenet": ("image/encoded", "image/class/label"),  # TF's build_imagenet_data.py
    "tfds": ("image", "label"),
    "own": ("jpeg", "class_id"),
}


def tf_shards(root, labels: list[int], names=NAMES["tfds"], *, per_shard=10, suffix=".tfrecord"):
    """Shards ``train-0000s-of-0000n<suffix>`` of ``labels``, written by ``TFRecordWriter``."""
    from tfrecord.writer import TFRecordWriter

    root.mkdir(parents=True, exist_ok=True)
    total = -(-len(labels) // per_shard)
    for s in range(total):
        writer = TFRecordWriter(str(root / f"train-{s:05d}-of-{total:05d}{suffix}"))
        for i in range(s * per_shard, min(len(labels), (s + 1) * per_shard)):
            writer.write({names[0]: (png(labels[i]), "byte"), names[1]: (labels[i], "int"),
                          "image/format": (b"png", "byte"), "id": (i, "int")})  # fmt: skip
        writer.close()
    return root


def records(config: PipelineConfig) -> list:
    listing = list_shards(config)
    return [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]


@pytest.mark.parametrize(
    "convention, suffix", [("imagenet", ""), ("tfds", ".tfrecord"), ("own", ".tfrecords")]
)
def test_every_record_once_with_its_label_for_each_convention(ray_session, tmp_path, convention,
                                                              suffix):  # fmt: skip
    labels = labels_of(24, seed=11)
    root = tf_shards(tmp_path / "tf", labels, NAMES[convention], suffix=suffix)
    config = PipelineConfig(source=str(root), image_size=8, batch_size=4, actors=(1, 1))
    if convention == "own":
        config = config.replace(image_column="jpeg", label_column="class_id")
    listing = list_shards(config)
    assert listing.format == "tfrecord" and listing.num_samples == 24
    assert repr(NAMES[convention][1]) in listing.labels
    seen = run_epoch(config)
    assert seen == dict(enumerate(labels))  # shards in order: key i is record i


@pytest.mark.parametrize("source", ["*.tfrecord", "list"])
def test_a_remote_glob_counts_by_the_index_its_reader_goes_on_by(tmp_path, source):
    """On object storage the listing looked for an index only among the files it listed,
    which for a glob or a list are the shards alone; the reader, past a damaged record,
    found the index by name and read on: more samples than counted, those after the
    count dropped unseen (the next shard's keys). Now both count by it."""
    import fsspec
    from tfrecord.tools.tfrecord2idx import create_index

    labels = labels_of(14, seed=3)
    root = tf_shards(tmp_path / "tf", labels, per_shard=7)
    first, second = sorted(root.iterdir())
    offsets, _, _ = scan(Storage(), str(first))
    data = bytearray(first.read_bytes())
    data[offsets[2] + 9] ^= 0xFF  # record 2's length CRC
    first.write_bytes(bytes(data))
    create_index(str(first), str(first) + ".index")
    mem = fsspec.filesystem("memory")
    for path in (first, second, first.with_name(first.name + ".index")):
        mem.pipe(f"/idx/{path.name}", path.read_bytes())
    mem.pipe("/idx/other.tfrecord", second.read_bytes())  # not matched: not a shard
    uri = "memory:///idx/"
    config = PipelineConfig(source=uri + "train-*.tfrecord" if source != "list" else
                            (uri + first.name, uri + second.name))  # fmt: skip
    listing = list_shards(config)
    assert [s.num_samples for s in listing.shards] == [7, 7]
    got = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert [r.key for r in got] == list(range(14))
    assert [(r.key, r.reason) for r in got if r.reason] == [(2, "bad_checksum")]
    assert [r.label for r in got if r.reason is None] == labels[:2] + labels[3:]


def test_gzip_and_index_files_give_the_same_records(tmp_path, monkeypatch):
    from tfrecord.tools.tfrecord2idx import create_index

    labels = labels_of(30, seed=12)
    plain = tf_shards(tmp_path / "plain", labels)
    zipped, indexed = tmp_path / "gz", tmp_path / "indexed"
    zipped.mkdir()
    shutil.copytree(plain, indexed)
    for path in sorted(plain.iterdir()):
        (zipped / (path.name + ".gz")).write_bytes(gzip.compress(path.read_bytes()))
        create_index(str(indexed / path.name), str(indexed / path.name) + ".index")
    want = [(r.key, r.label, r.data) for r in records(PipelineConfig(source=str(plain)))]
    assert [r[1] for r in want] == labels
    for root in (zipped, indexed):
        assert [(r.key, r.label, r.data) for r in records(PipelineConfig(source=str(root)))] == want
    monkeypatch.setattr(pieces, "PIECE_BYTES", 1000)  # a few records a piece
    split = [s for s in list_shards(PipelineConfig(source=str(indexed))).shards]
    scanned = list_shards(PipelineConfig(source=str(plain))).shards
    assert [(s.path.split("/indexed/")[1], s.first_key, s.num_samples) for s in split] == [
        (s.path.split("/plain/")[1], s.first_key, s.num_samples) for s in scanned
    ]
    assert len(split) > 3 and "#" in split[1].path
    assert len(list_shards(PipelineConfig(source=str(zipped))).shards) == 3  # GZIP: whole


def test_an_index_that_does_not_cover_its_file_is_not_trusted(tmp_path):
    """A ``.index`` written before records were appended (or cut short, or of another
    file): its offsets would lose the records after its last, silently. Only an index that
    covers the file record after record is used; otherwise every record's header is read."""
    from tfrecord.tools.tfrecord2idx import create_index

    labels = labels_of(10, seed=3)
    root = tf_shards(tmp_path / "tf", labels, per_shard=10)
    (shard,) = sorted(root.iterdir())
    create_index(str(shard), str(shard) + ".index")
    index = shard.with_name(shard.name + ".index")
    whole = index.read_text().splitlines()
    want = [(r.key, r.label) for r in records(PipelineConfig(source=str(root)))]
    assert [r[1] for r in want] == labels
    for stale in (whole[:6], whole[1:], [*whole[:4], *whole[5:]]):  # partial, shifted, a gap
        index.write_text("\n".join(stale) + "\n")
        assert list_shards(PipelineConfig(source=str(root))).num_samples == 10
        assert [(r.key, r.label) for r in records(PipelineConfig(source=str(root)))] == want


def test_a_gzip_shard_closes_its_file(tmp_path):
    import warnings

    from raypipe.formats import tfrecord
    from raypipe.formats.storage import Storage

    root = tf_shards(tmp_path / "tf", labels_of(4, seed=1), per_shard=4)
    (shard,) = sorted(root.iterdir())
    zipped = tmp_path / "z.tfrecord.gz"
    zipped.write_bytes(gzip.compress(shard.read_bytes()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        f = tfrecord._open(Storage(), str(zipped))
        with f:
            f.read(1)
        assert f.raw.closed


def test_a_flipped_byte_skips_exactly_that_record_with_its_offset(ray_session, tmp_path):
    labels = labels_of(20, seed=13)
    root = tf_shards(tmp_path / "tf", labels)
    shard = sorted(root.iterdir())[1]  # keys 10..19
    offsets, sizes, _ = scan(Storage(), str(shard))
    data = bytearray(shard.read_bytes())
    data[offsets[4] + sizes[4] // 2] ^= 0xFF  # inside record 4's image bytes
    shard.write_bytes(bytes(data))
    bad = [r for r in records(PipelineConfig(source=str(root))) if r.reason is not None]
    assert [(r.key, r.reason, r.where) for r in bad] == [
        (14, "bad_checksum", f"{shard}@{offsets[4]}")
    ]
    config = PipelineConfig(source=str(root), image_size=8, batch_size=1, actors=(1, 1),
                            max_skipped=0.1)  # fmt: skip
    log = SkipLog.create()
    out, _ = run_ranks(config, 1, 1, skips=log, keys_only=True)
    assert sorted(k for b in out[0][0] for k in b) == [k for k in range(20) if k != 14]
    report = log.epoch(0).report()
    assert report["by_reason"] == {"bad_checksum": 1}
    assert report["records"][0]["where"] == f"{shard}@{offsets[4]}"
    with pytest.raises(SampleError, match=rf"{shard}@{offsets[4]} \(key 14\): bad_checksum"):
        run_epoch(config.replace(on_error="raise"))
    with pytest.raises(SkipBudgetError, match="bad_checksum"):  # 1 of 20 > 1 %
        run_epoch(config.replace(max_skipped=0.01))


def test_with_an_index_a_bad_length_loses_that_record_alone(tmp_path, monkeypatch):
    """A record whose length CRC fails: without an index the rest of the file is lost (one
    sample, as listed); with one, which the listing counted every record by, the reader
    goes on at the next record's offset. The records after it were reported as
    unreadable_shard ("fewer samples than when it was listed") before."""
    from tfrecord.tools.tfrecord2idx import create_index

    labels = labels_of(10, seed=16)
    root = tf_shards(tmp_path / "tf", labels)
    (shard,) = root.iterdir()
    offsets, _, _ = scan(Storage(), str(shard))
    data = bytearray(shard.read_bytes())
    data[offsets[3] + 9] ^= 0xFF  # record 3's length CRC
    shard.write_bytes(bytes(data))
    got = records(PipelineConfig(source=str(root)))
    assert [r.reason for r in got] == [None] * 3 + ["bad_checksum"]  # no index: the rest lost
    create_index(str(shard), str(shard) + ".index")
    for piece_bytes in (None, 3 * (offsets[1] - offsets[0])):  # one piece, then pieces
        if piece_bytes:
            monkeypatch.setattr(pieces, "PIECE_BYTES", piece_bytes)
        listing = list_shards(PipelineConfig(source=str(root)))
        assert listing.num_samples == 10 and len(listing.shards) == (4 if piece_bytes else 1)
        got = records(PipelineConfig(source=str(root)))
        assert [r.key for r in got] == list(range(10))
        assert [r.label for r in got if r.reason is None] == labels[:3] + labels[4:]
        assert [(r.reason, r.where) for r in got if r.reason] == [
            ("bad_checksum", f"{shard}@{offsets[3]}")
        ]
    monkeypatch.setattr(pieces, "PIECE_BYTES", 32 << 20)
    data[9] ^= 0xFF  # the first record's length CRC too: without an index, not TFRecord
    shard.write_bytes(bytes(data))
    got = records(PipelineConfig(source=str(root)))
    assert [r.key for r in got] == list(range(10))
    assert [(r.key, r.reason) for r in got if r.reason] == [
        (0, "bad_checksum"),
        (3, "bad_checksum"),
    ]


def test_a_truncated_gzip_shard_is_listed_as_its_records_and_a_reported_rest(tmp_path):
    """A ``.tfrecord.gz`` cut short: the records before the cut are listed and read, and
    the rest is one ``truncated_shard`` skip, not a shard of one sample whose reader's
    other records the plan then dropped."""
    import gzip

    labels = labels_of(40, seed=15)
    root = tf_shards(tmp_path / "tf", labels, per_shard=40)
    (plain,) = root.iterdir()
    packed = gzip.compress(plain.read_bytes())
    plain.unlink()
    read = set()  # how many records each cut left readable (protobuf's map order, and so
    for cut in range(10, 100, 3):  # how far a cut reaches, differs from process to process)
        (root / "train.tfrecord.gz").write_bytes(packed[: len(packed) * cut // 100])
        got = records(PipelineConfig(source=str(root)))
        assert list_shards(PipelineConfig(source=str(root))).num_samples == len(got)
        good = len(got) - 1
        assert [r.label for r in got[:good]] == labels[:good] and got[good].data is None
        reasons = {"truncated_shard"} if good else {"truncated_shard", "unreadable_shard"}
        assert got[good].reason in reasons, (cut, got[good])
        read.add(good)
    assert max(read) > 2 and len(read) > 3


def test_truncation_other_files_and_unknown_names(tmp_path):
    labels = labels_of(10, seed=14)
    root = tf_shards(tmp_path / "tf", labels)
    shard = next(root.iterdir())
    offsets, _, _ = scan(Storage(), str(shard))
    shard.write_bytes(shard.read_bytes()[: offsets[7] + 30])  # cut inside record 7
    got = records(PipelineConfig(source=str(root)))
    assert len(got) == list_shards(PipelineConfig(source=str(root))).num_samples == 8
    assert [r.label for r in got[:7]] == labels[:7]
    assert got[7].reason == "truncated_shard" and f"byte {offsets[7]}" in got[7].error
    (root / "notes-00001-of-00002.tfrecord").write_bytes(png(1))  # not TFRecord at all
    (root / "notes.tfrecord.gz").write_bytes(b"not GZIP")
    odd = [r for r in records(PipelineConfig(source=str(root))) if r.where.startswith(str(root / "notes"))]  # fmt: skip
    assert [(r.reason, r.where) for r in odd] == [
        ("unreadable_shard", str(root / "notes-00001-of-00002.tfrecord")),
        ("unreadable_shard", str(root / "notes.tfrecord.gz")),
    ]
    with pytest.raises(ValueError) as e:
        list_shards(PipelineConfig(source=str(root), image_column="jpg", label_column="y"))
    message = str(e.value)
    assert "\n" not in message and "'image/format'" in message and "'label'" in message


def test_a_file_that_is_not_tfrecord_is_a_skip_or_an_error_naming_it(ray_session, tmp_path):
    labels = labels_of(8, seed=17)
    root = tf_shards(tmp_path / "tf", labels)
    odd = root / "train-00001-of-00002.tfrecord"
    odd.write_bytes(png(2))
    config = PipelineConfig(source=str(root), image_size=8, batch_size=4, actors=(1, 1),
                            max_skipped=None)  # fmt: skip
    assert run_epoch(config) == dict(enumerate(labels))  # the odd file: one skipped key
    with pytest.raises(SampleError, match=rf"{odd} \(key 8\): unreadable_shard: not a TFRecord"):
        run_epoch(config.replace(on_error="raise"))


def test_a_big_shard_is_read_by_several_tasks_exactly_once(ray_session, tmp_path, monkeypatch):
    """One 64-record shard in pieces of ~6 records: both ranks read it in several tasks,
    every epoch exactly once with equal batches, the same keys per rank with the same seed."""
    labels = labels_of(64, seed=15)
    root = tf_shards(tmp_path / "tf", labels, per_shard=64)
    monkeypatch.setattr(pieces, "PIECE_BYTES", 6 * len(png(0)))
    config = PipelineConfig(source=str(root), image_size=8, batch_size=4, actors=(2, 2), seed=3)
    listing = list_shards(config)
    assert len({s.path.split("#")[0] for s in listing.shards}) == 1 and len(listing.shards) >= 8
    for rank in range(2):
        plan = RankPlan.of(listing, seed=3, shuffle=True, rank=rank, world_size=2, per_task=64)
        assert len(plan.tasks(0)) >= 4
    runs = [run_ranks(config, 2, 2, listing=listing, keys_only=True)[0] for _ in range(2)]
    for epoch in range(2):
        keys = check_exactly_once_and_equal([r[epoch] for r in runs[0]], batch_size=4,
                                            good=range(64), left_over=0)  # fmt: skip
        assert len(keys) == 64
        assert [r[epoch] for r in runs[0]] == [r[epoch] for r in runs[1]]  # seeded
    assert runs[0][0][0] != runs[0][1][0], "epochs read in different orders"


def test_consumed_records_are_neither_read_nor_decoded(ray_session, tmp_path, monkeypatch):
    """Resume: every consumed record's bytes are corrupted (its CRC would fail); the epoch
    delivers the others and reads none of them."""
    root = tf_shards(tmp_path / "tf", labels_of(40, seed=16), per_shard=20)
    monkeypatch.setattr(pieces, "PIECE_BYTES", 5 * len(png(0)))
    config = PipelineConfig(source=str(root), image_size=8, batch_size=4)
    listing = list_shards(config)
    consumed = np.random.default_rng(2).random(40) < 0.5
    for s, shard in enumerate(sorted(root.iterdir())):
        offsets, sizes, _ = scan(Storage(), str(shard))
        data = bytearray(shard.read_bytes())
        for i in np.flatnonzero(consumed[20 * s : 20 * (s + 1)]):
            data[offsets[i] + sizes[i] // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    skips = SkipLog.create()
    ds = build_dataset(config, epoch=1, consumed=consumed, skips=skips, listing=listing)
    keys = [int(k) for b in ds.iter_batches(batch_size=None) for k in b["key"]]
    assert sorted(keys) == np.flatnonzero(~consumed).tolist()
    assert skips.counts() == {}


def test_convert_writes_tfrecord_that_the_tfrecord_package_reads(ray_session, tmp_path, capsys):
    from tfrecord.reader import tfrecord_loader

    from raypipe.cli.convert import ShardsConfig, convert
    from tests.conftest import make_imagefolder

    folder = make_imagefolder(tmp_path / "folder", {"a": 7, "b": 6})
    out = tmp_path / "out"
    summary = convert(ShardsConfig(source=str(folder), out=str(out), format="tfrecord", shards=2))
    assert summary.samples == 13 and sorted(p.name for p in out.glob("*.tfrecord")) == [
        "train-00000-of-00002.tfrecord", "train-00001-of-00002.tfrecord"]  # fmt: skip
    theirs = [
        (int(r["key"][0]), int(r["label"][0]))
        for path in sorted(out.glob("*.tfrecord"))
        for r in tfrecord_loader(str(path), None, {"key": "int", "label": "int"})
    ]
    assert sorted(theirs) == [(k, 0 if k < 7 else 1) for k in range(13)]  # the folder's keys
    assert main(["inspect", str(out), "--samples", "4"]) == 0
    report = capsys.readouterr().out
    assert "tfrecord (inferred)" in report and "feature 'label' (int64)" in report
    assert "TFDS" in report and "4 good" in report


# --- object storage -------------------------------------------------------------------


def test_a_tfrecord_source_in_s3_reads_as_its_local_copy(ray_session, tmp_path, s3, monkeypatch):  # noqa: F811
    """Shards on the loopback S3 server, one with a ``.index`` beside it, the other's offsets
    read from its record headers with ranged reads; in pieces, exactly once, labels kept."""
    import boto3
    from tfrecord.tools.tfrecord2idx import create_index

    labels = labels_of(40, seed=21)
    root = tf_shards(tmp_path / "tf", labels, per_shard=20)
    first = sorted(root.iterdir())[0]
    create_index(str(first), str(first) + ".index")
    opts = s3["options"]
    client = boto3.client("s3", endpoint_url=s3["url"], region_name="us-east-1",
                          aws_access_key_id=opts["access_key"],
                          aws_secret_access_key=opts["secret_key"])  # fmt: skip
    for path in root.iterdir():
        client.upload_file(str(path), BUCKET, f"tfrecord/{path.name}")
    monkeypatch.setattr(pieces, "PIECE_BYTES", 5 * len(png(0)))
    local = PipelineConfig(source=str(root), image_size=8, batch_size=4, actors=(1, 1))
    remote = local.replace(source=f"s3://{BUCKET}/tfrecord/", storage_options=opts)
    a, b = list_shards(local), list_shards(remote)
    assert b.format == "tfrecord" and b.reader.storage.remote and len(b.shards) >= 6
    assert [(s.path.split("/tfrecord/")[1], s.first_key, s.num_samples) for s in b.shards] == [
        (s.path.split("/tf/")[1], s.first_key, s.num_samples) for s in a.shards
    ]
    assert keys_and_labels(remote) == dict(enumerate(labels))


def test_a_record_whose_feature_list_is_damaged_is_that_record_alone(tmp_path):
    """CRCs sound, the Example's outer fields too, but the image's bytes_list claims 1,000
    bytes and holds 3 (a buggy writer): that record is a bad_record skip and the records
    after it are read; they were all lost as the shard's unreadable rest."""
    from raypipe.formats.tfexample import _message, _uvarint, encode_example, frame

    recs = [encode_example({"image": png(i), "label": i}) for i in range(6)]
    feature = _message(1, b"\x0a" + _uvarint(1000) + b"abc")
    entry = _message(1, _message(1, b"image") + _message(2, feature))
    label = _message(1, _message(1, b"label") + _message(2, _message(3, _message(1, _uvarint(3)))))
    recs[3] = _message(1, entry + label)
    root = tmp_path / "tf"
    root.mkdir()
    (root / "a.tfrecord").write_bytes(b"".join(frame(r) for r in recs))
    got = records(PipelineConfig(source=str(root)))
    assert [r.reason for r in got] == [None] * 3 + ["bad_record"] + [None] * 2
    assert [r.label for r in got if r.reason is None] == [0, 1, 2, 4, 5]


def test_a_damaged_first_record_does_not_refuse_the_source(tmp_path):
    """A flipped byte in the first record's feature name ('label' to 'lcbel'): its data CRC
    fails, so reading skips that record as bad_checksum; the listing parsed it unchecked
    and refused the source, naming columns it does have."""
    from raypipe.formats.tfexample import encode_example, frame

    recs = [frame(encode_example({"image": png(i), "label": i})) for i in range(6)]
    first = bytearray(recs[0])
    first[first.find(b"label") + 1] ^= 0x02
    root = tmp_path / "tf"
    root.mkdir()
    (root / "train-00000-of-00001.tfrecord").write_bytes(bytes(first) + b"".join(recs[1:]))
    got = records(PipelineConfig(source=str(root)))
    assert [r.reason for r in got] == ["bad_checksum"] + [None] * 5
    assert [r.label for r in got[1:]] == [1, 2, 3, 4, 5]


def test_a_transform_gets_every_feature_as_an_array_however_many_values(tmp_path):
    """Boxes of a detection record: 0, 1 and 2 objects came as ``[]``, ``0.5`` and
    ``[0.5, 0.5]``, so a transform's ``len(boxes)`` failed on every one-object record."""
    from raypipe.formats.tfexample import _message, _uvarint, frame

    def feature(name: str, kind: int, payload: bytes) -> bytes:
        return _message(1, _message(1, name.encode()) + _message(2, _message(kind, payload)))

    root = tmp_path / "tf"
    root.mkdir()
    with open(root / "det.tfrecord", "wb") as f:
        for n in range(3):
            floats = _message(1, np.full(n, 0.5, "<f4").tobytes())
            ints = _message(1, b"".join(_uvarint(i) for i in range(n)))
            f.write(frame(_message(1, feature("image", 1, _message(1, png(0)))
                                   + feature("label", 3, _message(1, _uvarint(n)))
                                   + feature("bbox/xmin", 2, floats) + feature("obj", 3, ints)
                                   + feature("name", 1, _message(1, b"r%d" % n)))))  # fmt: skip
    listing = list_shards(PipelineConfig(source=str(root), transform="tests.user_transforms:noisy"))
    got = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    for n, raw in enumerate(got):
        boxes, objects = raw.extras["bbox/xmin"], raw.extras["obj"]
        assert boxes.dtype == np.float32 and boxes.tolist() == [0.5] * n
        assert objects.dtype == np.int64 and objects.tolist() == list(range(n))
        assert raw.extras["name"] == [b"r%d" % n] and raw.label == n
