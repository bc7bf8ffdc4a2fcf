import math

import pytest

from raypipe import PipelineConfig


def test_defaults_and_list_coercion(tmp_path):
    c = PipelineConfig(source=[str(tmp_path)], actors=[2, 4], scale=[0.5, 1.0])
    assert c.source == (str(tmp_path),)
    assert c.actors == (2, 4) and c.scale == (0.5, 1.0)
    assert c.replace(batch_size=8).batch_size == 8


@pytest.mark.parametrize(
    "field, value",
    [
        ("format", "recordio"),
        ("image_size", 0),
        ("image_size", 3.5),
        ("batch_size", -1),
        ("batch_size", True),
        ("actors", (3, 2)),
        ("actors", (0, 2)),
        ("actors", (1, 2, 3)),
        ("seed", -1),
        ("on_error", "ignore"),
        ("train", "yes"),
        ("scale", (0.5, 0.2)),
        ("scale", (0.0, 1.0)),
        ("ratio", (2.0, 1.0)),
        ("std", (0.2, 0.0, 0.2)),
        ("mean", (0.5, 0.5)),
        ("actor_cpus", 0),
        ("actor_cpus", float("inf")),
        ("std", (float("nan"), 1.0, 1.0)),
        ("mean", (float("inf"), 0.0, 0.0)),
        ("ratio", (0.5, float("inf"))),
        ("actor_cpus", -(10**400)),
        ("shuffle_buffer", -3),
        ("lead_batches", -1),
        ("source", ""),
        ("source", ()),
        ("source", ["/data/train", None]),  # was the path 'None', refused by the listing
        ("source", ["/data/train", 3]),
        ("label_member", ".cls"),  # every sample's label went missing ("..cls")
    ],
)
def test_invalid_value_names_field_and_value(field, value):
    kwargs = {"source": "data"} | {field: value}
    with pytest.raises(ValueError) as e:
        PipelineConfig(**kwargs)
    assert f"PipelineConfig.{field}=" in str(e.value)
    assert repr(value if not isinstance(value, list) else tuple(value)) in str(e.value)


def test_numpy_scalars_are_taken_as_numbers():
    """A sweep's values often come from NumPy: ``batch_size=np.int64(256)`` was refused as
    "must be an integer"."""
    import numpy as np

    from raypipe import LoaderConfig

    c = PipelineConfig(source="data", batch_size=np.int64(256), actor_cpus=np.float32(0.5),
                       seed=np.uint8(3), actors=(np.int64(1), np.int64(2)), train=np.bool_(False))  # fmt: skip
    assert (c.batch_size, c.actor_cpus, c.seed, c.actors, c.train) == (256, 0.5, 3, (1, 2), False)
    assert type(c.batch_size) is int and type(c.actor_cpus) is float and type(c.seed) is int
    assert type(c.actors[0]) is int and type(c.train) is bool
    assert type(LoaderConfig(batch_size=np.int64(8)).batch_size) is int


def test_prefetch_batches_zero_is_the_dataset_paths_and_refused_before_a_pipelines_work(
    datasets, monkeypatch
):
    """``iter_torch_batches`` and `LoaderConfig` take 0 (Ray's iterator does); a Pipeline
    holds at least one batch, so ``train_ddp`` and ``Loader`` refuse 0 before any work
    (``train_ddp`` found it in every rank, after Ray and the trainer had started)."""
    from raypipe import Loader, LoaderConfig, train_ddp
    from raypipe.train import ddp

    def started(*args, **kwargs):
        raise AssertionError("Ray was started before the config was checked")

    monkeypatch.setattr(ddp.localnode, "ensure", started)
    config = PipelineConfig(source=str(datasets["parquet"]), batch_size=4, prefetch_batches=0)
    assert LoaderConfig(prefetch_batches=0).prefetch_batches == 0
    with pytest.raises(ValueError, match="prefetch_batches=0 must be an integer >= 1"):
        train_ddp(config, lambda ctx: None)
    for options in ({}, {"prefetch_batches": 0}):
        with pytest.raises(ValueError, match="prefetch_batches=0 must be"):
            Loader(config.replace(prefetch_batches=2 if options else 0), epochs=1, **options)
    with pytest.raises(ValueError, match="pin_memory='yes'"):
        Loader(config.replace(prefetch_batches=2), epochs=1, pin_memory="yes")


