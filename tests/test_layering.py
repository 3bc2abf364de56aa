"""The dependency direction of docs/architecture.md, checked on every import statement (function-local
ones included): lang -> engine -> (radix, fsm, model -> kernels); nothing below imports from above.
`jsgl.errors` and `jsgl.paths` sit at the root so that every layer can share them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jsgl"
SHARED = {"errors", "paths"}
ALLOWED = {
    "kernels": {"kernels"},
    "radix": {"radix"},
    "model": {"model", "kernels"},
    "fsm": {"fsm", "model"},  # model: only the tokenizer's stop ids, imported lazily (build workers skip it)
    "engine": {"engine", "radix", "fsm", "model", "kernels"},
}


def jsgl_imports(path: Path) -> set[str]:
    """The jsgl subpackages (first component under jsgl) that a module imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "jsgl" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_layer_imports_only_what_is_below_it(package):
    wrong = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = jsgl_imports(path) - ALLOWED[package] - SHARED
        if bad:
            wrong[str(path.relative_to(ROOT))] = sorted(bad)
    assert not wrong, f"imports against the architecture's direction: {wrong}"


def test_the_checker_sees_violations(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom jsgl.engine.request import X\n\ndef f():\n    import jsgl.server.app\n")
    assert jsgl_imports(module) == {"engine", "server"}


def test_every_package_is_installed():
    """pyproject.toml lists the packages by hand (experiments/ installs as jsgl.experiments): a new
    subpackage missing from the list would be absent from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {"jsgl"} | {f"jsgl.{p.parent.name}" for p in ROOT.glob("*/__init__.py")}
    experiments = ROOT.parent / "experiments"
    on_disk |= {"jsgl.experiments"} | {f"jsgl.experiments.{p.parent.name}" for p in experiments.glob("*/__init__.py")}
    assert on_disk == listed
