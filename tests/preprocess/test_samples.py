"""Samples with no image through a real local Ray: token and tabular Parquet read straight
through or by a transform, padded with masks; audio WebDataset members decoded."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypipe import PipelineConfig
from raypipe.preprocess.samples.fields import decode_member
from raypipe.skips.records import BadSample
from tests.properties import check_exactly_once_and_equal
from tests.ranks import run_ranks

TOKEN_FILES = [37, 25, 18]  # 80 documents


def make_tokens(root, sizes=TOKEN_FILES, *, seed: int = 0, max_len: int = 40):
    """Parquet files of ``tokens`` (list<int32>, every token id in the dataset once: a
    running count) and ``label``; returns the documents by key."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    docs, start = [], 0
    for f, n in enumerate(sizes):
        part = []
        for _ in range(n):
            length = int(rng.integers(1, max_len + 1))
            part.append(np.arange(start, start + length, dtype=np.int32))
            start += length
        table = pa.table({"tokens": pa.array([d.tolist() for d in part], pa.list_(pa.int32())),
                          "label": pa.array([len(d) % 3 for d in part], pa.int64())})  # fmt: skip
        pq.write_table(table, root / f"part-{f:03d}.parquet", row_group_size=16)
        docs.extend(part)
    return docs


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    return root, make_tokens(root)


def config(source, **kw) -> PipelineConfig:
    base = {"source": str(source), "image_column": None, "batch_size": 8, "actors": (1, 1),
            "follow": False, "seed": 3}  # fmt: skip
    return PipelineConfig(**{**base, **kw})


def test_tokens_straight_through_padded_with_masks(ray_session, tokens):
    root, docs = tokens
    out, _ = run_ranks(config(root), 2, 1)
    ranks = [r[0] for r in out]
    check_exactly_once_and_equal(ranks, batch_size=8, good=range(len(docs)),
                                 left_over=2 * 8 - 1)  # fmt: skip
    for batch in (b for r in ranks for b in r):
        assert batch["tokens"].dtype == np.int32 and batch["tokens_mask"].dtype == bool
        assert batch["tokens"].shape[1] == max(len(docs[k]) for k in batch["key"])
        for row, mask, key, label in zip(batch["tokens"], batch["tokens_mask"], batch["key"],
                                         batch["label"], strict=True):  # fmt: skip
            doc = docs[key]
            assert mask.sum() == len(doc) and mask[: len(doc)].all()
            np.testing.assert_array_equal(row[mask], doc)
            assert (row[~mask] == 0).all() and label == len(doc) % 3


def test_tokens_through_a_transform(ray_session, tokens):
    root, docs = tokens
    out, _ = run_ranks(config(root, transform="tests.user_transforms:shifted_ids"), 1, 1,
                       drop_last=False)  # fmt: skip
    batches = out[0][0]
    keys = np.concatenate([b["key"] for b in batches])
    assert sorted(keys.tolist()) == list(range(len(docs)))
    for b in batches:
        assert set(b) == {"ids", "ids_mask", "length", "label", "key"}
        for ids, mask, n, key in zip(b["ids"], b["ids_mask"], b["length"], b["key"], strict=True):
            np.testing.assert_array_equal(ids[mask], docs[key].astype(np.int64) + 1)
            assert n == len(docs[key])


def test_a_table_of_floats(ray_session, tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(45, 3)).astype(np.float32)
    table = pa.table({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2],
                      "label": pa.array(np.arange(45) % 2, pa.int64())})  # fmt: skip
    pq.write_table(table, tmp_path / "table.parquet", row_group_size=10)
    out, _ = run_ranks(config(tmp_path, batch_size=10), 1, 1, drop_last=False)
    batches = out[0][0]
    assert [len(b["key"]) for b in batches] == [10, 10, 10, 10, 5]
    for b in batches:
        assert set(b) == {"a", "b", "c", "label", "key"} and b["a"].dtype == np.float32
        np.testing.assert_array_equal(np.stack([b["a"], b["b"], b["c"]], 1), x[b["key"]])
        np.testing.assert_array_equal(b["label"], b["key"] % 2)


