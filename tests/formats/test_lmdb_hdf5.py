"""LMDB environments as the PyTorch LMDB recipes write them with ``lmdb`` (pickled tuples,
msgpack dicts, their ``__keys__``/``__len__`` entries) and HDF5 files as ``h5py`` writes
them (encoded bytes or raw pixels, chunked): every sample once with its label, large ones
in pieces over several tasks and ranks, a user transform, and bad input. Images are flat
grays whose level encodes the label (`test_formats`)."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest

from raypipe import PipelineConfig
from raypipe.cli import main
from raypipe.formats import infer_format, pieces
from raypipe.plan.shards import list_shards
from tests.formats.test_formats import labels_of, level, png, run_epoch
from tests.properties import check_exactly_once_and_equal
from tests.ranks import run_ranks


def lmdb_env(path, labels: list[int], *, codec="pickle", names=("image", "label")):
    """One environment directory (``data.mdb``): ``{i:08d}`` → ``(png, label)`` pickled (or
    ``(pixels, label)``), or a msgpack dict with ``names``; plus the recipes' ``__keys__`` and
    ``__len__`` entries."""
    import lmdb
    import msgpack

    env = lmdb.open(str(path), map_size=1 << 26)
    keys = [f"{i:08d}".encode() for i in range(len(labels))]
    with env.begin(write=True) as txn:
        for key, label in zip(keys, labels, strict=True):
            if codec == "pickle":
                value = pickle.dumps((png(label), label))
            elif codec == "pixels":  # a decoded H×W×3 array, as some recipes keep
                value = pickle.dumps((np.full((10, 12, 3), level(label), np.uint8), label))
            else:
                value = msgpack.packb({names[0]: png(label), names[1]: label, "src": "gen"})
            txn.put(key, value)
        txn.put(b"__keys__", pickle.dumps(keys))
        txn.put(b"__len__", pickle.dumps(len(keys)))
    env.close()
    return path


def h5_file(path, labels: list[int], *, raw=False, names=("images", "labels"), chunk=4):
    import h5py

    with h5py.File(path, "w") as f:
        if raw:
            pixels = np.stack([np.full((10, 12, 3), level(v), np.uint8) for v in labels])
            f.create_dataset(names[0], data=pixels, chunks=(chunk, 10, 12, 3))
        else:
            images = f.create_dataset(names[0], (len(labels),), h5py.vlen_dtype(np.uint8),
                                      chunks=(chunk,))  # fmt: skip
            for i, v in enumerate(labels):
                images[i] = np.frombuffer(png(v), np.uint8)
        f.create_dataset(names[1], data=np.asarray(labels, np.int64).reshape(-1, 1))
    return path


@pytest.mark.parametrize("codec", ["pickle", "msgpack", "pixels"])
def test_lmdb_every_sample_once_with_its_label(ray_session, tmp_path, codec):
    labels = labels_of(20, seed=31)
    names = ("img", "target") if codec == "msgpack" else ("image", "label")
    lmdb_env(tmp_path / "train.lmdb", labels, codec=codec, names=names)
    config = PipelineConfig(source=str(tmp_path / "train.lmdb"), image_size=8, batch_size=4,
                            image_column=names[0], label_column=names[1], actors=(1, 1))  # fmt: skip
    listing = list_shards(config)
    assert listing.format == "lmdb" and listing.num_samples == 20  # __keys__, __len__ left out
    assert run_epoch(config) == dict(enumerate(labels))


@pytest.mark.parametrize("raw", [False, True], ids=["encoded", "pixels"])
def test_hdf5_every_sample_once_with_its_label(ray_session, tmp_path, raw):
    labels = labels_of(30, seed=32)
    root = tmp_path / "h5"
    root.mkdir()
    names = ("x", "y") if raw else ("images", "labels")
    h5_file(root / "a.h5", labels[:18], raw=raw, names=names)
    h5_file(root / "b.hdf5", labels[18:], raw=raw, names=names)
    config = PipelineConfig(source=str(root), image_size=8, batch_size=5, actors=(1, 1))
    if raw:
        config = config.replace(image_column="x", label_column="y")
    listing = list_shards(config)
    assert listing.format == "hdf5" and [s.num_samples for s in listing.shards] == [18, 12]
    assert ("raw pixels" if raw else "encoded bytes") in listing.labels
    assert run_epoch(config) == dict(enumerate(labels))


def test_large_lmdb_and_hdf5_in_pieces_over_two_ranks(ray_session, tmp_path, monkeypatch):
    """Pieces of a few samples (LMDB by key ranges, HDF5 by whole chunks): two ranks, two
    epochs, exactly once with equal batches."""
    labels = labels_of(36, seed=33)
    lmdb_env(tmp_path / "db", labels)
    (tmp_path / "h5").mkdir()
    h5_file(tmp_path / "h5" / "big.h5", labels)
    monkeypatch.setattr(pieces, "PIECE_BYTES", 5 * len(png(0)))
    for source in (tmp_path / "db", tmp_path / "h5"):
        config = PipelineConfig(source=str(source), image_size=8, batch_size=3, actors=(2, 2))
        listing = list_shards(config)
        assert len(listing.shards) >= 4 and listing.num_samples == 36
        if source.name == "h5":  # pieces start on chunk boundaries (chunks of 4 rows)
            assert all(int(s.path.split("#")[1].split("+")[0]) % 4 == 0 for s in listing.shards)
        out, _ = run_ranks(config, 2, 2, listing=listing)
        for epoch in range(2):
            check_exactly_once_and_equal(
                [r[epoch] for r in out], batch_size=3, good=range(36), left_over=0
            )  # 36: six batches a rank
            got = {int(k): int(v) for r in out for b in r[epoch]
                   for k, v in zip(b["key"], b["label"], strict=True)}  # fmt: skip
            assert got == dict(enumerate(labels)) and len(got) == 36


def test_a_user_transform_gets_the_other_fields(ray_session, tmp_path):
    labels = labels_of(8, seed=34)
    lmdb_env(tmp_path / "db", labels, codec="msgpack")
    config = PipelineConfig(source=str(tmp_path / "db"), batch_size=4, actors=(1, 1),
                            transform="tests.formats.test_lmdb_hdf5:with_source")  # fmt: skip
    out, _ = run_ranks(config, 1, 1)
    rows = [(int(k), int(v), int(n)) for b in out[0][0]
            for k, v, n in zip(b["key"], b["label"], b["source_len"], strict=True)]  # fmt: skip
    assert sorted(rows) == [(k, labels[k], 3) for k in range(8)]


def with_source(sample: dict) -> dict:
    """The sample's image at 4×4, its label, and the length of its ``src`` field."""
    image = sample["image"][:4, :4].transpose(2, 0, 1).copy()
    return {"image": image, "label": sample["label"], "source_len": len(sample["src"])}


