import pytest

from raypipe import PipelineConfig
from raypipe.formats import Reader, infer_format
from raypipe.plan.shards import epoch_order, list_shards
from tests.conftest import FORMAT_SIZES


@pytest.mark.parametrize("fmt", ["imagefolder", "webdataset", "parquet"])
def test_listing_has_dense_stable_keys(datasets, fmt):
    config = PipelineConfig(source=str(datasets[fmt]))
    a, b = list_shards(config), list_shards(config)
    assert a == b and a.format == fmt
    keys = []
    for shard in a.shards:
        samples = list(Reader(fmt).read(shard.path, shard.first_key, shard.label))
        assert len(samples) == shard.num_samples
        assert all(s.error is None and s.data for s in samples)
        keys += [s.key for s in samples]
    assert keys == list(range(61)) == list(range(a.num_samples))


def test_a_file_name_that_is_not_utf8_is_listed_and_fingerprinted(tmp_path):
    """Linux file names are bytes: one that is not UTF-8 (a Latin-1 ``café.jpg``) is a sample
    like any other, and the listing's fingerprint (every checkpoint's) takes it; it raised
    UnicodeEncodeError there, which stopped every run and resume on that folder."""
    import os

    from tests.conftest import make_imagefolder

    root = make_imagefolder(tmp_path / "data", {"a": 2}, seed=1)
    odd = root / "a" / os.fsdecode(b"caf\xe9.jpg")
    odd.write_bytes((root / "a" / "0001.jpg").read_bytes())
    listing = list_shards(PipelineConfig(source=str(root)))
    assert listing.num_samples == 3 and any(s.path == str(odd) for s in listing.shards)
    before = listing.fingerprint
    odd.rename(root / "a" / os.fsdecode(b"caf\xe8.jpg"))
    assert list_shards(PipelineConfig(source=str(root))).fingerprint != before


def test_symlinked_folders_are_listed_once_and_a_link_loop_ends(tmp_path):
    """A class folder's images partly in a folder linked from elsewhere (another disk):
    listed (os.walk left linked folders out); a link back up does not loop."""
    from tests.conftest import make_imagefolder

    root = make_imagefolder(tmp_path / "data", {"cat": 2, "dog": 2}, seed=1)
    more = make_imagefolder(tmp_path / "elsewhere", {"x": 3}, seed=2) / "x"
    (root / "cat" / "more").symlink_to(more, target_is_directory=True)
    (root / "dog" / "loop").symlink_to(root / "dog", target_is_directory=True)
    listing = list_shards(PipelineConfig(source=str(root)))
    by_class = [sum(1 for s in listing.shards if s.label == c) for c in (0, 1)]
    assert by_class == [5, 2] and listing.num_samples == 7


def test_imagefolder_labels_follow_sorted_class_names(datasets):
    listing = list_shards(PipelineConfig(source=str(datasets["imagefolder"])))
    assert listing.classes == ("cat", "dog", "emu")
    counts = [sum(1 for s in listing.shards if s.label == i) for i in range(3)]
    assert counts == [FORMAT_SIZES["imagefolder"][c] for c in listing.classes]


def test_glob_and_list_sources(datasets):
    wds = datasets["webdataset"]
    by_glob = list_shards(PipelineConfig(source=str(wds / "*.tar")))
    by_list = list_shards(PipelineConfig(source=[str(p) for p in sorted(wds.glob("*.tar"))]))
    assert by_glob == by_list and by_glob.num_samples == 61


def test_epoch_order_is_a_seeded_permutation(datasets):
    shards = list_shards(PipelineConfig(source=str(datasets["imagefolder"]))).shards
    e0 = epoch_order(shards, seed=1, epoch=0, shuffle=True)
    assert e0 == epoch_order(shards, seed=1, epoch=0, shuffle=True)
    assert sorted(e0, key=lambda s: s.first_key) == list(shards)
    assert e0 != epoch_order(shards, seed=1, epoch=1, shuffle=True)
    assert e0 != epoch_order(shards, seed=2, epoch=0, shuffle=True)
    assert epoch_order(shards, seed=1, epoch=0, shuffle=False) == list(shards)