def test_every_batch_of_a_sample_field_has_its_mask_whatever_the_first_rows_held():
    """Samples without an image: an array field is padded with its ``_mask`` in every
    batch. Decided by shape, a field whose first rows had one length (text chunked to 512,
    clips cut to a length) was stacked without a mask in the first batches, and padded
    with one later: ``batch["tokens_mask"]`` failed mid-epoch."""
    from raypipe.loader.collate import pad_collate
    from raypipe.preprocess.userrows import Schema, rows_block

    schema = Schema(arrays_ragged=True)
    lengths = [[4, 4], [4, 2]]
    blocks = []
    for part in lengths:
        rows = [{"tokens": np.arange(n, dtype=np.int32), "label": np.int64(1)} for n in part]
        for k, row in enumerate(rows):
            schema.check(row, k, "here")
        blocks.append(pad_collate(rows_block(rows, schema.ragged)))
    assert all("tokens_mask" in b for b in blocks) and "label_mask" not in blocks[0]
    assert blocks[0]["tokens_mask"].all() and blocks[1]["tokens_mask"].sum() == 6
    assert blocks[0]["tokens"].dtype == blocks[1]["tokens"].dtype  # int32 either way
    stacked = Schema()  # image samples: a fixed-shape field stacks
    stacked.check({"image": np.zeros((3, 2, 2), np.uint8)}, 0, "here")
    assert stacked.ragged == set()


def test_every_batch_has_the_mask_through_a_real_pipeline(ray_session, tmp_path):
    """The test above builds the actor's blocks by hand; through the pipeline, a block
    whose rows share a length crosses Ray as one stacked array and came without
    ``tokens_mask`` (the docs' own loop failed on it)."""
    import pyarrow.parquet as pq

    from raypipe import Pipeline

    lengths = [4] * 8 + [2, 3, 4, 5] * 2
    tokens = pa.array([list(range(1, n + 1)) for n in lengths], pa.list_(pa.int32()))
    pq.write_table(pa.table({"tokens": tokens, "label": pa.array([i % 2 for i in range(16)])}),
                   tmp_path / "a.parquet")  # fmt: skip
    config = PipelineConfig(source=str(tmp_path), image_column=None, batch_size=4,
                            rows_per_block=4, actors=(1, 1))  # fmt: skip
    with Pipeline(config, epochs=1, device="cpu", normalize=False) as pipe:
        for _, batches in pipe.epochs():
            got = list(batches)
    assert len(got) == 4 and all("tokens_mask" in b and "label_mask" not in b for b in got)
    for b in got:
        assert b["tokens_mask"].sum(1).tolist() == [lengths[k] for k in b["key"].tolist()]


def test_column_values_keep_their_dtypes_with_nulls_and_fixed_size_lists():
    from raypipe.formats.fields import column_values

    tokens = column_values(pa.array([[1, 2], None, [], [3]], pa.list_(pa.int32())))
    assert tokens[1] is None and [tokens[0].tolist(), tokens[3].tolist()] == [[1, 2], [3]]
    assert all(t.dtype == np.int32 for t in tokens if t is not None) and len(tokens[2]) == 0
    x = column_values(pa.array([1.5, None, 2.5], pa.float32()))
    assert x[1] is None and x[0].dtype == np.float32 and x[2] == 2.5
    emb = column_values(pa.array([[1, 2], None, [3, 4]], pa.list_(pa.float32(), 2)))
    assert emb[1] is None and emb[2].dtype == np.float32 and emb[2].tolist() == [3, 4]
    # a null inside one row's list: that row alone is null (every row read with it came as
    # Python lists, int64, and the run stopped at a good row)
    holed = column_values(pa.array([[1, 2], [5, None, 7], None, [9]], pa.list_(pa.int32())))
    assert [None if t is None else t.tolist() for t in holed] == [[1, 2], None, None, [9]]
    assert holed[3].dtype == np.int32
    emb = column_values(pa.array([[1, 2], [None, 4], [3, 4]], pa.list_(pa.float32(), 2)))
    assert emb[1] is None and emb[2].dtype == np.float32 and emb[2].tolist() == [3, 4]


