"""Job configs: which job a YAML file describes, checked, with its paths made absolute.

Two kinds of YAML config drive raypipe jobs: a run config (``data``, ``eval``,
``trainer`` sections; `raypipe run`) and a convert config (a ``convert`` section, or
``preprocess`` as raypipe 0.1 named it; `raypipe convert`). Relative data paths in either are relative to the
directory the user works in, which is not where a submitted job runs (Ray unpacks
the working dir elsewhere), so jobs resolve them against an explicit root.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal

from raypipe.config import check_keys, load_yaml

Kind = Literal["train", "convert"]

RUN_SECTIONS = ("data", "eval", "trainer")
# Path-valued keys per section: these are resolved against the data root.
PATH_KEYS = {
    "data": ("source", "cache_dir"),
    "eval": ("source", "cache_dir"),
    "trainer": ("storage_path",),
    "convert": ("source", "out"),
    "preprocess": ("source", "out"),
}
CONVERT_SECTIONS = ("convert", "preprocess")  # the second: its name in raypipe 0.1


def convert_section(raw: dict[str, Any]) -> str | None:
    """The key of a config's convert section (``convert``, or the older ``preprocess``)."""
    return next((k for k in CONVERT_SECTIONS if k in raw), None)


def kind_of(path: str | Path) -> Kind:
    """``"convert"`` for a config with a ``convert`` section, else ``"train"``."""
    raw = load_yaml(path)
    if (section := convert_section(raw)) and "data" in raw:
        raise ValueError(f"{path}: both a run config's 'data' and a convert config's "
                         f"'{section}' section: one file describes one job")  # fmt: skip
    if section:
        return "convert"
    if "model" in raw:  # jobs/configs/tokens-lm.yaml's kind: not raypipe's own jobs
        raise ValueError(f"{path}: a language model's config (its 'model' section): run it "
                         f"with python jobs/train_lm.py {path}")  # fmt: skip
    trainer = raw.get("trainer")
    if isinstance(trainer, dict) and "num_classes" in trainer:  # torchrun_train.py's own
        raise ValueError(f"{path}: a torchrun rank's config (its trainer's num_classes): run "
                         "it with torchrun --nproc_per_node=N jobs/torchrun_train.py "
                         f"{path} (docs/trainers.md)")  # fmt: skip
    check_keys(raw, [*RUN_SECTIONS, "convert"], where=str(path))
    if "data" not in raw:
        raise ValueError(
            f"{path}: neither a run config (needs a 'data' section) "
            "nor a convert config (needs a 'convert' section)"
        )
    return "train"


def check(path: str | Path, root: str | Path = ".") -> Kind:
    """Load and validate the config fully, its relative paths joined onto ``root`` as the
    job's are (a relative ``cache_dir`` is one); returns its kind. Errors are ValueErrors."""
    from raypipe.cli.classify import RunConfig
    from raypipe.cli.convertconfig import ShardsConfig

    kind = kind_of(path)
    try:
        (ShardsConfig if kind == "convert" else RunConfig).from_yaml(
            path, resolve_paths(path, root)
        )
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None
    return kind


def make_folder(folder: str | None, setting: str) -> None:
    """A local output folder made now, before Ray starts; ValueError naming ``setting``
    (the config key or flag that gave it) where it cannot be."""
    if folder and "://" not in folder:
        try:
            os.makedirs(os.path.expanduser(folder), exist_ok=True)
        except OSError as e:
            where = f" ({e.filename})" if e.filename and e.filename != folder else ""
            raise ValueError(f"{setting} {folder!r}: cannot make the folder: "
                             f"{e.strerror}{where}") from None  # fmt: skip


def resolve_paths(path: str | Path, root: str | Path) -> dict[str, Any]:
    """The config as a mapping with relative data paths joined onto ``root``."""
    raw = copy.deepcopy(load_yaml(path))
    root = os.path.abspath(root)
    for section, keys in PATH_KEYS.items():
        body = raw.get(section)
        if not isinstance(body, dict):
            continue
        for key in keys:
            value = body.get(key)
            if isinstance(value, str):
                body[key] = resolve(root, value)
            elif isinstance(value, list):
                body[key] = [resolve(root, v) if isinstance(v, str) else v for v in value]
    return raw


def check_sources(path: str | Path, root: str | Path) -> None:
    """Refuse a relative local ``source`` of the config at ``path`` that is not under
    ``root``, in one line naming the config, the folder and ``--data-root``."""
    import glob

    raw = load_yaml(path)
    for section in ("data", "eval", *CONVERT_SECTIONS):
        body = raw.get(section)
        sources = body.get("source") if isinstance(body, dict) else None
        for value in sources if isinstance(sources, list) else [sources]:
            if not isinstance(value, str) or resolve(root, value) == value or value[:1] == "~":
                continue  # absolute, a URL, or no path: checked where it is listed
            if not glob.has_magic(value) and not os.path.exists(resolve(root, value)):
                raise ValueError(
                    f"{path}: {section}.source {value!r} is relative to "
                    f"{os.path.abspath(root)} (the current folder, or --data-root), which "
                    "does not hold it: run from the folder that does, or pass --data-root"
                )


def write_resolved(path: str | Path, root: str | Path, out_dir: str | Path) -> Path:
    """Write the resolved config into ``out_dir``; returns the new file's path."""
    import yaml

    out = Path(out_dir) / Path(path).name
    out.write_text(yaml.safe_dump(resolve_paths(path, root), sort_keys=False))
    return out


def resolve(root: str, value: str) -> str:
    """``value`` joined onto ``root`` unless it is absolute or a URL (``s3://...``)."""
    if not value or "://" in value or os.path.isabs(value):
        return value
    return os.path.join(os.path.abspath(root), os.path.expanduser(value))
