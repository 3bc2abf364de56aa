"""Writing the new tokens' K (or V) rows into the KV pool on TPU: a Pallas (Mosaic) kernel, in place of XLA's
scatter (slow on TPU: vLLM's TPU backend replaced it with a Pallas ``kv_cache_update`` kernel for the same reason).

Contract (:func:`write_rows`): that of :func:`jsgl.kernels.kv_quant.write`. The pool ``[Hkv, N, D]``, a scanned
model's stack ``[Hkv, L, N, D]`` at a traced layer (:class:`~jsgl.kernels.kv_quant.LayerPool`), or the 8-bit format
(:class:`~jsgl.kernels.kv_quant.Int8Pool`, rows quantized here in JAX by :func:`kv_quant.quantize`, the kernel
writing values and scales) comes back with ``x [T, Hkv, D]`` at ``slots [T]``; the pool arrays stay in HBM
(``memory_space=ANY``), aliased to the outputs, so nothing is copied. Padding tokens write the reserved slot 0.

**Why blocks, not one DMA per token.** The pool is head-major, so a token's row is one row of the ``(N, D)`` tiles of
every head. XLA lays a 16-bit (8-bit) array's tiles out with two (four) consecutive rows interleaved in each 32-bit
word (``T(8,128)(2,1)``), so one bf16 or int8 row cannot be copied alone: Mosaic requires a DMA's offset and size
along tiled dimensions to be whole tiles (``MemRefSliceOp::verifyOffsetAndSizeTileAlignment``, jaxlib's Mosaic
dialect; only a 32-bit argument one tile wide is re-tiled ``(1, 128)``, which allows any row). So the kernel works
in **blocks**: the ``span = 8 * packing`` slots of one tile row (8 float32, 16 bfloat16, 32 int8), read into VMEM,
merged with the block's new rows, written back. The new rows reach the block through a float32 VMEM stage, which
Mosaic tiles ``(1, 128)`` (32-bit, ``D <= 128``): one async copy per token, all heads at once (strided over heads
in the stage), at any row. The merge is a select in float32 (exact for bf16, f16 and int8 values).

**Runs.** Tokens are sorted by slot (one ``argsort`` of ``T`` ints; the same for K, V and every layer, so XLA
computes it once) and grouped into runs of one block each: every block is read and written once per call, a
prefill's consecutive slots fill whole blocks, and no block is read while a write to it is in flight. Blocks are
read ``AHEAD`` runs ahead into ``2 * AHEAD`` buffers; a buffer is refilled once its write-back has had ``AHEAD``
merges' time to land.

**Scales** (8-bit format; ``[Hkv, (L,) N]`` float32, slots along lanes): blocks of 128 slots (one lane tile) of
the layer's 8-row tile group (of every layer where ``L`` is not a multiple of 8: a whole dimension needs no
alignment), merged by per-head selects of each token's scale, read from SMEM, at its lane.

Pools the blocks do not tile (``N`` not a multiple of ``span``, or of 128 for the 8-bit format's scales; head_dim
over 128) are written by :func:`kv_quant.write` instead; an engine on a TPU sizes its pool in whole 128-slot
blocks (``jsgl.engine.platform.pool_slots``), so its pools fit at any head_dim up to 128.

Checked in the Pallas TPU interpreter and by lowering for TPU from a CPU host: Mosaic's own compile (the tilings
assumed above, the f32 conversions and selects) is unverified until it runs on a TPU, where the engine's first-step
check (:mod:`jsgl.kernels.self_check`) writes through it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jsgl.kernels import kv_quant
from jsgl.kernels.kv_quant import Int8Pool, KVPool, LayerPool

SUBLANES = 8
LANES = 128
# Blocks read ahead of the one being merged; twice as many buffers, so a write-back has AHEAD merges to land.
AHEAD = 4
BUFFERS = 2 * AHEAD


def row_span(dtype: Any) -> int:
    """Slots per block of a values pool of ``dtype``: the rows of one ``(8 * packing, 128)`` tile."""
    return SUBLANES * (4 // jnp.dtype(dtype).itemsize)


def fits(pool: KVPool) -> bool:
    """Whether the kernel writes ``pool`` (else :func:`write_rows` falls back to :func:`kv_quant.write`)."""
    stored = pool.stack if isinstance(pool, LayerPool) else pool
    values = stored.values if isinstance(stored, Int8Pool) else stored
    num_slots, head_dim = values.shape[-2:]
    whole_lanes = not isinstance(stored, Int8Pool) or num_slots % LANES == 0
    return head_dim <= LANES and num_slots % row_span(values.dtype) == 0 and whole_lanes


def _runs(slots: jax.Array, span: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(sorted slots, their tokens, run starts [T + 1], run count [1])``: runs of sorted tokens in one block."""
    num_tokens = slots.shape[0]
    order = jnp.argsort(slots, stable=True).astype(jnp.int32)
    sorted_slots = slots[order]
    block = sorted_slots // span
    first = jnp.concatenate([jnp.ones(1, bool), block[1:] != block[:-1]])
    (starts,) = jnp.nonzero(first, size=num_tokens, fill_value=num_tokens)
    run_start = jnp.concatenate([starts.astype(jnp.int32), jnp.full(1, num_tokens, jnp.int32)])
    return sorted_slots, order, run_start, jnp.sum(first, dtype=jnp.int32).reshape(1)


