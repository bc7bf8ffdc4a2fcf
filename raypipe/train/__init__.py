"""Ray Train: `train_ddp` and its `TrainContext`, pipeline checkpoints and their state.

Imports the layers below it (`config`, `formats`, `data`, `loader`), never `cli`.
"""

from raypipe.train import rendezvous  # noqa: F401  (raypipe.train.rendezvous.BoundStoreTorchConfig)
from raypipe.train.ddp import TrainContext, train_ddp

__all__ = ["TrainContext", "train_ddp"]
assert __all__ == sorted(__all__)
