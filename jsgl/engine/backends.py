"""Which kernels run the model, decided once: the attention and matmul backends, and what follows from them.

``resolve_backends`` turns the configuration's names (``auto`` included), the platform, the dtypes and the
tensor-parallel degree into a ``Backends`` record, before the weights load (they load by it: the GGUF's blocks
for ``gguf``); the runner builds its step and its step shapes from it, and ``stats()`` reports it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp

from jsgl.errors import ConfigError
from jsgl.kernels import cpu as cpu_kernels
from jsgl.kernels.attention import get_attention_backend, resolve_attention_backend
from jsgl.kernels.self_check import KernelCheckFailed, check_attention_kernel
from jsgl.model.config import ModelConfig

log = logging.getLogger(__name__)

# The kernels each accelerator's `auto` picks; their first call there is checked (kernels/self_check.py).
DEVICE_KERNELS = {"gpu": "pallas", "tpu": "tpu"}


@dataclasses.dataclass(frozen=True)
class Backends:
    attention: str  # native | cpu | pallas | tpu (kernels/attention.py's registry)
    matmul: str  # xla | packed | gguf (kernels/cpu.py)
    tp: int = 1
    # The layers as one lax.scan over stacked weights and pools (one layer compiled), or unrolled (model/llama.py)
    scanned: bool = False
    # Why `auto` fell back to native attention on this device (its kernel failed its check), else "".
    attention_fallback: str = ""

    @property
    def layers(self) -> str:
        return "scanned" if self.scanned else "unrolled"

    def ragged(self, config: ModelConfig) -> bool:
        """The CPU attention kernel on every layer (it has no sliding window): it reads each request's lengths
        from the metadata."""
        return self.attention == "cpu" and self.tp == 1 and not config.layer_windows

    def length_free(self, config: ModelConfig) -> bool:
        """A step's signature drops the attended length and an extend's new tokens per request: the kernels read
        lengths at run time (the CPU kernel when ragged; the Pallas and TPU kernels' loops stop at each request's
        length)."""
        return self.ragged(config) or self.attention in ("pallas", "tpu")

    def builds_scores(self, config: ModelConfig) -> bool:
        """Whether attention materializes a [heads, queries, keys] score array (the scheduler bounds its size):
        the native path does, and the CPU kernel's windowed layers go through it."""
        return get_attention_backend(self.attention).builds_scores or (self.attention == "cpu" and
                                                                       not self.ragged(config))


def resolve_backends(attention: str = "auto", matmul: str = "auto", *, tp: int = 1, dtype: Any = jnp.float32,
                     kv_dtype: Any = jnp.float32, page_size: int = 1, platform: str | None = None,
                     layers: str = "auto") -> Backends:
    """The backends on ``platform`` (JAX's backend name; default this process's). A choice that cannot run is an
    error naming the option to change."""
    platform = platform or jax.default_backend()
    dtype, kv_dtype = jnp.dtype(dtype), jnp.dtype(kv_dtype)
    on_cpu = platform == "cpu"
    # The CPU kernels are float32 (weights, pools and activations): under another dtype "auto" means XLA's dot,
    # and the native attention (the 8-bit KV format included). Under tensor parallelism the matmuls stay XLA's
    # (it partitions them by the shardings) and attention runs per shard: the C++ kernels do not shard.
    if attention == "auto" and on_cpu and (dtype != jnp.float32 or kv_dtype != jnp.float32 or tp > 1):
        attention = "native"
    if matmul == "auto" and on_cpu and dtype != jnp.float32:
        matmul = "xla"
    attention = resolve_attention_backend(attention, platform)
    matmul = cpu_kernels.resolve_matmul_backend(matmul, tp, platform)
    get_attention_backend(attention)  # an unknown name is refused here
    if dtype != jnp.float32 and matmul != "xla":
        raise ConfigError(f"dtype {dtype}: the CPU matmul kernels are float32; use matmul_backend=xla (or auto)")
    if attention == "cpu":
        if not cpu_kernels.available():
            raise ConfigError(f"attention_backend='cpu' needs the CPU kernels: {cpu_kernels.unavailable_reason()}")
        if dtype != jnp.float32 or kv_dtype != jnp.float32:
            raise ConfigError(f"dtype {dtype}, kv_dtype {kv_dtype}: the CPU attention kernel is float32; use "
                              "attention_backend=native (or auto)")
    if attention == "tpu" and platform != "tpu":
        raise ConfigError(f"attention_backend='tpu' is the Mosaic kernel for TPUs; this platform is {platform!r}: "
                          "use auto, native, pallas (GPU) or cpu")
    if attention == "pallas" and page_size & (page_size - 1):
        raise ConfigError(f"page_size {page_size}: the Pallas kernels read whole pages per K/V block, so the page "
                          "size must be a power of two (1, 2, 4, ..., 64)")
    return Backends(attention, matmul, tp, _scanned(layers, attention, matmul, platform))


def _scanned(layers: str, attention: str, matmul: str, platform: str) -> bool:
    """Scan the layers on a TPU (compile time that does not grow with depth; the layout TPU programs commonly use,
    MaxText's scan_layers). Unroll them on CPU, where XLA copied each layer's weights out of the stack before
    its matmuls (decode ~1.8x slower) and the C++ kernels take per-layer pools and packed weights; and on a GPU,
    where XLA of jax 0.10-0.12 may copy them too (its dynamic-slice fusion is off by default) and a scanned
    step's speed is not measured yet (docs/performance.md)."""
    if layers not in ("auto", "scanned", "unrolled"):
        raise ConfigError(f"layers must be auto, scanned or unrolled, not {layers!r}")
    if layers == "scanned" and (attention == "cpu" or matmul != "xla"):
        raise ConfigError(f"layers=scanned: the CPU kernels (attention {attention!r}, matmul {matmul!r}) take each "
                          "layer's own pools and packed weights; use attention_backend=native and matmul_backend=xla")
    return layers == "scanned" or (layers == "auto" and platform == "tpu")


def checked_on_device(backends: Backends, requested: str, config: ModelConfig, kv_dtype: Any, page_size: int,
                      platform: str) -> Backends:
    """``backends`` once the device's compiler has run its attention kernel right (``check_attention_kernel`` at
    the model's shapes, per tensor-parallel shard). Only where ``platform`` is this process's own accelerator: a
    plan for another platform (a dry run, lowering) checks nothing. A kernel named by the user that fails is an
    error; one ``auto`` picked falls back to native attention with a warning, and stats() say why."""
    if backends.attention != DEVICE_KERNELS.get(platform) or platform != jax.default_backend():
        return backends
    try:
        error = check_attention_kernel(backends.attention, num_heads=config.num_heads // backends.tp,
                                       num_kv_heads=max(1, config.num_kv_heads // backends.tp),
                                       head_dim=config.head_dim, kv_dtype=kv_dtype, page_size=page_size)
    except KernelCheckFailed as failure:
        if requested != "auto":
            raise ConfigError(f"attention_backend={requested!r}: {failure}. attention_backend=native runs on "
                              f"{platform} too (please report this failure)") from failure
        log.warning("%s; attending through the native path instead (attention_backend=native)", failure)
        return dataclasses.replace(backends, attention="native", attention_fallback=str(failure))
    log.info("%s attention checked against the native path on this device: max abs error %.2g",
             backends.attention, error)
    return backends
