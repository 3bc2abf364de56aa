"""Paged attention over the token-granular KV pool: the interface every backend implements.

The model writes the new tokens' K/V into the pool first (``kv_quant.write``, or the backend's ``write``: a kernel
on TPU), then calls ``paged_attention``: each query
attends to its request's slots ``block_table[b, :kv_lens[b]]`` up to (and including) its own position.
Because ``block_table[b, j]`` holds the slot of position ``j`` (with pages of ``page_size > 1`` slots, the
table holds each page and ``slot_table()`` expands it), "causal over the new tokens" and "full
over the cached prefix" are the same mask: ``j <= position``. Prefill, extend-after-prefix and decode
(``max_q_len == 1``) are therefore one function. A sliding window ``W`` (Mistral; Qwen2/3's windowed layers)
adds ``position - j < W``: each query sees its last ``W`` positions, itself included (transformers'
``sliding_window_overlay``: ``kv_idx > q_idx - W``). Every backend honours it or declines the call.

Pool layout is head-major, ``[num_kv_heads, num_slots, head_dim]`` per layer: measured faster on XLA CPU
than token-major, and it is the layout the Pallas kernels (``jsgl.kernels.pallas_*``) read. A pool may also be
an ``Int8Pool`` (``jsgl.kernels.kv_quant``, the 8-bit format): every backend dequantizes what it gathers, or
declines the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jsgl.kernels import kv_quant


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token sits and which pool slots each request attends over.

    T new tokens (flat, ragged across B requests), padded to a bucket; padding tokens have
    ``positions == -1`` semantics handled by the caller (they write to the reserved slot 0 and their
    outputs are ignored).
    """

    positions: jax.Array  # [T] int32, absolute position of each new token in its sequence
    q_start: jax.Array  # [B] int32, index of a request's first new token in the flat batch
    q_len: jax.Array  # [B] int32, number of new tokens of a request (0 for padding rows)
    # [B, L / page_size] int32: at page size 1 the pool slot of each position of each request (pad: 0); else the
    # page of each page_size positions, page p holding slots [p * page_size, (p + 1) * page_size) (`slot_table`).
    block_table: jax.Array
    kv_lens: jax.Array  # [B] int32, positions cached after this step (prefix + new)
    max_q_len: int = dataclasses.field(metadata=dict(static=True), default=1)  # S, static bucket
    # Keys with ``position - j >= sliding_window`` are masked; None: full causal attention. Static: the model
    # sets it per layer (jsgl.model.llama.forward_hidden), so unwindowed models trace exactly as before.
    sliding_window: int | None = dataclasses.field(metadata=dict(static=True), default=None)

    # Positions per entry of `block_table` (the pool's pages; static). The Pallas kernels read the page table as it
    # is; the other paths attend over `slot_table()`.
    page_size: int = dataclasses.field(metadata=dict(static=True), default=1)

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1

    def slot_table(self) -> jax.Array:
        """[B, L]: the pool slot of each position (the page table expanded; the table itself at page size 1)."""
        if self.page_size == 1:
            return self.block_table
        batch, pages = self.block_table.shape
        within = jnp.arange(self.page_size, dtype=self.block_table.dtype)
        return (self.block_table[:, :, None] * self.page_size + within).reshape(batch, pages * self.page_size)


AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, AttentionMetadata, float], jax.Array]
# (qkv, k_pool, v_pool, write_slots, cos, signed_sin, meta, scale) -> (out, k_pool, v_pool) | None
FusedAttentionFn = Callable[..., "tuple[jax.Array, jax.Array, jax.Array] | None"]
# (pool, slots [T], x [T, Hkv, D]) -> the pool with x written at slots (kv_quant.write's contract)
KVWriteFn = Callable[[kv_quant.KVPool, jax.Array, jax.Array], kv_quant.KVPool]


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """An attention implementation, as the model uses it.

    `attend(q, k_pool, v_pool, meta, scale)` attends each new token over its request's slots (the new
    tokens' K/V already written). `rope_write_attend`, where a backend has it, does RoPE on the new q and k
    (taken from the fused q|k|v projection), the K/V write and the attention as one op (the CPU kernel's,
    which saves three XLA ops per layer); it returns None where it does not apply, and the model then
    composes the three steps itself. `write(pool, slots, x)`, where set, is how the backend's platform writes
    the new K/V into a pool when the model composes them (`kv_quant.write`'s contract; the TPU backend's Mosaic
    kernel, ``jsgl.kernels.tpu_kv_write``, in place of XLA's scatter); None: `kv_quant.write`. Calling the record
    calls `attend`. `builds_scores` says whether the scheduler must bound an extend batch's padded score array.
    """

    name: str
    attend: AttentionFn
    rope_write_attend: FusedAttentionFn | None = None
    # Whether attending materializes a [heads, requests, new tokens, length] score array (the native path);
    # the kernels stream K/V blocks through an online softmax and build none.
    builds_scores: bool = False
    write: KVWriteFn | None = None

    def __call__(self, q: jax.Array, k_pool: kv_quant.KVPool, v_pool: kv_quant.KVPool, meta: AttentionMetadata,
                 scale: float) -> jax.Array:
        return self.attend(q, k_pool, v_pool, meta, scale)


def _padded_token_index(meta: AttentionMetadata, num_tokens: int) -> jax.Array:
    """[B, S] flat index of each request's s-th new token, or ``num_tokens`` (out of range) for padding."""
    s = jnp.arange(meta.max_q_len, dtype=jnp.int32)[None, :]
    idx = meta.q_start[:, None] + s
    return jnp.where(s < meta.q_len[:, None], idx, num_tokens)


