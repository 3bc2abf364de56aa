"""Ragged paged attention for TPU: a Pallas (Mosaic) kernel serving decode, extend and mixed batches in one call.

Contract (the kernel, :func:`ragged_paged_attention`): the flat new tokens ``q [T, Hq, D]`` of ``num_seqs``
sequences laid end to end, sequence ``s`` owning tokens ``[cu_q_lens[s], cu_q_lens[s + 1])`` and attending over
its ``kv_lens[s]`` cached positions (its new tokens' K/V already written, the new tokens being its last
``q_len`` positions). Query ``i`` of sequence ``s`` sits at position ``kv_lens[s] - q_len + i`` and sees keys
``j <= position`` (and ``j > position - W`` under a sliding window ``W``): causal over the new tokens and full
over the cached prefix at once, so decode (``q_len == 1``), prefill, extend over a prefix and jump-forward's short
extends are one kernel. Tokens no sequence covers come back as zeros.

**Pages.** K and V are ``[Hkv, num_pages, page_size, D]`` in HBM (``memory_space=ANY``): jsgl's per-layer pool
``[Hkv, N, D]`` reshaped, no copy (page ``p`` is slots ``[p * page_size, (p + 1) * page_size)``). Which pages a
sequence reads is a *flat* page list: sequence ``s``'s pages are ``page_indices[cu_pages[s]:cu_pages[s + 1]]``
(``cdiv(kv_len, page_size)`` entries), not a padded ``[B, max_pages]`` row. ``cu_q_lens``, ``kv_lens``,
``num_seqs`` and ``first_seq`` (per query block, the first sequence it overlaps) are scalar-prefetched into SMEM,
and so is the page list while its static length is small (``SMEM_PAGE_LIST_BYTES``). A longer one (a length-free
step's, sized by the context: 64 requests at 128k in pages of 16 is 2 MiB) stays in HBM, padded by a block, and each
KV block's ``pages_per_block`` indices are copied into a two-slot SMEM buffer: SMEM use is bounded whatever the
context. Those copies run one block further ahead than the pages: block ``b + 2``'s indices are fetched while block
``b + 1``'s pages are in flight, so in the steady state they add no wait (only a program's first block waits on them).

**Blocks.** Grid ``(Hkv, cdiv(T, block_q))``. A program owns ``block_q`` flat tokens × the ``G = Hq / Hkv`` query
heads of one KV head (``R = block_q * G`` rows of ``q``, laid out ``[Hkv, T * G, D]`` by the wrapper so the tile
is contiguous). It walks the sequences its tokens belong to (several in a decode block, part of one in a long
prefill), and for each streams KV blocks of ``pages_per_block`` pages through an online softmax in float32:
each page is one async copy HBM→VMEM, and the next block's pages are copied while the current block is computed
(two VMEM buffers, one DMA semaphore each). The walk is one stream of blocks across sequences: a sequence's last
block starts the next sequence's first (the next one this program walks that has a block; padding rows are
skipped), so a decode block of many short sequences has no pipeline bubble per sequence, and the buffer slot
carries over from one sequence to the next. A block is loaded only up to the last key the program's queries can
see (and from the first one inside a sliding window). Rows of other sequences are masked out and left
untouched in the output. Pages past a sequence's end are fetched from page 0 (jsgl's reserved slot 0) so the
buffers never hold uninitialised values; the mask removes them.

**head_dim** not a multiple of 128 (SmolLM2's 64, an 80 or 96): ``q`` and the output are padded with zeros to
whole 128-lane vregs by the wrapper (and the output sliced back); the pools stay unpadded in HBM (no 2x pool memory
or DMA traffic at 64) and each KV block, once in VMEM, is stored into lanes ``[0, head_dim)`` of a 128-lane-wide
buffer whose other lanes are zeroed once per program, so every dot and the accumulator are lane-aligned. Zero lanes
add nothing to ``q.k`` or ``p.v``; the scale is the caller's (of the true head_dim). Unpadded head_dims lowered for
v5e/v6e too, but as 64-lane vectors whose unaligned dots Mosaic's own compile (unchecked here) would have to mask.

**8-bit KV** (:class:`jsgl.kernels.kv_quant.Int8Pool`): int8 pages and their per-token float32 scales
``[Hkv, num_pages, page_size]`` are fetched by the same per-page copies; the int8 values (exact in bf16) enter the
dots as they are and the scales multiply the scores (K) and the probabilities (V), rows of ``block_keys``.

Checked in the Pallas TPU interpreter and by lowering to Mosaic from a CPU host; never yet run on a TPU, so Mosaic's
own compile (layouts, the ``[R, 1]`` softmax statistics, the page-buffer reshapes) is unverified. The new K/V
reach the pool before this kernel runs, through a kernel of their own (:mod:`jsgl.kernels.tpu_kv_write`, the
backend's ``write``), not written from inside this one; the pool is the same head-major layout as everywhere
(docs/tpu.md says why).
Under tensor parallelism the runner calls it per shard (``TensorParallel.shard_attention``), checked by lowering at
tp=4; the step's signature carries no attended length (``Backends.length_free``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jsgl.kernels.attention import AttentionBackend, AttentionMetadata, register_attention_backend
from jsgl.kernels.kv_quant import Int8Pool, KVPool, LayerPool

# A masked score: finite, so a fully masked row gives exp(0) garbage that the final select drops, never NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# (block_q tokens, keys per KV block) by TPU generation: KV blocks fill the MXU (128 wide on v5e, 256 on v6e).
BLOCK_SIZES = {"TPU v5 lite": (32, 128), "TPU v6 lite": (32, 256)}
DEFAULT_BLOCK_SIZES = (32, 128)
# A TPU vreg's lanes: q, the output and the K/V blocks the dots read are this wide (head_dim padded with zeros).
LANES = 128
# The largest flat page list scalar-prefetched whole into SMEM (4096 pages: 32 requests at 2k positions in pages of
# 16), a sliver of the 1 MiB SMEM of v4 and later; a longer one stays in HBM and each KV block's indices are copied
# in, so SMEM holds two blocks' indices whatever the context.
SMEM_PAGE_LIST_BYTES = 16 * 1024


class _Span(NamedTuple):
    """What of one sequence a program attends (int32 scalars): its first token ``q_lo`` and that token's position
    ``first_pos``, the program's tokens of it ``[lo, hi)`` and the KV blocks they see ``[kv_first, kv_stop)``."""

    q_lo: jax.Array
    first_pos: jax.Array
    lo: jax.Array
    hi: jax.Array
    kv_first: jax.Array
    kv_stop: jax.Array


