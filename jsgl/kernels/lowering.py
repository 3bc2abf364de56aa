"""Lowering a jitted step for a platform this machine does not have (CUDA, TPU), as tests and benchmarks do.

From jax 0.11 a Pallas kernel lowered for a GPU the process cannot see must be told which GPU it targets:
an abstract device inside an abstract mesh (`jax.sharding.use_abstract_mesh`). Under tensor parallelism that
mesh is the real mesh's axes with the abstract device swapped in, so `shard_map` sees the mesh it was built on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh

# The devices lowering targets stand for when none is present: what a researcher most likely runs on.
TARGET_KINDS = {"cuda": ("NVIDIA H100", 132, "gpu"), "tpu": ("TPU v5 lite", 1, "tpu")}


@contextlib.contextmanager
def abstract_target(platform: str, mesh: Mesh | None = None) -> Iterator[None]:
    """Lower for ``platform`` (``cuda``/``tpu``) from here: a no-op where the default backend already is it."""
    backend = {"cuda": "gpu"}.get(platform, platform)
    if platform not in TARGET_KINDS or jax.default_backend() == backend:
        yield
        return
    kind, cores, device_platform = TARGET_KINDS[platform]
    device = AbstractDevice(device_kind=kind, num_cores=cores, platform=device_platform)
    if mesh is None:
        abstract = AbstractMesh((1,), ("_target",), axis_types=(AxisType.Auto,), abstract_device=device)
    else:
        abstract = mesh.abstract_mesh.update(abstract_device=device)
    with jax.sharding.use_abstract_mesh(abstract):
        yield


def lower_for(fn: Any, *args: Any, platform: str, mesh: Mesh | None = None, **kwargs: Any) -> jax.stages.Lowered:
    """``fn`` (jitted) traced on ``args`` (arrays or `jax.ShapeDtypeStruct`s) and lowered for ``platform``."""
    with abstract_target(platform, mesh):
        return fn.trace(*args, **kwargs).lower(lowering_platforms=(platform,))
