"""Where jsgl keeps what it computes once: converted weights, tokenizers, compiled kernels and programs,
FSM indexes. At the package root so that every layer (model, kernels, fsm, engine) can use it."""

from __future__ import annotations

import os
from pathlib import Path

from jsgl.cache_security import ensure_private_dir


def cache_dir() -> Path:
    """`JSGL_CACHE_DIR`, or ~/.cache/jsgl; created 0700 on first use, refused if another user could write into it
    (jsgl/cache_security.py: it holds code jsgl runs)."""
    return ensure_private_dir(Path(os.environ.get("JSGL_CACHE_DIR", Path.home() / ".cache" / "jsgl")))


def cache_subdir(name: str) -> Path:
    """``cache_dir()/name``, created 0700 and checked like the root."""
    return ensure_private_dir(cache_dir() / name)