def test_from_yaml_roundtrip_and_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  source: /x\n  batch_size: 16\n  actors: [1, 3]\n")
    c = PipelineConfig.from_yaml(path, section="data")
    assert (c.source, c.batch_size, c.actors) == ("/x", 16, (1, 3))
    with pytest.raises(ValueError, match="no 'eval' section"):
        PipelineConfig.from_yaml(path, section="eval")


def test_unknown_key_suggests_closest(tmp_path):
    """A guess for each unknown key is the line; the fifty known keys only when one has none."""
    with pytest.raises(ValueError, match=r"'batchsize' \(did you mean 'batch_size'\?\)") as e:
        PipelineConfig.from_dict({"source": "/x", "batchsize": 3})
    assert "known:" not in str(e.value)
    with pytest.raises(ValueError, match=r"'zzz'; known: source, .*batch_size"):
        PipelineConfig.from_dict({"source": "/x", "zzz": 3})


@pytest.mark.parametrize(
    "text, match",
    [
        ("a: [1, 2", "not valid YAML"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("{}", "source is required"),
    ],
)
def test_bad_yaml_files(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        PipelineConfig.from_yaml(path)


def test_numbers_in_exponent_form_are_numbers(tmp_path):
    """YAML 1.1 wants a dot in a float: ``lr: 2e-3`` came as the string '2e-3' and was
    refused as "not a number"."""
    from raypipe.config import load_yaml

    path = tmp_path / "c.yaml"
    path.write_text("a: 2e-3\nb: -1E5\nc: '2e-3'\nd: 12\ne: 1.5e3\nf: e5\ng: .5e1\n"
                    "h: 1.25\ni: 2.5e0\nj: 1e400\n")  # fmt: skip
    got = load_yaml(path)
    assert got == {"a": 0.002, "b": -1e5, "c": "2e-3", "d": 12, "e": 1500.0, "f": "e5",
                   "g": 5.0, "h": 1.25, "i": 2.5, "j": math.inf}  # fmt: skip
    # a whole number in exponent form is an integer: a byte count can be written 2e9
    assert [type(got[k]) for k in "abeghi"] == [float, int, int, int, float, float]
    path.write_text("source: x\ncache: memory\ncache_budget: 2e9\n")
    assert PipelineConfig.from_yaml(path).cache_budget == 2 * 10**9


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    """YAML keeps the last of two keys without a word: a second ``trainer:`` section
    dropped the first one's ``epochs``."""
    from raypipe.config import load_yaml

    path = tmp_path / "c.yaml"
    path.write_text("data: {source: x, batch_size: 32, batch_size: 64}\n")
    with pytest.raises(
        ValueError, match=r"c.yaml:1:\d+: .*'batch_size' is given twice \(first on line 1\)"
    ):
        load_yaml(path)
    path.write_text("trainer: {epochs: 1}\ndata: {source: x}\ntrainer: {use_gpu: false}\n")
    with pytest.raises(
        ValueError, match=r"c.yaml:3:1: .*'trainer' is given twice \(first on line 1\)"
    ):
        load_yaml(path)
    # a merge's keys may be overridden
    path.write_text("base: &b {a: 1, b: 2}\nx: {<<: *b, b: 3}\n")
    assert load_yaml(path)["x"] == {"a": 1, "b": 3}


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ValueError, match="config file not found"):
        PipelineConfig.from_yaml(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "kwargs, field, value",
    [
        ({"image_column": ""}, "image_column", ""),
        ({"buckets": 0}, "buckets", 0),
        ({"buckets": (8, 4)}, "buckets", (8, 4)),
        ({"buckets": [0, 4]}, "buckets", (0, 4)),
        ({"bucket_window": 0}, "bucket_window", 0),
        ({"bucket_by": ""}, "bucket_by", ""),
        ({"bucket_by": "tokens"}, "bucket_by", "tokens"),  # images, no transform: no lengths
        ({"image_column": None, "bucket_by": "t", "shuffle_buffer": 64}, "bucket_by", "t"),
        ({"image_column": None, "pack": "t"}, "pack", "t"),  # no seq_len
        ({"image_column": None, "pack": "t", "seq_len": 0}, "seq_len", 0),
        ({"image_column": None, "seq_len": 128}, "seq_len", 128),  # no pack
        ({"image_column": None, "pack": "t", "seq_len": 8, "bucket_by": "t"}, "pack", "t"),
        ({"pack": "t", "seq_len": 8}, "pack", "t"),  # with an image
        ({"image_column": None, "pack": "t", "seq_len": 8, "shuffle_buffer": 4}, "pack", "t"),
        ({"image_column": None, "decode": "gpu"}, "decode", "gpu"),
        ({"image_column": None, "transform_input": "pil"}, "transform_input", "pil"),
        ({"sample_rate": 0}, "sample_rate", 0),
        ({"sample_rate": 16000.5}, "sample_rate", 16000.5),
    ],
)
def test_sample_settings_refused_in_one_line(kwargs, field, value):
    with pytest.raises(ValueError) as e:
        PipelineConfig(source="data", **kwargs)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"PipelineConfig.{field}={value!r}")


