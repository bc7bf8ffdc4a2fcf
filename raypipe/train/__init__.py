"""Ray Train: `train_ddp` and its `TrainContext`, pipeline checkpoints and their state.

Imports the layers below it (`config`, `formats`, `data`, `loader`), never `cli`.
"""

from raypipe.train.ddp import TrainContext, train_ddp

__all__ = ["TrainContext", "train_ddp"]
assert __all__ == sorted(__all__)


def __getattr__(name: str):
    """``raypipe.train.rendezvous`` (docs name ``BoundStoreTorchConfig`` there), imported
    on first use: it imports torch, which ``import raypipe`` (every preprocessing worker)
    does not."""
    if name == "rendezvous":
        import importlib

        return importlib.import_module("raypipe.train.rendezvous")
    raise AttributeError(f"module 'raypipe.train' has no attribute {name!r}")
