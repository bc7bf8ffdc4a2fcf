"""Your own transform in the actors, through a real local Ray and the warm pipeline: seeds,
image + mask, ragged outputs and the default collate, skips and raise, bad transforms."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from raypipe import Pipeline, PipelineConfig, SampleError, SkipLog
from raypipe.loader.collate import pad_collate
from raypipe.preprocess.usermap import TransformOutputError
from tests import user_transforms
from tests.conftest import image_bytes

T = "tests.user_transforms"


def run(config: PipelineConfig, epochs: int = 1, **kw) -> list[list[dict]]:
    """Every batch of every epoch (one rank), with each key checked once per epoch."""
    out = []
    with Pipeline(config, epochs=epochs, device="cpu", **kw) as pipe:
        for _, batches in pipe.epochs():
            got = [b for b in batches]
            keys = [k for b in got for k in b["key"].tolist()]
            assert len(keys) == len(set(keys))
            out.append(got)
    return out


def by_key(batches: list[dict], field: str) -> dict[int, np.ndarray]:
    return {
        k: np.asarray(v) for b in batches for k, v in zip(b["key"].tolist(), b[field], strict=True)
    }


def test_global_generators_are_seeded_per_sample(ray_session, datasets):
    config = PipelineConfig(source=str(datasets["parquet"]), batch_size=4, actors=(2, 2),
                            transform=f"{T}:noisy", seed=3)  # fmt: skip
    a, b = run(config, epochs=2), run(config.replace(actors=(1, 1)), epochs=2)
    for epoch in range(2):
        da, db = by_key(a[epoch], "draws"), by_key(b[epoch], "draws")
        assert da.keys() == db.keys() and len(da) == 60
        assert all(np.array_equal(da[k], db[k]) for k in da)  # same seed, key: same draws
    e0, e1 = by_key(a[0], "draws"), by_key(a[1], "draws")
    assert all(not np.array_equal(e0[k], e1[k]) for k in e0.keys() & e1.keys())
    other = by_key(run(config.replace(seed=4))[0], "draws")
    assert all(not np.array_equal(other[k], e0[k]) for k in other.keys() & e0.keys())
    image = a[0][0]["image"]
    assert image.shape == (4, 3, 8, 8) and image.dtype.is_floating_point  # normalized uint8


def png(value: int, size=(16, 12), mode="RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, value if mode == "L" else (value,) * 3).save(out, "PNG")
    return out.getvalue()


def mask_shards(root, n: int) -> None:
    import webdataset as wds

    root.mkdir(parents=True)
    with wds.TarWriter(str(root / "shard-0000.tar")) as sink:
        for i in range(n):
            mask = np.zeros((12, 16), np.uint8)
            mask[:, :8] = i % 7 + 1  # left half labelled: a flip moves it right
            image = np.full((12, 16, 3), 200, np.uint8)
            image[:, :8] = 40 + i  # the image's left half too: its own value, the key's
            m, p = io.BytesIO(), io.BytesIO()
            Image.fromarray(mask, "L").save(m, "PNG")
            Image.fromarray(image, "RGB").save(p, "PNG")
            sink.write({"__key__": f"s{i:04d}", "jpg": p.getvalue(), "mask.png": m.getvalue(),
                        "cls": i % 3, "json": {"source": f"cam{i % 2}"}})  # fmt: skip


def test_image_and_mask_batch_together(ray_session, tmp_path):
    mask_shards(tmp_path / "wds", 18)
    config = PipelineConfig(source=str(tmp_path / "wds"), batch_size=6, actors=(1, 1),
                            transform=f"{T}:with_mask")  # fmt: skip
    (batches,) = run(config, normalize=False)
    assert len(batches) == 3
    flipped = []
    for b in batches:
        assert b["image"].shape == (6, 3, 8, 8) and b["mask"].shape == (6, 8, 8)
        assert b["meta"] == [f"cam{k % 2}" for k in b["key"].tolist()]  # a list of strings
        for k, image, mask in zip(b["key"].tolist(), b["image"].numpy(), b["mask"].numpy(),
                                  strict=True):  # fmt: skip
            labelled = mask.any(axis=0)  # the mask's labelled columns
            assert labelled.sum() == 4 and set(mask[:, labelled].ravel()) == {k % 7 + 1}
            # the image's own row, flipped with its mask: its key's value where labelled
            assert (image[:, :, labelled] == 40 + k).all() and (image[:, :, ~labelled] == 200).all()
            flipped.append(bool(labelled[4:].all()))
    assert 0 < sum(flipped) < len(flipped)  # both ways occur


def test_ragged_outputs_pad_with_a_correct_mask(ray_session, datasets):
    config = PipelineConfig(source=str(datasets["webdataset"]), batch_size=5, actors=(1, 1),
                            transform=f"{T}:tokens", rows_per_block=3)  # fmt: skip
    (batches,) = run(config)
    assert sum(len(b["key"]) for b in batches) == 60
    for b in batches:
        tokens, mask = b["tokens"], b["tokens_mask"]
        assert tokens.shape[:1] == mask.shape[:1] == (5,) and mask.shape == tokens.shape
        for k, row, m in zip(b["key"].tolist(), tokens.numpy(), mask.numpy(), strict=True):
            n = k % 5 + 1
            assert m.sum() == n and m[:n].all()
            assert row[:n].tolist() == list(range(100 * k, 100 * k + n)) and not row[n:].any()


def test_pad_collate_alone():
    column = np.empty(3, dtype=object)
    column[:] = [np.ones((2, 4)), np.ones((3, 4)), np.ones((1, 4))]
    out = pad_collate({"boxes": column, "key": np.arange(3)})
    assert out["boxes"].shape == out["boxes_mask"].shape == (3, 3, 4)
    assert out["boxes_mask"][..., 0].tolist() == [
        [True, True, False], [True, True, True], [True, False, False]
    ]  # fmt: skip
    assert out["boxes"][2, 1:].abs().sum() == 0


def test_a_transforms_fields_have_their_masks_in_every_batch_the_image_none():
    """An image transform's boxes: the first blocks happened to hold two boxes an image,
    stacked, and their batches came without ``boxes_mask`` (a KeyError in a loop that
    reads it) until a batch's rows differed."""
    from raypipe.loader.collate import collate_for

    collate = collate_for(PipelineConfig(source="x", transform=f"{T}:with_mask"))
    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.ones((3, 4), np.float32), np.ones((1, 4), np.float32)]
    image = np.zeros((2, 3, 8, 8), np.uint8)
    for boxes in (np.ones((2, 2, 4), np.float32), ragged):
        out = collate({"image": image, "boxes": boxes, "key": np.arange(2)})
        assert sorted(out) == ["boxes", "boxes_mask", "image", "key"]
        assert out["boxes_mask"].shape == out["boxes"].shape
    assert out["boxes_mask"][:, :, 0].tolist() == [[True] * 3, [True, False, False]]