def test_no_image_from_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("source: d\nimage_column: null\npack: tokens\nseq_len: 64\n")
    c = PipelineConfig.from_yaml(path)
    assert c.image_column is None and (c.pack, c.seq_len) == ("tokens", 64)
    bucketed = c.replace(pack=None, seq_len=None, bucket_by="tokens", buckets=[16, 32])
    assert bucketed.buckets == (16, 32)


@pytest.mark.parametrize("fmt", ["imagefolder", "tfrecord"])
def test_no_image_is_refused_for_formats_without_fields(tmp_path, fmt):
    from raypipe.plan.shards import list_shards

    (tmp_path / "a.tfrecord").write_bytes(b"")
    config = PipelineConfig(source=str(tmp_path), format=fmt, image_column=None)
    with pytest.raises(ValueError, match=rf"image_column=None: .* the source is {fmt}"):
        list_shards(config)


def test_a_bad_loader_value_is_named_before_the_cache_uses_it():
    with pytest.raises(ValueError, match=r"PipelineConfig.batch_size='256'"):
        PipelineConfig(source="d", cache="memory", cache_budget=10**9, batch_size="256")


def test_a_device_torch_does_not_know_is_refused_where_it_is_set():
    """``device="gpu"`` passed every check and failed at the first iter(), in torch's words,
    after Ray and the ranks had started."""
    from raypipe import Loader
    from raypipe.config import LoaderConfig

    with pytest.raises(ValueError, match=r"LoaderConfig.device='gpu': must be 'auto' or a torch"):
        Loader(PipelineConfig(source="/tmp"), epochs=1, device="gpu")
    assert LoaderConfig(device="cuda:1").device == "cuda:1"  # no GPU needed to name one


@pytest.mark.parametrize("section", ["data", "eval"])
def test_a_run_config_whose_ranks_hold_no_batch_ahead_is_refused_before_ray(tmp_path, section):
    """``prefetch_batches: 0`` passed `raypipe run`'s checks and was refused by
    ``train_ddp``, after the local Ray had started."""
    from raypipe.cli.classify import RunConfig

    path = tmp_path / "run.yaml"
    other = {"data": "eval", "eval": "data"}[section]
    path.write_text(f"{other}: {{source: x}}\n{section}: {{source: z, prefetch_batches: 0}}\n")
    with pytest.raises(ValueError, match=rf"run.yaml: {section}: prefetch_batches=0 must be"):
        RunConfig.from_yaml(path)


def test_a_uri_with_a_password_in_it_is_refused_without_printing_it():
    """``ftp://user:secret@host/...`` never reached the store (its host was not given to
    fsspec), and every error and skip record naming the URI printed the password."""
    for source in ("ftp://me:s3cret@files.example/d", ("sftp://me:s3cret@h/a", "sftp://h/b")):
        with pytest.raises(ValueError, match=r"ftp://me:\*\*\*@.*storage_options") as info:
            PipelineConfig(source=source)
        assert "s3cret" not in str(info.value)
    PipelineConfig(source="s3://bucket/key@v2/data")  # an @ in a path is no password