def _native_decode_attention(
    q: jax.Array, k_pool: kv_quant.KVPool, v_pool: kv_quant.KVPool, meta: AttentionMetadata, scale: float
) -> jax.Array:
    """Decode (at most one new token per request): no [B, S] regrouping of queries.

    The new token sits at position ``kv_len - 1``, so ``j < kv_len`` is the whole mask. Fewer ops than the
    general path also means a smaller graph: with 30 unrolled layers, compile time matters.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[0]
    table = meta.slot_table()
    batch = table.shape[0]
    qg = jnp.take(q, meta.q_start, axis=0, mode="clip")
    qg = qg.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    k = kv_quant.gather(k_pool, table)  # [Hkv, B, L, D]
    v = kv_quant.gather(v_pool, table)
    scores = jnp.einsum("bhgd,hbld->bhgl", qg.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(table.shape[1], dtype=jnp.int32)
    visible = key_pos[None, :] < meta.kv_lens[:, None]
    if meta.sliding_window is not None:  # the new token is position kv_len - 1: keys from kv_len - W on
        visible &= key_pos[None, :] >= meta.kv_lens[:, None] - meta.sliding_window
    # Padding rows (kv_len 0) attend uniformly to slot 0 instead of nothing: finite, and never read.
    mask = visible | (meta.kv_lens[:, None] == 0)
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhgl,hbld->bhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.astype(q.dtype).reshape(batch, num_q_heads, head_dim)
    # Back to flat token order (the identity for the runner's decode batches); padding rows are dropped.
    rows = jnp.where(meta.q_len > 0, meta.q_start, num_tokens)
    return jnp.zeros_like(q).at[rows].set(out, mode="drop")


def native_paged_attention(
    q: jax.Array, k_pool: kv_quant.KVPool, v_pool: kv_quant.KVPool, meta: AttentionMetadata, scale: float
) -> jax.Array:
    """Pure-JAX reference and CPU path.

    q: [T, Hq, D]; k_pool, v_pool: [Hkv, N, D] (this layer). Returns [T, Hq, D].
    Gathers each request's keys by slot, regroups the flat queries into [B, S] by ``q_start``/``q_len``,
    and masks keys by ``j <= position`` and ``j < kv_len`` (and ``j > position - W`` with a sliding window).
    """
    if meta.is_decode:
        return _native_decode_attention(q, k_pool, v_pool, meta, scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[0]
    group = num_q_heads // num_kv_heads
    table = meta.slot_table()
    batch = table.shape[0]

    tok_idx = _padded_token_index(meta, num_tokens)  # [B, S]
    qp = jnp.take(q, tok_idx, axis=0, mode="fill", fill_value=0)  # [B, S, Hq, D]
    pos = jnp.take(meta.positions, tok_idx, axis=0, mode="fill", fill_value=-1)  # [B, S]
    qp = qp.reshape(batch, meta.max_q_len, num_kv_heads, group, head_dim)
    qp = qp.transpose(2, 3, 0, 1, 4)  # [Hkv, G, B, S, D] head-major

    k = kv_quant.gather(k_pool, table)  # [Hkv, B, L, D]
    v = kv_quant.gather(v_pool, table)
    scores = jnp.einsum("hgbsd,hbld->hgbsl", qp.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(table.shape[1], dtype=jnp.int32)
    mask = (key_pos[None, None, :] <= pos[:, :, None]) & (key_pos[None, None, :] < meta.kv_lens[:, None, None])
    if meta.sliding_window is not None:
        mask &= key_pos[None, None, :] > pos[:, :, None] - meta.sliding_window
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    # Padding queries have no valid key: keep their softmax finite, their output is never read.
    scores = jnp.where(mask.any(-1)[None, None, :, :, None], scores, 0.0)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("hgbsl,hbld->hgbsd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32).astype(q.dtype)  # [Hkv, G, B, S, D]
    out = out.transpose(2, 3, 0, 1, 4).reshape(batch * meta.max_q_len, num_q_heads, head_dim)

    # Scatter back to the flat token order; padding rows go to an out-of-range index and are dropped.
    flat = jnp.zeros((num_tokens, num_q_heads, head_dim), q.dtype)
    return flat.at[tok_idx.reshape(-1)].set(out, mode="drop")


_BACKENDS: dict[str, AttentionBackend] = {"native": AttentionBackend("native", native_paged_attention,
                                                                     builds_scores=True)}


def register_attention_backend(backend: AttentionBackend) -> None:
    """Kernel modules register themselves here (e.g. ``pallas``) so the model stays backend-agnostic."""
    _BACKENDS[backend.name] = backend


def resolve_attention_backend(name: str, platform: str | None = None) -> str:
    """``auto``: the Pallas kernels on a GPU, the Mosaic kernel (``tpu``) on a TPU, the C++ kernel on a CPU that
    builds it, else native. An engine checks an accelerator's kernel on its device before its first step
    (``jsgl.kernels.self_check``). ``platform``: JAX's backend name to resolve for (default: this process's)."""
    if name != "auto":
        return name
    platform = platform or jax.default_backend()
    if platform in ("gpu", "tpu"):
        return {"gpu": "pallas", "tpu": "tpu"}[platform]
    from jsgl.kernels import cpu

    return "cpu" if platform == "cpu" and cpu.available() else "native"


def get_attention_backend(name: str) -> AttentionBackend:
    """The registered backend of a resolved name (``resolve_attention_backend`` turns ``auto`` into one)."""
    if name == "pallas" and "pallas" not in _BACKENDS:
        import jsgl.kernels.pallas_attention  # noqa: F401  (registers itself)
    if name == "tpu" and "tpu" not in _BACKENDS:
        import jsgl.kernels.tpu_attention  # noqa: F401  (registers itself)
    if name == "cpu" and "cpu" not in _BACKENDS:
        import jsgl.kernels.cpu  # noqa: F401  (registers itself)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}, or 'auto' to choose")
    return _BACKENDS[name]