def test_arrays_of_strings_arrive_as_lists():
    """A ``.npy`` member of strings: the rank iterator died in ``torch.from_numpy``."""
    words = np.empty(2, dtype=object)
    words[:] = [np.array(["a", "bb"]), np.array(["ccc"])]
    out = pad_collate({"words": words, "tags": np.array([["x", "y"], ["z", "w"]]),
                       "key": np.arange(2)}, masks=True)  # fmt: skip
    assert [w.tolist() for w in out["words"]] == [["a", "bb"], ["ccc"]]
    assert [t.tolist() for t in out["tags"]] == [["x", "y"], ["z", "w"]]
    assert out["key"].tolist() == [0, 1] and sorted(out) == ["key", "tags", "words"]


def test_a_fields_mask_has_one_layout_whether_its_rows_differ_or_not():
    """(channels, frames) clips: a batch whose clips share a length and one whose clips
    differ give masks of one layout, the field's own (the first was B×C, the other
    B×C×T: a loop written against one broke on the other)."""
    ragged = np.empty(3, dtype=object)
    ragged[:] = [np.ones((2, 5)), np.ones((2, 7)), np.ones((2, 3))]
    same = pad_collate({"audio": np.ones((3, 2, 5))}, masks=True)["audio_mask"]
    varied = pad_collate({"audio": ragged}, masks=True)
    assert same.shape == (3, 2, 5) and same.all()
    assert varied["audio_mask"].shape == varied["audio"].shape == (3, 2, 7)
    assert varied["audio_mask"].sum(dim=(1, 2)).tolist() == [10, 14, 6]
    assert varied["audio_mask"][:, 0].sum(1).tolist() == [5, 7, 3]  # frames per clip


