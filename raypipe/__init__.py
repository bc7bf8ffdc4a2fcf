"""raypipe: elastic Ray Data preprocessing feeding PyTorch DDP trainers.

Public contract:

- `Pipeline(config, epochs=)`: the warm path for a whole run: ``epochs()`` yields
  ``(epoch, batches)``, every epoch from one preprocessing pool started once; each rank
  reads its own seeded slice of every epoch (``rank=``, ``world_size=``, ``ledger=``).
- `PipelineConfig`: every setting of one dataset's pipeline (also from YAML);
  `LoaderConfig` (``config.loader``): the rank iterator's part of it.
- `build_dataset(config, epoch=, skips=)`: a Ray Dataset of ``image`` (uint8 C×H×W),
  ``label`` and ``key`` (int64), preprocessed on an autoscaling actor pool.
- `iter_torch_batches(source, config)` (or ``batch_size=`` and other loader
  settings as keywords): the per-rank iterator; equal, exact-size, exactly-once
  batches of torch tensors, with ``.stats()``.
- `SkipLog`: the bad samples a pipeline skipped (``SkipLog.create()``, passed as
  ``skips=``; ``.report()``): counts per reason and the records (key, file or
  shard member, reason).
- `PoolWatch()`: preprocessing actors and nodes alive over time (elastic runs);
  ``iter_torch_batches(..., watch=)`` reports it in ``stats()["pool"]``.
- `Loader(config, epochs=)`: a DataLoader-shaped loader over one rank's warm `Pipeline`:
  each ``iter()`` the next epoch, ``len()``, ``set_epoch()``, ``state_dict()`` /
  ``load_state_dict()`` for mid-epoch resume; for plain loops, your own Ray Train
  ``TorchTrainer``, Lightning and torchrun (docs/trainers.md).
- `train_ddp(config, train_loop, num_workers=...)`: DDP on Ray Train in one call;
  ``train_loop`` receives a `TrainContext`. Its checkpoints hold the pipeline's
  position (``checkpoint_every=``); ``resume_from=`` resumes mid-epoch, exactly
  once, with any number of workers (`raypipe.train.state`).
"""

from raypipe.config import LoaderConfig, PipelineConfig
from raypipe.formats.storage import StorageError
from raypipe.loader.iterator import iter_torch_batches
from raypipe.loader.pipeline import Pipeline
from raypipe.pool.watch import PoolWatch
from raypipe.preprocess.datasets import build_dataset
from raypipe.skips.budget import SkipBudgetError
from raypipe.skips.log import SkipLog
from raypipe.skips.records import SampleError
from raypipe.train.ddp import TrainContext, train_ddp
from raypipe.train.loader import Loader

__all__ = [
    "Loader",
    "LoaderConfig",
    "Pipeline",
    "PipelineConfig",
    "PoolWatch",
    "SampleError",
    "SkipBudgetError",
    "SkipLog",
    "StorageError",
    "TrainContext",
    "build_dataset",
    "iter_torch_batches",
    "train_ddp",
]
assert __all__ == sorted(__all__)

__version__ = "0.1.0"
