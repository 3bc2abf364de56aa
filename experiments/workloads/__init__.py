"""The paper's end-to-end workloads (§6, Figs. 5 and 6) as jsgl programs, each with its data.

A `Workload` is a record: the program (an `sgl.function`), how to build the arguments of n programs from
real data (or, for the two agent workloads the paper replays from recorded traces, trace-shaped synthetic
inputs, said so in `source`), and the variables every finished program sets. `bench_workloads.py`
measures them as the paper defines: throughput (programs/s with a batch big enough to fill the engine)
and latency (one program alone).

    from jsgl.experiments.workloads import get_workload, workload_names
    w = get_workload("mmlu")
    states = w.program.run_batch(w.inputs(64), **w.sampling)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Modules defining the workloads, in the order of the paper's Fig. 5.
_MODULES = ("few_shot", "agents", "reasoning", "judge_json", "chat", "rag")


@dataclass(frozen=True)
class Workload:
    name: str  # the CLI name, e.g. "hellaswag"
    title: str  # the paper's label, e.g. "HellaSwag (20-shot)"
    source: str  # where the inputs come from (dataset and package, or "synthetic: ...")
    program: Any  # an sgl.function
    inputs: Callable[[int], list[dict[str, Any]]]  # the arguments of n programs (deterministic)
    outputs: tuple[str, ...]  # variables each finished program has set
    programs: int  # the throughput batch on the default model (CPU)
    quick_programs: int = 4  # `--quick`
    latency_programs: int = 3  # programs timed one at a time for the latency
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 0.0})
    note: str = ""  # how this differs from the paper's setup


_REGISTRY: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    if workload.name in _REGISTRY:
        raise ValueError(f"workload {workload.name!r} registered twice")
    _REGISTRY[workload.name] = workload
    return workload


def _load_all() -> None:
    for module in _MODULES:
        importlib.import_module(f"{__name__}.{module}")


def workload_names() -> list[str]:
    _load_all()
    return list(_REGISTRY)


def get_workload(name: str) -> Workload:
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; choose from {', '.join(_REGISTRY)}") from None
