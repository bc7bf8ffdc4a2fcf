"""Old module paths (raypipe 0.1's flat layout) still import, with a DeprecationWarning.

Configs name transforms as ``"module:function"`` and checkpoints may pickle classes by
module path; both keep working for one release after the move into subpackages.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "raypipe.blocks": "raypipe.loader.blocks",
    "raypipe.blocksize": "raypipe.data.blocksize",
    "raypipe.budget": "raypipe.data.budget",
    "raypipe.checkpoint": "raypipe.train.checkpoint",
    "raypipe.classify": "raypipe.cli.classify",
    "raypipe.collate": "raypipe.loader.collate",
    "raypipe.demo": "raypipe.cli.demo",
    "raypipe.device_ops": "raypipe.loader.device_ops",
    "raypipe.epochs": "raypipe.loader.pipeline",
    "raypipe.examples": "raypipe.cli.examples",
    "raypipe.fastimage": "raypipe.data.decode",
    "raypipe.feeder": "raypipe.loader.feeder",
    "raypipe.follow": "raypipe.data.follow",
    "raypipe.gpudecode": "raypipe.data.gpudecode",
    "raypipe.h2d": "raypipe.loader.h2d",
    "raypipe.jobspec": "raypipe.cli.jobspec",
    "raypipe.ledger": "raypipe.loader.ledger",
    "raypipe.parquetfiles": "raypipe.formats.parquet",
    "raypipe.pipeline": "raypipe.data.dataset",
    "raypipe.plan": "raypipe.data.rankplan",
    "raypipe.poolwatch": "raypipe.data.poolwatch",
    "raypipe.progress": "raypipe.loader.progress",
    "raypipe.rebatch": "raypipe.loader.rebatch",
    "raypipe.resume": "raypipe.train.state",
    "raypipe.shard_writer": "raypipe.formats.writer",
    "raypipe.shardfiles": "raypipe.formats.webdataset",
    "raypipe.shards": "raypipe.cli.convert",
    "raypipe.skips": "raypipe.data.skips",
    "raypipe.sources": "raypipe.data.shards",
    "raypipe.stats": "raypipe.loader.stats",
    "raypipe.storage": "raypipe.formats.storage",
    "raypipe.submit": "raypipe.cli.submit",
    "raypipe.survey": "raypipe.cli.survey",
    "raypipe.transforms": "raypipe.data.augment",
    "raypipe.usermap": "raypipe.data.usermap",
    "raypipe.userrows": "raypipe.data.userrows",
    "raypipe.warm": "raypipe.data.warm",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as the module that now lives at the new one."""

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.append(_Moved())
