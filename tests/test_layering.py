"""The dependency direction of docs/architecture.md, checked on every import statement (function-local
ones included): lang -> engine -> (radix, fsm, model -> kernels); nothing below imports from above.
`jsgl.errors`, `jsgl.paths` and `jsgl.cache_security` sit at the root so that every layer can share them.

The two front ends sit side by side on the engine, and neither imports the other: lang (the DSL) reaches the
runtime only through the engine's API (`Runtime`) or over HTTP (`RuntimeEndpoint`), never model/, kernels/,
radix/ or fsm/ directly; server (the HTTP API) calls the engine and uses fsm/'s request-side helpers (a tool's
JSON schema as a regex, token bytes), never model/, kernels/ or radix/. The one bridge is server/launch.py, the
launcher (SGLang's `Runtime`): it hands the server it started to the DSL as a `RuntimeEndpoint`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jsgl"
SHARED = {"errors", "paths", "cache_security"}
ALLOWED = {
    "kernels": {"kernels"},
    "radix": {"radix"},
    "model": {"model", "kernels"},
    "fsm": {"fsm", "model"},  # model: only the tokenizer's stop ids, imported lazily (build workers skip it)
    "engine": {"engine", "radix", "fsm", "model", "kernels"},
    "lang": {"lang", "engine"},
    "server": {"server", "engine", "fsm"},
}
# Single modules allowed one more package than their layer (the module docstring says why).
EXCEPTIONS = {"server/launch.py": {"lang"}}


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


def wrong_imports(module: str, imports: set[str]) -> set[str]:
    """What a module (its path under jsgl/, e.g. "lang/api.py") imports against its layer's rule."""
    return imports - ALLOWED[module.split("/")[0]] - SHARED - EXCEPTIONS.get(module, set())


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_layer_imports_only_what_is_below_it(package):
    wrong = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        bad = wrong_imports(module, jsgl_imports(path))
        if bad:
            wrong[module] = sorted(bad)
    assert not wrong, f"imports against the architecture's direction: {wrong}"


def test_every_package_has_a_rule():
    assert {p.parent.name for p in ROOT.glob("*/__init__.py")} == set(ALLOWED)
    assert all((ROOT / module).exists() for module in EXCEPTIONS)  # an exception outlives no module


def test_the_checker_sees_violations(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom jsgl.engine.request import X\n\ndef f():\n    import jsgl.server.app\n")
    assert jsgl_imports(module) == {"engine", "server"}
    # The DSL reaching past the engine, even lazily, is caught; so is the server reaching for the model or the DSL.
    module.write_text("from jsgl.engine import Engine\n\ndef f():\n    from jsgl.model.llama import forward\n"
                      "    import jsgl.kernels.attention\n")
    assert wrong_imports("lang/m.py", jsgl_imports(module)) == {"model", "kernels"}
    module.write_text("import jsgl.fsm\nfrom jsgl.engine.request import X\nfrom jsgl.lang.endpoint_backend import E\n"
                      "from jsgl.radix import RadixCache\n")
    assert wrong_imports("server/app.py", jsgl_imports(module)) == {"lang", "radix"}
    assert wrong_imports("server/launch.py", jsgl_imports(module)) == {"radix"}  # its exception is lang alone


def test_every_package_is_installed():
    """pyproject.toml lists the packages by hand (experiments/ installs as jsgl.experiments): a new
    subpackage missing from the list would be absent from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {"jsgl"} | {f"jsgl.{p.parent.name}" for p in ROOT.glob("*/__init__.py")}
    experiments = ROOT.parent / "experiments"
    on_disk |= {"jsgl.experiments"} | {f"jsgl.experiments.{p.parent.name}" for p in experiments.glob("*/__init__.py")}
    assert on_disk == listed
