"""Pallas paged-attention kernels over the KV pool (the "pallas" attention backend).

Same contract as :func:`jsgl.kernels.attention.native_paged_attention`: ``q [T, Hq, D]``, per-layer pools
``k_pool, v_pool [Hkv, N, D]`` (slot 0 is a reserved dummy), :class:`AttentionMetadata`; returns
``[T, Hq, D]``. Query token ``t`` of request ``b`` attends to keys ``j`` with ``j <= positions[t]`` and
``j < kv_lens[b]`` (and ``j > positions[t] - W`` under a sliding window ``meta.sliding_window = W``), key ``j``
living in pool slot ``block_table[b, j]``. Tokens not covered by any request's ``[q_start, q_start + q_len)``
come back as zeros, as in the reference.

Two kernels, chosen by :func:`pallas_paged_attention` on the static ``meta.max_q_len``:

* **decode** (``max_q_len == 1``), :func:`paged_decode_attention`: grid ``(B, Hkv, num_splits)``. One
  program owns one request, one KV head and all ``G = Hq // Hkv`` query heads of that KV head (GQA:
  each K/V row is read once for the whole group; the group is padded to ``block_h`` rows, >= 16 on
  GPU because ``tl.dot`` needs M >= 16). Split-K: the request's ``cdiv(len, block_k)`` KV blocks are
  cut into ``num_splits`` contiguous ranges *by its actual length* (so short requests don't pay for
  the table width; under a sliding window the range starts at the window's first block), each program
  runs an online softmax over its range and writes un-normalised ``(acc, max, sum)`` partials in
  float32; a small jnp reduction (log-sum-exp merge) combines them.
* **extend / prefill** (``max_q_len > 1``), :func:`paged_extend_attention`: grid
  ``(B, Hkv, cdiv(max_q_len, block_q))``. One program owns ``block_q`` new tokens of one request and all
  ``G`` query heads of one KV head (GQA: each K/V block is gathered once for the group; the group padded
  to a power of two ``Gp``, and ``q`` laid out ``[Hkv, T * Gp, D]`` so the tile is ``block_q * Gp``
  consecutive rows); it reads them from that ragged layout at ``(q_start[b] + i * block_q) * Gp`` with a
  masked load (tokens ``>= q_len[b]`` masked, programs past ``q_len`` do nothing), loops over KV blocks
  ``[0, min(kv_len, max position + 1))`` with online softmax, masks ``j <= position & j < kv_len``
  (causal over the new tokens and full over the cached prefix at once) and does a masked store of its
  rows into the flat output. Under a sliding window the loop starts at the block of the tile's first
  visible key and the mask adds ``j > position - W``.

**KV gather.** Scalar prefetch (``PrefetchScalarGridSpec``) is TPU-only and the Triton lowering rejects
it, so the slot table travels as an ordinary input block: the request's row of the (zero-padded)
``block_table`` is the block, a ``block_k`` window of it is loaded with ``bt_ref[pl.ds(j0, block_k)]``,
out-of-range positions are redirected to the dummy slot 0, and the K/V rows are gathered from the
whole per-head pool block with an integer-array index ``k_ref[slots, :]``. In the Triton lowering
that is a pointer-tensor gather ``base + slot * D + d`` (``tt.load`` on a ``[block_k, D]`` pointer tensor,
same mechanism as ``jax.experimental.pallas.ops.gpu.paged_attention``'s ``k_pages_ref[block_tables]``);
in interpret mode it discharges to an XLA gather. No K/V is copied outside the kernel.

**Page tables** (``meta.page_size = P > 1``, the engine's ``--page-size``): the table holds each request's
pages, page ``p`` being slots ``[p * P, (p + 1) * P)``, so it is ``P`` times narrower (a step's table at 8192
positions: 512 entries a request at ``P = 16`` instead of 8192). A KV block is whole pages (``block_k`` a
multiple of ``P``, raised to ``P`` if smaller); its ``block_k / P`` page numbers are gathered from the table
row (``bt_ref[key_pos // P]``, the same 1-D gather as the 8-bit format's scales) and its slots are
``page * P + key_pos % P``: ``P`` consecutive rows of the pool per page.

**8-bit KV** (``jsgl.kernels.kv_quant.Int8Pool``): the kernels take the int8 pools and their ``[N]`` per-token
scales as two more inputs, gather the scales with the same slots and dequantize each gathered block to the
query's dtype before its dots: only int8 rows (and a float per row) cross memory.

**Lowering notes (jax 0.10.2).** Written for the Pallas **Triton** GPU lowering (``plgpu.load/store``
masks, ``CompilerParams(num_warps, num_stages)``): every loaded/stored tile has power-of-two size
(``block_h``, ``block_k``, ``block_q``, ``head_dim`` must be powers of two, and >= 16 for ``tl.dot`` on GPU);
one indexer per ref access; float32 dots use ``precision=HIGHEST`` (IEEE, not TF32) so float32 matches the
reference. The Triton path is deprecated in newer jax in favour of Mosaic GPU; the kernels sit behind
two small functions (``_decode_partials`` and ``_extend_call``: pool + table + lengths in, partials /
flat output out) so a Mosaic GPU version can replace them without touching the wrappers.
On CPU, ``interpret=True`` (the default there) runs the same kernel bodies through the Pallas HLO
interpreter; that is what the tests check.

Differences from the reference only in degenerate cases: a query that is covered by a request but has
no valid key (``positions < 0`` or ``kv_len == 0``) gets zeros here, the mean of its table's V there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jsgl.kernels.attention import AttentionBackend, AttentionMetadata, register_attention_backend
from jsgl.kernels.kv_quant import Int8Pool, KVPool, LayerPool

# Module-level switch: None = decide per call (interpret on CPU, compiled Triton on GPU).
INTERPRET: bool | None = None

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: no inf - inf NaNs in online softmax
_MIN_DOT = 16  # tl.dot needs M, N, K >= 16


def _resolve_interpret(interpret: bool | None) -> bool:
    if interpret is not None:
        return interpret
    if INTERPRET is not None:
        return INTERPRET
    return jax.default_backend() == "cpu"


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _check_block(name: str, n: int, interpret: bool) -> None:
    if not _is_pow2(n):
        raise ValueError(f"{name}={n} must be a power of two (Pallas Triton tile sizes)")
    if not interpret and n < _MIN_DOT:
        raise ValueError(f"{name}={n} must be >= {_MIN_DOT} on GPU (tl.dot minimum)")


def _compiler_params(interpret: bool, num_warps: int, num_stages: int):
    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _dot(a: jax.Array, b: jax.Array, *, trans_b: bool = False) -> jax.Array:
    """2-D matmul with float32 accumulation; IEEE float32 (not TF32) when the inputs are float32."""
    contract_b = 1 if trans_b else 0
    return lax.dot_general(
        a,
        b,
        (((1,), (contract_b,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _pad_table(block_table: jax.Array, entries: int) -> jax.Array:
    """Pad the table's width to a multiple of ``entries`` (a KV block's: block_k slots or block_k / page_size
    pages) with slot 0 (or page 0, which holds it): the dummy."""
    width = block_table.shape[1]
    padded = pl.cdiv(max(width, 1), entries) * entries
    if padded != width:
        block_table = jnp.pad(block_table, ((0, 0), (0, padded - width)))
    return block_table.astype(jnp.int32)


def _gather_kv(bt_ref, kv_refs, first_key, length, block_k: int, dtype, page_size: int = 1, stacked: bool = False):
    """Slots and K/V rows ``[block_k, D]`` of positions ``first_key + [0, block_k)`` (invalid -> slot 0).
    ``bt_ref``: the request's slot table, or with ``page_size > 1`` its page table (the block's
    ``block_k / page_size`` pages gathered, each page ``page_size`` consecutive slots). ``kv_refs``: (k, v) of a
    plain pool, or (k, v, k scales, v scales) of the 8-bit format, whose rows are dequantized here to ``dtype``
    (the query's): the int8 rows are what crosses memory. ``stacked`` (a scanned model): each ref holds every
    layer (``[L, N, D]``, scales ``[L, N]``) and one more, last, the layer's index ``[1]``."""
    key_pos = first_key + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    if page_size == 1:
        slots = bt_ref[pl.ds(first_key, block_k)]
    else:
        slots = bt_ref[key_pos // page_size] * page_size + key_pos % page_size
    slots = jnp.where(key_pos < length, slots, 0)
    at: tuple = (slots,)
    if stacked:
        at, kv_refs = (kv_refs[-1][0], slots), kv_refs[:-1]
    k, v = kv_refs[0][(*at, slice(None))], kv_refs[1][(*at, slice(None))]
    if len(kv_refs) == 4:
        k = (k.astype(jnp.float32) * kv_refs[2][at][:, None]).astype(dtype)
        v = (v.astype(jnp.float32) * kv_refs[3][at][:, None]).astype(dtype)
    return key_pos, k, v


def _suffix(kv: list[jax.Array], page_size: int, stacked: bool) -> str:
    """Kernel-name suffix: the 8-bit KV format, page-granular tables, a scanned model's stacked pools."""
    return ("_int8" if len(kv) - stacked == 4 else "") + (f"_pg{page_size}" if page_size > 1 else "") + \
        ("_stacked" if stacked else "")


def _page_block_k(page_size: int, block_k: int) -> int:
    """The KV block for a table of ``page_size``-slot pages: whole pages, so at least one page."""
    block_k = max(block_k, page_size)
    if not _is_pow2(page_size) or block_k % page_size:
        raise ValueError(f"page_size={page_size} must be a power of two dividing block_k={block_k}")
    return block_k


def _kv_operands(k_pool: KVPool, v_pool: KVPool) -> tuple[list[jax.Array], bool]:
    """The kernels' K/V inputs: ``[k, v]``, or ``[k, v, k scales, v scales]`` for the 8-bit format; and whether
    they are a scanned model's stacks (``LayerPool``), the layer's index ``[1]`` then last."""
    layer = None
    if isinstance(k_pool, LayerPool):
        layer, k_pool, v_pool = k_pool.layer, k_pool.stack, v_pool.stack
    if isinstance(k_pool, Int8Pool):
        operands = [k_pool.values, v_pool.values, k_pool.scales, v_pool.scales]
    else:
        operands = [k_pool, v_pool]
    if layer is None:
        return operands, False
    return [*operands, jnp.reshape(layer, (1,)).astype(jnp.int32)], True


def _kv_specs(operands: list[jax.Array], head_of, stacked: bool) -> list[pl.BlockSpec]:
    """BlockSpecs of the K/V operands: the whole pool of the KV head ``head_of(*grid indices)`` (of every layer,
    ``stacked``), and the layer's index."""
    def spec(x: jax.Array) -> pl.BlockSpec:
        rest = (0,) * (x.ndim - 1)
        return pl.BlockSpec((None, *x.shape[1:]), lambda *grid: (head_of(*grid), *rest))

    if stacked:
        return [spec(x) for x in operands[:-1]] + [pl.BlockSpec((1,), lambda *grid: (0,))]
    return [spec(x) for x in operands]


def _online_softmax_init(rows: int, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(un-normalised output, running max, running sum) before the first key block."""
    return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def _online_softmax_block(carry: tuple[jax.Array, jax.Array, jax.Array], q: jax.Array, k: jax.Array,
                          v: jax.Array, valid: jax.Array, scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold one block of keys into the running softmax (flash attention's recurrence), shared by the decode
    and extend kernels; ``valid`` [rows, block_k] masks keys a row may not see."""
    acc, m_prev, l_prev = carry
    s = jnp.where(valid, _dot(q, k, trans_b=True) * scale, _MASK_VALUE)  # [rows, block_k]
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
    l_next = alpha * l_prev + p.sum(axis=1)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_next, l_next


# ----------------------------------------------------------------------------------------------------
# Decode: one query token per request, all G query heads of a KV head per program, split-K.
# ----------------------------------------------------------------------------------------------------


def _decode_kernel(
    start_ref,  # [1] int32: keys [start, len) of this request (start > 0 only under a sliding window)
    len_ref,  # [1] int32
    q_ref,  # [block_h, D]
    bt_ref,  # [Lp] int32: this request's slot table (or page table), zero padded
    *refs,  # k, v [N, D] (this KV head's pool; and their [N] scales in the 8-bit format), then the outputs:
    # o [block_h, D] float32 un-normalised, m [block_h] float32 running max, l [block_h] float32 running sum
    scale: float,
    block_k: int,
    num_splits: int,
    page_size: int,
    stacked: bool,
):
    kv_refs, (o_ref, m_ref, l_ref) = refs[:-3], refs[-3:]
    split = pl.program_id(2)
    start, length = start_ref[0], len_ref[0]
    block_h, head_dim = q_ref.shape
    q = q_ref[...]

    first_block = start // block_k
    num_blocks = pl.cdiv(length, block_k) - first_block  # the blocks of keys [start, length)
    per_split = pl.cdiv(num_blocks, num_splits)
    mine = split * per_split  # this split's share of them: [mine, mine + per_split), clipped
    first = first_block + mine
    count = jnp.maximum(jnp.minimum(mine + per_split, num_blocks) - mine, 0)

    def body(i, carry):
        key_pos, k, v = _gather_kv(bt_ref, kv_refs, (first + i) * block_k, length, block_k, q.dtype, page_size,
                                   stacked)
        return _online_softmax_block(carry, q, k, v, ((key_pos < length) & (key_pos >= start))[None, :], scale)

    acc, m_run, l_run = lax.fori_loop(0, count, body, _online_softmax_init(block_h, head_dim))
    o_ref[...] = acc
    m_ref[...] = m_run
    l_ref[...] = l_run


def _decode_partials(
    q_grp: jax.Array,  # [B, Hkv, block_h, D]
    k_pool: KVPool,
    v_pool: KVPool,
    block_table: jax.Array,  # [B, Lp] int32, Lp * page_size % block_k == 0
    starts: jax.Array,  # [B] int32
    lengths: jax.Array,  # [B] int32
    *,
    scale: float,
    block_k: int,
    num_splits: int,
    page_size: int,
    interpret: bool,
    num_warps: int,
    num_stages: int,
):
    """The decode kernel call: per-split partials ``(acc [P,B,Hkv,block_h,D], m, l [P,B,Hkv,block_h])``."""
    batch, num_kv_heads, block_h, head_dim = q_grp.shape
    kv, stacked = _kv_operands(k_pool, v_pool)
    width = block_table.shape[1]
    kernel = functools.partial(_decode_kernel, scale=scale, block_k=block_k, num_splits=num_splits,
                               page_size=page_size, stacked=stacked)
    part = (num_splits, batch, num_kv_heads, block_h)
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, s: (b,)),
            pl.BlockSpec((1,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, None, block_h, head_dim), lambda b, h, s: (b, h, 0, 0)),
            pl.BlockSpec((None, width), lambda b, h, s: (b, 0)),
            *_kv_specs(kv, lambda b, h, s: h, stacked),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_h, head_dim), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*part, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ],
        interpret=interpret,
        compiler_params=_compiler_params(interpret, num_warps, num_stages),
        name=f"jsgl_paged_decode_bh{block_h}_bk{block_k}_p{num_splits}{_suffix(kv, page_size, stacked)}",
    )(starts, lengths, q_grp, block_table, *kv)


