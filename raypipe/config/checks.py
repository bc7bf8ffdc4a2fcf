"""Checks shared by the configs: YAML files, unknown keys, numbers, importable callables."""

from __future__ import annotations

import difflib
import functools
import importlib
import math
import pickle
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["check_keys", "check_share", "is_int", "is_num", "is_pair", "load_yaml",
           "python_scalars", "resolve_callable"]  # fmt: skip
assert __all__ == sorted(__all__)


# YAML 1.1's floats need a dot, and a sign in an exponent: PyYAML reads ``lr: 2e-3`` and
# ``1.5e3`` as strings. Numbers in exponent form are numbers here (YAML 1.2's rule), and
# a whole one an integer: ``cache_budget: 2e9`` is bytes, a count.
_EXPONENT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


@functools.cache
def _loader():
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            """A key given twice is refused (YAML keeps the last one without a word: a
            repeated ``trainer:`` section would drop the first one's settings)."""
            seen: dict = {}
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and not key_node.tag.endswith(":merge"):
                    key = self.construct_object(key_node)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"{key!r} is given twice (first on line {seen[key]})",
                            key_node.start_mark)  # fmt: skip
                    seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

        def construct_yaml_float(self, node):
            value = super().construct_yaml_float(node)
            return int(value) if "e" in node.value.lower() and value.is_integer() else value

    Loader.add_constructor("tag:yaml.org,2002:float", Loader.construct_yaml_float)
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT, list("-+.0123456789"))
    return Loader


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping (``2e-3`` a float), with errors that name the file."""
    import yaml

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a config file (a YAML such as "
                         "jobs/configs/digits.yaml; its data.source names the data)")  # fmt: skip
    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_text(), Loader=_loader())  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ValueError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        raise ValueError(f"{path}: the file is empty (a config starts with its data: section)")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top, got {type(data).__name__}")
    return data


def check_keys(data: Mapping[str, Any], known: list[str], *, where: str) -> None:
    """Raise ValueError naming unknown keys and the closest known key for each."""
    unknown = [k for k in data if k not in known]
    if not unknown:
        return
    hints, guessed = [], True
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        guessed = guessed and bool(close)
    known_list = "" if guessed else f"; known: {', '.join(known)}"  # a guess for each: enough
    raise ValueError(f"{where}: unknown key(s) {', '.join(hints)}{known_list}")


def python_scalars(obj) -> None:
    """Replace NumPy's scalars in a frozen dataclass's fields, and in its tuples, with
    Python's (a sweep's ``np.int64`` batch size, ``np.bool_`` flag), before its checks."""
    import dataclasses

    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        plain = tuple(map(_plain, value)) if isinstance(value, tuple) else _plain(value)
        if plain is not value:
            object.__setattr__(obj, f.name, plain)


def _plain(v: Any) -> Any:
    import numbers

    import numpy as np

    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, numbers.Integral) and not isinstance(v, int):
        return int(v)
    if isinstance(v, numbers.Real) and not isinstance(v, (int, float)):
        return float(v)
    return v


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    """A finite int or float (not a bool)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, int) or math.isfinite(v)  # an int is finite (and may overflow isfinite)


def is_pair(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and all(is_num(x) for x in v)


def resolve_callable(value: Any, field: str) -> Callable | None:
    """``value`` as a callable: itself, or the object a ``"module:attribute"`` path names.

    A callable must pickle by reference (a module-level function, a ``functools.partial``
    of one, an instance of an importable class such as a torchvision ``Compose``): lambdas
    and local functions cannot be re-imported where the actors run, so they are refused here,
    before any work.
    """
    if value is None:
        return None
    if isinstance(value, str):
        module, sep, name = value.partition(":")
        if not sep or not module or not name:
            raise ValueError(f"PipelineConfig.{field}={value!r}: expected 'module:attribute'")
        try:
            obj: Any = importlib.import_module(module)
            for part in name.split("."):
                obj = getattr(obj, part)
        except Exception as e:  # no such module or name; or the module fails as it imports
            named = isinstance(e, (ImportError, AttributeError))  # says what is missing
            why = (str(e) if named else f"{type(e).__name__}: {e}").strip() or type(e).__name__
            why = why.splitlines()[0]
            raise ValueError(f"PipelineConfig.{field}={value!r}: cannot import it: {why}") from None
        value = obj
    if not callable(value):
        raise ValueError(f"PipelineConfig.{field}={value!r}: not callable")
    try:
        pickle.dumps(value)
    except Exception as e:
        raise ValueError(
            f"PipelineConfig.{field}={value!r}: cannot be pickled by reference ({e}); define it "
            "at module level in an importable module, or give 'module:function'"
        ) from None
    return value


def check_share(config, num_samples: int, ranks: int, what: str = "ranks") -> None:
    """Refuse a batch no rank could fill (with ``drop_last``, every epoch would be empty);
    ``what`` the ranks are called where they are set. Packed batches are rows of
    ``seq_len`` tokens, more of them than documents when they are long: not checked here."""
    if config.pack is None and num_samples // ranks < config.batch_size:
        raise ValueError(
            f"batch_size={config.batch_size} is larger than one rank's share ({num_samples} "
            f"samples / {ranks} {what} = {num_samples // ranks}): no rank would get a full batch"
        )