def test_bad_input(tmp_path):
    import fsspec

    lmdb_env(tmp_path / "db", [1, 2], codec="msgpack", names=("img", "target"))
    with pytest.raises(ValueError) as e:
        list_shards(PipelineConfig(source=str(tmp_path / "db")))
    assert "\n" not in str(e.value) and "['img', 'src', 'target']" in str(e.value)
    h5_file(tmp_path / "h.h5", [1, 2], names=("pics", "ids"), chunk=1)
    with pytest.raises(ValueError) as e:
        list_shards(PipelineConfig(source=str(tmp_path / "h.h5")))
    assert "\n" not in str(e.value) and "['ids', 'pics']" in str(e.value)
    # files that are not what their names say: one skip each, naming the file
    for name in ("odd/data.mdb", "odd.h5"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(png(0))
        listing = list_shards(PipelineConfig(source=str(tmp_path / name)))
        raws = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
        assert [(r.reason, r.where) for r in raws] == [("unreadable_shard", str(tmp_path / name))]
    # LMDB memory-maps its file: object storage is refused in one line
    fsspec.filesystem("memory").pipe("/envs/train/data.mdb", (tmp_path / "db" / "data.mdb").read_bytes())  # fmt: skip
    with pytest.raises(ValueError) as e:
        list_shards(PipelineConfig(source="memory://envs/train", format="lmdb"))
    assert "\n" not in str(e.value) and "memory-maps" in str(e.value)


def test_lmdb_labels_as_arrays_and_an_environment_rebuilt_in_place(tmp_path):
    """Labels pickled as 0-d or one-element NumPy arrays are labels (a 0-d one raised
    TypeError, which lost the rest of the environment); an environment rebuilt at the same
    path is read anew in a process that read it before (a notebook's driver, a pooled
    worker), not from the old one it had open."""
    import shutil

    import lmdb

    def read(source):
        listing = list_shards(PipelineConfig(source=str(source)))
        return [(r.key, r.label, r.reason) for s in listing.shards
                for r in listing.reader.read(s.path, s.first_key, -1)]  # fmt: skip

    root = tmp_path / "db"
    env = lmdb.open(str(root), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i, label in enumerate([np.array(3), np.array([4]), np.int64(5), [6]]):
            txn.put(f"{i:08d}".encode(), pickle.dumps((png(i), label)))
    env.close()
    assert read(root) == [(0, 3, None), (1, 4, None), (2, 5, None), (3, 6, None)]
    shutil.rmtree(root)
    lmdb_env(root, [1, 1, 1, 1, 1])
    assert [r[1] for r in read(root)] == [1] * 5


def _h5_rows(path, *, images: int, labels: int, chunks=None) -> list:
    """Every sample read from a new HDF5 file of ``images`` encoded images (labels i % 5)
    and a labels dataset of ``labels`` rows."""
    import h5py

    with h5py.File(path, "w") as f:
        data = f.create_dataset("images", (images,), h5py.vlen_dtype(np.uint8), chunks=chunks)
        for i in range(images):
            data[i] = np.frombuffer(png(i % 5), np.uint8)
        f.create_dataset("labels", data=np.arange(labels, dtype=np.int64) % 5)
    listing = list_shards(PipelineConfig(source=str(path)))
    return [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]


def test_hdf5_rows_past_a_shorter_label_dataset_are_missing_labels_only(tmp_path):
    """192 images and 90 labels: rows 90..191 are ``missing_label`` skips; the rows before
    them keep their labels (a read run that crossed the end lost all its rows, labelled
    ones too, under a NumPy reshape message; so did a run wholly past it)."""
    raws = _h5_rows(tmp_path / "short.h5", images=192, labels=90, chunks=(4,))
    assert [r.key for r in raws] == list(range(192))
    assert [r.label for r in raws[:90]] == [i % 5 for i in range(90)]
    assert {r.reason for r in raws[90:]} == {"missing_label"} and "90 rows" in raws[95].error


def test_hdf5_labels_longer_than_the_images_are_no_ones_labels(tmp_path):
    """12 images and 15 labels: which label is whose cannot be told (labels appended
    without their images, or images cut), so every row is a ``bad_label`` skip naming both
    lengths, not a sample trained on a label that may be another's (they were all read)."""
    raws = _h5_rows(tmp_path / "long.h5", images=12, labels=15)
    assert [r.key for r in raws] == list(range(12))
    assert {r.reason for r in raws} == {"bad_label"} and {r.data for r in raws} == {None}
    assert "15 rows" in raws[3].error and "12 images" in raws[3].error


def test_hdf5_from_object_storage_reads_as_its_local_copy(tmp_path):
    """Through a remote file system (fsspec's in-memory one here): ranged reads of the file."""
    import fsspec

    labels = labels_of(12, seed=35)
    h5_file(tmp_path / "a.h5", labels, raw=True)
    fsspec.filesystem("memory").pipe("/h5/a.h5", (tmp_path / "a.h5").read_bytes())
    local, remote = (PipelineConfig(source=s) for s in (str(tmp_path / "a.h5"), "memory://h5"))
    got = [list_shards(c) for c in (local, remote)]
    assert got[1].reader.storage.remote
    a, b = ([(r.key, r.label, r.data) for s in g.shards for r in g.reader.read(s.path, s.first_key, -1)]
            for g in got)  # fmt: skip
    assert a == b and [r[1] for r in a] == labels


@pytest.mark.parametrize(
    "fmt, modules, extra",
    [("tfrecord", ["crc32c", "google_crc32c"], "tfrecord"), ("lmdb", ["lmdb"], "lmdb"),
     ("hdf5", ["h5py"], "hdf5")],
)  # fmt: skip
def test_a_missing_library_names_its_extra(tmp_path, monkeypatch, capsys, fmt, modules, extra):
    from raypipe.formats import tfexample
    from tests.formats.test_tfrecord import tf_shards

    if fmt == "tfrecord":
        tf_shards(tmp_path / fmt, [1, 2])
    elif fmt == "lmdb":
        lmdb_env(tmp_path / fmt, [1, 2])
    else:
        (tmp_path / fmt).mkdir()
        h5_file(tmp_path / fmt / "a.h5", [1, 2], chunk=1)
    monkeypatch.setattr(tfexample, "_crc32c", None)  # CRC32C's library is looked up again
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    with pytest.raises(ImportError, match=rf"pip install 'raypipe\[{extra}\]'"):
        list_shards(PipelineConfig(source=str(tmp_path / fmt)))
    from raypipe.cli import main

    assert main(["inspect", str(tmp_path / fmt)]) == 2  # one line, no traceback
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"pip install 'raypipe[{extra}]'" in err


@pytest.mark.parametrize(
    "name, fmt",
    [("train-00000-of-01024", "tfrecord"), ("a.tfrecords", "tfrecord"),
     ("a.tfrecord.gz", "tfrecord"), ("env/data.mdb", "lmdb"), ("train.lmdb", "lmdb"),
     ("a.h5", "hdf5"), ("a.HDF5", "hdf5"), ("train-00000-of-00004.tar", "webdataset")],
)  # fmt: skip
def test_file_names_give_the_format(tmp_path, name, fmt):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_bytes(b"")
    (tmp_path / "train-00000-of-01024.index").write_bytes(b"")  # an index is no shard
    assert infer_format([str(tmp_path)]) == fmt


def test_inspect_shows_where_images_and_labels_are(tmp_path, capsys, monkeypatch):
    lmdb_env(tmp_path / "db", labels_of(6, seed=36))
    (tmp_path / "h5").mkdir()
    h5_file(tmp_path / "h5" / "a.h5", labels_of(9, seed=37), raw=True)
    monkeypatch.setattr(pieces, "PIECE_BYTES", 3 * 10 * 12 * 3)  # pieces of 4 rows (a chunk)
    assert main(["inspect", str(tmp_path / "db"), "--samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "lmdb (inferred)" in out and "(image, label) tuples" in out and "4 good" in out
    assert main(["inspect", str(tmp_path / "h5"), "--samples", "4"]) == 0
    out = capsys.readouterr().out
    assert "hdf5 (inferred)" in out and "dataset 'labels', images 'images' (raw pixels" in out
    assert "3 (pieces of 1 file)" in out and "12x10 RGB" in out


def test_an_lmdb_file_cut_short_is_one_unreadable_shard_not_a_dead_process(tmp_path):
    """LMDB maps its file: reading a page past the end of a data.mdb cut short (a copy that
    stopped) killed the process with SIGBUS, listing included, without a word. Run in a
    child process, as the failure was."""
    import subprocess
    from pathlib import Path

    env = lmdb_env(tmp_path / "db", labels_of(200, seed=3))
    data = Path(env) / "data.mdb"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    code = ("import sys\nfrom raypipe import PipelineConfig\nfrom raypipe.plan.shards import "
            "list_shards\nl = list_shards(PipelineConfig(source=sys.argv[1]))\n"
            "print([(r.reason, r.error) for s in l.shards for r in l.reader.read(s.path, "
            "s.first_key, -1)])\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(env)], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert out.returncode == 0, (out.returncode, out.stderr[-1500:])
    assert "'unreadable_shard'" in out.stdout and "the file is cut short" in out.stdout


def test_old_msgpack_values_and_a_scalar_hdf5_dataset(tmp_path):
    """Values packed by msgpack before 1.0 (``use_bin_type=False``: bytes as str) were every
    one a bad_record blamed on pickle; a scalar ``images`` dataset crashed the listing with
    an IndexError."""
    import h5py
    import lmdb
    import msgpack

    env = lmdb.open(str(tmp_path / "db"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(b"0", msgpack.packb({"image": png(1), "label": 1}, use_bin_type=False))
        txn.put(b"1", msgpack.packb({"image": png(2), "label": 2}, use_bin_type=True))
        txn.put(b"2", b"\xc1 neither")
    env.close()
    listing = list_shards(PipelineConfig(source=str(tmp_path / "db")))
    got = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert [(r.reason, r.label) for r in got[:2]] == [(None, 1), (None, 2)]
    assert got[0].data == png(1) and got[2].reason == "bad_record"
    assert "msgpack:" in got[2].error and "pickle" not in got[2].error.split(":", 1)[1]
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f.create_dataset("images", data=np.uint8(3))
        f.create_dataset("labels", data=np.int64(1))
    listing = list_shards(PipelineConfig(source=str(tmp_path / "s.h5")))
    got = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert [r.reason for r in got] == ["missing_column"]


def test_a_damaged_hdf5_file_is_its_own_unreadable_shard_not_the_sources_end(tmp_path):
    """A bit flipped in an HDF5 file's metadata (its local heap's signature): h5py's
    RuntimeError escaped listing, reading and labels, so one damaged file among many
    stopped the run at listing, naming none."""
    import h5py

    root = tmp_path / "h5"
    root.mkdir()
    for name in ("a", "b"):
        with h5py.File(root / f"{name}.h5", "w") as f:
            f["images"] = np.zeros((4, 8, 8, 3), np.uint8)
            f["labels"] = np.arange(4)
    raw = bytearray((root / "b.h5").read_bytes())
    raw[raw.find(b"HEAP")] ^= 1
    (root / "b.h5").write_bytes(bytes(raw))
    listing = list_shards(PipelineConfig(source=str(root)))
    read = {s.path.rsplit("/", 1)[1]: list(listing.reader.read(s.path, s.first_key, -1))
            for s in listing.shards}  # fmt: skip
    assert [r.reason for r in read["a.h5"]] == [None] * 4
    assert {r.reason for r in read["b.h5"]} == {"unreadable_shard"}
    assert all("b.h5" in r.where for r in read["b.h5"])


def test_an_hdf5_image_dataset_of_strings_is_a_wrong_type_per_row(tmp_path):
    """Images stored as variable-length strings come back as Python bytes, which have no
    dtype: an AttributeError lost the whole shard, where each row is a ``wrong_type``."""
    import h5py

    path = tmp_path / "s.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=[b"abc", b"de"], dtype=h5py.special_dtype(vlen=bytes))
        f["labels"] = np.arange(2)
    listing = list_shards(PipelineConfig(source=str(path)))
    raws = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert [r.key for r in raws] == [0, 1] and {r.reason for r in raws} == {"wrong_type"}
