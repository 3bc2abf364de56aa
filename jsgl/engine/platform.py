"""Where the engine runs, and the defaults that follow from it (SGLang's choices on an accelerator).

On a GPU or TPU: pages of 16 slots, a KV pool sized from the device (``mem_fraction`` of its memory for
weights + KV) and mixed prefill+decode steps; on the CPU: token-granular pages and a 1 GiB pool, as the paper's
runtime, and prefill and decode steps apart. Asking for a device
that is not there (``--device gpu`` on a machine whose JAX sees only its CPU) is an error naming what to
install, never a silent CPU run.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax

from jsgl.errors import ConfigError

DEVICES = ("auto", "cpu", "gpu", "tpu")
ACCELERATOR_PAGE_SIZE = 16  # SGLang's and vLLM's page on GPUs; the Pallas kernels read a page per K/V row block
ACCELERATOR_MEM_FRACTION = 0.85  # of the device, for weights + KV (SGLang's mem_fraction_static on large cards)
CPU_KV_CACHE_GB = 1.0
# JAX preallocates this fraction of a GPU unless told otherwise (XLA_PYTHON_CLIENT_MEM_FRACTION).
JAX_GPU_PREALLOCATION = 0.75
# What the `jsgl` command asks JAX for on a GPU before it starts: room for mem_fraction plus the step's own.
CLI_GPU_PREALLOCATION = "0.95"
INSTALL_HINT = {"gpu": 'pip install "jsgl[cuda12]" (or [cuda13])', "tpu": 'pip install "jsgl[tpu]"'}


@dataclasses.dataclass(frozen=True)
class Platform:
    name: str  # cpu | gpu | tpu (JAX's backend name)
    device_kind: str
    device_count: int

    @property
    def accelerator(self) -> bool:
        return self.name != "cpu"


def current_platform(requested: str = "auto") -> Platform:
    """The platform JAX's default backend is on, checked against ``requested`` (``auto`` takes any)."""
    if requested not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, not {requested!r}")
    devices = jax.devices()
    found = Platform(jax.default_backend(), devices[0].device_kind, len(devices))
    if requested not in ("auto", found.name):
        raise ConfigError(f"device {requested!r} was asked for, but JAX's default backend is {found.name} "
                          f"({found.device_kind}): install a {requested} build of JAX ({INSTALL_HINT[requested]}) "
                          "or drop --device")
    return found


@dataclasses.dataclass(frozen=True)
class PlatformDefaults:
    """What ``None`` in an EngineConfig field means on this platform."""

    page_size: int
    kv_cache_gb: float | None  # None: size the pool from mem_fraction
    mem_fraction: float | None
    mixed_prefill_tokens: int  # 0: no mixed steps


def default_mixed_prefill_tokens(platform: Platform, chunked_prefill_size: int, max_running_requests: int) -> int:
    """Mixed steps where they pay: on an accelerator a step's cost is mostly reading the weights until it holds a
    few hundred tokens, so prefill riding in a decode step costs little and saves a step; the running decodes and
    the prefill share the chunk's token budget (vLLM's), so with the defaults no step is larger than a prefill chunk
    (with more running requests than half a chunk, ``max_step_tokens``). On CPU a step
    costs about its tokens: mixing saves nothing measurable and a small share slows prefill (docs/performance.md)."""
    return mixed_step_prefill(chunked_prefill_size, max_running_requests) if platform.accelerator else 0


def mixed_step_prefill(chunked_prefill_size: int, max_running_requests: int) -> int:
    """The prefill tokens a mixed step carries beside ``max_running_requests`` decodes: the chunk's budget less
    theirs, at least half a chunk."""
    return max(chunked_prefill_size - max_running_requests, chunked_prefill_size // 2)


def max_step_tokens(chunked_prefill_size: int, mixed_prefill_tokens: int, max_running_requests: int) -> int:
    """The most new tokens one step holds (what the memory plan sizes activations for): a prefill chunk, or a mixed
    step's prefill beside every running request's token, whichever is larger."""
    return max(chunked_prefill_size, mixed_prefill_tokens + max_running_requests if mixed_prefill_tokens else 0)


def resolve_defaults(platform: Platform, *, page_size: int | None, kv_cache_gb: float | None,
                     num_kv_slots: int | None, mem_fraction: float | None, mixed_prefill_tokens: int | None = None,
                     chunked_prefill_size: int = 512, max_running_requests: int = 64) -> PlatformDefaults:
    """Fill the fields the user left unset: an explicit pool size or fraction always wins."""
    if page_size is None:
        page_size = ACCELERATOR_PAGE_SIZE if platform.accelerator else 1
    if kv_cache_gb is None and num_kv_slots is None and mem_fraction is None:
        if platform.accelerator:
            mem_fraction = ACCELERATOR_MEM_FRACTION
        else:
            kv_cache_gb = CPU_KV_CACHE_GB
    if mixed_prefill_tokens is None:
        mixed_prefill_tokens = default_mixed_prefill_tokens(platform, chunked_prefill_size, max_running_requests)
    return PlatformDefaults(page_size, kv_cache_gb, mem_fraction, mixed_prefill_tokens)


def gpu_preallocation() -> float | None:
    """The fraction of a GPU that JAX's allocator takes (its ``bytes_limit``), or None when it does not
    preallocate a fraction (then the limit is not a fraction of the card we can undo)."""
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() in ("false", "0") \
            or os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return None
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_GPU_PREALLOCATION))


def prepare_gpu_allocator() -> None:
    """Before JAX starts (the `jsgl` command's first act): let its allocator take most of a GPU, so a
    ``mem_fraction`` of the device fits in it. A value the user set stays."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", CLI_GPU_PREALLOCATION)


def describe(platform: Platform, **backends: Any) -> dict[str, Any]:
    """What the engine reports it runs on (logs, ``stats()``, ``/get_server_info``)."""
    return {"platform": platform.name, "device_kind": platform.device_kind, "device_count": platform.device_count,
            **backends}


# On a TPU the pool's slot count is a whole number of 128-slot blocks: what the K/V write kernel tiles in every KV
# format (jsgl.kernels.tpu_kv_write.fits; else the model writes through XLA's scatter, slow there).
TPU_SLOT_BLOCK = 128


def pool_slots(num_slots: int, page_size: int, platform: str) -> int:
    """The pool's slot count: ``num_slots`` rounded down to whole pages (whole 128-slot blocks on a TPU), two at
    least."""
    granule = math.lcm(page_size, TPU_SLOT_BLOCK) if platform == "tpu" else page_size
    return max(num_slots - num_slots % granule, 2 * granule)