def _pipelined(num_runs: jax.Array, block: Callable, buffers: Any, sems: Any, fetch_rows: Callable,
               wait_rows: Callable, merge: Callable) -> None:
    """Each run's pool block read into ``buffers[run % BUFFERS]`` ``AHEAD`` runs ahead (with its new rows:
    ``fetch_rows``), merged, written back. Runs hold distinct blocks, so reads and writes never overlap on one."""

    def copy(run: jax.Array, to_pool: bool) -> Any:
        buf = buffers.at[run % BUFFERS]
        src, dst = (buf, block(run)) if to_pool else (block(run), buf)
        return pltpu.make_async_copy(src, dst, sems.at[int(to_pool), run % BUFFERS])

    def fetch(run: jax.Array) -> None:
        copy(run, False).start()
        fetch_rows(run)

    lax.fori_loop(0, jnp.minimum(num_runs, AHEAD), lambda run, c: fetch(run), None)

    def body(run: jax.Array, carry: None) -> None:
        copy(run, False).wait()
        wait_rows(run)
        ahead = run + AHEAD

        @pl.when(ahead < num_runs)
        def _():
            @pl.when(ahead >= BUFFERS)  # the buffer's last run has written back
            def _():
                copy(ahead - BUFFERS, True).wait()

            fetch(ahead)

        merge(run)
        copy(run, True).start()
        return carry

    lax.fori_loop(0, num_runs, body, None)
    # The loop waited the write-backs of runs [0, num_runs - BUFFERS); the rest land here.
    lax.fori_loop(jnp.maximum(num_runs - BUFFERS, 0), num_runs, lambda run, c: copy(run, True).wait(), None)


