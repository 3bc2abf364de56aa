"""Memory planning: how many KV slots fit on a device beside the weights and a step's activations.

``--mem-fraction F`` (SGLang's ``mem_fraction_static``) gives the engine F of each device's memory for weights
plus KV pool; what is left of that after the weights and an activation reserve becomes KV slots. F is of the
whole device: on a GPU its size is inferred from the allocator's ``bytes_limit`` and the fraction JAX
preallocated (75% unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise; the `jsgl` command asks for 95%), and
the plan never exceeds that limit; on a TPU the limit is the device; on CPU the host's available RAM. On an
accelerator F defaults to 0.85 (jsgl.engine.platform); on CPU the pool is ``--kv-cache-gb`` (or
``--num-kv-slots``). ``plan_memory`` needs only the model's config, so ``jsgl serve --dry-run --model DIR
--tp N`` prints the plan without loading a weight.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jsgl.engine.kv_pool import slots_for_memory
from jsgl.engine.platform import CPU_KV_CACHE_GB, gpu_preallocation
from jsgl.errors import ConfigError
from jsgl.kernels import kv_quant
from jsgl.model.config import ModelConfig, read_hf_config
from jsgl.model.llama import param_shapes
from jsgl.model.registry import resolve_model_path
from jsgl.model.sharding import TensorParallel, head_layout

WEIGHT_BYTES = 4  # float32: the default itemsize of weights and KV (bfloat16/float16: 2)
DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_DTYPES = (*DTYPES, "int8")  # int8: the 8-bit KV format, int8 values with per-token scales (jsgl.kernels.kv_quant)


def resolve_dtypes(dtype: str, kv_dtype: str, platform: str | None = None) -> tuple[Any, Any]:
    """The (weights and activations, KV pool) dtypes. ``auto``: float32 on CPU (its kernels are float32),
    bfloat16 on GPU/TPU; the KV pool's ``auto`` follows the weights. Matmuls accumulate in float32 whatever
    the dtype; norms, RoPE, softmax, sampling and logprobs compute in float32 (jsgl.model.llama). ``kv_dtype``
    int8 is the 8-bit KV format."""
    for name, value, allowed in (("dtype", dtype, DTYPES), ("kv_dtype", kv_dtype, KV_DTYPES)):
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    platform = platform or jax.default_backend()
    weights = jnp.dtype(dtype if dtype != "auto" else ("float32" if platform == "cpu" else "bfloat16"))
    return weights, jnp.dtype(kv_dtype) if kv_dtype != "auto" else weights
# Activations of the largest step, per token of it: the residual stream, q|k|v, the MLP's gate|up, and the
# logits of its sampled rows, with XLA's temporaries (~3x, measured as peak minus weights on CPU).
ACTIVATION_FACTOR = 3
# Of an allocator's limit, the most a plan takes: the rest stays for XLA's temporaries and fragmentation.
ALLOCATOR_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    total: int  # the device's memory
    usable: int  # what its allocator may hand out (JAX's preallocated share of a GPU)
    how: str  # what was measured, and how


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    device: str  # what was measured, and how
    device_bytes: int  # per device
    tp: int
    mem_fraction: float | None
    weight_bytes: int  # per device
    activation_bytes: int  # per device, reserved for the largest step
    kv_bytes_per_token: int  # per device
    num_slots: int  # KV token slots (each device holds its heads of every slot)

    @property
    def kv_bytes(self) -> int:
        return self.num_slots * self.kv_bytes_per_token

    @property
    def free_bytes(self) -> int:
        return self.device_bytes - self.weight_bytes - self.activation_bytes - self.kv_bytes

    def render(self) -> str:
        gib = lambda n: f"{n / (1 << 30):8.2f} GiB"  # noqa: E731
        budget = (f"{self.mem_fraction:.2f} of it for weights + KV" if self.mem_fraction is not None
                  else "KV pool from --kv-cache-gb / --num-kv-slots")
        return "\n".join([
            f"device        {gib(self.device_bytes)}  per device ({self.device}); tp={self.tp}; {budget}",
            f"weights       {gib(self.weight_bytes)}  per device",
            f"activations   {gib(self.activation_bytes)}  reserved per device (largest step)",
            f"KV pool       {gib(self.kv_bytes)}  per device: {self.num_slots:,} token slots "
            f"x {self.kv_bytes_per_token:,} B",
            f"left          {gib(self.free_bytes)}  per device",
        ])


def load_config(model: str | os.PathLike) -> ModelConfig:
    """The model's config alone (an HF folder's config.json, or a GGUF's metadata): no tensor is read (nor, for a
    Hub id, downloaded)."""
    path = resolve_model_path(model, config_only=True)
    if path.is_dir():
        return ModelConfig.from_hf(read_hf_config(path))
    import gguf

    from jsgl.model.loader import _gguf_config

    return ModelConfig.from_hf(_gguf_config(gguf.GGUFReader(str(path))))


def device_memory() -> DeviceMemory:
    """The first device's memory and what its allocator may use of it."""
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        limit = int((device.memory_stats() or {}).get("bytes_limit", 0))
        if limit:
            share = gpu_preallocation() if device.platform == "gpu" else None
            if share:
                return DeviceMemory(int(limit / share), limit, f"{device.device_kind}: allocator bytes_limit "
                                    f"{limit / (1 << 30):.2f} GiB = {share:.2f} of the device")
            return DeviceMemory(limit, limit, f"{device.device_kind}: allocator bytes_limit")
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
            return DeviceMemory(available, available, "cpu: host MemAvailable")
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return DeviceMemory(available, available, "cpu: available pages")


