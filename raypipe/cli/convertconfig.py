"""The ``convert`` section of a YAML config: what ``raypipe convert`` writes, checked."""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raypipe.cli.jobspec import convert_section
from raypipe.config import check_keys, load_yaml
from raypipe.formats.storage import is_remote
from raypipe.formats.writer import EXTENSIONS

__all__ = ["ShardsConfig"]


@dataclasses.dataclass(frozen=True)
class ShardsConfig:
    """What ``raypipe convert`` does (the ``convert`` section of a YAML config).

    Args:
        source: the image folder (class sub-folders).
        out: the output folder for the shards and ``index.json``.
        format: ``"webdataset"`` (tar), ``"parquet"`` or ``"tfrecord"``.
        shards: number of shards; or leave it None and set ``samples_per_shard``.
        samples_per_shard: samples per shard when ``shards`` is None.
        prefix: shard name prefix, e.g. ``train`` → ``train-00000-of-00008.tar``.
        cpus_per_task: logical CPUs each shard-writing Ray task reserves.
        restart_markers: store each JPEG re-written losslessly with a restart marker after
            every MCU, so that raypipe decodes only the MCUs a crop needs (the same
            pixels; files 2–7 % larger); False stores the bytes as they are.
    """

    source: str
    out: str
    format: str = "webdataset"
    shards: int | None = None
    samples_per_shard: int = 1000
    prefix: str = "train"
    cpus_per_task: float = 1.0
    restart_markers: bool = True

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"convert.{field}={getattr(self, field)!r}: {why}")

        self._check_paths(bad)
        if self.format not in EXTENSIONS:
            raise bad("format", f"must be one of {sorted(EXTENSIONS)}")
        if self.shards is not None and (not _is_int(self.shards) or self.shards < 1):
            raise bad("shards", "must be an integer >= 1 (or left out)")
        if not _is_int(self.samples_per_shard) or self.samples_per_shard < 1:
            raise bad("samples_per_shard", "must be an integer >= 1")
        if "/" in self.prefix or self.prefix.startswith("."):
            raise bad("prefix", "must be a plain file name prefix")
        cpus = self.cpus_per_task
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not cpus > 0:
            raise bad("cpus_per_task", "must be a number > 0")
        self._check_switches(bad)

    def _check_paths(self, bad) -> None:
        for name in ("source", "out", "prefix"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise bad(name, "must be a non-empty string")
        if remote := [name for name in ("source", "out") if is_remote(getattr(self, name))]:
            raise bad(remote[0], "must be a local folder (convert reads and writes local files)")
        if (
            glob.has_magic(self.source)
            and not os.path.isdir(self.source)
            and glob.glob(self.source)
        ):
            raise bad("source", "must be one image folder (the folder of the class folders), "
                      "not a glob")  # fmt: skip

    def _check_switches(self, bad) -> None:
        if not isinstance(self.restart_markers, bool):
            raise bad("restart_markers", "must be true or false")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardsConfig:
        if not isinstance(data, Mapping):
            raise ValueError(f"convert config must be a mapping, got {type(data).__name__}")
        check_keys(data, [f.name for f in dataclasses.fields(cls)], where="convert")
        if missing := [k for k in ("source", "out") if k not in data]:
            raise ValueError(f"convert: missing required key(s) {', '.join(missing)}")
        if data.get("shards") is not None and "samples_per_shard" in data:  # one was ignored
            raise ValueError("convert: shards and samples_per_shard are both set: set one")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path, raw: dict | None = None) -> ShardsConfig:
        raw = load_yaml(path) if raw is None else raw  # ``raw``: what was read of ``path``
        section = convert_section(raw)
        check_keys(raw, [section or "convert"], where=str(path))
        if section is None:
            raise ValueError(f"{path}: a convert config needs a 'convert' section")
        try:
            return cls.from_dict(raw[section])
        except (TypeError, ValueError) as e:  # a ValueError's own message names the section
            raise ValueError(f"{path}: {f'{section}: ' * isinstance(e, TypeError)}{e}") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
