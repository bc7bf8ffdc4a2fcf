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
from raypipe import fastimage
from raypipe.gpudecode import crop_resize, decode_rgb
from raypipe.skips import SampleError
from raypipe.transforms import Box, Plan, plan, sample_rng
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
        height, width = fastimage.jpeg_size(data)
        p = plan(width, height, train=train, rng=sample_rng(0, 0, key), scale=(0.08, 1.0),
                 ratio=(3 / 4, 4 / 3), flip=True)  # fmt: skip
        cpu = fastimage.decode_crop(data, 32, lambda w, h, p=p: p)
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
    assert set(gpu) == set(cpu)
    assert np.mean([(gpu[k].int() - cpu[k].int()).abs().float().mean() for k in cpu]) < 3


def damaged_folder(root, n: int = 20, bad=(3, 11)):
    """JPEGs whose ``bad`` ones are cut after the header: the actor's header check passes,
    and neither decoder can read them."""
    rng = np.random.default_rng(0)
    (root / "c").mkdir(parents=True)
    for i in range(n):
        data = photo(rng)
        if i in bad:
            data = data[: len(data) // 2]
        (root / "c" / f"{i:03d}.jpg").write_bytes(data)
    return root


def test_a_file_both_decoders_refuse_is_skipped_from_its_batch(ray_session, tmp_path):
    root = damaged_folder(tmp_path / "d")
    config = raypipe.PipelineConfig(source=str(root), image_size=16, batch_size=5,
                                    actors=(1, 1), decode="gpu")  # fmt: skip
    with raypipe.Pipeline(config, epochs=1, device="cpu", normalize=False) as p:
        for _, batches in p.epochs():
            sizes = [len(b["key"]) for b in batches]
            report = p.skips.epoch(0).report()
    assert len(sizes) == 4 and sum(sizes) == 18  # two rows short, the batch count unchanged
    assert report["by_reason"] == {"decode_error": 2}
    assert sorted(r["where"].rsplit("/", 1)[1] for r in report["records"]) == ["003.jpg", "011.jpg"]


def test_on_error_raise_names_the_file(ray_session, tmp_path):
    root = damaged_folder(tmp_path / "r", bad=(7,))
    config = raypipe.PipelineConfig(source=str(root), image_size=16, batch_size=5, actors=(1, 1),
                                    decode="gpu", on_error="raise")  # fmt: skip
    with pytest.raises(SampleError, match="007.jpg"), raypipe.Pipeline(config, epochs=1) as p:
        for _, batches in p.epochs():
            for _ in batches:
                pass


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="decode"):
        raypipe.PipelineConfig(source="x", decode="nvjpeg")
    with pytest.raises(ValueError, match="decode.*transform"):
        raypipe.PipelineConfig(source="x", decode="gpu", transform="raypipe.examples:ColorCrop")


def test_a_non_jpeg_keeps_the_cpu_path():
    from raypipe.gpudecode import Encoded

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
    diffs = [(gpu[k].int() - cpu[k].int()).abs().float().mean().item() for k in cpu]
    assert np.mean(diffs) < 3 and max(diffs) < 12, (np.mean(diffs), max(diffs))


@pytest.mark.gpu
@needs_cuda
def test_nvjpeg_refusals_fall_back_or_skip(ray_session, tmp_path):
    root = damaged_folder(tmp_path / "g")
    config = raypipe.PipelineConfig(source=str(root), image_size=16, batch_size=5,
                                    actors=(1, 1), decode="gpu")  # fmt: skip
    with raypipe.Pipeline(config, epochs=1, device="cuda", normalize=False) as p:
        for _, batches in p.epochs():
            sizes = [len(b["key"]) for b in batches]
            report = p.skips.epoch(0).report()
    assert sum(sizes) == 18 and len(sizes) == 4
    assert report["by_reason"] == {"decode_error": 2}
