"""Old module paths (raypipe 0.1's flat layout) still import, with a DeprecationWarning.

Configs name transforms as ``"module:function"`` and checkpoints may pickle classes by
module path; both keep working for one release after the move into subpackages.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
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


# Names that left the module they moved with: old path -> {name: "module:attribute"}.
# (Left out on purpose: shardfiles.tar_label_members, dead code removed in the move.)
ELSEWHERE = {
    "raypipe.fastimage": {"transforms": "raypipe.data:augment"},
    "raypipe.follow": {
        n: f"raypipe.data.autoscale:{n}"
        for n in ("FollowingAutoscaler", "FollowingCluster", "RAY_VERSION", "check_ray", "follow")
    },
    "raypipe.resume": {
        "Delivered": "raypipe.loader.stats:Delivered",
        "Shard": "raypipe.data.shards:Shard",
        "pending_rows": "raypipe.data.shards:pending_rows",
        "unpack_done": "raypipe.data.shards:unpack_done",
    },
    "raypipe.shard_writer": {"read_shard": "raypipe._moved:read_shard"},
    "raypipe.sources": {
        "IMAGE_EXTS": "raypipe.formats.imagefolder:IMAGE_EXTS",
        "RawSample": "raypipe.formats.sample:RawSample",
        "count_parquet_rows": "raypipe.formats.parquet:count_parquet_rows",
        "count_tar_samples": "raypipe.formats.webdataset:count_tar_samples",
        "os_error": "raypipe.formats.sample:os_error",
        "parquet_labels": "raypipe.formats.parquet:parquet_labels",
        "read_parquet": "raypipe.formats.parquet:read_parquet",
        "read_shard": "raypipe._moved:read_shard",
        "read_tar": "raypipe.formats.webdataset:read_tar",
    },
    "raypipe.transforms": {
        "decode_crop": "raypipe.data.pillow:pillow_decode_crop",
        "to_rgb": "raypipe.data.pillow:to_rgb",
    },
    "raypipe.usermap": {"INPUTS": "raypipe.config.validate:INPUTS"},
}


def read_shard(path, fmt, first_key, label, done=None):
    """0.1's ``sources.read_shard``: `raypipe.formats.Reader` ``.read`` with a format name
    meaning that format's defaults on local files."""
    from raypipe.formats import Reader

    reader = fmt if isinstance(fmt, Reader) else Reader(fmt)
    return reader.read(path, first_key, label, done)


def _resolve(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _old_module(name: str, new) -> types.ModuleType:
    """A module at the old path: its names from ``new``, and those that went elsewhere."""
    elsewhere = ELSEWHERE[name]
    module = types.ModuleType(name, new.__doc__)

    def __getattr__(attr: str):
        if attr in elsewhere:
            return _resolve(elsewhere[attr])
        try:
            return getattr(new, attr)
        except AttributeError:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}") from None

    module.__getattr__ = __getattr__
    module.__dir__ = lambda: sorted({*dir(new), *elsewhere})
    return module


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
        module = importlib.import_module(new)
        return _old_module(spec.name, module) if spec.name in ELSEWHERE else module

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.append(_Moved())