def test_pad_collate_holds_rows_of_two_actors_types_and_refuses_mixed_dimensions():
    """A batch can hold rows of two actors whose files stored a field differently: token
    ids of 70,000 as int32 beside uint16 rows wrapped to 4,464 in the first row's type;
    rows of 1 and 2 dimensions failed inside numpy."""
    column = np.empty(2, dtype=object)
    column[:] = [np.array([5, 9], np.uint16), np.array([70_000, 65_536, 3], np.int32)]
    out = pad_collate({"tokens": column, "key": np.arange(2)})
    assert out["tokens"].tolist() == [[5, 9, 0], [70_000, 65_536, 3]]
    column[:] = [np.array([1, 2]), np.array([0.5, 2.0])]
    assert pad_collate({"x": column})["x"].tolist() == [[1.0, 2.0], [0.5, 2.0]]
    column[:] = [np.zeros(16000, np.float32), np.zeros((2, 16000), np.float32)]
    with pytest.raises(ValueError, match=r"field 'clip' has rows of \[1, 2\] dimensions"):
        pad_collate({"clip": column})


def test_a_failing_transform_skips_exactly_and_raise_names_the_file(ray_session, datasets):
    config = PipelineConfig(source=str(datasets["imagefolder"]), batch_size=4, actors=(1, 1),
                            transform=f"{T}:fails_on_every_20th", max_skipped=0.1)  # fmt: skip
    skips = SkipLog.create()
    with Pipeline(config, epochs=1, device="cpu", skips=skips) as pipe:
        for _, batches in pipe.epochs():
            keys = [k for b in batches for k in b["key"].tolist()]
            report = skips.epoch(0).report()
    assert report["by_reason"] == {"transform_error": 4}  # keys 0, 20, 40, 60 of 61
    assert {r["key"] for r in report["records"]} == {0, 20, 40, 60}
    assert all("augmentation failed" in r["detail"] and str(datasets["imagefolder"]) in r["where"]
               for r in report["records"])  # fmt: skip
    assert len(keys) == 56 and not {0, 20, 40, 60} & set(keys)
    with pytest.raises(SampleError) as e:
        run(config.replace(on_error="raise"))
    assert "transform_error" in str(e.value) and str(datasets["imagefolder"]) in str(e.value)


def test_signed_and_unsigned_token_ids_pad_as_integers():
    """numpy's common type of uint64 and int64 is float64: ids past 2**53 came back
    rounded, and nn.Embedding refused the batch."""
    column = np.empty(2, dtype=object)
    column[:] = [np.array([2**53 + 1, 2], np.uint64), np.array([4], np.int64)]
    out = pad_collate({"ids": column})
    assert out["ids"].dtype == torch.int64 and out["ids"].tolist() == [[2**53 + 1, 2], [4, 0]]
    column[:] = [np.array([], np.uint64), np.array([], np.int64)]
    assert pad_collate({"ids": column})["ids"].shape == (2, 0)
    column[:] = [np.array([2**63], np.uint64), np.array([-1], np.int64)]
    with pytest.raises(
        ValueError, match=r"field 'ids' has unsigned values up to 9223372036854775808"
    ):
        pad_collate({"ids": column})


def test_an_empty_list_of_ids_is_an_empty_row_of_the_fields_type():
    """A transform that returns a Python list: an empty one is float64 to numpy. It stopped
    an image run blaming a good row, and turned a batch of token ids into floats."""
    from raypipe.formats.sample import RawSample
    from raypipe.preprocess.usermap import _as_row
    from raypipe.preprocess.userrows import Schema, rows_block

    raws = [RawSample(k, -1, None, f"f.parquet:row{k}") for k in range(4)]
    outs = [{"ids": []}, {"ids": [5, 6, 7]}, {"ids": []}, {"ids": [8]}]
    rows = [_as_row(o, r) for o, r in zip(outs, raws, strict=True)]
    for ragged in (True, False):  # samples without an image; an image run's transform
        schema = Schema(arrays_ragged=ragged)
        for row, raw in zip(rows, raws, strict=True):
            schema.check(row, raw.key, raw.where)
        batch = pad_collate(rows_block(rows, schema.ragged), masks=True)
        assert batch["ids"].dtype == torch.int64
        assert batch["ids"].tolist() == [[0, 0, 0], [5, 6, 7], [0, 0, 0], [8, 0, 0]]
        assert batch["ids_mask"].sum(1).tolist() == [0, 3, 0, 1]
    stacked = Schema()
    stacked.check({"ids": np.array([1.5])}, 0, "a")
    with pytest.raises(TransformOutputError, match=r"field 'ids' is int64 with 1 dims at key 1"):
        stacked.check({"ids": np.array([2])}, 1, "b")  # a real change of type still stops


