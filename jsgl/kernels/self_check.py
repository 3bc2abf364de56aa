"""An attention kernel's first call on a device, checked against the pure-JAX path before an engine relies on it.

jsgl's Pallas kernels are checked on CPU in the interpreter and by lowering; the device's own compiler (Triton on
a GPU, Mosaic on a TPU) sees them first on the device. So an engine on an accelerator runs one small ragged batch
(two decode rows, an extend over a cached prefix, a padding row; pages shuffled) through the kernel it picked and
through ``native``, at the model's head counts, head_dim, KV format and page size, before its first step: a
kernel the device's compiler refuses, or one that computes wrong numbers, is found in a second, not mid-serve. A
backend that writes K/V through its own kernel (``write``: the TPU's) writes the batch's pools through it too, which
must equal ``kv_quant.write``'s bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jsgl.kernels import kv_quant
from jsgl.kernels.attention import AttentionMetadata, get_attention_backend, native_paged_attention

# Max abs error against native on the same pools, outputs of magnitude ~1: bfloat16 rounding of q, p and the
# output (each ~4e-3 relative) with room; float32 kernels come in far under it.
TOLERANCE = 5e-2


class KernelCheckFailed(RuntimeError):
    """The kernel did not compile or run on this device, or its output differs from the native path's."""


def check_batch(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: Any, page_size: int,
                dtype: Any = jnp.bfloat16, seed: int = 0, write: Any = kv_quant.write,
                ) -> tuple[jax.Array, Any, Any, AttentionMetadata]:
    """``(q, k_pool, v_pool, meta)`` of a small ragged batch: decode at ``page + 1`` and at 1 cached position, an
    extend of 3 tokens over ``2 * page - 1`` cached ones, and a padding row, over shuffled pages (page 0 reserved).
    The pools are written by ``write`` (``kv_quant.write``'s contract)."""
    rng = np.random.default_rng(seed)
    kv_lens = np.array([page_size + 1, 1, 2 * page_size + 2, 0], np.int32)
    q_lens = np.array([1, 1, 3, 0], np.int32)
    width = -(-int(kv_lens.max()) // page_size)
    # Whole 128-slot blocks, as an engine on a TPU sizes its pool, so the TPU's K/V write kernel applies.
    num_slots = -(-(len(kv_lens) * width + 1) * page_size // 128) * 128
    num_pages = num_slots // page_size
    pages = rng.permutation(np.arange(1, num_pages, dtype=np.int32))[:len(kv_lens) * width].reshape(len(kv_lens), width)
    table = np.where(np.arange(width)[None, :] * page_size < kv_lens[:, None], pages, 0).astype(np.int32)
    slots = table[:, :, None] * page_size + np.arange(page_size, dtype=np.int32)
    slots = slots.reshape(len(kv_lens), -1)
    written = np.concatenate([slots[b, :kv_lens[b]] for b in range(len(kv_lens))])
    pool_shape = (num_kv_heads, num_pages * page_size, head_dim)
    k_new, v_new = (jnp.asarray(rng.standard_normal((len(written), num_kv_heads, head_dim)), dtype)
                    for _ in range(2))
    k_pool = write(kv_quant.allocate(pool_shape, kv_dtype), jnp.asarray(written), k_new)
    v_pool = write(kv_quant.allocate(pool_shape, kv_dtype), jnp.asarray(written), v_new)
    q_start = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    positions = np.concatenate([np.arange(kv_lens[b] - q_lens[b], kv_lens[b]) for b in range(len(kv_lens))])
    num_tokens = int(q_lens.sum())
    q = jnp.asarray(rng.standard_normal((num_tokens, num_heads, head_dim)), dtype)
    meta = AttentionMetadata(positions=jnp.asarray(positions, jnp.int32), q_start=jnp.asarray(q_start),
                             q_len=jnp.asarray(q_lens), block_table=jnp.asarray(table),
                             kv_lens=jnp.asarray(kv_lens), max_q_len=int(q_lens.max()), page_size=page_size)
    return q, k_pool, v_pool, meta


def check_attention_kernel(name: str, *, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: Any,
                           page_size: int, dtype: Any = jnp.bfloat16) -> float:
    """Run backend ``name`` on :func:`check_batch` where JAX runs by default (compiled there; interpreted on CPU
    hosts, as the kernels decide) and return its max abs error against ``native``; raise
    :class:`KernelCheckFailed`, saying why, if it fails to compile or run or is over :data:`TOLERANCE`."""
    q, k_pool, v_pool, meta = check_batch(num_heads, num_kv_heads, head_dim, kv_dtype, page_size, dtype)
    scale = head_dim**-0.5
    kernel = get_attention_backend(name)
    try:
        got = jax.jit(kernel.attend, static_argnums=4)(q, k_pool, v_pool, meta, scale)
        got = np.asarray(got.astype(jnp.float32))
    except Exception as error:  # any compile or runtime failure of the device's compiler is the finding
        raise KernelCheckFailed(f"{name} attention failed on {jax.devices()[0].device_kind}: "
                                f"{type(error).__name__}: {str(error).splitlines()[0][:300]}") from error
    want = np.asarray(jax.jit(native_paged_attention, static_argnums=4)(q, k_pool, v_pool, meta, scale)
                      .astype(jnp.float32))
    error = float(np.abs(got - want).max())
    if not error <= TOLERANCE:  # NaN fails too
        raise KernelCheckFailed(f"{name} attention on {jax.devices()[0].device_kind} differs from the native path "
                                f"by {error:.3g} (tolerance {TOLERANCE})")
    if kernel.write is not None:
        _check_write(name, kernel.write, (k_pool, v_pool), num_heads, num_kv_heads, head_dim, kv_dtype, page_size,
                     dtype)
    return error


def _check_write(name: str, write: Any, want: Any, *shape: Any) -> None:
    """The batch's pools written by backend ``name``'s ``write`` (jitted: compiled where JAX runs) are ``want``
    (``kv_quant.write``'s), bit for bit; else :class:`KernelCheckFailed`."""
    try:
        got = jax.device_get(check_batch(*shape, write=jax.jit(write))[1:3])
    except Exception as error:
        raise KernelCheckFailed(f"{name} K/V write failed on {jax.devices()[0].device_kind}: "
                                f"{type(error).__name__}: {str(error).splitlines()[0][:300]}") from error
    same = [np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.device_get(want)), strict=True)]
    if not all(same):
        raise KernelCheckFailed(f"{name} K/V write on {jax.devices()[0].device_kind} differs from kv_quant.write")