def weight_bytes_per_device(config: ModelConfig, tp: int, itemsize: int = WEIGHT_BYTES) -> int:
    """Bytes of weights on each device, with tensor parallelism's padding and replicated leaves."""
    if tp == 1:
        return sum(x.size * itemsize for x in jax.tree.leaves(param_shapes(config)))
    layout = head_layout(config.num_heads, config.num_kv_heads, tp)
    padded = dataclasses.replace(config, num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads,
                                 intermediate_size=-(-config.intermediate_size // tp) * tp)
    shapes = param_shapes(padded)
    specs = TensorParallel(None, layout, padded).param_specs(shapes)  # no mesh: only the specs' axes
    sharded = lambda spec: any(axis is not None for axis in spec)  # noqa: E731
    leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    return sum(x.size * itemsize // (tp if sharded(spec) else 1)
               for x, spec in zip(jax.tree.leaves(shapes), leaves))


def plan_memory(config: ModelConfig, *, tp: int = 1, mem_fraction: float | None = None,
                kv_cache_gb: float | None = 1.0, num_kv_slots: int | None = None, max_step_tokens: int = 512,
                max_batch: int = 64,
                device_bytes: tuple[int, str] | None = None, weight_itemsize: int = WEIGHT_BYTES,
                kv_dtype: Any = jnp.float32) -> MemoryPlan:
    """The KV pool's size and what each device holds. ``device_bytes`` (bytes, how) overrides the measured
    device, all of it usable."""
    memory = DeviceMemory(device_bytes[0], device_bytes[0], device_bytes[1]) if device_bytes else device_memory()
    total, how = memory.total, memory.how
    weights = weight_bytes_per_device(config, tp, weight_itemsize)
    kv_heads = head_layout(config.num_heads, config.num_kv_heads, tp).num_kv_heads if tp > 1 else config.num_kv_heads
    per_token = 2 * config.num_layers * (kv_heads // tp) * kv_quant.bytes_per_head_token(kv_dtype, config.head_dim)
    width = config.hidden_size + (config.num_heads + 2 * config.num_kv_heads) * config.head_dim \
        + 2 * config.intermediate_size
    activations = ACTIVATION_FACTOR * weight_itemsize * (max_step_tokens * width // tp
                                                      + max_batch * config.vocab_size)
    if num_kv_slots is not None:
        slots = num_kv_slots
    elif mem_fraction is not None:
        if not 0 < mem_fraction <= 1:
            raise ConfigError(f"mem_fraction must be in (0, 1], not {mem_fraction}")
        budget = int(total * mem_fraction)
        if budget > ALLOCATOR_SHARE * memory.usable:  # the allocator cannot hand out more than its limit
            budget = int(ALLOCATOR_SHARE * memory.usable)
            how += f"; mem_fraction {mem_fraction} capped by it"
        room = budget - weights - activations
        if room < per_token * 1024:
            raise ConfigError(f"mem_fraction {mem_fraction}: {budget / (1 << 30):.2f} GiB of the device "
                              f"leaves no room for a KV pool beside {weights / (1 << 30):.2f} GiB of weights and "
                              f"{activations / (1 << 30):.2f} GiB of activations (tp={tp}): raise --mem-fraction, "
                              "or a larger --tp splits the weights over more devices")
        slots = room // per_token
    else:
        slots = slots_for_memory(config, CPU_KV_CACHE_GB if kv_cache_gb is None else kv_cache_gb, dtype=kv_dtype)
    return MemoryPlan(how, total, tp, mem_fraction, weights, activations, per_token, slots)