def test_a_list_of_numpy_numbers_is_a_row_of_them_padded_and_masked():
    """``list(sample["tokens"])[:n]``, a list of NumPy scalars, was kept as a Python list:
    no padding, no mask, and the trainer got lists of lists."""
    from raypipe.formats.sample import RawSample
    from raypipe.preprocess.usermap import _as_row
    from raypipe.preprocess.userrows import Schema, rows_block

    raws = [RawSample(k, -1, None, f"f.parquet:row{k}") for k in range(2)]
    ids = np.array([7, 8, 9], np.int32)
    rows = [_as_row({"ids": list(ids)}, raws[0]), _as_row({"ids": list(ids[:1])}, raws[1])]
    assert rows[0]["ids"].dtype == np.int32
    schema = Schema(arrays_ragged=True)
    for row, raw in zip(rows, raws, strict=True):
        schema.check(row, raw.key, raw.where)
    batch = pad_collate(rows_block(rows, schema.ragged), masks=True)
    assert batch["ids"].tolist() == [[7, 8, 9], [7, 0, 0]]
    assert batch["ids_mask"].sum(1).tolist() == [3, 1]


def test_a_tensor_numpy_has_no_type_for_is_the_transforms_error_not_the_samples():
    """A bfloat16 tensor (NumPy has no such type) was a ``decode_error`` of every sample,
    skipped until the budget ran out: it is the transform's output, named as such."""
    from raypipe.formats.sample import RawSample
    from raypipe.preprocess.usermap import _as_row

    raw = RawSample(3, -1, None, "f.parquet:row3")
    with pytest.raises(TransformOutputError, match=r"field 'x' at key 3 \(f.parquet:row3\) "
                       r"is a torch.bfloat16 tensor"):  # fmt: skip
        _as_row({"x": torch.ones(3, dtype=torch.bfloat16)}, raw)


def _members(batch: dict) -> dict:
    return {"n": [len(v) if v is not None else -1 for v in batch["txt"]],
            "has_json": [v is not None for v in batch["json"]]}  # fmt: skip


def _a_number(batch: dict) -> dict:
    return {"n": 5}


def _a_scalar_tensor(batch: dict) -> dict:
    return {"n": torch.tensor(1.0)}


def test_a_per_batch_transform_gets_every_member_any_sample_has():
    """Its input was built from the first sample's members: one a later sample lacked
    skipped the whole batch as the transform's error (KeyError) before it ran, one the
    first lacked was left out. Every member any sample has is there, None where a sample
    has none."""
    from raypipe.formats.sample import RawSample
    from raypipe.preprocess.usermap import SampleMap

    m = SampleMap(_members, seed=0, image_input="numpy", per_batch=True, max_image_pixels=None)
    raws = [RawSample(k, 0, None, f"s.tar:{k}") for k in range(3)]
    samples = [{"txt": "ab"}, {"txt": "abc", "json": {"a": 1}}, {"json": {}}]
    rows = m.batch(raws, 0, samples)
    assert [int(r["n"]) for r in rows] == [2, 3, -1]
    assert [bool(r["has_json"]) for r in rows] == [False, True, True]


def test_a_per_batch_output_that_is_not_one_value_a_row_is_the_transforms_error():
    """``{"n": 5}`` for a batch of 3: a TypeError (no len) that skipped every sample as a
    ``decode_error`` until the skip budget ran out; it is the transform's broken output."""
    from raypipe.formats.sample import RawSample
    from raypipe.preprocess.usermap import SampleMap

    m = SampleMap(_a_number, seed=0, image_input="numpy", per_batch=True, max_image_pixels=None)
    raws = [RawSample(k, 0, None, f"s.tar:{k}") for k in range(3)]
    with pytest.raises(TransformOutputError, match=r"field 'n' is int, not one value a row, "
                       r"for a batch of 3"):  # fmt: skip
        m.batch(raws, 0, [{"txt": "a"}] * 3)
    m = SampleMap(_a_scalar_tensor, seed=0, image_input="numpy", per_batch=True,
                  max_image_pixels=None)  # fmt: skip
    with pytest.raises(TransformOutputError, match=r"field 'n' is Tensor, not one value a row"):
        m.batch(raws, 0, [{"txt": "a"}] * 3)


