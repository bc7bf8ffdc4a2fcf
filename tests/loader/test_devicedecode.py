"""decode="gpu": JPEG bytes and the seeded plan from the actors, decoded by the rank's device.

Without CUDA the device step runs on the CPU device (libjpeg-turbo instead of nvJPEG);
the same checks run with nvJPEG on a CUDA machine (``-m gpu``).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import raypipe
from raypipe.formats.sample import RawSample
from raypipe.loader.devicedecode import DeviceDecode, collate_encoded, crop_resize, decode_rgb
from raypipe.loader.resample import read_region, resample
from raypipe.preprocess import decode
from raypipe.preprocess.augment import Box, Plan, plan, sample_rng
from raypipe.preprocess.encoded import Encoded, EncodedBlocks
from raypipe.skips.records import SampleError
from tests.conftest import image_bytes, make_imagefolder

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def photo(rng: np.random.Generator, size=(96, 72)) -> bytes:
    return image_bytes(rng, "JPEG", size=size)


def crops(config, *, device="cpu", epochs=2, **kwargs) -> dict[tuple[int, int], torch.Tensor]:
    """{(epoch, key): uint8 3×S×S crop on the host} of a run, every key checked once."""
    out = {}
    with raypipe.Pipeline(config, epochs=epochs, device=device, normalize=False, **kwargs) as p:
        for e, batches in p.epochs():
            for b in batches:
                assert b["image"].dtype == torch.uint8 and b["image"].device.type == device
                for k, img in zip(b["key"].tolist(), b["image"].cpu(), strict=True):
                    assert (e, k) not in out
                    out[(e, k)] = img
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """JPEGs and PNGs (every third file) of a few sizes in two classes: 90 samples."""
    root = tmp_path_factory.mktemp("gpudecode")
    return make_imagefolder(root / "f", {"a": 50, "b": 40}, seed=5)


@pytest.mark.parametrize("train", [True, False])
def test_crop_resize_follows_the_plan_like_the_cpu_path(train):
    rng = np.random.default_rng(1)
    diffs = []
    for key in range(40):
        data = photo(rng, size=(int(rng.integers(40, 160)), int(rng.integers(40, 160))))
        height, width = decode.jpeg_size(data)
        p = plan(width, height, train=train, rng=sample_rng(0, 0, key), scale=(0.08, 1.0),
                 ratio=(3 / 4, 4 / 3), flip=True)  # fmt: skip
        cpu = decode.decode_crop(data, 32, lambda w, h, p=p: p)
        rgb = torch.from_numpy(decode_rgb(data)).permute(2, 0, 1)
        dev = crop_resize(rgb, (*p.box, float(p.flip)), 32)
        assert dev.shape == (3, 32, 32) and dev.dtype == torch.uint8
        diffs.append(np.abs(dev.numpy().astype(int) - cpu.astype(int)).mean())
        if p.flip:  # the flip is the plan's: undoing it makes a worse match
            unflipped = dev.flip(-1).numpy().astype(int)
            assert np.abs(unflipped - cpu.astype(int)).mean() > diffs[-1]
    assert np.mean(diffs) < 4, diffs  # resampling arithmetic only: a few grey levels


def test_a_fractional_box_lands_where_the_plan_puts_it():
    ramp = torch.arange(200, dtype=torch.uint8).repeat(3, 100, 1)  # value = x coordinate
    out = crop_resize(ramp, (50.5, 10.25, 100.0, 60.0, 0.0), 50)
    # 100 source columns from x=50.5 onto 50: output column j samples around 50.5 + 2j + 0.5
    centres = 50.5 + 2 * np.arange(50) + 0.5
    assert np.abs(out[0, 25].numpy().astype(float) - centres).max() <= 1.5


@pytest.mark.parametrize("channels_last", [False, True])
def test_same_keys_labels_and_crops_as_decode_cpu(ray_session, folder, channels_last):
    config = raypipe.PipelineConfig(source=str(folder), image_size=24, batch_size=8,
                                    actors=(1, 2), seed=3)  # fmt: skip
    cpu = crops(config)
    gpu = crops(config.replace(decode="gpu"), channels_last=channels_last)
    assert set(gpu) == set(cpu)  # the same keys per epoch, each once
    assert len(cpu) == 2 * (90 // 8) * 8
    diffs = [(gpu[k].int() - cpu[k].int()).abs().float().mean().item() for k in cpu]
    assert np.mean(diffs) < 3 and max(diffs) < 12, (np.mean(diffs), max(diffs))


def test_eval_center_crop_through_the_pipeline(ray_session, folder):
    config = raypipe.PipelineConfig(source=str(folder), image_size=16, batch_size=10,
                                    actors=(1, 1), train=False)  # fmt: skip
    cpu, gpu = crops(config, epochs=1), crops(config.replace(decode="gpu"), epochs=1)
    assert set(gpu) == set(cpu) == {(0, k) for k in range(90)}  # every sample, once
    assert np.mean([(gpu[k].int() - cpu[k].int()).abs().float().mean() for k in cpu]) < 3


def damaged_folder(root, n: int = 20, bad=(3, 11)):
    """JPEGs whose ``bad`` ones are cut in half: their header reads, their pixels do not."""
    rng = np.random.default_rng(0)
    (root / "c").mkdir(parents=True)
    for i in range(n):
        data = photo(rng)
        if i in bad:
            data = data[: len(data) // 2]
        (root / "c" / f"{i:03d}.jpg").write_bytes(data)
    return root


def skipped_files(root, *, device="cpu", **changes):
    config = raypipe.PipelineConfig(source=str(root), image_size=16, batch_size=5,
                                    actors=(1, 1), max_skipped=None, **changes)  # fmt: skip
    with raypipe.Pipeline(config, epochs=1, device=device, normalize=False) as p:
        for _, batches in p.epochs():
            sizes = [len(b["key"]) for b in batches]
            report = p.skips.epoch(0).report()
    files = sorted(r["where"].rsplit("/", 1)[1] for r in report["records"])
    return sizes, report["by_reason"], files


def test_a_truncated_jpeg_is_skipped_as_with_decode_cpu(ray_session, tmp_path):
    root = damaged_folder(tmp_path / "d")
    expected = ([5, 5, 5], {"truncated_image": 2}, ["003.jpg", "011.jpg"])
    assert skipped_files(root) == expected
    assert skipped_files(root, decode="gpu") == expected


def test_on_error_raise_names_the_file(ray_session, tmp_path):
    root = damaged_folder(tmp_path / "r", bad=(7,))
    with pytest.raises(SampleError, match="007.jpg"):
        skipped_files(root, decode="gpu", on_error="raise")


def encoded_batch(files: list[bytes]) -> dict:
    """A collated batch of ``files`` (whole-image plans) as the rank receives it."""
    blocks = EncodedBlocks(16, len(files))
    for key, data in enumerate(files):
        enc = Encoded(data, Plan(Box(0, 0, 96, 72), key % 2 == 1))
        blocks.add(enc, RawSample(key, 0, data, f"f{key}.jpg"))
    batch = collate_encoded(blocks.take())
    return {**batch, "label": batch["label"].clone(), "key": batch["key"].clone()}


def test_a_refusing_device_decoder_falls_back_to_the_cpu_per_sample():
    rng = np.random.default_rng(2)
    files = [photo(rng) for _ in range(5)]
    plain = DeviceDecode(16, "cpu")(encoded_batch(files))

    def refuse_the_third(data):  # nvJPEG fails a whole batch call for one bad file
        if any(torch.equal(d, torch.from_numpy(np.frombuffer(files[2], np.uint8))) for d in data):
            raise RuntimeError("nvjpeg refused it")
        return [torch.from_numpy(decode_rgb(d.numpy().tobytes())).permute(2, 0, 1) for d in data]

    decoder = DeviceDecode(16, "cpu")
    decoder._nvjpeg = refuse_the_third
    out = decoder(encoded_batch(files))
    assert decoder.fallbacks == 1 and decoder.skipped == 0
    assert torch.equal(out["image"], plain["image"]) and out["key"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_file_no_decoder_reads_is_left_out_of_its_batch_or_raised(on_error):
    rng = np.random.default_rng(3)
    files = [photo(rng) for _ in range(5)]
    files[3] = b"\xff\xd8\xff" + bytes(200)  # past the actor's checks, unreadable to both
    decoder = DeviceDecode(16, "cpu", on_error=on_error)
    if on_error == "raise":
        with pytest.raises(SampleError, match="f3.jpg"):
            decoder(encoded_batch(files))
        return
    out = decoder(encoded_batch(files))
    assert decoder.skipped == 1 and out["key"].tolist() == [0, 1, 2, 4]
    assert out["image"].shape == (4, 3, 16, 16) and out["label"].shape == (4,)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="decode"):
        raypipe.PipelineConfig(source="x", decode="nvjpeg")
    with pytest.raises(ValueError, match="decode.*transform"):
        raypipe.PipelineConfig(source="x", decode="gpu", transform="raypipe.cli.examples:ColorCrop")


def test_a_non_jpeg_keeps_the_cpu_path():
    buf = io.BytesIO()
    Image.new("RGB", (20, 10)).save(buf, "PNG")
    assert Encoded.of(buf.getvalue(), lambda w, h: Plan(Box(0, 0, w, h), False)) is None
    jpeg = photo(np.random.default_rng(0))
    enc = Encoded.of(jpeg, lambda w, h: Plan(Box(0, 0, w, h), True))
    assert enc is not None and enc.plan.box == Box(0, 0, 96, 72) and enc.data == jpeg


@pytest.mark.gpu
@needs_cuda
def test_nvjpeg_gives_the_cpu_paths_crops(ray_session, folder):
    config = raypipe.PipelineConfig(source=str(folder), image_size=24, batch_size=8,
                                    actors=(1, 2), seed=3)  # fmt: skip
    cpu = crops(config)
    gpu = crops(config.replace(decode="gpu"), device="cuda")
    assert set(gpu) == set(cpu)
    keys = sorted(cpu)
    g = torch.stack([gpu[k] for k in keys]).flatten(1).float()
    c = torch.stack([cpu[k] for k in keys]).flatten(1).float()
    dist = torch.cdist(g, c, p=1) / g.shape[1]  # mean |diff| of every GPU crop to every CPU crop
    own = dist.diagonal()
    # nvJPEG upsamples chroma unlike libjpeg-turbo: a few levels apart on these busy images,
    # PNGs (decoded in the actors) exactly equal; every crop is nearest its own key's crop.
    assert own.mean() < 8 and own.max() < 16, (own.mean(), own.max())
    assert dist.argmin(dim=1).tolist() == list(range(len(keys)))


@pytest.mark.gpu
@needs_cuda
def test_a_truncated_jpeg_on_cuda(ray_session, tmp_path):
    root = damaged_folder(tmp_path / "g")
    expected = ([5, 5, 5], {"truncated_image": 2}, ["003.jpg", "011.jpg"])
    assert skipped_files(root, device="cuda", decode="gpu") == expected


def test_decoding_only_the_region_resample_reads_gives_the_same_crops():
    """The rows and columns `read_region` names, with the plan moved into them, resample to
    exactly the whole image's output: a decoder that reads only that region loses nothing."""
    rng = np.random.default_rng(4)
    images, plans, regions, moved = [], [], [], []
    for key in range(24):
        w, h = int(rng.integers(30, 200)), int(rng.integers(30, 200))
        p = plan(w, h, train=key % 3 > 0, rng=sample_rng(0, 0, key), scale=(0.08, 1.0),
                 ratio=(3 / 4, 4 / 3), flip=True)  # fmt: skip
        row = np.array([*p.box, float(p.flip)], dtype=np.float32)
        image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8)
        (y0, y1), (x0, x1) = read_region(row, 20, h, w)
        assert 0 <= y0 < y1 <= h and 0 <= x0 < x1 <= w
        images.append(image)
        plans.append(row)
        regions.append(image[:, y0:y1, x0:x1])
        moved.append(row - np.array([x0, y0, 0, 0, 0], dtype=np.float32))
    whole = resample(images, np.stack(plans), 20)
    assert torch.equal(resample(regions, np.stack(moved), 20), whole)
    # and the region is needed: one row fewer changes the output somewhere
    cut = [r[:, 1:, :] if r.shape[1] > 1 else r for r in regions]
    assert not torch.equal(resample(cut, np.stack(moved) - [0, 1, 0, 0, 0], 20), whole)


def test_a_batch_of_mixed_shapes_resamples_each_image_as_alone():
    """Images of different sizes share one padded batch: the padding past an image's edge
    never reaches its output, which equals the image resampled on its own."""
    rng = np.random.default_rng(7)
    images, plans = [], []
    for key in range(12):
        w, h = int(rng.integers(24, 120)), int(rng.integers(24, 120))
        p = plan(w, h, train=key % 2 == 0, rng=sample_rng(0, 0, key), scale=(0.08, 1.0),
                 ratio=(3 / 4, 4 / 3), flip=True)  # fmt: skip
        box = p.box if key % 3 else (0, 0, w, h)  # a box to the image's edges reads them
        images.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8))
        plans.append(np.array([*box, float(p.flip)], dtype=np.float32))
    batch = resample(images, np.stack(plans), 16)
    for image, row, out in zip(images, plans, batch, strict=True):
        assert torch.equal(crop_resize(image, row, 16), out)
