"""The package's layers: each module imports only its own layer and the ones below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import raypipe

PACKAGE = Path(raypipe.__file__).parent
# bottom to top; a module may import its own layer and any layer listed before it
LAYERS = ("localnode", "config", "formats", "data", "loader", "train", "cli")


def layer_of(module: str) -> int | None:
    """The layer of ``raypipe.<name>[...]``; None for the package's own entry points."""
    parts = module.split(".")
    if parts[0] != "raypipe" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


FRONT_DOOR = len(LAYERS)  # `raypipe` itself imports every layer: above all of them


def imported_layer(module: str) -> int:
    """The layer an import of ``module`` reaches: its own, or above every layer for the
    package itself and the names it re-exports (``from raypipe import Pipeline``)."""
    own = layer_of(module)
    return FRONT_DOOR if own is None else own


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        out.append((name, path))
    return out


def raypipe_imports(path: Path, name: str) -> set[str]:
    """Every raypipe module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("raypipe"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "raypipe":  # `from raypipe import x`: x is a module or a name
                found.update(f"raypipe.{a.name}" for a in node.names)
            elif node.module.startswith("raypipe"):
                found.add(node.module)
    return found


def test_every_module_has_a_layer():
    outside = [
        n for n, _ in modules() if layer_of(n) is None and n not in ("raypipe", "raypipe.__main__")
    ]
    assert not outside, f"modules outside the layers {LAYERS}: {outside}"


@pytest.mark.parametrize("name,path", modules(), ids=[n for n, _ in modules()])
def test_no_upward_import(name, path):
    own = layer_of(name)
    if own is None:
        return  # the package's front door and entry point import from every layer
    upward = sorted(m for m in raypipe_imports(path, name) if imported_layer(m) > own)
    assert not upward, f"{name} (layer {LAYERS[own]}) imports from above: {upward}"


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from raypipe.train.ddp import train_ddp\n")
    assert raypipe_imports(bad, "raypipe.data.m") == {"raypipe.train.ddp"}
    assert layer_of("raypipe.train.ddp") > layer_of("raypipe.data.m")


def test_an_import_from_the_package_front_door_is_an_upward_import(tmp_path):
    """`from raypipe import Pipeline` (or `import raypipe`) runs raypipe/__init__.py, which
    imports every layer: from any layer it reaches above."""
    bad = tmp_path / "m.py"
    bad.write_text("import raypipe\nfrom raypipe import Pipeline\nfrom raypipe import localnode\n")
    found = raypipe_imports(bad, "raypipe.data.m")
    assert found == {"raypipe", "raypipe.Pipeline", "raypipe.localnode"}
    data = layer_of("raypipe.data.m")
    assert {m for m in found if imported_layer(m) > data} == {"raypipe", "raypipe.Pipeline"}
    assert imported_layer("raypipe.localnode") == 0