def test_outputs_that_change_dtype_fail_naming_field_key_and_file(ray_session, datasets):
    config = PipelineConfig(source=str(datasets["parquet"]), batch_size=4, actors=(1, 1),
                            transform=f"{T}:dtype_changes_at_7", shuffle_files=False)  # fmt: skip
    with pytest.raises(TransformOutputError) as e:
        run(config)
    message = str(e.value)
    assert "field 'value'" in message and "key 7" in message and ".parquet:row7" in message
    assert "\n" not in message


def test_per_batch_torch_input_and_user_collate(ray_session, datasets):
    source = str(datasets["parquet"])
    batch = PipelineConfig(source=source, batch_size=4, actors=(1, 1), rows_per_block=4,
                           transform=f"{T}:batch_mean", transform_batch=True)  # fmt: skip
    (batches,) = run(batch)
    assert sum(len(b["key"]) for b in batches) == 60 and batches[0]["mean"].dtype.is_floating_point
    tensor = PipelineConfig(source=source, batch_size=4, actors=(1, 1), transform_input="torch",
                            transform=f"{T}:torch_input", collate=f"{T}:sum_collate")  # fmt: skip
    (batches,) = run(tensor)
    assert all(set(b) == {"label_sum", "key"} for b in batches) and len(batches) == 15


def test_a_collate_that_keeps_no_key_is_counted_by_the_keys_it_was_given(ray_session, datasets):
    """The iterator counted each batch's rows as ``len(batch["key"])`` after the user's
    collate, whose output the docs leave to it: one without ``key`` was a KeyError."""
    config = PipelineConfig(source=str(datasets["imagefolder"]), batch_size=4, actors=(1, 1),
                            image_size=8, collate=f"{T}:label_sum_collate")  # fmt: skip
    with Pipeline(config, epochs=1, device="cpu") as pipe:
        for _, batches in pipe.epochs():
            got = list(batches)
            stats = batches.stats()
    assert len(got) == 15 and all(set(b) == {"label_sum"} for b in got)
    assert stats["samples"] == 60 and len(batches.state_dict()["keys"]) == 60


def not_importable(sample):
    return sample


