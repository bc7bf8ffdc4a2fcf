"""One rank's side: the iterator and its numbered stages, re-batching, host to device,
and `Pipeline`, every epoch of a run from one warm pool.

Imports the layers below it (`raypipe.plan`, `raypipe.skips`, `raypipe.preprocess`, `raypipe.pool`
and under them), never `train` or `cli`.
"""

from raypipe.loader.iterator import TorchBatches, iter_torch_batches
from raypipe.loader.pipeline import Pipeline

__all__ = ["Pipeline", "TorchBatches", "iter_torch_batches"]
assert __all__ == sorted(__all__)
