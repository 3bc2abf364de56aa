"""jsgl: SGLang (structured LM programs, RadixAttention, compressed-FSM decoding) rebuilt in JAX.

Names are imported on first use (PEP 562), so `import jsgl.fsm` (e.g. in a constraint-build worker
process) does not pull in JAX and the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_ENGINE_NAMES = {
    "EngineConfig": "jsgl.engine.config",
    "Engine": "jsgl.engine.engine",
    "RequestHandle": "jsgl.engine.handle",
    "FinishReason": "jsgl.engine.request",
    "GenerateOutput": "jsgl.engine.request",
    "SamplingParams": "jsgl.engine.request",
    "InvalidRequestError": "jsgl.errors",
}


def _lang_names() -> list[str]:
    # The frontend language (SGLang-compatible names): `import jsgl as sgl` then `@sgl.function`, `sgl.gen`, ...
    return list(importlib.import_module("jsgl.lang").__all__)


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        value = getattr(importlib.import_module(_ENGINE_NAMES[name]), name)
    elif name == "__all__":
        value = [*_ENGINE_NAMES, *_lang_names()]
    elif not name.startswith("__") and name in _lang_names():
        value = getattr(importlib.import_module("jsgl.lang"), name)
    else:
        raise AttributeError(f"module 'jsgl' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_ENGINE_NAMES, *_lang_names()})
