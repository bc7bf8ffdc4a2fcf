"""Ray's private APIs behind one fence: every private name of Ray's that the package uses is
used in `raypipe.rayapi`, and is there in the pinned Ray with the shape raypipe relies on."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import raypipe
from raypipe import rayapi

PACKAGE = Path(raypipe.__file__).parent
FENCE = "raypipe.rayapi"
DOTTED = re.compile(r"\bray(?:\.\w+)+")  # a Ray module path in a string


def private_path(path: str) -> bool:
    """``ray._private...``, ``ray.data._internal...``: a part of a Ray path starts with _."""
    parts = path.split(".")
    return parts[0] == "ray" and any(p.startswith("_") for p in parts[1:])


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        out.append((".".join(p for p in rel.parts if p != "__init__"), path))
    return out


def own_private_names(trees) -> set[str]:
    """The ``_names`` raypipe defines itself: functions, classes, attributes it assigns,
    variables, parameters."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
    return {n for n in own if n.startswith("_")}


def private_ray_names(tree: ast.AST, own: set[str], ray: frozenset[str] | None = None) -> set[str]:
    """What ``tree`` touches of Ray's private API: imports of a private Ray module or name,
    private attributes of objects other than ``self`` / ``cls`` (also as ``getattr``'s
    string), private keywords (also as a dict's keys or ``setdefault``'s), each one that
    raypipe does not define itself or that is in ``ray`` (the fence's; None: every one is
    Ray's); private Ray module paths as strings."""

    def foreign(name) -> bool:
        if not isinstance(name, str) or not name.startswith("_") or name.startswith("__"):
            return False
        return ray is None or name not in own or name in ray

    found = set()
    for node in ast.walk(tree):
        for kind, name in _touched(node):
            if (
                kind == "path"
                and private_path(name)
                or kind == "from"
                and foreign(name.rpartition(".")[2])
            ):
                found.add(name)
            elif kind in ("attr", "keyword") and foreign(name):
                found.add(f".{name}" if kind == "attr" else f"{name}=")
    return found


def _touched(node: ast.AST) -> list[tuple[str, str]]:
    """``(kind, name)`` of what ``node`` reaches: a module ``path``, a name imported
    ``from`` a Ray module, an ``attr``ibute of another object, a ``keyword``."""
    if isinstance(node, ast.Import):
        return [("path", a.name) for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module != "ray" and not node.module.startswith("ray."):
            return []
        return [("path", node.module)] + [("from", f"{node.module}.{a.name}") for a in node.names]
    if isinstance(node, ast.Attribute):
        mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        return [] if mine else [("attr", node.attr)]
    if isinstance(node, ast.Call) and node.args:
        return _call_strings(node)
    if isinstance(node, ast.keyword) and node.arg:
        return [("keyword", node.arg)]
    if isinstance(node, ast.Dict):  # keywords for a call: {"_system_config": ...}
        return [("keyword", _text(k)) for k in node.keys if k is not None]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" not in node.value:
        return [("path", p) for p in DOTTED.findall(node.value)]  # a name or a path, not prose
    return []


def _call_strings(node: ast.Call) -> list[tuple[str, str]]:
    """``getattr(x, "_name")`` and ``kwargs.setdefault("_name", ...)``."""
    first = [_text(a) for a in node.args[:2]]
    if isinstance(node.func, ast.Name) and node.func.id in GETATTR and len(first) > 1:
        return [("attr", first[1])]
    if isinstance(node.func, ast.Attribute) and node.func.attr == "setdefault":
        return [("keyword", first[0])]
    return []


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


GETATTR = ("getattr", "hasattr", "setattr", "delattr")


def usage() -> dict[str, set[str]]:
    """Every private Ray name the package uses, by module (docstrings left out)."""
    trees = {name: ast.parse(path.read_text()) for name, path in modules()}
    for tree in trees.values():
        _drop_docstrings(tree)
    own = own_private_names(trees.values())
    fence = private_ray_names(trees[FENCE], own)
    ray = frozenset(n.strip(".=") for n in fence)
    found = {n: private_ray_names(t, own, ray) for n, t in trees.items() if n != FENCE}
    return {FENCE: fence, **{n: f for n, f in found.items() if f}}


def _drop_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and _text(first.value) is not None:
            first.value.value = ""


def test_every_private_ray_name_is_used_in_the_fence_only():
    used = usage()
    outside = {m: sorted(n) for m, n in used.items() if m != FENCE}
    assert not outside, f"private Ray names outside {FENCE}: {outside}"
    # the list, as the fence's docstring and INTERNALS describe it
    assert sorted(used[FENCE]) == [
        "._actor_autoscaler",
        "._alive_actors_to_in_flight_tasks_heap",
        "._alive_node_to_actor_heap",
        "._build_bundle_iterator",
        "._cluster_autoscaler",
        "._config",
        "._create_executor",
        "._lock",
        "._release_running_actor",
        "._running_actors",
        "._send_resource_request",
        "._topology",
        "_system_config=",
        "ray._private",
        "ray._private.authentication.authentication_token_setup",
        "ray._private.ray_constants",
        "ray._private.ray_logging",
        "ray._private.services",
        "ray._private.state",
        "ray._raylet",
        "ray.data._internal.actor_autoscaler",
        "ray.data._internal.cluster_autoscaler",
        "ray.data._internal.execution.operators.actor_pool_map_operator",
        "ray.data._internal.execution.streaming_executor",
        "ray.data._internal.execution.streaming_executor_state",
        "ray.train.torch.config._TorchBackend",
        "ray.train.torch.config._set_torch_distributed_env_vars",
        "ray.train.v2._internal.exceptions",
        "ray.train.v2._internal.util",
    ]


def test_the_pinned_ray_has_every_internal_the_fence_touches():
    assert rayapi.check() == []


@pytest.mark.parametrize(
    "code,seen",
    [
        ("def f(ds):\n    return ds._execute_to_iterator()\n", {"._execute_to_iterator"}),
        ("from ray._private import state\n", {"ray._private"}),
        ("import ray._raylet\n", {"ray._raylet"}),
        ("from ray.train.torch.config import _TorchBackend\n", {"ray.train.torch.config._TorchBackend"}),
        ("def f(e):\n    return getattr(e, '_actor_autoscaler', None)\n", {"._actor_autoscaler"}),
        ("import ray\nray.init(_system_config={})\n", {"_system_config="}),
        ("def f(kw):\n    kw.setdefault('_system_config', {})\n", {"_system_config="}),
        ("NAME = 'ray.data._internal.x'\n", {"ray.data._internal.x"}),
        ("class A:\n    def __init__(self):\n        self._x = 1\n\n    def f(self):\n"
         "        return self._x\n", set()),
    ],
)  # fmt: skip
def test_the_checker_sees_a_private_name(code, seen):
    tree = ast.parse(code)
    assert private_ray_names(tree, own_private_names([tree])) == seen


def test_the_fence_names_a_shape_it_cannot_find():
    bogus = (("test", "ray.data.dataset", "Dataset", ("attr:_no_such_thing",)),)
    original = rayapi.INTERNALS
    try:
        rayapi.INTERNALS = bogus
        assert rayapi.check_names(("test",)) == ["ray.data.dataset.Dataset: attr:_no_such_thing"]
    finally:
        rayapi.INTERNALS = original
