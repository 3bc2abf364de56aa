"""The Llama-family forward (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM) as plain functions over a params
pytree.

One forward serves prefill, extend-after-prefix and decode: it takes a flat batch of new tokens with
their positions and the pool slot each writes its K/V to, writes them, and attends through the
paged-attention interface of ``jsgl.kernels.attention``. The families differ only in what a layer's params
hold (q/k/v and o biases; Qwen3's ``q_norm``/``k_norm``) and in the config's per-layer sliding windows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jsgl.kernels import kv_quant
from jsgl.kernels.attention import AttentionBackend, AttentionFn, AttentionMetadata
from jsgl.kernels.cpu import PACKED_TYPES, PackedWeight, QuantWeight, pack_quant, pack_weight, packed_matmul
from jsgl.model.config import ModelConfig

Params = dict[str, Any]
# Per-layer K and V pools, each [num_kv_heads, num_slots, head_dim] (an Int8Pool in the 8-bit format): separate
# buffers, like the weights, so every layer's scatter updates its own donated buffer in place and no layer slice
# is ever copied. A scanned model (stack_layers) has one stack [num_kv_heads, num_layers, num_slots, head_dim]
# each for K and V instead, read and written at the layer (kv_quant.LayerPool).
KVCache = tuple[list[kv_quant.KVPool] | kv_quant.KVPool, list[kv_quant.KVPool] | kv_quant.KVPool]
# A layer's matmul weights ([in, out] arrays), grouped by the input they multiply. Packed for the CPU kernels
# (with_packed_weights), each group becomes one PackedWeight named "wq+wk+wv" etc.: one call instead of three
# (the down projection's key stays "w_down": the group of one).
PROJECTIONS = (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",))


def linear(x: jax.Array, w: jax.Array | PackedWeight | QuantWeight) -> jax.Array:
    return packed_matmul(x, w) if isinstance(w, PACKED_TYPES) else mm(x, w)


def mm(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` in the weight's dtype, accumulated in float32 and returned in the weight's dtype: a bfloat16
    model multiplies bfloat16 operands (no float32 copy of a weight) with float32 sums (the dtype policy)."""
    return jnp.matmul(x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(w.dtype)


def _packed(layer: Params, names: tuple[str, ...]) -> PackedWeight | QuantWeight | None:
    w = layer.get("+".join(names))
    return w if isinstance(w, PACKED_TYPES) else None


# The layer's three matmul blocks. Packed (the CPU kernels), each is one or two kernel calls with the
# norm, SwiGLU and residual inside them; otherwise plain jnp.
def _normed_qkv(h: jax.Array, layer: Params, eps: float) -> jax.Array | list[jax.Array]:
    """q, k, v of ``rms_norm(h)`` (with their biases, if any): packed, as one ``[T, q | k | v]`` array."""
    if (packed := _packed(layer, ("wq", "wk", "wv"))) is not None:
        qkv = packed_matmul(h, packed, norm=layer["attn_norm"], eps=eps)
        return qkv + jnp.concatenate([layer["bq"], layer["bk"], layer["bv"]]) if "bq" in layer else qkv
    x = rms_norm(h, layer["attn_norm"], eps)
    qkv = [mm(x, layer[name]) for name in ("wq", "wk", "wv")]
    return [y + layer[b] for y, b in zip(qkv, ("bq", "bk", "bv"))] if "bq" in layer else qkv


def _attention_output(h: jax.Array, attn: jax.Array, layer: Params) -> jax.Array:
    """``h + attn @ wo (+ bo)``."""
    residual = h + layer["bo"] if "bo" in layer else h
    if (packed := _packed(layer, ("wo",))) is not None:
        return packed_matmul(attn, packed, residual=residual)
    return residual + mm(attn, layer["wo"])


def _mlp(h: jax.Array, layer: Params, eps: float) -> jax.Array:
    """``h + (silu(x @ w_gate) * (x @ w_up)) @ w_down`` with ``x = rms_norm(h)``."""
    if (packed := _packed(layer, ("w_gate", "w_up"))) is not None:
        gate_up = packed_matmul(h, packed, norm=layer["mlp_norm"], eps=eps)
        return packed_matmul(gate_up, layer["w_down"], swiglu=True, residual=h)
    x = rms_norm(h, layer["mlp_norm"], eps)
    return h + mm(jax.nn.silu(mm(x, layer["w_gate"])) * mm(x, layer["w_up"]), layer["w_down"])


def param_shapes(cfg: ModelConfig, dtype: Any = jnp.float32, scanned: bool = False) -> Params:
    """The params pytree of ``cfg`` as ``jax.ShapeDtypeStruct`` leaves (jsgl's layout: matrices [in, out]), as
    the loader returns them (``scanned``: as ``stack_layers`` gives them): to lower or plan a model of any size
    without allocating it."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shape = lambda *dims: jax.ShapeDtypeStruct(dims, dtype)  # noqa: E731
    layer = {"attn_norm": shape(d), "wq": shape(d, q), "wk": shape(d, kv), "wv": shape(d, kv), "wo": shape(q, d),
             "mlp_norm": shape(d), "w_gate": shape(d, cfg.intermediate_size),
             "w_up": shape(d, cfg.intermediate_size), "w_down": shape(cfg.intermediate_size, d)}
    if cfg.attention_bias:
        layer |= {"bq": shape(q), "bk": shape(kv), "bv": shape(kv)}
        if cfg.architecture != "qwen2":
            layer["bo"] = shape(d)
    if cfg.qk_norm:
        layer |= {"q_norm": shape(hd), "k_norm": shape(hd)}
    params: Params = {"embed": shape(cfg.vocab_size, d), "final_norm": shape(d),
                      "layers": [dict(layer) for _ in range(cfg.num_layers)]}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = shape(d, cfg.vocab_size)
    if scanned:
        params["layers"] = {name: shape(cfg.num_layers, *leaf.shape) for name, leaf in layer.items()}
    return params


def is_scanned(params: Params) -> bool:
    """Whether the layers' params are stacked (``stack_layers``): the forward then scans over them."""
    return isinstance(params["layers"], dict)


def stack_layers(params: Params, stack: Any = None) -> Params:
    """The params with the layers' leaves stacked over a leading layer axis, for a forward that compiles one
    layer and scans it (``forward_hidden``). ``stack(name, leaves)`` builds one stacked leaf (default
    ``jnp.stack``; the runner's places it as tensor parallelism shards it). The layers' dicts of ``params`` are
    emptied as their leaves are stacked, so an 8B model's weights are held about once, not twice."""
    layers = params["layers"]
    stack = stack or (lambda name, leaves: jnp.stack(leaves))
    stacked = {name: stack(name, [layer.pop(name) for layer in layers]) for name in list(layers[0])}
    return {**params, "layers": stacked}


def layer_runs(cfg: ModelConfig) -> list[tuple[int, int, int | None]]:
    """The layers as runs of one sliding window: ``(first, end, window)``; a scanned forward scans each run."""
    runs: list[tuple[int, int, int | None]] = []
    for i in range(cfg.num_layers):
        window = cfg.layer_window(i)
        if runs and runs[-1][2] == window:
            runs[-1] = (runs[-1][0], i + 1, window)
        else:
            runs.append((i, i + 1, window))
    return runs


def _from_blocks(group_blocks: list[Any]) -> bool:
    return all(b is not None for b in group_blocks) and len({b.kind for b in group_blocks}) == 1


def with_packed_weights(params: Params, blocks: tuple[list[dict], Any] | None = None) -> Params:
    """The same params with each layer's PROJECTIONS packed (and fused) for the CPU kernels, and the LM head
    packed (for a tied model, a packed copy of the embedding's transpose; the embedding stays for lookup).

    ``blocks`` (from :func:`jsgl.model.loader.load_gguf_blocks`): where a group's matrices all come in GGUF
    blocks of one kind, it is packed from them (QuantWeight, the same values) instead of float32; those
    matrices (:func:`packed_from_blocks`) need not be in ``params``."""
    layer_blocks, head_blocks = blocks or ([{}] * len(params["layers"]), None)
    layers = []
    for layer, quant in zip(params["layers"], layer_blocks):
        packed = {key: w for key, w in layer.items() if not any(key in group for group in PROJECTIONS)}
        for group in PROJECTIONS:
            group_blocks = [quant.get(name) for name in group]
            if _from_blocks(group_blocks):
                packed["+".join(group)] = pack_quant(group_blocks)
            else:
                packed["+".join(group)] = pack_weight([layer[name] for name in group])
        layers.append(packed)
    if head_blocks is not None:
        lm_head = pack_quant([head_blocks])
    else:
        lm_head = pack_weight([params["lm_head"] if "lm_head" in params else params["embed"].T])
    return {**params, "layers": layers, "lm_head": lm_head}


def packed_from_blocks(blocks: tuple[list[dict], Any] | None) -> frozenset[str]:
    """Flat names ("layers.3.wq", "lm_head") of the float32 matrices ``with_packed_weights(params, blocks)``
    never reads: the loader skips them (restoring the default model's 540 MB of float32 weights took ~1.5 s of
    an engine's start, 80% of them matrices the kernels read from the GGUF's blocks)."""
    if blocks is None:
        return frozenset()
    layer_blocks, head_blocks = blocks
    names = {f"layers.{i}.{name}" for i, quant in enumerate(layer_blocks) for group in PROJECTIONS
             if _from_blocks([quant.get(name) for name in group]) for name in group}
    return frozenset(names | ({"lm_head"} if head_blocks is not None else set()))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """In float32, returned in x's dtype (as transformers' LlamaRMSNorm: normalize in float32, cast, scale)."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype) * weight.astype(x.dtype)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[cos, cos]`` and ``[-sin, sin]`` [T, 1, hd] of every new token's angles, computed once for all layers."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)


def rope(x: jax.Array, cos: jax.Array, signed_sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on [T, H, hd] (HF layout; the GGUF loader undoes llama.cpp's interleaving):
    ``[x1 cos - x2 sin, x2 cos + x1 sin]``, written with a roll of the halves instead of a concatenation
    of two results (XLA CPU's concatenate took ~40 us per layer at 16 tokens; this is ~3x faster)."""
    x32 = x.astype(jnp.float32)  # in float32, returned in x's dtype
    return (x32 * cos + jnp.roll(x32, x.shape[-1] // 2, axis=-1) * signed_sin).astype(x.dtype)


def _layer(
    cfg: ModelConfig,
    attention: AttentionBackend,
    rope_cos_sin: tuple[jax.Array, jax.Array],
    write_slots: jax.Array,
    meta: AttentionMetadata,
    h: jax.Array,
    layer: Params,
    k_pool: kv_quant.KVPool,
    v_pool: kv_quant.KVPool,
) -> tuple[jax.Array, kv_quant.KVPool, kv_quant.KVPool]:
    num_tokens = h.shape[0]
    qkv = _normed_qkv(h, layer, cfg.rms_norm_eps)
    scale = cfg.head_dim**-0.5
    fused = attention.rope_write_attend  # RoPE + K/V write + attention as one op, where the backend has it
    result = None
    # The fused op takes q and k straight from the projection: it cannot apply Qwen3's q/k norms first.
    if fused is not None and not isinstance(qkv, list) and "q_norm" not in layer:
        result = fused(qkv, k_pool, v_pool, write_slots, *rope_cos_sin, meta, scale)
    if result is not None:
        attn, k_pool, v_pool = result
    else:
        if not isinstance(qkv, list):
            q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            qkv = jnp.split(qkv, [q_width, q_width + kv_width], axis=-1)
        q = qkv[0].reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = qkv[1].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[2].reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if "q_norm" in layer:  # Qwen3: RMSNorm over each head's vector, before RoPE
            q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
        q, k = rope(q, *rope_cos_sin), rope(k, *rope_cos_sin)
        # Write first, then attend: the new tokens read their own K/V from the pool like the prefix. The backend's
        # platform may write through a kernel (TPU: XLA's scatter is slow there).
        write = attention.write or kv_quant.write
        k_pool, v_pool = write(k_pool, write_slots, k), write(v_pool, write_slots, v)
        attn = attention.attend(q, k_pool, v_pool, meta, scale)
    h = _attention_output(h, attn.reshape(num_tokens, -1), layer)
    return _mlp(h, layer, cfg.rms_norm_eps), k_pool, v_pool


def forward_hidden(
    params: Params,
    kv: KVCache,
    token_ids: jax.Array,
    write_slots: jax.Array,
    meta: AttentionMetadata,
    cfg: ModelConfig,
    attention: AttentionBackend | AttentionFn,
) -> tuple[jax.Array, KVCache]:
    """Final-norm hidden states [T, D] of the new tokens, and the KV pools with their K/V written.
    `attention`: a backend record, or a plain attention function (the model then writes K/V itself)."""
    if not isinstance(attention, AttentionBackend):
        attention = AttentionBackend("custom", attention)
    rope_cos_sin = rope_tables(meta.positions, jnp.asarray(cfg.rope_inv_freq()))
    h = params["embed"][token_ids]
    if is_scanned(params):
        h, kv = _scanned_layers(cfg, attention, rope_cos_sin, write_slots, meta, h, params["layers"], kv)
        return rms_norm(h, params["final_norm"], cfg.rms_norm_eps), kv
    k_pools, v_pools = list(kv[0]), list(kv[1])
    # Per-layer params: a Python loop, unrolled in the one jitted step (the CPU's and, until measured, a GPU's
    # default): a lax.scan made XLA CPU copy each layer's weights out of the stack (decode ran ~1.8x slower).
    for i, layer in enumerate(params["layers"]):
        # The layer's sliding window travels as a static field of the metadata: every backend sees it.
        window = cfg.layer_window(i)
        layer_meta = meta if window is None else dataclasses.replace(meta, sliding_window=window)
        h, k_pools[i], v_pools[i] = _layer(cfg, attention, rope_cos_sin, write_slots, layer_meta, h, layer,
                                           k_pools[i], v_pools[i])
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps), (k_pools, v_pools)


def _scanned_layers(
    cfg: ModelConfig,
    attention: AttentionBackend,
    rope_cos_sin: tuple[jax.Array, jax.Array],
    write_slots: jax.Array,
    meta: AttentionMetadata,
    h: jax.Array,
    layers: Params,
    kv: KVCache,
) -> tuple[jax.Array, KVCache]:
    """The layers as one ``lax.scan`` per run of equal sliding windows (one for most models): XLA compiles one
    layer, not ``num_layers`` copies. The stacked pools ride in the carry, each layer writing and reading its own
    through a ``LayerPool``; the weights are indexed at the layer, as the scan would slice them."""
    if attention.rope_write_attend is not None:
        raise ValueError(f"attention backend {attention.name!r} fuses its K/V write (the CPU kernels): it needs "
                         "per-layer pools, not a scanned model")

    def one_layer(layer_meta: AttentionMetadata, carry: tuple, index: jax.Array) -> tuple[tuple, None]:
        h, k_stack, v_stack = carry
        layer = jax.tree.map(lambda leaf: leaf[index], layers)
        h, k_view, v_view = _layer(cfg, attention, rope_cos_sin, write_slots, layer_meta, h, layer,
                                   kv_quant.LayerPool(k_stack, index), kv_quant.LayerPool(v_stack, index))
        return (h, k_view.stack, v_view.stack), None

    carry = (h, *kv)
    for first, end, window in layer_runs(cfg):
        layer_meta = meta if window is None else dataclasses.replace(meta, sliding_window=window)
        carry, _ = jax.lax.scan(functools.partial(one_layer, layer_meta), carry,
                                jnp.arange(first, end, dtype=jnp.int32))
    h, k_stack, v_stack = carry
    return h, (k_stack, v_stack)


def lm_logits(params: Params, hidden: jax.Array) -> jax.Array:
    """Logits [N, V] for hidden states [N, D]; tied models reuse the embedding matrix."""
    head = params.get("lm_head")
    if isinstance(head, PACKED_TYPES):
        return packed_matmul(hidden, head)
    if head is not None:  # float32 logits whatever the weights' dtype
        return jnp.matmul(hidden.astype(head.dtype), head, preferred_element_type=jnp.float32)
    embed = params["embed"]
    return jnp.einsum("nd,vd->nv", hidden.astype(embed.dtype), embed, preferred_element_type=jnp.float32)