def _values_kernel(sorted_slots_ref, order_ref, run_start_ref, num_runs_ref, layer_ref, rows_hbm, pool_hbm,
                   out_hbm, blocks, stage, sems, *, span: int, stacked: bool):
    """Values pool ``[Hkv, (L,) N, D]`` (aliased: ``pool_hbm`` is ``out_hbm``); ``rows_hbm [T, Hkv, 1, D]`` float32;
    ``blocks [BUFFERS, Hkv, span, D]`` of the pool's dtype and ``stage`` (float32, the same shape) in VMEM."""
    del pool_hbm
    head_dim = blocks.shape[-1]

    def block(run: jax.Array) -> Any:
        start = pl.multiple_of(sorted_slots_ref[run_start_ref[run]] // span * span, span)
        if stacked:
            return out_hbm.at[:, layer_ref[0], pl.ds(start, span), :]
        return out_hbm.at[:, pl.ds(start, span), :]

    def row_copy(i: jax.Array, buf: jax.Array) -> Any:  # sorted token i into its row of the stage, every head
        row = sorted_slots_ref[i] % span
        return pltpu.make_async_copy(rows_hbm.at[order_ref[i]], stage.at[buf, :, pl.ds(row, 1), :], sems.at[2, buf])

    def each_token(run: jax.Array, op: Callable) -> None:
        end = run_start_ref[run + 1]

        def one(i: jax.Array, carry: None) -> None:
            # Of tokens sharing a slot (padding's slot 0) the last writes, as a sequential scatter would.
            @pl.when((i + 1 == end) | (sorted_slots_ref[jnp.minimum(i + 1, end - 1)] != sorted_slots_ref[i]))
            def _():
                op(i, run % BUFFERS)

            return carry

        lax.fori_loop(run_start_ref[run], end, one, None)

    def merge(run: jax.Array) -> None:
        buf = run % BUFFERS
        row_ids = lax.broadcasted_iota(jnp.int32, (span, head_dim), 0)
        written = lax.fori_loop(run_start_ref[run], run_start_ref[run + 1],
                                lambda i, w: jnp.where(row_ids == sorted_slots_ref[i] % span, 1, w),
                                jnp.zeros((span, head_dim), jnp.int32))
        old = blocks[buf].astype(jnp.float32)
        blocks[buf] = jnp.where(written[None] != 0, stage[buf], old).astype(blocks.dtype)

    _pipelined(num_runs_ref[0], block, blocks, sems,
               fetch_rows=lambda run: each_token(run, lambda i, buf: row_copy(i, buf).start()),
               wait_rows=lambda run: each_token(run, lambda i, buf: row_copy(i, buf).wait()), merge=merge)


def _scales_kernel(sorted_slots_ref, order_ref, run_start_ref, num_runs_ref, layer_ref, new_scales_ref,
                   scales_hbm, out_hbm, blocks, sems, *, group: int, stacked: bool):
    """Scales ``[Hkv, (L,) N]`` float32 (aliased); ``new_scales_ref [T * Hkv]`` in SMEM; ``blocks`` in VMEM:
    ``[BUFFERS, Hkv, group, 128]`` (a stack: ``group`` layers' rows) or ``[BUFFERS, Hkv, 128]``."""
    del scales_hbm
    heads = blocks.shape[1]
    whole_stack = stacked and group == out_hbm.shape[1]

    def block(run: jax.Array) -> Any:
        start = pl.multiple_of(sorted_slots_ref[run_start_ref[run]] // LANES * LANES, LANES)
        if not stacked:
            return out_hbm.at[:, pl.ds(start, LANES)]
        first_layer = 0 if whole_stack else pl.multiple_of(layer_ref[0] // group * group, group)
        return out_hbm.at[:, pl.ds(first_layer, group), pl.ds(start, LANES)]

    def merge(run: jax.Array) -> None:
        buf = run % BUFFERS
        lane_ids = lax.broadcasted_iota(jnp.int32, (1, LANES), 1)

        def put(i: jax.Array, carry: None) -> None:
            lane, token = sorted_slots_ref[i] % LANES, order_ref[i]
            for head in range(heads):
                rows, row = (blocks.at[buf, head], layer_ref[0] % group) if stacked else (blocks.at[buf], head)
                old = rows[pl.ds(row, 1), :]
                rows[pl.ds(row, 1), :] = jnp.where(lane_ids == lane, new_scales_ref[token * heads + head], old)
            return carry

        lax.fori_loop(run_start_ref[run], run_start_ref[run + 1], put, None)

    _pipelined(num_runs_ref[0], block, blocks, sems, fetch_rows=lambda run: None, wait_rows=lambda run: None,
               merge=merge)


def _call(kernel: Callable, name: str, runs: tuple, layer: jax.Array, extra_scalars: list, inputs: list,
          scratch: list, interpret: bool) -> jax.Array:
    """One pallas_call on a single program: the pool (the last of ``inputs``) aliased to its output."""
    scalars = [*runs, jnp.reshape(layer, (1,)).astype(jnp.int32), *extra_scalars]
    pool = inputs[-1]
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars), grid=(1,), in_specs=[hbm] * len(inputs), out_specs=hbm,
            scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={len(scalars) + len(inputs) - 1: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=name,
    )(*scalars, *inputs)


@functools.partial(jax.jit, static_argnames=("interpret",))  # one function an unrolled model's layers all call
def _write_values(values: jax.Array, layer: jax.Array | None, slots: jax.Array, rows: jax.Array,
                  interpret: bool) -> jax.Array:
    """``values [Hkv, (L,) N, D]`` with ``rows [T, Hkv, D]`` (float32, exact in the pool's dtype) at ``slots``."""
    span = row_span(values.dtype)
    num_kv_heads, head_dim = values.shape[0], values.shape[-1]
    block = (BUFFERS, num_kv_heads, span, head_dim)
    kernel = functools.partial(_values_kernel, span=span, stacked=layer is not None)
    scratch = [pltpu.VMEM(block, values.dtype), pltpu.VMEM(block, jnp.float32), pltpu.SemaphoreType.DMA((3, BUFFERS))]
    # A unit row axis: each token's copy lands on one row of the stage, the same shape on both sides.
    rows = rows.reshape(rows.shape[0], num_kv_heads, 1, head_dim)
    return _call(kernel, f"jsgl_kv_write_rows_x{span}", _runs(slots, span), _layer(layer), [], [rows, values],
                 scratch, interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _write_scales(scales: jax.Array, layer: jax.Array | None, slots: jax.Array, new_scales: jax.Array,
                  interpret: bool) -> jax.Array:
    """``scales [Hkv, (L,) N]`` with ``new_scales [T, Hkv]`` at ``slots``."""
    num_kv_heads = scales.shape[0]
    stacked = layer is not None
    # A stack's blocks take the layer's 8-row tile of layers, or every layer (a whole dimension) where L is no
    # multiple of 8 (an 8-row block of the last tile would overrun the stack).
    group = (SUBLANES if scales.shape[1] % SUBLANES == 0 else scales.shape[1]) if stacked else None
    block = (BUFFERS, num_kv_heads, group, LANES) if stacked else (BUFFERS, num_kv_heads, LANES)
    kernel = functools.partial(_scales_kernel, group=group, stacked=stacked)
    scratch = [pltpu.VMEM(block, jnp.float32), pltpu.SemaphoreType.DMA((2, BUFFERS))]
    return _call(kernel, "jsgl_kv_write_scales", _runs(slots, LANES), _layer(layer),
                 [new_scales.astype(jnp.float32).reshape(-1)], [scales], scratch, interpret)


def _layer(layer: jax.Array | None) -> jax.Array:
    return jnp.zeros((), jnp.int32) if layer is None else layer


def write_rows(pool: KVPool, slots: jax.Array, x: jax.Array, *, interpret: bool | None = None) -> KVPool:
    """The pool with ``x [T, Hkv, D]`` (the new tokens' K or V) written at ``slots [T]``: :func:`kv_quant.write`'s
    contract, through the kernel. ``interpret`` unset: Mosaic where the step is lowered for a TPU, the Pallas TPU
    interpreter elsewhere (as the "tpu" attention backend decides)."""
    if interpret is None:
        from jsgl.kernels.tpu_attention import _target_tpu  # here: tpu_attention imports this module

        interpret = _target_tpu() is None
    if x.shape[0] == 0 or not fits(pool):
        return kv_quant.write(pool, slots, x)
    stored, layer = (pool.stack, pool.layer) if isinstance(pool, LayerPool) else (pool, None)
    slots = slots.astype(jnp.int32)
    if isinstance(stored, Int8Pool):
        values, scales = kv_quant.quantize(x)
        stored = Int8Pool(_write_values(stored.values, layer, slots, values.astype(jnp.float32), interpret),
                          _write_scales(stored.scales, layer, slots, scales, interpret))
    else:  # rounded to the pool's dtype first, as kv_quant.write stores them; exact in float32
        stored = _write_values(stored, layer, slots, x.astype(stored.dtype).astype(jnp.float32), interpret)
    return LayerPool(stored, pool.layer) if isinstance(pool, LayerPool) else stored