@pytest.mark.parametrize(
    "transform, words",
    [
        (lambda s: s, "cannot be pickled by reference"),
        ("tests.no_such_module:f", "cannot import it"),
        (f"{T}:no_such_function", "cannot import it"),
        ("no-colon", "expected 'module:attribute'"),
        (3, "not callable"),
    ],
)
def test_bad_transforms_fail_before_any_work(transform, words):
    with pytest.raises(ValueError) as e:
        PipelineConfig(source="data", transform=transform)
    assert str(e.value).startswith("PipelineConfig.transform=") and words in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "module, error",
    [("def f(:\n", "SyntaxError: invalid syntax"), ("raise RuntimeError('no GPU here')\n",
     "RuntimeError: no GPU here"), ("raise RuntimeError('two\\nlines')\n", "RuntimeError: two")],
)  # fmt: skip
def test_a_transform_module_that_fails_to_import_is_named_in_one_line(
    tmp_path, monkeypatch, module, error
):
    """A module with a syntax error, or one that raises as it imports, ended `raypipe run`
    in a traceback; a relative name in a TypeError that named no field."""
    (tmp_path / "broken_transform.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    for transform, words in (("broken_transform:f", error), (".relative:f", "relative import")):
        with pytest.raises(ValueError) as e:
            PipelineConfig(source="data", transform=transform)
        text = str(e.value)
        assert text.startswith(f"PipelineConfig.transform={transform!r}: cannot import it: ")
        assert words in text and "\n" not in text


def test_a_module_level_callable_is_accepted_as_it_is():
    config = PipelineConfig(source="data", transform=user_transforms.noisy)
    assert config.transform is user_transforms.noisy


def test_two_ranks_equal_batches_exactly_once_with_a_transform_and_skips(ray_session, datasets):
    from tests.ranks import run_ranks

    config = PipelineConfig(source=str(datasets["webdataset"]), batch_size=4, actors=(2, 2),
                            rows_per_block=3, transform=f"{T}:fails_on_every_20th",
                            max_skipped=0.1)  # fmt: skip
    out, stats = run_ranks(config, 2, 2, keys_only=True, skips=SkipLog.create())
    for epoch in range(2):
        a, b = out[0][epoch], out[1][epoch]
        assert len(a) == len(b) > 0 and all(len(x) == 4 for x in a + b)
        keys = [k for batch in a + b for k in batch]
        assert len(keys) == len(set(keys)) and not {0, 20, 40} & set(keys)
        good = sum(stats[r][epoch]["good"] for r in range(2))
        assert good == 60 - 3 and len(keys) >= good - 2 * 4


def test_an_albumentations_pipeline_as_it_is(ray_session, tmp_path):
    """Keyword targets (image, mask), its own generator seeded per sample: the same output
    for the same (seed, epoch, key) whatever the pool, another one in another epoch."""
    mask_shards(tmp_path / "wds", 12)
    config = PipelineConfig(source=str(tmp_path / "wds"), batch_size=4, actors=(1, 1),
                            transform=user_transforms.ALBU, shuffle_files=False)  # fmt: skip
    a = run(config, epochs=2, normalize=False)
    b = run(config.replace(actors=(2, 2)), epochs=1, normalize=False)
    batch = a[0][0]
    assert batch["image"].shape == (4, 8, 8, 3) and batch["mask"].shape == (4, 8, 8)
    ia, ib, ia1 = by_key(a[0], "image"), by_key(b[0], "image"), by_key(a[1], "image")
    assert len(ia) == 12 and all(np.array_equal(ia[k], ib[k]) for k in ia)
    ma, ma1 = by_key(a[0], "mask"), by_key(a[1], "mask")
    differ = sum(not (np.array_equal(ia[k], ia1[k]) and np.array_equal(ma[k], ma1[k])) for k in ia)
    assert differ >= 9, differ


def test_normalize_at_its_default_leaves_a_transforms_own_layout_alone(ray_session, tmp_path):
    """The albumentations pipeline's H×W×3 uint8 images with ``normalize`` at its default:
    the same bytes as with ``normalize=False``; declared ``channels_last``, normalized along
    their last axis instead."""
    from raypipe.config.loader import IMAGENET_MEAN, IMAGENET_STD

    mask_shards(tmp_path / "wds", 12)
    config = PipelineConfig(source=str(tmp_path / "wds"), batch_size=4, actors=(1, 1),
                            transform=user_transforms.ALBU, shuffle_files=False)  # fmt: skip
    assert config.normalize
    raw = by_key(run(config, normalize=False)[0], "image")
    kept = run(config)[0]
    assert kept[0]["image"].shape == (4, 8, 8, 3) and kept[0]["image"].dtype == torch.uint8
    assert all(np.array_equal(raw[k], v) for k, v in by_key(kept, "image").items())
    normed = by_key(run(config.replace(channels_last=True))[0], "image")
    mean, std = np.array(IMAGENET_MEAN), np.array(IMAGENET_STD)
    assert len(normed) == 12
    for k, v in normed.items():
        assert v.dtype == np.float32 and v.shape == (8, 8, 3)
        np.testing.assert_allclose(v, (raw[k] / 255 - mean) / std, rtol=1e-5, atol=1e-5)


class _Records:
    """The skip log's part a `Preprocessor` writes to, kept here (no Ray)."""

    def __init__(self):
        self.records = []

    def add(self, records):
        self.records += list(records)
        return len(self.records)

    def epoch(self, e):
        return self


def preprocess_alone(config: PipelineConfig) -> tuple[list[int], list]:
    """Every shard of ``config``'s source through one `Preprocessor`, in this process."""
    from raypipe.plan.shards import list_shards, shard_row
    from raypipe.preprocess.actor import Preprocessor

    listing = list_shards(config)
    rows = [shard_row(s, None) for s in listing.shards]
    batch = {k: np.array([r[k] for r in rows], dtype=object) for k in rows[0]}
    log = _Records()
    blocks = list(Preprocessor(config, listing.reader, epoch=0, skips=log, samples=None)(batch))
    return [int(k) for b in blocks for k in b["key"]], log.records


def jpeg_folder(root, n: int, bad=()) -> str:
    (root / "c").mkdir(parents=True)
    for i in range(n):
        data = (
            b"this is not an image" if i in bad else image_bytes(np.random.default_rng(i), "JPEG")
        )
        (root / "c" / f"{i:03d}.jpg").write_bytes(data)
    return str(root)


def test_a_per_batch_transform_loses_only_the_sample_that_does_not_decode(tmp_path):
    config = PipelineConfig(source=jpeg_folder(tmp_path, 8, bad=(3,)), batch_size=4,
                            rows_per_block=4, transform="tests.user_transforms:batch_mean",
                            transform_batch=True, max_skipped=None)  # fmt: skip
    keys, records = preprocess_alone(config)
    assert keys == [0, 1, 2, 4, 5, 6, 7]
    assert [(r.key, r.where.rsplit("/", 1)[1], r.reason) for r in records] == [
        (3, "003.jpg", "not_an_image")
    ]


def test_a_transform_that_returns_no_dict_stops_the_run(tmp_path):
    config = PipelineConfig(source=jpeg_folder(tmp_path, 6), batch_size=2, rows_per_block=2,
                            transform="tests.user_transforms:returns_none_at_2",
                            max_skipped=None)  # fmt: skip
    with pytest.raises(TransformOutputError, match="returned NoneType"):
        preprocess_alone(config)


def mask_only(sample: dict) -> dict:
    return {"mask": sample["mask"]}


@pytest.mark.parametrize("mask", [b"\x89PNG garbage", b"\x89PNG\r\n\x1a\n" + bytes(40)])
def test_a_damaged_member_is_named_not_the_main_image(mask):
    from raypipe.formats.sample import RawSample
    from raypipe.preprocess.usermap import SampleMap
    from raypipe.skips.records import BadSample

    m = SampleMap(mask_only, seed=0, image_input="numpy", per_batch=False,
                  max_image_pixels=None)  # fmt: skip
    main = image_bytes(np.random.default_rng(0), "JPEG")
    raw = RawSample(7, 1, main, "shard-0.tar:sample7", extras={"mask.png": mask})
    with pytest.raises(BadSample) as info:
        m(raw, 0)
    assert info.value.detail.startswith("member mask.png: "), info.value.detail
    assert repr(main[:8]) not in info.value.detail  # the main image's bytes are not blamed
    ok = RawSample(8, 1, main, "shard-0.tar:sample8", extras={"mask.png": png(3)})
    assert "mask" in m(ok, 0)


def test_a_member_not_the_size_of_the_cached_image_is_said_once(caplog, monkeypatch):
    """With the decoded cache the transform's ``image`` is the capped copy, its other image
    members full size: a mask cropped with the image would not line up, without a word."""
    import logging

    from raypipe.formats.sample import RawSample
    from raypipe.preprocess import usermap

    monkeypatch.setattr(usermap, "_SAID", False)
    m = usermap.SampleMap(mask_only, seed=0, image_input="numpy", per_batch=False,
                          max_image_pixels=None)  # fmt: skip
    capped = np.zeros((10, 12, 3), np.uint8)  # what the cache gives for a 20x24 photo
    same = RawSample(1, 1, None, "s:1", extras={"mask.png": png(1, size=(12, 10))})
    other = RawSample(2, 1, None, "s:2", extras={"mask.png": png(1, size=(24, 20))})
    with caplog.at_level(logging.WARNING, logger="raypipe.preprocess.usermap"):
        assert m(same, 0, image=capped)["mask"].shape[:2] == (10, 12)
        assert not caplog.records  # the member fits the image: nothing to say
        for raw in (other, other):
            assert m(raw, 0, image=capped)["mask"].shape[:2] == (20, 24)
    (record,) = caplog.records
    assert "capped 12x10 one, but member 'mask.png' of s:2 is 24x20" in record.getMessage()


def test_a_members_pixels_count_against_max_image_pixels():
    from raypipe.formats.sample import RawSample
    from raypipe.preprocess.usermap import SampleMap
    from raypipe.skips.records import BadSample

    m = SampleMap(mask_only, seed=0, image_input="numpy", per_batch=False,
                  max_image_pixels=100)  # fmt: skip
    raw = RawSample(1, 1, png(1, size=(8, 8)), "s:1", extras={"mask.png": png(2, size=(16, 12))})
    with pytest.raises(BadSample, match="member mask.png: 16x12 = 192 pixels") as info:
        m(raw, 0)
    assert info.value.reason == "decompression_bomb"
