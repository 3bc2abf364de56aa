"""What `pip install "jsgl[cuda12]"` (cuda13, tpu) would install resolves, by pip's own resolver (a dry run: no CUDA
or libtpu is downloaded beyond its metadata), to a JAX inside jsgl's range with the accelerator's plugin."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import pypi_reachable
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).parent.parent / "pyproject.toml"
PLUGINS = {"cuda12": "jax-cuda12-plugin", "cuda13": "jax-cuda13-plugin", "tpu": "libtpu"}

pytestmark = pytest.mark.slow


def test_accelerator_extras_resolve(tmp_path):
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = project["optional-dependencies"]
    assert set(PLUGINS) <= set(extras)
    jax_range = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "jax").specifier
    for name in PLUGINS:  # each extra is JAX with that extra, in the same range as the base dependency
        (requirement,) = (Requirement(r) for r in extras[name])
        assert requirement.name == "jax" and requirement.extras == {name} and requirement.specifier == jax_range
    if not pypi_reachable():
        pytest.skip("PyPI is unreachable: cannot resolve the extras")
    report = tmp_path / "report.json"
    # All three in one resolve (one JAX with the union of the extras): ~35 s, mostly metadata downloads.
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--disable-pip-version-check", "--report", str(report),
                           *(r for name in PLUGINS for r in extras[name])],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    versions = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert versions["jax"] in jax_range and versions["jaxlib"] in jax_range, versions
    for name, plugin in PLUGINS.items():
        assert plugin in versions, (name, sorted(versions))