def test_a_null_row_is_a_skip_and_the_others_keep_their_dtypes(ray_session, tmp_path):
    """One null row among int32 token lists, float32 numbers and float32 embeddings (a
    fixed-size list, as Hugging Face writes ``Sequence(length=N)``): the null row is a
    skip and every other row keeps the columns' dtypes (a null made the rows read with it
    int64 / float64, and the worker's type check stopped the run; fixed-size lists were
    always float64)."""
    n = 40
    table = pa.table({
        "tokens": pa.array([None if i == 30 else list(range(i, i + 1 + i % 5)) for i in range(n)],
                           pa.list_(pa.int32())),
        "x": pa.array(np.arange(n, dtype=np.float32)),
        "emb": pa.array([[i, i + 0.5] for i in range(n)], pa.list_(pa.float32(), 2)),
        "label": pa.array(np.arange(n) % 2, pa.int64()),
    })  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=n)
    out, _ = run_ranks(config(tmp_path, batch_size=8), 1, 1, drop_last=False)
    batches = out[0][0]
    assert sorted(np.concatenate([b["key"] for b in batches]).tolist()) == [
        k for k in range(n) if k != 30
    ]
    for b in batches:
        assert (b["tokens"].dtype, b["x"].dtype, b["emb"].dtype) == (
            np.int32,
            np.float32,
            np.float32,
        )
        np.testing.assert_array_equal(b["emb"][:, 0], b["key"])


def write_audio(root, clips: dict[str, tuple[np.ndarray, int, str]], *, labels=True):
    """A WebDataset tar: each clip ``stem: (samples, rate, format)`` as ``stem.<format>``
    (written by soundfile), and ``stem.cls``."""
    import soundfile

    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(root / "audio-000.tar", "w") as tar:
        for i, (stem, (samples, rate, fmt)) in enumerate(clips.items()):
            buf = io.BytesIO()
            soundfile.write(buf, samples, rate, format=fmt.upper(), subtype="PCM_16")
            members = {fmt: buf.getvalue(), "cls": str(i % 4).encode()} if labels else {}
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{stem}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def pcm16(rng, frames: int) -> np.ndarray:
    """Random samples that 16-bit PCM stores exactly."""
    return (rng.integers(-2000, 2000, frames) / 32768).astype(np.float32)


def test_flac_audio_decoded_and_cropped_by_a_transform(ray_session, tmp_path):
    pytest.importorskip("soundfile")
    rng = np.random.default_rng(2)
    clips = {f"c{i:03d}": (pcm16(rng, 500 + 37 * i), 16000, "flac") for i in range(12)}
    write_audio(tmp_path, clips)
    cfg = config(tmp_path, transform="tests.user_transforms:cropped_audio", label_member="cls",
                 batch_size=4)  # fmt: skip
    out, _ = run_ranks(cfg, 1, 1, drop_last=False)
    batches = out[0][0]
    assert sorted(np.concatenate([b["key"] for b in batches]).tolist()) == list(range(12))
    stems = sorted(clips)
    for b in batches:
        assert b["audio"].dtype == np.float32 and b["audio"].shape == (len(b["key"]), 400)
        assert (b["rate"] == 16000).all()
        for audio, key, label in zip(b["audio"], b["key"], b["label"], strict=True):
            np.testing.assert_array_equal(audio, clips[stems[key]][0][:400])
            assert label == key % 4


def test_audio_members_resampled_and_bad_ones_skipped(ray_session, tmp_path):
    pytest.importorskip("soundfile")
    rng = np.random.default_rng(4)
    clips = {f"w{i:03d}": (pcm16(rng, 800 + 8 * i), 8000, "wav") for i in range(6)}
    write_audio(tmp_path, clips)
    with tarfile.open(tmp_path / "audio-000.tar", "a") as tar:
        info = tarfile.TarInfo("zbad.wav")
        info.size = 12
        tar.addfile(info, io.BytesIO(b"not a wav!!!"))
    cfg = config(tmp_path, sample_rate=16000, batch_size=3, max_skipped=0.5)
    out, stats = run_ranks(cfg, 1, 1, drop_last=False)
    batches = out[0][0]
    assert stats[0][0]["skipped"] == {"bad_audio": 1}
    assert sorted(np.concatenate([b["key"] for b in batches]).tolist()) == list(range(6))
    for b in batches:
        assert (b["sample_rate"] == 16000).all() and "cls" in b
        lengths = b["audio_mask"].sum(1)
        np.testing.assert_array_equal(lengths, [2 * (800 + 8 * k) for k in b["key"]])


def test_an_audio_member_that_does_not_decode_is_bad_audio():
    pytest.importorskip("soundfile")
    with pytest.raises(BadSample) as e:
        decode_member("flac", b"\x00" * 64)
    assert e.value.reason == "bad_audio"
    assert decode_member("cls", b" 3\n") == {"cls": 3}
    assert decode_member("tokens", [1, 2]) == {"tokens": [1, 2]}


