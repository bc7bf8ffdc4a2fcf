"""The package's layers: each module imports only its own layer and the ones below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import raypipe

PACKAGE = Path(raypipe.__file__).parent
# bottom to top; a module may import its own layer and any layer listed before it.
# rayapi holds every use of Ray's private APIs (tests/test_rayapi.py). A folder says where
# its code runs: plan/ on the driver (pure), skips/ and preprocess/ in the actors, pool/
# beside the rank's execution, loader/ on the rank and its device.
LAYERS = (
    "rayapi",
    "localnode",
    "config",
    "formats",
    "plan",
    "skips",
    "preprocess",
    "pool",
    "loader",
    "train",
    "cli",
)


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
    """Every raypipe module ``path`` (the module ``name``) imports, at the top or inside a
    function: absolute, relative (``from ..train import x``) or by ``importlib``."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("raypipe"))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: against the module's own package
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                module = f"{base}.{module}" if module else base
            if module == "raypipe" or (node.level and not node.module):
                # `from raypipe import x` / `from . import x`: x is a module or a name
                found.update(f"{module}.{a.name}" for a in node.names)
            elif module.startswith("raypipe"):
                found.add(module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
              == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and str(node.args[0].value).startswith("raypipe")):  # fmt: skip
            found.add(node.args[0].value)
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
    assert raypipe_imports(bad, "raypipe.preprocess.m") == {"raypipe.train.ddp"}
    assert layer_of("raypipe.train.ddp") > layer_of("raypipe.preprocess.m")


def test_the_checker_sees_relative_and_importlib_imports(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("from ..train.ddp import train_ddp\nfrom . import region\nimport importlib\n"
                   "importlib.import_module('raypipe.loader.pipeline')\n")  # fmt: skip
    found = raypipe_imports(bad, "raypipe.preprocess.m")
    assert found == {"raypipe.train.ddp", "raypipe.preprocess.region", "raypipe.loader.pipeline"}
    init = tmp_path / "__init__.py"
    init.write_text("from .decode import crop_chw\n")
    assert raypipe_imports(init, "raypipe.preprocess") == {"raypipe.preprocess.decode"}


def test_an_import_from_the_package_front_door_is_an_upward_import(tmp_path):
    """`from raypipe import Pipeline` (or `import raypipe`) runs raypipe/__init__.py, which
    imports every layer: from any layer it reaches above."""
    bad = tmp_path / "m.py"
    bad.write_text("import raypipe\nfrom raypipe import Pipeline\nfrom raypipe import localnode\n")
    found = raypipe_imports(bad, "raypipe.preprocess.m")
    assert found == {"raypipe", "raypipe.Pipeline", "raypipe.localnode"}
    own = layer_of("raypipe.preprocess.m")
    assert {m for m in found if imported_layer(m) > own} == {"raypipe", "raypipe.Pipeline"}
    assert imported_layer("raypipe.localnode") == LAYERS.index("localnode")


MAX_LINES = 300  # past this a module is probably two (docs/design.md, Layout)
MAX_FLOORS = 4  # raypipe/<layer>/<group>/<module>.py: no deeper than the package was


def test_every_module_is_small_and_no_folder_deeper_than_the_house():
    long = {
        n: lines for n, p in modules() if (lines := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
    deep = [n for n, p in modules() if len(p.relative_to(PACKAGE.parent).parts) > MAX_FLOORS]
    assert not deep, f"modules deeper than raypipe/<layer>/<group>/: {deep}"