def default_block_sizes(device_kind: str | None, page_size: int) -> tuple[int, int]:
    """``(block_q, pages_per_block)`` for a TPU generation (its ``device_kind``), chosen without a device."""
    block_q, block_keys = BLOCK_SIZES.get(device_kind or "", DEFAULT_BLOCK_SIZES)
    return block_q, max(1, block_keys // page_size)


def _kernel(
    *refs, scale: float, group: int, page_size: int, pages_per_block: int, sliding_window: int | None,
    quantized: bool, head_dim: int, page_list_in_smem: bool,
):
    # Scalar prefetch (SMEM): the flat page list where it is small, then cu_pages, cu_q_lens, kv_lens, num_seqs,
    # first_seq, layer. Then this program's queries (VMEM block), the page list where it is not in SMEM (HBM), the
    # pools (HBM) and, in the 8-bit format, their scales (HBM); the output block; VMEM buffers for each pool (and
    # scales); their DMA semaphores; the page-index buffer and its semaphores (page list in HBM); where head_dim is
    # padded, the widened K and V blocks.
    if page_list_in_smem:
        page_list_ref, *refs = refs
    cu_pages_ref, cu_q_lens_ref, kv_lens_ref, num_seqs_ref, first_seq_ref, layer_ref, q_ref, *refs = refs
    if not page_list_in_smem:
        page_list_ref, *refs = refs
    padded = head_dim != q_ref.shape[-1]  # q and o carry head_dim padded to 128 lanes; the pages do not
    if padded:  # the K/V block widened to the padded lanes (zeros past head_dim) in VMEM
        *refs, k_wide, v_wide = refs
    if not page_list_in_smem:  # two blocks' page indices (SMEM) and a DMA semaphore per slot
        *refs, index_buf, index_sems = refs
    if quantized:
        k_hbm_ref, v_hbm_ref, ks_hbm_ref, vs_hbm_ref, o_ref, k_buf, v_buf, ks_buf, vs_buf, sems = refs
        pools = ((k_hbm_ref, k_buf), (v_hbm_ref, v_buf), (ks_hbm_ref, ks_buf), (vs_hbm_ref, vs_buf))
    else:
        k_hbm_ref, v_hbm_ref, o_ref, k_buf, v_buf, sems = refs
        pools = ((k_hbm_ref, k_buf), (v_hbm_ref, v_buf))
    head, q_blk = pl.program_id(0), pl.program_id(1)
    rows = q_ref.shape[0]
    block_q = rows // group
    block_keys = pages_per_block * page_size
    block_start = q_blk * block_q
    block_end = block_start + block_q
    num_seqs = num_seqs_ref[0]
    # The flat token of each row; rows are token-major (G heads of one token consecutive).
    row_token = block_start + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group
    q = q_ref[...]
    o_ref[...] = jnp.zeros_like(o_ref)
    if padded:  # lanes past head_dim stay zero: each block's pages are stored into lanes [0, head_dim) only
        k_wide[...] = jnp.zeros_like(k_wide)
        v_wide[...] = jnp.zeros_like(v_wide)

    # The program's walk: its sequences in order, each over KV blocks [kv_first, kv_stop); one stream of blocks.
    def in_walk(seq):  # seq is (still) a sequence this program walks: its tokens start before the block's end
        return (seq < num_seqs) & (cu_q_lens_ref[jnp.minimum(seq, num_seqs)] < block_end)

    def span(seq) -> _Span:
        seq = jnp.minimum(seq, kv_lens_ref.shape[0] - 1)  # one past num_seqs (the walk's end) reads a real entry
        q_lo, q_hi = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
        first_pos = kv_lens_ref[seq] - (q_hi - q_lo)  # position of the sequence's first new token
        lo, hi = jnp.maximum(q_lo, block_start), jnp.minimum(q_hi, block_end)
        kv_end = first_pos + (hi - q_lo)  # keys past the block's last query are never visible
        kv_first = jnp.int32(0)
        if sliding_window is not None:  # keys before the block's first query's window are never visible
            kv_first = jnp.maximum(first_pos + (lo - q_lo) - sliding_window + 1, 0) // block_keys
        return _Span(q_lo, first_pos, lo, hi, kv_first, (kv_end + block_keys - 1) // block_keys)

    def with_blocks(seq):  # the first sequence from seq on with a KV block here (padding rows have none)
        def skip(s):
            here = span(s)
            return in_walk(s) & ((here.hi <= here.lo) | (here.kv_stop <= here.kv_first))
        return lax.while_loop(skip, lambda s: s + 1, seq)

    def advance(seq, kv_blk):  # the block after (seq, kv_blk): the next one of seq, else the next sequence's first
        def next_seq():
            nxt = with_blocks(seq + 1)
            return nxt, span(nxt).kv_first
        return lax.cond(kv_blk + 1 < span(seq).kv_stop, lambda: (seq, kv_blk + 1), next_seq)

    def index_copy(seq, kv_blk, slot):  # the block's pages_per_block page indices, HBM -> SMEM
        chunk = page_list_ref.at[pl.ds(cu_pages_ref[seq] + kv_blk * pages_per_block, pages_per_block)]
        return pltpu.make_async_copy(chunk, index_buf.at[slot], index_sems.at[slot])

    def fetch_indices(seq, kv_blk, slot):
        if not page_list_in_smem:
            index_copy(seq, kv_blk, slot).start()

    def wait_indices(slot):
        if not page_list_in_smem:
            index_copy(0, 0, slot).wait()

    def page_copy(which, page, slot, p):
        hbm, buf = pools[which]
        return pltpu.make_async_copy(hbm.at[head, layer_ref[0], page], buf.at[slot, p], sems.at[which, slot])

    def fetch_pages(seq, kv_blk, slot):
        # One DMA per page; pages past the sequence's end read page 0 so the buffer stays finite.
        first, end = cu_pages_ref[seq], cu_pages_ref[seq + 1]
        for p in range(pages_per_block):
            idx = first + kv_blk * pages_per_block + p
            listed = page_list_ref[jnp.minimum(idx, end - 1)] if page_list_in_smem else index_buf[slot, p]
            page = jnp.where(idx < end, listed, 0)
            for which in range(len(pools)):
                page_copy(which, page, slot, p).start()

    def wait_pages(slot):  # a wait needs the semaphore and the size only: any page stands in
        for p in range(pages_per_block):
            for which in range(len(pools)):
                page_copy(which, 0, slot, p).wait()

    def attend_seq(seq, slot, next_block):
        """Sequence seq's blocks, the first's pages already in flight into ``slot``; ``next_block`` (seq, kv_blk) is
        the walk's block after that one (its indices in flight). Each block starts the next one's pages (after the
        sequence's last: the next sequence's first) and the indices of the block after that; returns the slot and
        the next block after the sequence's last."""
        here = span(seq)
        in_seq = (row_token >= here.lo) & (row_token < here.hi)
        q_pos = here.first_pos + row_token - here.q_lo  # [R, 1]

        def body(kv_blk, carry):
            slot, next_block, m, denom, acc = carry
            has_next = in_walk(next_block[0])

            @pl.when(has_next)
            def _():
                wait_indices(1 - slot)
                fetch_pages(*next_block, 1 - slot)

            block_after = advance(*next_block)
            if not page_list_in_smem:  # block b + 2's indices while block b + 1's pages are in flight

                @pl.when(has_next & in_walk(block_after[0]))
                def _():
                    fetch_indices(*block_after, slot)

            wait_pages(slot)
            k = k_buf[slot].reshape(block_keys, head_dim)
            v = v_buf[slot].reshape(block_keys, head_dim)
            if quantized:  # int8 is exact in bf16/f32: dot the values, apply the per-token scales to the scores
                k, v = k.astype(q.dtype), v.astype(q.dtype)
            if padded:  # masked stores at lane 0, then whole-vreg dots: zero lanes add nothing to q.k or p.v
                k_wide[:, :head_dim] = k.astype(k_wide.dtype)
                v_wide[:, :head_dim] = v.astype(v_wide.dtype)
                k, v = k_wide[...], v_wide[...]
            s = lax.dot_general(q.astype(k.dtype), k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale
            if quantized:
                s = s * ks_buf[slot].reshape(1, block_keys)
            k_pos = kv_blk * block_keys + lax.broadcasted_iota(jnp.int32, (rows, block_keys), 1)
            visible = k_pos <= q_pos
            if sliding_window is not None:
                visible &= k_pos > q_pos - sliding_window
            s = jnp.where(visible, s, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
            p = jnp.exp(s - m_new)
            alpha = jnp.exp(m - m_new)
            denom = alpha * denom + p.sum(axis=1, keepdims=True)
            # V's scale folds into the probabilities: p @ (s_v * v) == (p * s_v) @ v.
            pv_weights = p * vs_buf[slot].reshape(1, block_keys) if quantized else p
            pv = jnp.dot(pv_weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return 1 - slot, block_after, m_new, denom, alpha * acc + pv

        init = (slot, next_block, jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
                jnp.zeros((rows, q.shape[1]), jnp.float32))
        slot, next_block, _, denom, acc = lax.fori_loop(here.kv_first, here.kv_stop, body, init)
        out = acc / jnp.where(in_seq, denom, 1.0)
        o_ref[...] = jnp.where(in_seq, out.astype(o_ref.dtype), o_ref[...])
        return slot, next_block

    def step(carry):
        seq, slot, next_block = carry
        slot, next_block = attend_seq(seq, slot, next_block)
        return with_blocks(seq + 1), slot, next_block

    # The walk's first block (its indices waited for: once per program), then the next block's indices.
    seq = with_blocks(first_seq_ref[q_blk])
    kv_first = span(seq).kv_first
    next_block = advance(seq, kv_first)

    @pl.when(in_walk(seq))
    def _():
        fetch_indices(seq, kv_first, 0)
        wait_indices(0)
        fetch_pages(seq, kv_first, 0)

        @pl.when(in_walk(next_block[0]))
        def _():
            fetch_indices(*next_block, 1)

    lax.while_loop(lambda carry: in_walk(carry[0]), step, (seq, jnp.int32(0), next_block))


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block", "sliding_window", "interpret",
                                             "page_list_smem_bytes"))
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_indices: jax.Array,
    cu_pages: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    num_seqs: jax.Array,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    layer: jax.Array | None = None,
    *,
    scale: float,
    block_q: int = DEFAULT_BLOCK_SIZES[0],
    pages_per_block: int | None = None,
    sliding_window: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    page_list_smem_bytes: int = SMEM_PAGE_LIST_BYTES,
) -> jax.Array:
    """The kernel. ``q [T, Hq, D]``; ``k_pages, v_pages [Hkv, num_pages, page_size, D]``; ``page_indices`` flat
    int32, sequence ``s``'s pages at ``[cu_pages[s], cu_pages[s + 1])``; ``cu_q_lens`` and ``cu_pages`` ``[S + 1]``;
    ``kv_lens [S]``; ``num_seqs [1]`` (sequences ``>= num_seqs[0]`` are ignored). Returns ``[T, Hq, D]``.
    The 8-bit format: int8 pages with ``k_scales, v_scales [Hkv, num_pages, page_size]`` float32 (one per token
    and head, as :mod:`jsgl.kernels.kv_quant`), fetched page by page beside the values.
    ``layer`` (int32 scalar): the pages (and scales) carry a layer axis after the heads, ``[Hkv, L, num_pages, ...]``
    (a scanned forward's stacked pools), and the kernel reads this layer's pages from the stack without a copy.
    ``interpret``: run through the Pallas TPU interpreter (any backend) instead of Mosaic (``True``, or the
    interpreter's parameters).
    ``page_list_smem_bytes``: the largest ``page_indices`` (in bytes) scalar-prefetched whole into SMEM; a longer
    one is read from HBM, ``pages_per_block`` indices at a time."""
    num_tokens, num_q_heads, head_dim = q.shape
    if layer is None:  # one layer's pools: a layer axis of 1 (a reshape)
        k_pages, v_pages = k_pages[:, None], v_pages[:, None]
        k_scales, v_scales = (None, None) if k_scales is None else (k_scales[:, None], v_scales[:, None])
        layer = jnp.zeros((), jnp.int32)
    num_kv_heads, _, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    if pages_per_block is None:
        pages_per_block = default_block_sizes(None, page_size)[1]
    num_blocks = pl.cdiv(num_tokens, block_q)
    padded = num_blocks * block_q
    # head_dim padded to whole 128-lane vregs for q, the output and the dots (zeros: q.k and p.v unchanged; the
    # scale is the caller's, of the true head_dim); the pages stay unpadded in HBM and are widened in VMEM.
    lanes = pl.cdiv(head_dim, LANES) * LANES
    # Token-major rows per KV head: [Hkv, T * G, D], the G heads of one token consecutive.
    qh = jnp.pad(q, ((0, padded - num_tokens), (0, 0), (0, lanes - head_dim)))
    qh = qh.reshape(padded, num_kv_heads, group, lanes).transpose(1, 0, 2, 3)
    qh = qh.reshape(num_kv_heads, padded * group, lanes)
    # The first sequence each query block overlaps: the first s with cu_q_lens[s + 1] > block start.
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    first_seq = jnp.searchsorted(cu_q_lens[1:], starts, side="right").astype(jnp.int32)

    rows = block_q * group
    q_spec = pl.BlockSpec((None, rows, lanes), lambda h, i, *_: (h, i, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    quantized = k_scales is not None
    pools, in_specs, scratch = [k_pages, v_pages], [q_spec, hbm, hbm], [buf, buf]
    if quantized:
        pools += [k_scales, v_scales]
        in_specs += [hbm, hbm]
        scratch += [pltpu.VMEM((2, pages_per_block, page_size), jnp.float32)] * 2
    scratch.append(pltpu.SemaphoreType.DMA((len(pools), 2)))
    page_list_in_smem = page_indices.size * page_indices.dtype.itemsize <= page_list_smem_bytes
    scalars = [cu_pages, cu_q_lens, kv_lens, num_seqs, first_seq, jnp.reshape(layer, (1,)).astype(jnp.int32)]
    inputs = [qh, *pools]
    if page_list_in_smem:
        scalars.insert(0, page_indices)
    else:  # in HBM, padded so that the last sequence's last block's indices are whole
        inputs.insert(1, jnp.pad(page_indices, (0, pages_per_block)))
        in_specs.insert(1, hbm)
        scratch += [pltpu.SMEM((2, pages_per_block), jnp.int32), pltpu.SemaphoreType.DMA((2,))]
    if lanes > head_dim:
        scratch += [pltpu.VMEM((pages_per_block * page_size, lanes), q.dtype if quantized else k_pages.dtype)] * 2
    kernel = functools.partial(_kernel, scale=scale, group=group, page_size=page_size,
                               pages_per_block=pages_per_block, sliding_window=sliding_window, quantized=quantized,
                               head_dim=head_dim, page_list_in_smem=page_list_in_smem)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(num_kv_heads, num_blocks),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(qh.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        # The block sizes in the name: which generation's defaults a lowered step took shows in its HLO.
        name=f"jsgl_ragged_paged_attention_bq{block_q}_kv{pages_per_block}x{page_size}",
    )(*scalars, *inputs)
    out = out.reshape(num_kv_heads, padded, group, lanes).transpose(1, 0, 2, 3)
    return out.reshape(padded, num_q_heads, lanes)[:num_tokens, :, :head_dim]


def kernel_inputs(meta: AttentionMetadata) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """jsgl's metadata as the kernel's scalar inputs: ``(page_indices, cu_pages, cu_q_lens, kv_lens, num_seqs)``.

    Assumes the runner's batch order (request ``b``'s tokens at ``q_start[b] = sum(q_len[:b])``; padding rows with
    ``q_len == 0`` anywhere). The flat page list is the table's rows compacted to ``cdiv(kv_len, page_size)`` pages
    each. Its static length stays the table's ``B * pages``, which a length-free step sets by the context (64
    requests at 128k, pages of 16: 2 MiB); past ``SMEM_PAGE_LIST_BYTES`` the kernel keeps it in HBM and copies each
    KV block's indices into SMEM, so SMEM holds a bounded slice of it whatever the context.
    """
    table, page = meta.block_table, meta.page_size
    batch, width = table.shape
    kv_lens = jnp.where(meta.q_len > 0, meta.kv_lens, 0).astype(jnp.int32)
    cu_q = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(meta.q_len).astype(jnp.int32)])
    pages = (kv_lens + page - 1) // page
    cu_pages = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(pages).astype(jnp.int32)])
    col = jnp.arange(width, dtype=jnp.int32)[None, :]
    dest = jnp.where(col < pages[:, None], cu_pages[:-1, None] + col, batch * width)
    flat = jnp.zeros(batch * width, jnp.int32).at[dest.reshape(-1)].set(table.reshape(-1), mode="drop")
    return flat, cu_pages, cu_q, kv_lens, jnp.full((1,), batch, jnp.int32)


