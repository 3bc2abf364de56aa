"""Where jsgl keeps what it computes once: converted weights, tokenizers, compiled kernels and programs,
FSM indexes. At the package root so that every layer (model, kernels, fsm, engine) can use it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`JSGL_CACHE_DIR`, or ~/.cache/jsgl; created on first use."""
    root = Path(os.environ.get("JSGL_CACHE_DIR", Path.home() / ".cache" / "jsgl"))
    root.mkdir(parents=True, exist_ok=True)
    return root