def _combine_splits(acc: jax.Array, m_run: jax.Array, l_run: jax.Array) -> jax.Array:
    """Log-sum-exp merge of split-K partials over axis 0; rows without any key give 0."""
    m_all = m_run.max(axis=0)
    w = jnp.exp(m_run - m_all[None])
    l_all = (l_run * w).sum(axis=0)
    o = (acc * w[..., None]).sum(axis=0)
    return o / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def default_num_splits(batch: int, num_kv_heads: int, table_width: int, block_k: int) -> int:
    """Split-K heuristic: enough programs to fill a big GPU (~512), >= 4 KV blocks per split, <= 16."""
    blocks = pl.cdiv(max(table_width, 1), block_k)
    want = pl.cdiv(512, max(batch * num_kv_heads, 1))
    return int(max(1, min(16, want, blocks // 4)))


def paged_decode_attention(
    q: jax.Array,
    k_pool: KVPool,
    v_pool: KVPool,
    meta: AttentionMetadata,
    scale: float,
    *,
    block_k: int = 64,
    block_h: int | None = None,
    num_splits: int | None = None,
    interpret: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Decode attention (one new token per request). ``q [T, Hq, D]`` -> ``[T, Hq, D]``.

    ``block_h``: query-head rows per program (the GQA group, padded; default next power of two of G,
    at least 16 on GPU). ``num_splits``: split-K partitions (default :func:`default_num_splits`).
    """
    interpret = _resolve_interpret(interpret)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[0]
    group = num_q_heads // num_kv_heads
    if group * num_kv_heads != num_q_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    page_size = meta.page_size
    block_k = _page_block_k(page_size, block_k)
    batch, width = meta.block_table.shape[0], meta.block_table.shape[1] * page_size  # in positions
    if block_h is None:
        block_h = max(pl.next_power_of_2(group), 1 if interpret else _MIN_DOT)
    if block_h < group:
        raise ValueError(f"block_h={block_h} < GQA group {group}")
    _check_block("block_h", block_h, interpret)
    _check_block("block_k", block_k, interpret)
    _check_block("head_dim", head_dim, interpret)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, width, block_k)

    # One query per request: gather it, group heads by KV head, pad the group to block_h rows.
    real = meta.q_len > 0
    q_idx = jnp.clip(meta.q_start, 0, num_tokens - 1)
    pos = jnp.take(meta.positions, q_idx, axis=0)
    # Keys j < min(kv_len, pos + 1, L): the reference mask, as one length per request.
    lengths = jnp.where(real, jnp.clip(jnp.minimum(meta.kv_lens, pos + 1), 0, width), 0).astype(jnp.int32)
    # Under a sliding window W the query at `pos` also needs j > pos - W: keys [start, len).
    window = meta.sliding_window
    starts = jnp.zeros_like(lengths) if window is None else jnp.where(real, jnp.maximum(pos + 1 - window, 0), 0)
    q_grp = jnp.take(q, q_idx, axis=0).reshape(batch, num_kv_heads, group, head_dim)
    if block_h != group:
        q_grp = jnp.pad(q_grp, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))

    acc, m_run, l_run = _decode_partials(
        q_grp,
        k_pool,
        v_pool,
        _pad_table(meta.block_table, block_k // page_size),
        starts,
        lengths,
        scale=scale,
        block_k=block_k,
        num_splits=num_splits,
        page_size=page_size,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    o = _combine_splits(acc, m_run, l_run)[:, :, :group]  # [B, Hkv, G, D]
    o = o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
    dest = jnp.where(real, meta.q_start, num_tokens)
    return jnp.zeros((num_tokens, num_q_heads, head_dim), q.dtype).at[dest].set(o, mode="drop")


# ----------------------------------------------------------------------------------------------------
# Extend / prefill: ragged new tokens, causal over themselves, full over the cached prefix.
# ----------------------------------------------------------------------------------------------------


def _extend_kernel(
    qs_ref,  # [1] int32 q_start[b]
    ql_ref,  # [1] int32 q_len[b]
    kvl_ref,  # [1] int32 kv_len[b]
    pos_ref,  # [T * Gp] int32 positions, each repeated for the group's Gp rows
    q_ref,  # [T * Gp, D]: all tokens, this KV head's (padded) group of query heads, row t * Gp + g
    bt_ref,  # [Lp] int32: this request's slot table (or page table)
    *refs,  # k, v [N, D] of this KV head (and their [N] scales in the 8-bit format); then
    # o [T * Gp, D], laid out as q
    scale: float,
    block_q: int,
    block_k: int,
    group: int,
    window: int | None,
    page_size: int,
    stacked: bool,
):
    kv_refs, o_ref = refs[:-1], refs[-1]
    q_block = pl.program_id(2)
    q_len = ql_ref[0]
    row0 = q_block * block_q  # first token of this tile
    rows = block_q * group  # its rows: block_q tokens x the group's query heads, one K/V block for all

    @pl.when(row0 < q_len)
    def _():
        head_dim = q_ref.shape[1]
        start = (qs_ref[0] + row0) * group
        kv_len = kvl_ref[0]
        row_ok = row0 + lax.broadcasted_iota(jnp.int32, (rows,), 0) // group < q_len
        row_ok_2d = jnp.broadcast_to(row_ok[:, None], (rows, head_dim))
        q = plgpu.load(q_ref.at[pl.ds(start, rows), :], mask=row_ok_2d, other=0.0)
        pos = plgpu.load(pos_ref.at[pl.ds(start, rows)], mask=row_ok, other=-1)
        pos = jnp.where(row_ok, pos, -1)
        hi = jnp.minimum(kv_len, pos.max() + 1)  # keys [0, hi) can be visible to some row
        num_blocks = jnp.maximum(pl.cdiv(hi, block_k), 0)
        first_block = 0
        if window is not None:  # keys before the tile's first row's window are visible to no row
            first_pos = jnp.where(row_ok, pos, jnp.iinfo(jnp.int32).max).min()
            first_block = jnp.minimum(jnp.maximum(first_pos + 1 - window, 0) // block_k, num_blocks)

        def body(i, carry):
            key_pos, k, v = _gather_kv(bt_ref, kv_refs, i * block_k, kv_len, block_k, q.dtype, page_size, stacked)
            valid = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] < kv_len)  # causal + in range
            if window is not None:
                valid &= key_pos[None, :] > pos[:, None] - window
            return _online_softmax_block(carry, q, k, v, valid, scale)

        acc, _, l_run = lax.fori_loop(first_block, num_blocks, body, _online_softmax_init(rows, head_dim))
        out = acc / jnp.where(l_run > 0, l_run, 1.0)[:, None]
        plgpu.store(o_ref.at[pl.ds(start, rows), :], out.astype(o_ref.dtype), mask=row_ok_2d)


def _extend_call(
    q_rows: jax.Array,  # [Hkv, T * Gp, D]: each KV head's group of query heads, row t * Gp + g
    k_pool: KVPool,
    v_pool: KVPool,
    pos_rows: jax.Array,  # [T * Gp] int32
    q_start: jax.Array,  # [B] int32
    q_len: jax.Array,  # [B] int32
    kv_lens: jax.Array,  # [B] int32
    block_table: jax.Array,  # [B, Lp] int32, Lp * page_size % block_k == 0
    *,
    max_q_len: int,
    scale: float,
    block_q: int,
    block_k: int,
    group: int,
    window: int | None,
    page_size: int,
    interpret: bool,
    num_warps: int,
    num_stages: int,
) -> jax.Array:
    """The extend kernel call: output laid out as ``q_rows``, rows not covered by any request undefined."""
    num_kv_heads, num_rows, head_dim = q_rows.shape
    kv, stacked = _kv_operands(k_pool, v_pool)
    batch, width = block_table.shape
    kernel = functools.partial(_extend_kernel, scale=scale, block_q=block_q, block_k=block_k, group=group,
                               window=window, page_size=page_size, stacked=stacked)
    per_req = lambda b, h, i: (b,)
    row_spec = pl.BlockSpec((None, num_rows, head_dim), lambda b, h, i: (h, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, pl.cdiv(max_q_len, block_q)),
        in_specs=[
            pl.BlockSpec((1,), per_req),
            pl.BlockSpec((1,), per_req),
            pl.BlockSpec((1,), per_req),
            pl.BlockSpec((num_rows,), lambda b, h, i: (0,)),
            row_spec,
            pl.BlockSpec((None, width), lambda b, h, i: (b, 0)),
            *_kv_specs(kv, lambda b, h, i: h, stacked),
        ],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        interpret=interpret,
        compiler_params=_compiler_params(interpret, num_warps, num_stages),
        name=f"jsgl_paged_extend_bq{block_q}_g{group}_bk{block_k}{_suffix(kv, page_size, stacked)}",
    )(q_start, q_len, kv_lens, pos_rows, q_rows, block_table, *kv)


def paged_extend_attention(
    q: jax.Array,
    k_pool: KVPool,
    v_pool: KVPool,
    meta: AttentionMetadata,
    scale: float,
    *,
    block_q: int | None = None,
    block_k: int = 64,
    interpret: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Extend/prefill attention over ragged new tokens. ``q [T, Hq, D]`` -> ``[T, Hq, D]``.

    A program owns ``block_q`` tokens of one request and all ``G`` query heads of one KV head (GQA: each K/V
    block is gathered once for the group, not once per query head), the group padded to ``Gp``, a power of
    two: ``block_q * Gp`` query rows against each ``block_k`` keys (default ``block_q``: 64 rows' worth)."""
    interpret = _resolve_interpret(interpret)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[0]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    padded_group = pl.next_power_of_2(group)
    page_size = meta.page_size
    block_k = _page_block_k(page_size, block_k)
    width = meta.block_table.shape[1] * page_size  # in positions
    # No point in query tiles (much) taller than the longest request; on GPU the tile's rows feed tl.dot (>= 16).
    block_q = block_q or max(64 // padded_group, 1)
    block_q = min(block_q, pl.next_power_of_2(meta.max_q_len))
    if not interpret:
        block_q = max(block_q, _MIN_DOT // min(padded_group, _MIN_DOT))
    # A power of two; the >= 16 rows tl.dot needs are the tile's, block_q * Gp (checked next), not block_q's.
    _check_block("block_q", block_q, interpret=True)
    _check_block("block_q * padded group", block_q * padded_group, interpret)
    _check_block("block_k", block_k, interpret)
    _check_block("head_dim", head_dim, interpret)

    # [T, Hq, D] -> [Hkv, T * Gp, D]: a KV head's query heads side by side in consecutive rows of each token.
    q_rows = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if padded_group != group:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_group - group), (0, 0)))
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, num_tokens * padded_group, head_dim)
    pos_rows = jnp.repeat(meta.positions.astype(jnp.int32), padded_group)
    q_len = jnp.clip(meta.q_len, 0, meta.max_q_len).astype(jnp.int32)
    kv_lens = jnp.clip(meta.kv_lens, 0, width).astype(jnp.int32)
    out = _extend_call(
        q_rows,
        k_pool,
        v_pool,
        pos_rows,
        meta.q_start.astype(jnp.int32),
        q_len,
        kv_lens,
        _pad_table(meta.block_table, block_k // page_size),
        max_q_len=meta.max_q_len,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        group=padded_group,
        window=meta.sliding_window,
        page_size=page_size,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    out = out.reshape(num_kv_heads, num_tokens, padded_group, head_dim)[:, :, :group]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    # Zero the rows no request covers (the kernel leaves them untouched/uninitialised), like the reference.
    tok = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
    covered = ((tok >= meta.q_start[None, :]) & (tok < (meta.q_start + q_len)[None, :])).any(axis=1)
    return jnp.where(covered[:, None, None], out, jnp.zeros((), q.dtype))


# ----------------------------------------------------------------------------------------------------
# Backend entry point.
# ----------------------------------------------------------------------------------------------------


def pallas_paged_attention(
    q: jax.Array,
    k_pool: KVPool,
    v_pool: KVPool,
    meta: AttentionMetadata,
    scale: float,
    *,
    decode_block_k: int = 64,
    decode_block_h: int | None = None,
    num_splits: int | None = None,
    extend_block_q: int | None = None,
    extend_block_k: int = 64,
    interpret: bool | None = None,
) -> jax.Array:
    """The "pallas" backend: decode kernel when ``meta.max_q_len == 1``, extend kernel otherwise.

    With ``interpret`` unset (and no module-wide ``INTERPRET``), interpreting or compiling follows the platform
    the step is lowered for, not the machine tracing it: ``lax.platform_dependent`` lowers the interpreted
    kernel for CPU and the compiled Triton one for CUDA, so a step lowered on a CPU host for a GPU gets the
    GPU kernels."""
    if interpret is None and INTERPRET is None:
        def variant(flag: bool):
            return functools.partial(pallas_paged_attention, scale=scale, decode_block_k=decode_block_k,
                                     decode_block_h=decode_block_h, num_splits=num_splits,
                                     extend_block_q=extend_block_q, extend_block_k=extend_block_k, interpret=flag)

        return jax.lax.platform_dependent(q, k_pool, v_pool, meta, cpu=variant(True), default=variant(False))
    if not isinstance(scale, (int, float)):  # traced scale: fold it into q, kernels get a static 1.0
        q = (q * scale).astype(q.dtype)
        scale = 1.0
    scale = float(scale)
    if meta.max_q_len == 1:
        return paged_decode_attention(
            q,
            k_pool,
            v_pool,
            meta,
            scale,
            block_k=decode_block_k,
            block_h=decode_block_h,
            num_splits=num_splits,
            interpret=interpret,
        )
    return paged_extend_attention(
        q, k_pool, v_pool, meta, scale, block_q=extend_block_q, block_k=extend_block_k, interpret=interpret
    )


register_attention_backend(AttentionBackend("pallas", pallas_paged_attention))

__all__ = [
    "INTERPRET",
    "default_num_splits",
    "paged_decode_attention",
    "paged_extend_attention",
    "pallas_paged_attention",
]