def test_hugging_face_audio_and_image_columns_are_decoded(ray_session, tmp_path):
    """Parquet as Hugging Face writes ``Audio()`` and ``Image()`` columns (``{bytes, path}``
    structs; a path may be None): decoded and resampled as WebDataset members are; they came
    as the raw dicts, ``sample_rate`` left unused."""
    soundfile = pytest.importorskip("soundfile")
    from PIL import Image

    rng = np.random.default_rng(5)
    clips, audio, images = [pcm16(rng, 700 + 10 * i) for i in range(6)], [], []
    for i, clip in enumerate(clips):
        buf = io.BytesIO()
        soundfile.write(buf, clip, 8000, format="WAV", subtype="PCM_16")
        audio.append({"bytes": buf.getvalue(), "path": f"c{i}.wav" if i % 2 else None})
        png = io.BytesIO()
        Image.fromarray(np.full((3, 4, 3), i, np.uint8)).save(png, "PNG")
        images.append({"bytes": png.getvalue(), "path": None})
    table = pa.table({"audio": audio, "photo": images, "label": list(range(6)),
                      "meta": [{"speaker": i} for i in range(6)]})  # fmt: skip
    tmp_path.mkdir(exist_ok=True)
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
    out, _ = run_ranks(config(tmp_path, sample_rate=16000, batch_size=3), 1, 1, drop_last=False)
    batches = out[0][0]
    assert sorted(np.concatenate([b["key"] for b in batches]).tolist()) == list(range(6))
    for b in batches:
        assert (b["audio_sample_rate"] == 16000).all() and b["audio"].dtype == np.float32
        np.testing.assert_array_equal(
            b["audio_mask"].sum(1), [2 * (700 + 10 * k) for k in b["key"]]
        )
        for key, image, meta in zip(b["key"], b["photo"], b["meta"], strict=True):
            np.testing.assert_array_equal(image, np.full((3, 4, 3), key, np.uint8))
            assert meta == {"speaker": key}  # a struct of other fields stays as it is


def test_token_ids_of_two_numeric_types_are_padded_together_and_a_change_of_dims_stops(
    ray_session, tmp_path
):
    """One actor reads both files (with compute="tasks" two pooled workers may read one
    each): int32 ids in one file and int64 in the other are one field, padded into int64
    (they stopped the run, where docs/samples.md promised this); a field whose number of
    dimensions changes still stops it."""
    from raypipe.preprocess.usermap import TransformOutputError

    for f, dtype in enumerate((pa.int32(), pa.int64())):
        table = pa.table({"tokens": pa.array([[1, 2], [3]] * 4, pa.list_(dtype))})
        pq.write_table(table, tmp_path / f"part-{f}.parquet")
    cfg = config(tmp_path, shuffle_files=False, batch_size=2, compute="actors")
    out, _ = run_ranks(cfg, 1, 1, drop_last=False)
    batches = out[0][0]
    assert sum(len(b["key"]) for b in batches) == 16
    assert {b["tokens"].dtype for b in batches} <= {np.dtype("int32"), np.dtype("int64")}
    assert (
        sorted(int(t) for b in batches for t in b["tokens"][b["tokens_mask"]])
        == [1] * 8 + [2] * 8 + [3] * 8
    )
    nested = pa.array([[[1, 2]], [[3, 4]]] * 4, pa.list_(pa.list_(pa.int64())))
    pq.write_table(pa.table({"tokens": nested}), tmp_path / "part-1.parquet")
    with pytest.raises(
        TransformOutputError,
        match=r"field 'tokens' is (list|int\d+ with 1 dims) at key .*, "
        r"but (int\d+ with 1 dims|list) in the earlier samples",
    ):
        run_ranks(cfg, 1, 1, drop_last=False)


def test_npy_and_json_members_are_fields():
    buf = io.BytesIO()
    np.save(buf, np.arange(5, dtype=np.int16))
    np.testing.assert_array_equal(decode_member("ids.npy", buf.getvalue())["ids"], np.arange(5))
    assert decode_member("json", b'{"a": 1}') == {"json": {"a": 1}}
    assert decode_member("txt", b"hello") == {"txt": "hello"}


