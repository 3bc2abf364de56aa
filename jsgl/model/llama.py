"""The Llama-family forward (Llama, Mistral, Qwen2, SmolLM) as plain functions over a params pytree.

One forward serves prefill, extend-after-prefix and decode: it takes a flat batch of new tokens with
their positions and the pool slot each writes its K/V to, writes them, and attends through the
paged-attention interface of ``jsgl.kernels.attention``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jsgl.kernels.attention import AttentionFn, AttentionMetadata
from jsgl.model.config import ModelConfig

Params = dict[str, Any]
KVCache = tuple[jax.Array, jax.Array]  # K and V pools, each [num_layers, num_kv_heads, num_slots, head_dim]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + eps) * weight


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE on [T, H, hd] (HF layout; the GGUF loader undoes llama.cpp's interleaving)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _layer(
    cfg: ModelConfig,
    attention: AttentionFn,
    inv_freq: jax.Array,
    write_slots: jax.Array,
    meta: AttentionMetadata,
    h: jax.Array,
    layer: Params,
    k_all: jax.Array,
    v_all: jax.Array,
    index: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    num_tokens = h.shape[0]
    x = rms_norm(h, layer["attn_norm"], cfg.rms_norm_eps)
    q, k, v = x @ layer["wq"], x @ layer["wk"], x @ layer["wv"]
    if "bq" in layer:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q = rope(q.reshape(num_tokens, cfg.num_heads, cfg.head_dim), meta.positions, inv_freq)
    k = rope(k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim), meta.positions, inv_freq)
    v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    # Write first, then attend: the new tokens read their own K/V from the pool like the prefix.
    # Scattering straight into the all-layer pool (not into a slice put back afterwards) is what lets
    # XLA update the donated buffer in place; the slice handed to attention fuses into its gather.
    k_all = k_all.at[index, :, write_slots].set(k)
    v_all = v_all.at[index, :, write_slots].set(v)
    attn = attention(q, k_all[index], v_all[index], meta, cfg.head_dim**-0.5)
    h = h + attn.reshape(num_tokens, -1) @ layer["wo"]
    x = rms_norm(h, layer["mlp_norm"], cfg.rms_norm_eps)
    h = h + (jax.nn.silu(x @ layer["w_gate"]) * (x @ layer["w_up"])) @ layer["w_down"]
    return h, k_all, v_all


def forward_hidden(
    params: Params,
    kv: KVCache,
    token_ids: jax.Array,
    write_slots: jax.Array,
    meta: AttentionMetadata,
    cfg: ModelConfig,
    attention: AttentionFn,
) -> tuple[jax.Array, KVCache]:
    """Final-norm hidden states [T, D] of the new tokens, and the KV pools with their K/V written."""
    inv_freq = jnp.asarray(cfg.rope_inv_freq())
    h = params["embed"][token_ids]

    def body(carry, layer_and_index):
        h, k_all, v_all = carry
        layer, i = layer_and_index
        return _layer(cfg, attention, inv_freq, write_slots, meta, h, layer, k_all, v_all, i), None

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (h, k_all, v_all), _ = jax.lax.scan(body, (h, kv[0], kv[1]), (params["layers"], layer_ids))
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps), (k_all, v_all)


def lm_logits(params: Params, hidden: jax.Array) -> jax.Array:
    """Logits [N, V] for hidden states [N, D]; tied models reuse the embedding matrix."""
    if "lm_head" in params:
        return hidden @ params["lm_head"]
    return jnp.einsum("nd,vd->nv", hidden, params["embed"])