def test_format_inference(datasets):
    for fmt, path in datasets.items():
        assert infer_format([str(path)]) == fmt


@pytest.mark.parametrize(
    "source, match",
    [("/does/not/exist", "does not exist"), ("/tmp/*.nothing-here", "matches nothing")],
)
def test_bad_sources(source, match):
    with pytest.raises(ValueError, match=match):
        list_shards(PipelineConfig(source=source))


def test_empty_image_folder(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="no images"):
        list_shards(PipelineConfig(source=str(tmp_path), format="imagefolder"))


def test_a_root_above_its_splits_is_refused_and_split_named_classes_are_not(tmp_path):
    """``data/`` holding ``train/<class>/`` and ``val/<class>/`` read as an image folder
    trained on two classes, "train" and "val"; it is refused with the split to point at.
    Classes that happen to carry split names but hold their images are read as named."""
    from tests.conftest import make_imagefolder

    make_imagefolder(tmp_path / "data" / "train", {"cat": 2, "dog": 1}, seed=1)
    make_imagefolder(tmp_path / "data" / "val", {"cat": 1, "dog": 1}, seed=2)
    with pytest.raises(ValueError, match=r"splits \(train, val\) as classes.*data/train'"):
        list_shards(PipelineConfig(source=str(tmp_path / "data")))
    assert list_shards(PipelineConfig(source=str(tmp_path / "data" / "train"))).num_samples == 3
    flat = make_imagefolder(tmp_path / "flat", {"test": 2, "train": 3}, seed=3)
    assert list_shards(PipelineConfig(source=str(flat))).classes == ("test", "train")
    # ImageNet as shipped: train/<wnid>/ and a flat val/; COCO-style names; the train split
    # suggested whatever sorts first
    raw = make_imagefolder(tmp_path / "raw" / "train2017", {"n01": 2}, seed=4).parent
    make_imagefolder(tmp_path / "raw" / "test2017", {"n01": 1}, seed=5)
    (raw / "val2017").mkdir()
    (raw / "val2017" / "x.jpg").write_bytes(next((raw / "test2017" / "n01").iterdir()).read_bytes())
    with pytest.raises(ValueError, match=r"e\.g\. '.*raw/train2017'"):
        list_shards(PipelineConfig(source=str(raw)))


def _fingerprint_before(listing) -> str:
    """The formula of the fingerprint every checkpoint written so far names."""
    import hashlib
    import os

    paths = list(listing.shards.paths)
    root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
    h = hashlib.sha256(listing.format.encode())
    for path, n in zip(paths, listing.shards.num_samples.tolist(), strict=True):
        h.update(f"\0{os.path.relpath(path, root)}\0{n}".encode(errors="surrogateescape"))
    return h.hexdigest()[:32]


def test_the_fingerprint_is_the_one_checkpoints_already_name():
    """The fingerprint is cut from the path strings where they are absolute and normal
    (``relpath`` and ``commonpath`` took 7 s for 1.28M files): the same hash as the
    formula before, over random layouts (shared name prefixes, a lone file, the root
    folder, a path that is its siblings' folder, non-UTF-8 names), and through ``os.path``
    for the rest (URIs, relative and unnormalised paths)."""
    import random

    from raypipe.plan.shards import Listing, Shard

    rng = random.Random(7)
    names = ["a", "ab", "a-b", "a.b", "b", "n0001", "n00010", "é", "x y", "caf\udce9", "_", "0"]
    tops = ["", "/data", "/data/set", "/a", "/a-b", "s3://bucket/p", "rel/dir", "/d//e", "/d/./e"]
    for _ in range(400):
        top = rng.choice(tops)
        paths = sorted({"/".join([top, *rng.choices(names, k=rng.randint(1, 3))])
                        for _ in range(rng.randint(1, 6))})  # fmt: skip
        if rng.random() < 0.1:
            paths.append(paths[0].rsplit("/", 1)[0] or "/")  # the others' folder, listed too
        shards = tuple(Shard(p, i, rng.randint(1, 9), 0) for i, p in enumerate(paths))
        listing = Listing(rng.choice(["imagefolder", "parquet"]), shards)
        assert listing.fingerprint == _fingerprint_before(listing), paths