def test_a_json_label_member_stays_a_field_and_a_label_column_never_replaces_one(tmp_path):
    """``label_member="json"`` took the whole .json as the label, its other keys (a
    transcript, a speaker) lost; ``label_column="fine_label"`` beside a column ``label``
    replaced that column's values with the label in every sample."""
    from raypipe.plan.shards import list_shards

    root = tmp_path / "wds"
    root.mkdir()
    with tarfile.open(root / "a.tar", "w") as tar:
        for name, data in (("u0.npy", b"\x93NUMPY"), ("u0.json", b'{"label": 3, "text": "hi"}')):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    listing = list_shards(config(root, label_member="json"))
    (raw,) = [r for s in listing.shards for r in listing.reader.read(s.path, s.first_key, -1)]
    assert raw.label == 3 and raw.extras["label"] == 3
    assert decode_member("json", raw.extras["json"])["json"] == {"label": 3, "text": "hi"}
    table = pa.table({"x": [1.0, 2.0], "label": [7, 8], "fine_label": [0, 1]})
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"^PipelineConfig\.label_column='fine_label': .* also "
                       r"has a column 'label', which the label would replace"):  # fmt: skip
        list_shards(config(tmp_path / "t.parquet", label_column="fine_label"))
    assert list_shards(config(tmp_path / "t.parquet")).num_samples == 2
    pq.write_table(pa.table({"x": [1.0], "key": ["utt-17"]}), tmp_path / "k.parquet")
    with pytest.raises(ValueError, match=r"k.parquet has a column 'key', which raypipe's "):
        list_shards(config(tmp_path / "k.parquet"))  # the actors refused it, mid-run


def test_a_field_named_key_and_sample_rate_for_images_are_refused():
    """A data column named ``key`` (an utterance id) was replaced by raypipe's sample key
    without a word; ``sample_rate`` on image samples did nothing."""
    from raypipe.formats.sample import RawSample
    from raypipe.preprocess.samples.fields import FieldMap
    from raypipe.preprocess.usermap import TransformOutputError

    fields = FieldMap(None, seed=0, per_batch=False, sample_rate=None)
    with pytest.raises(TransformOutputError, match="field named 'key'.*rename it"):
        fields.sample(RawSample(5, 1, None, "t.parquet:row5", extras={"key": "utt-17", "x": 1.0}))
    with pytest.raises(ValueError, match="PipelineConfig.sample_rate=16000: resamples"):
        PipelineConfig(source="d", sample_rate=16000)
    PipelineConfig(source="d", image_column=None, sample_rate=16000)


def test_an_empty_list_in_a_list_of_strings_column_stays_a_list():
    """A Parquet list<string> (tags) or list<list<float>> (boxes) column holding ``[]`` in
    one row: NumPy made it a float64 array, the other rows lists, and the actor stopped the
    run as if a transform had changed its fields' types."""
    from raypipe.formats.sample import RawSample
    from raypipe.loader.collate import pad_collate
    from raypipe.preprocess.samples.fields import FieldMap
    from raypipe.preprocess.userrows import Schema, rows_block

    fields, schema = FieldMap(None, seed=0, per_batch=False, sample_rate=None), Schema(True)
    values = [[], ["a", "b"], [], [[1.0, 2.0]], []]  # the first row's empty too
    rows = []
    for key, tags in enumerate(values):
        raw = RawSample(key, 0, None, f"t.parquet:row{key}", extras={"tags": tags, "n": 1.5})
        row = fields(raw, 0)
        schema.check(row, key, raw.where)
        rows.append(row)
    batch = pad_collate(rows_block(rows, schema.ragged))
    assert batch["tags"] == values and batch["n"].tolist() == [1.5] * 5


def test_an_image_member_of_a_sample_without_an_image_keeps_max_image_pixels():
    """``image_column=None``: a mask or picture member is decoded under the same limit as an
    image sample's members (it had none: a huge PNG could take an actor's memory)."""
    from raypipe.formats.sample import RawSample
    from raypipe.preprocess.samples.fields import FieldMap
    from tests.conftest import image_bytes

    png = image_bytes(np.random.default_rng(0), "PNG", size=(40, 30))
    small = FieldMap(None, seed=0, per_batch=False, sample_rate=None, max_image_pixels=1000)
    with pytest.raises(BadSample, match="1200 pixels > max_image_pixels=1000"):
        small.sample(RawSample(0, 1, None, "s.tar:0", extras={"mask.png": png}))
    roomy = FieldMap(None, seed=0, per_batch=False, sample_rate=None, max_image_pixels=2000)
    row = roomy.sample(RawSample(0, 1, None, "s.tar:0", extras={"mask.png": png}))
    assert row["mask"].shape[:2] == (30, 40)
