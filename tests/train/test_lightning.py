"""`raypipe.Loader` as a Lightning ``Trainer``'s train and val dataloaders, in one process:
Lightning's own epoch loop over two epochs, and its checkpoints (mid-epoch and at an
epoch's last step) resuming the loader's position without repeating a sample; and under
Ray Train's Lightning integration, two workers, equal batches and exactly once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raypipe import Loader, PipelineConfig
from tests.properties import check_exactly_once_and_equal

L = pytest.importorskip("lightning")

B, EVERY = 4, 5  # 61 samples: 15 batches per epoch, a checkpoint every 5 steps


class Tiny(L.LightningModule):
    """A linear classifier that logs the keys of every batch it trains and validates on."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(3 * 8 * 8, 5)
        self.trained: list[tuple[int, list[int]]] = []  # (Lightning's epoch, keys)
        self.validated: list[tuple[int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.trained.append((self.current_epoch, batch["key"].tolist()))
        return torch.nn.functional.cross_entropy(self.net(batch["image"].flatten(1)),
                                                 batch["label"] % 5)  # fmt: skip

    def validation_step(self, batch, batch_idx):
        self.validated.append((self.current_epoch, batch["key"].tolist()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(config, folder, ckpt_path=None) -> Tiny:
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = Tiny()
    checkpoints = ModelCheckpoint(dirpath=folder, filename="{epoch}-{step}", save_top_k=-1,
                                  every_n_train_steps=EVERY)  # fmt: skip
    ends = ModelCheckpoint(dirpath=folder / "ends", filename="{epoch}", save_top_k=-1,
                           every_n_epochs=1, save_on_train_epoch_end=True)  # fmt: skip
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[checkpoints, ends])  # fmt: skip
    val = config.replace(train=False)
    with Loader(config, epochs=2, device="cpu") as train, \
         Loader(val, epochs=2, device="cpu", drop_last=False) as held_out:  # fmt: skip
        assert len(train) == 15 and len(held_out) == 16
        trainer.fit(model, train_dataloaders=train, val_dataloaders=held_out,
                    ckpt_path=ckpt_path)  # fmt: skip
    return model


def _keys(steps) -> list[int]:
    return [k for _, keys in steps for k in keys]


def test_lightning_fits_two_epochs_and_resumes_from_its_checkpoints(
    ray_session, datasets, tmp_path
):
    config = PipelineConfig(source=str(datasets["webdataset"]), image_size=8, batch_size=B,
                            actors=(1, 1))  # fmt: skip
    first = _fit(config, tmp_path / "a")
    assert [e for e, _ in first.trained] == [0] * 15 + [1] * 15
    for epoch in range(2):
        batches = [keys for e, keys in first.trained if e == epoch]
        check_exactly_once_and_equal([batches], batch_size=B, good=range(61), left_over=B - 1)
        assert sorted(_keys(s for s in first.validated if s[0] == epoch)) == list(range(61))

    # mid-epoch 0 (step 10): the rest of epoch 0, then epoch 1 as the first run read it
    resumed = _fit(config, tmp_path / "b", ckpt_path=tmp_path / "a" / "epoch=0-step=10.ckpt")
    again = [keys for e, keys in resumed.trained if e == 0]
    assert len(again) == 5
    epoch0 = _keys(first.trained[:10]) + _keys((0, k) for k in again)
    assert len(epoch0) == len(set(epoch0)) == 60
    assert [k for e, k in resumed.trained if e == 1] == [k for e, k in first.trained if e == 1]

    # the epoch's last step (15): epoch 1, whole, and nothing of epoch 0
    resumed = _fit(config, tmp_path / "c", ckpt_path=tmp_path / "a" / "epoch=0-step=15.ckpt")
    assert [e for e, _ in resumed.trained] == [1] * 15
    assert [k for _, k in resumed.trained] == [k for e, k in first.trained if e == 1]
    assert np.array_equal(sorted(_keys(resumed.validated)), sorted(_keys(first.validated[-16:])))

    # a checkpoint taken at the epoch's end (ModelCheckpoint(every_n_epochs=1), Ray Train's
    # report callback): Lightning gives the loader no state then, only set_epoch(1); the
    # loader read epoch 0 again, its batches trained as epoch 1
    resumed = _fit(config, tmp_path / "d", ckpt_path=tmp_path / "a" / "ends" / "epoch=0.ckpt")
    assert [e for e, _ in resumed.trained] == [1] * 15
    assert [k for _, k in resumed.trained] == [k for e, k in first.trained if e == 1]


def ray_lightning_func(cfg: dict) -> None:
    """A train function of Ray Train's Lightning integration, with the Loader as its data."""
    import json
    from pathlib import Path

    import ray.train
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer

    from raypipe import Loader, PipelineConfig

    model = Tiny()
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices="auto", logger=False,
                        strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    trainer = prepare_trainer(trainer)
    with Loader(PipelineConfig(**cfg["data"]), epochs=2, device="cpu") as loader:
        assert len(loader) == 61 // 2 // B
        trainer.fit(model, train_dataloaders=loader)  # rank, world, ledger: the process group's
    rank = ray.train.get_context().get_world_rank()
    Path(cfg["out"], f"r{rank}.json").write_text(json.dumps(model.trained))


@pytest.mark.slow
def test_under_ray_train_lightning_integration_two_ranks_equal_and_exactly_once(
    ray_session, datasets, tmp_path
):
    import json

    import ray.train
    from ray.train.torch import TorchTrainer

    from raypipe.train.rendezvous import BoundStoreTorchConfig

    data = {"source": str(datasets["webdataset"]), "image_size": 8, "batch_size": B,
            "actors": (2, 2), "actor_cpus": 0.5}  # fmt: skip
    trainer = TorchTrainer(
        ray_lightning_func,
        train_loop_config={"data": data, "out": str(tmp_path)},
        torch_config=BoundStoreTorchConfig(),
        scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=ray.train.RunConfig(name="lightning", storage_path=str(tmp_path / "runs")),
    )
    assert trainer.fit().error is None
    ranks = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    for epoch in range(2):
        batches = [[keys for e, keys in steps if e == epoch] for steps in ranks]
        keys = check_exactly_once_and_equal(batches, batch_size=B, good=range(61),
                                            left_over=2 * B - 1)  # fmt: skip
        assert len(batches[0]) == 7 and len(keys) == 56