def _target_tpu() -> str | None:
    """The device kind of the TPU being traced for (this process's, or an abstract mesh's), else None. Decided at
    trace time: the interpreter's callbacks cannot sit in a ``lax.platform_dependent`` branch."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None and device.platform == "tpu":
        return device.device_kind
    return jax.devices()[0].device_kind if jax.default_backend() == "tpu" else None


def tpu_paged_attention(
    q: jax.Array, k_pool: KVPool, v_pool: KVPool, meta: AttentionMetadata, scale: float, *,
    block_q: int | None = None, pages_per_block: int | None = None,
    interpret: bool | pltpu.InterpretParams | None = None,
) -> jax.Array:
    """The "tpu" backend: jsgl's attention contract (``q [T, Hq, D]``, pools ``[Hkv, N, D]`` or a layer of a stack,
    :class:`AttentionMetadata`) on the kernel. ``interpret`` unset: Mosaic where the step is lowered for TPU, the
    interpreter elsewhere, so a step lowered on this CPU host for TPU (an abstract TPU device) gets the kernel. Block
    sizes default per TPU generation, the target's."""
    target = _target_tpu()
    if interpret is None:
        interpret = target is None
    layer = None
    if isinstance(k_pool, LayerPool):  # a scanned forward: the stack and the layer, read in place
        k_pool, v_pool, layer = k_pool.stack, v_pool.stack, k_pool.layer
    page = meta.page_size
    default_q, default_pages = default_block_sizes(target, page)

    def pages(x: jax.Array) -> jax.Array:  # [Hkv, (L,) N, (D)] -> [Hkv, (L,) N / page, page, (D)]: a reshape
        lead = 1 if layer is None else 2
        return x.reshape(*x.shape[:lead], x.shape[lead] // page, page, *x.shape[lead + 1:])

    if isinstance(k_pool, Int8Pool):
        pools = [pages(k_pool.values), pages(v_pool.values), pages(k_pool.scales), pages(v_pool.scales)]
    else:
        pools = [pages(k_pool), pages(v_pool)]
    if not isinstance(scale, (int, float)):  # a traced scale: folded into q, the kernel's stays static
        q, scale = (q * scale).astype(q.dtype), 1.0
    scales = pools[2:] or [None, None]
    return ragged_paged_attention(
        q, *pools[:2], *kernel_inputs(meta), *scales, layer, scale=float(scale), block_q=block_q or default_q,
        pages_per_block=pages_per_block or default_pages, sliding_window=meta.sliding_window, interpret=interpret,
        page_list_smem_bytes=SMEM_PAGE_LIST_BYTES)  # read per call: a test can shrink it


from jsgl.kernels.tpu_kv_write import write_rows  # noqa: E402  (it imports _target_tpu from here when called)

register_attention_backend(AttentionBackend("tpu", tpu_paged_attention, write=write_rows))
