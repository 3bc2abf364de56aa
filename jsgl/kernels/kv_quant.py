"""The 8-bit KV format (``--kv-dtype int8``): int8 values with one float32 scale per token and KV head.

A pool of this format is an :class:`Int8Pool`, ``values [Hkv, N, D] int8`` beside ``scales [Hkv, N]``, in
place of a plain ``[Hkv, N, D]`` array. Each new token's K (and V) row of a head is stored as
``round(x / s)`` with ``s = max|x| / 127`` (symmetric absmax, as vLLM's and SGLang's per-token int8 KV),
and read back as ``values * s``: the rounding error of an element is at most ``s / 2``, under 0.4% of the
row's largest magnitude. A token costs ``D + 4`` bytes per head instead of ``4 D`` (float32) or ``2 D``
(bfloat16): 3.8x float32's slots for SmolLM2's ``D = 64``, 3.9x at Llama-3's 128.

Every attention path reads it through :func:`gather` (the native path) or by dequantizing the gathered
rows in-kernel (Pallas); the model writes it through :func:`write` (XLA's scatter), or on TPU through the backend's
kernel (:func:`jsgl.kernels.tpu_kv_write.write_rows`, the same contract, quantizing with :func:`quantize`). The CPU
kernels read float32 pools only, so an engine with this format attends through the native path on CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

INT8_MAX = 127.0
SCALE_BYTES = 4  # the float32 scale of one token's row of one head


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Pool:
    """One layer's K (or V) pool in the 8-bit format."""

    values: jax.Array  # [Hkv, N, D] int8
    scales: jax.Array  # [Hkv, N] float32

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical pool's shape, ``[Hkv, N, D]`` (what code written for a plain pool reads)."""
        return self.values.shape

    @property
    def dtype(self) -> Any:
        return self.values.dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerPool:
    """Layer ``layer`` of the pools of every layer stacked as ``[Hkv, L, N, D]`` (an :class:`Int8Pool` of stacked
    values ``[Hkv, L, N, D]`` and scales ``[Hkv, L, N]`` in the 8-bit format): what one iteration of a scanned
    forward reads and writes. Writes and gathers index the stack at the layer; the layer is never sliced out (a
    copy of it). The layer axis sits after the heads, so a gather needs no transpose and tensor parallelism splits
    the stack over its leading (head) axis as it does a layer's pool."""

    stack: jax.Array | Int8Pool
    layer: jax.Array  # int32 scalar

    @property
    def shape(self) -> tuple[int, ...]:
        """The layer's pool's shape, ``[Hkv, N, D]``."""
        shape = self.stack.shape
        return (shape[0], *shape[2:])

    @property
    def dtype(self) -> Any:
        return self.stack.dtype


KVPool = jax.Array | Int8Pool | LayerPool


def is_quantized(dtype: Any) -> bool:
    """Whether a KV dtype names the 8-bit format (stored as int8 + scales) rather than a plain float pool."""
    return jnp.dtype(dtype) == jnp.int8


def bytes_per_head_token(dtype: Any, head_dim: int) -> int:
    """Bytes one token's K (or V) row of one head takes in a pool of ``dtype``."""
    if is_quantized(dtype):
        return head_dim + SCALE_BYTES
    return head_dim * jnp.dtype(dtype).itemsize


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., D]`` -> (int8 ``[..., D]``, float32 scales ``[...]``), absmax per row; zero rows get scale 0."""
    x32 = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(x32), axis=-1) / INT8_MAX
    safe = jnp.where(scales > 0, scales, 1.0)
    values = jnp.clip(jnp.round(x32 / safe[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return values, scales


def dequantize(values: jax.Array, scales: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """int8 rows ``[..., D]`` with their scales ``[...]`` -> ``dtype`` (the multiply in float32)."""
    return (values.astype(jnp.float32) * scales[..., None].astype(jnp.float32)).astype(dtype)


def allocate(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> KVPool:
    """A zeroed pool ``[Hkv, N, D]`` (or a stack ``[Hkv, L, N, D]``) of ``dtype``; ``sharding`` (a NamedSharding
    over the heads) places it."""
    if not is_quantized(dtype):
        return jnp.zeros(shape, dtype, device=sharding)
    scale_sharding = None
    if sharding is not None:  # the scales split over heads as the values do
        scale_spec = jax.sharding.PartitionSpec(*sharding.spec[:len(shape) - 1])
        scale_sharding = jax.sharding.NamedSharding(sharding.mesh, scale_spec)
    return Int8Pool(jnp.zeros(shape, jnp.int8, device=sharding), jnp.zeros(shape[:-1], jnp.float32,
                                                                              device=scale_sharding))


def _storage(pool: KVPool) -> tuple[jax.Array | Int8Pool, tuple[Any, ...]]:
    """The arrays a pool is stored in, and the index of its layer's ``[Hkv, N, ...]`` within them."""
    if isinstance(pool, LayerPool):
        return pool.stack, (slice(None), pool.layer)
    return pool, (slice(None),)


def _restored(pool: KVPool, stored: jax.Array | Int8Pool) -> KVPool:
    return LayerPool(stored, pool.layer) if isinstance(pool, LayerPool) else stored


def write(pool: KVPool, slots: jax.Array, x: jax.Array) -> KVPool:
    """The pool with ``x [T, Hkv, D]`` (the new tokens' K or V) written at ``slots [T]``: XLA's scatter (an
    attention backend's ``write`` may replace it on its platform: the TPU kernel, ``jsgl.kernels.tpu_kv_write``)."""
    rows = x.swapaxes(0, 1)  # [Hkv, T, D]
    stored, at = _storage(pool)
    at = (*at, slots)
    if isinstance(stored, Int8Pool):
        values, scales = quantize(rows)
        return _restored(pool, Int8Pool(stored.values.at[at].set(values), stored.scales.at[at].set(scales)))
    rows = rows.astype(stored.dtype)
    if stored.dtype.itemsize == 2:  # bfloat16/float16: on CPU as their bits (_on_bits)
        return _restored(pool, _on_bits(lambda p, r: p.at[at].set(r), stored, rows))
    return _restored(pool, stored.at[at].set(rows))


def gather(pool: KVPool, index: jax.Array) -> jax.Array:
    """Rows of ``index`` (slots, any shape) from every head: ``[Hkv, *index.shape, D]``, dequantized to
    float32 from the 8-bit format, as stored otherwise."""
    stored, at = _storage(pool)
    at = (*at, index)
    if isinstance(stored, Int8Pool):
        return dequantize(stored.values[at], stored.scales[at])
    if stored.dtype.itemsize == 2:
        return _on_bits(lambda p: p[at], stored)
    return stored[at]


def _on_bits(op: Any, *arrays: jax.Array) -> jax.Array:
    """``op`` over 16-bit float arrays, on CPU applied to their bits (uint16) instead. XLA's CPU backend widens a
    bfloat16 scatter or gather to float32 over the whole operand, so a step wrote through float32 copies of every
    pool: at batch 16, 374 ms a step with a 23k-slot bfloat16 pool, 76 ms with a 2.3k-slot one. On the bits
    (XLA:CPU still copies them once each way: 214 ms) it is the same data movement. Elsewhere (GPU, TPU) ``op``
    runs on the floats as they are."""
    dtype = arrays[0].dtype

    def on_bits(*xs: jax.Array) -> jax.Array:
        return _from_bits(op(*(jax.lax.bitcast_convert_type(x, jnp.uint16) for x in xs)), dtype)

    return jax.lax.platform_dependent(*arrays, cpu=on_bits, default=op)


def _from_bits(x: jax.Array, dtype: Any) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype)
