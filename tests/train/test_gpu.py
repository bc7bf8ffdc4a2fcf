"""The trainer's real path on CUDA: `train_ddp(use_gpu=True)` puts a Ray Train worker on the
GPU (``device="auto"`` resolves to it, DDP on NCCL, `prepare_model`), trains the demo
classifier on digits, checkpoints, and a second run resumes from that checkpoint; with the
decode on the CPU (pixels travel) and on the GPU (JPEG bytes travel, nvJPEG on the rank).
Skipped where torch sees no CUDA device."""

from __future__ import annotations

import json

import pytest
import torch

from raypipe import PipelineConfig, train_ddp
from raypipe.cli.classify import small_cnn
from raypipe.cli.demo import write_digits

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BATCH = 64


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The demo's digits as RGB JPEGs, so that ``decode="gpu"`` decodes them with nvJPEG."""
    from PIL import Image

    root = tmp_path_factory.mktemp("gpu-demo")
    write_digits(root)
    for png in (root / "digits").rglob("*.png"):
        Image.open(png).convert("RGB").save(png.with_suffix(".jpg"), quality=95)
        png.unlink()
    return root / "digits"


def _loop(out):
    """Train the small CNN; per epoch write this rank's keys, the batches' device, the
    backend, the mean loss and accuracy, and the parameters' checksum to ``out``."""

    def loop(ctx) -> None:
        import torch.distributed as dist
        import torch.nn.functional as F

        torch.manual_seed(0)
        net = small_cnn(10)
        restored = ctx.restored()
        if restored is not None:
            net.load_state_dict(restored["model"])
        model = ctx.prepare_model(net)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        state = lambda: {"model": net.state_dict(), "sum": _checksum(net)}  # noqa: E731
        for epoch, batches in ctx.epochs(state=state):
            keys, devices, loss_sum, correct, seen = [], set(), 0.0, 0, 0
            for batch in batches:
                image, label = batch["image"], batch["label"]
                devices |= {str(image.device), str(label.device)}
                logits = model(image)
                loss = F.cross_entropy(logits, label)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                keys += [int(k) for k in batch["key"]]
                loss_sum += loss.item() * len(label)
                correct += int((logits.argmax(1) == label).sum())
                seen += len(label)
            record = {"keys": keys, "devices": sorted(devices), "loss": loss_sum / seen,
                      "accuracy": correct / seen, "sum": _checksum(net),
                      "backend": dist.get_backend() if dist.is_initialized() else None,
                      "restored_sum": None if restored is None else restored["sum"]}  # fmt: skip
            (out / f"{ctx.rank}-{epoch}.json").write_text(json.dumps(record))
            ctx.report({"epoch": epoch})

    return loop


def _checksum(net) -> float:
    return float(sum(p.detach().double().sum().item() for p in net.parameters()))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_train_ddp_on_the_gpu_trains_checkpoints_and_resumes(ray_session, digits, tmp_path,
                                                             decode):  # fmt: skip
    train_and_resume(digits, tmp_path, decode, use_gpu=True)


def train_and_resume(digits, tmp_path, decode: str, *, use_gpu: bool) -> None:
    device, backend = ("cuda:0", "nccl") if use_gpu else ("cpu", "gloo")
    config = PipelineConfig(source=str(digits / "train"), image_size=32, batch_size=BATCH,
                            flip=False, scale=(0.7, 1.0), ratio=(0.9, 1.1), decode=decode,
                            mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), seed=0)  # fmt: skip
    out, runs = tmp_path / "epochs", tmp_path / "runs"
    out.mkdir()
    first = train_ddp(config, _loop(out), num_workers=1, use_gpu=use_gpu, epochs=2,
                      checkpoint_every=5, storage_path=str(runs), name="first")  # fmt: skip
    assert first.error is None, first.error
    assert first.checkpoint is not None
    epochs = [json.loads((out / f"0-{e}.json").read_text()) for e in (0, 1)]
    total = len(list((digits / "train").rglob("*.jpg")))
    for e in epochs:
        assert e["devices"] == [device]  # device="auto": the worker's GPU
        assert e["backend"] == backend
        assert len(e["keys"]) == len(set(e["keys"])) == total // BATCH * BATCH
    assert epochs[1]["loss"] < epochs[0]["loss"]

    second = train_ddp(config, _loop(out), num_workers=1, use_gpu=use_gpu, epochs=3,
                       resume_from=first.path, storage_path=str(runs), name="second")  # fmt: skip
    assert second.error is None, second.error
    last = json.loads((out / "0-2.json").read_text())
    assert last["restored_sum"] == pytest.approx(epochs[1]["sum"], rel=1e-12)  # rank 0's state
    assert last["devices"] == [device]
    assert len(last["keys"]) == len(set(last["keys"])) == total // BATCH * BATCH
    assert last["accuracy"] > 0.8, last["accuracy"]  # three epochs of the demo's classifier
