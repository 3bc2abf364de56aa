"""The TPU ragged paged-attention kernel (jsgl.kernels.tpu_attention) vs the pure-JAX reference, in Pallas TPU
interpret mode on CPU, and its Mosaic lowering for TPU v5e/v6e from this machine: alone, and in the whole engine
step at tp=1 and tp=4. An engine serving tiny checkpoints through the interpreted kernel against transformers:
tests/test_model_families.py::test_tpu_kernel_engine_matches_transformers.

Pools are paged (page size 8, page 0 reserved) with shuffled pages; lengths 1, page - 1, page, page + 1 and a
long one; GQA ratios 1, 4 and 8; bfloat16, the 8-bit format and float32. Small query and KV blocks so sequences
straddle query blocks and take several double-buffered KV blocks.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from step_lowering import donated, lowered_step, partitions, pool_gathers, pool_scatters

from jsgl.engine.step_inputs import StepLayout
from jsgl.kernels import kv_quant, lowering, tpu_attention
from jsgl.kernels.attention import AttentionMetadata, get_attention_backend, native_paged_attention
from jsgl.kernels.kv_quant import Int8Pool, LayerPool
from jsgl.kernels.tpu_attention import kernel_inputs, ragged_paged_attention, tpu_paged_attention

PAGE = 8
HEAD_DIM = 32
SCALE = HEAD_DIM**-0.5
LONG = 5 * PAGE + 3
GQA = [(4, 1), (8, 2), (8, 1)]  # (Hq, Hkv): group 4, 4 with 2 KV heads, 8
GQA_ONE = (2, 2)  # group 1


def make_case(seed, num_q_heads, num_kv_heads, kv_lens, q_lens, *, dtype, extra_tokens=0, head_dim=HEAD_DIM,
              spare_columns=1):
    """A paged pool whose pages are shuffled among the requests, and the batch's metadata (runner order).
    ``dtype="int8"``: the 8-bit format (an Int8Pool of per-token scales) with bfloat16 queries. ``spare_columns``:
    the table's columns past the longest request's pages (0: the flat page list is full when all are as long)."""
    quantized = dtype == "int8"
    dtype = jnp.bfloat16 if quantized else dtype
    rng = np.random.default_rng(seed)
    kv_lens, q_lens = np.asarray(kv_lens, np.int32), np.asarray(q_lens, np.int32)
    pages = -(-kv_lens // PAGE)
    num_pages = int(pages.sum()) + 3  # page 0 reserved, two never used
    order = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((len(kv_lens), int(pages.max()) + spare_columns), np.int32)  # spare columns: padding
    off = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[off:off + n]
        off += n
    q_start = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    num_tokens = int(q_lens.sum()) + extra_tokens
    positions = np.full(num_tokens, -1, np.int32)
    for b in range(len(kv_lens)):
        positions[q_start[b]:q_start[b] + q_lens[b]] = kv_lens[b] - q_lens[b] + np.arange(q_lens[b])
    meta = AttentionMetadata(positions=jnp.asarray(positions), q_start=jnp.asarray(q_start),
                             q_len=jnp.asarray(q_lens), block_table=jnp.asarray(table),
                             kv_lens=jnp.asarray(kv_lens), max_q_len=max(1, int(q_lens.max())), page_size=PAGE)
    pool_shape = (num_kv_heads, num_pages * PAGE, head_dim)
    k = jnp.asarray(rng.standard_normal(pool_shape), dtype)
    v = jnp.asarray(rng.standard_normal(pool_shape), dtype)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_q_heads, head_dim)), dtype)
    if quantized:
        k, v = Int8Pool(*kv_quant.quantize(k)), Int8Pool(*kv_quant.quantize(v))
    return q, k, v, meta


def max_error(q, k, v, meta, interpret=True, **blocks):
    """Max |kernel - reference| over the tokens some request owns (padding tokens: zeros in the kernel)."""
    scale = q.shape[-1] ** -0.5  # of the true head_dim, however far the kernel pads it
    ref = jax.jit(native_paged_attention, static_argnums=4)(q, k, v, meta, scale)
    fn = functools.partial(tpu_paged_attention, scale=scale, interpret=interpret, **blocks)
    out = jax.jit(fn)(q, k, v, meta)
    assert out.shape == q.shape and out.dtype == q.dtype
    owned = np.asarray(meta.positions) >= 0
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not out[~owned].any()
    return float(np.abs(out[owned] - ref[owned]).max())


# bf16 (and int8 with bf16 queries): output rounding, 2^-8 relative, of values up to ~3.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, "int8": 3e-2}
LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, LONG]
CASES = {
    # One new token each; a padding row (q_len 0) in the middle and padding tokens after the batch.
    "decode": (LENGTHS[:2] + [0] + LENGTHS[2:], [1, 1, 0, 1, 1, 1], 2),
    # Extends over cached prefixes (a jump-forward-sized one among them) and two whole prefills.
    "extend": (LENGTHS, [1, PAGE - 1, 3, PAGE + 1, 11], 0),
    # Decode rows between extend rows, so one query block holds both.
    "mixed": ([LONG, 1, PAGE + 1, PAGE, PAGE - 1, 2 * PAGE], [1, 1, 5, 1, PAGE - 1, 2 * PAGE], 3),
}


# float32 in the full suite only (the quick loop's 60 s budget); test_default_blocks_... keeps one float32 case there.
@pytest.mark.parametrize("dtype", [jnp.bfloat16, "int8", pytest.param(jnp.float32, marks=pytest.mark.slow)])
@pytest.mark.parametrize("heads", [GQA_ONE, *GQA])
@pytest.mark.parametrize("batch", sorted(CASES))
def test_matches_reference(batch, heads, dtype):
    kv_lens, q_lens, extra_tokens = CASES[batch]
    q, k, v, meta = make_case(len(batch) + heads[0], *heads, kv_lens, q_lens, dtype=dtype, extra_tokens=extra_tokens)
    assert max_error(q, k, v, meta, block_q=4, pages_per_block=2) < TOLERANCE[dtype]


# Model head sizes: SmolLM2's 64 and an odd 80 (padded to 128 lanes in the kernel, the pages not), Llama-3's 128.
@pytest.mark.parametrize("dtype", [jnp.bfloat16, "int8"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("batch", ["decode", "extend"])
def test_head_dims(batch, head_dim, dtype):
    kv_lens, q_lens, extra_tokens = CASES[batch]
    q, k, v, meta = make_case(head_dim, 8, 2, kv_lens, q_lens, dtype=dtype, extra_tokens=extra_tokens,
                              head_dim=head_dim)
    assert max_error(q, k, v, meta, block_q=4, pages_per_block=2) < TOLERANCE[dtype]


def test_default_blocks_and_one_page_per_block():
    # The default block sizes (one query block, one KV block here) and the smallest KV block (one page).
    q, k, v, meta = make_case(11, 8, 2, *CASES["mixed"][:2], dtype=jnp.float32)
    assert max_error(q, k, v, meta) < 2e-5
    assert max_error(q, k, v, meta, block_q=2, pages_per_block=1) < 2e-5


def test_sliding_window():
    # The window starts the KV loop past the first blocks (LONG with W = 10) and masks inside a block.
    import dataclasses

    q, k, v, meta = make_case(5, 8, 2, *CASES["mixed"][:2], dtype=jnp.float32)
    meta = dataclasses.replace(meta, sliding_window=10)
    assert max_error(q, k, v, meta, block_q=4, pages_per_block=1) < 2e-5


def stack_layers(pool, other):
    """A [Hkv, 3, N, ...] stack whose layer 1 is pool (the others another pool's values)."""
    if isinstance(pool, Int8Pool):
        return Int8Pool(*(jnp.stack([o, x, o], axis=1) for x, o in ((pool.values, other.values),
                                                                 (pool.scales, other.scales))))
    return jnp.stack([other, pool, other], axis=1)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param("int8", marks=pytest.mark.slow)])
def test_layer_of_a_stack(dtype):
    # A scanned forward's pools: the kernel reads layer 1 of a [Hkv, 3, N, D] stack in place.
    q, k, v, meta = make_case(7, 8, 2, *CASES["mixed"][:2], dtype=dtype)
    k_stack, v_stack = LayerPool(stack_layers(k, v), jnp.int32(1)), LayerPool(stack_layers(v, k), jnp.int32(1))
    assert max_error(q, k_stack, v_stack, meta, block_q=4, pages_per_block=2) < TOLERANCE[dtype]


def test_flat_page_list():
    # Each request's pages, compacted: no padded [B, pages] row reaches the kernel.
    _, _, _, meta = make_case(0, 2, 2, [1, 0, 2 * PAGE + 1], [1, 0, 1], dtype=jnp.float32)
    pages, cu_pages, cu_q, kv_lens, num_seqs = kernel_inputs(meta)
    table = np.asarray(meta.block_table)
    assert list(np.asarray(cu_pages)) == [0, 1, 1, 4] and list(np.asarray(cu_q)) == [0, 1, 1, 2]
    assert list(np.asarray(pages)[:4]) == [table[0, 0], *table[2, :3]]
    assert list(np.asarray(kv_lens)) == [1, 0, 2 * PAGE + 1] and int(num_seqs[0]) == 3


def scalar_prefetch_count(q, k, v, meta, **blocks) -> int:
    """How many operands the kernel's pallas_call scalar-prefetches into SMEM (7 with the page list, 6 without)."""
    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                return eqn.params["grid_mapping"].num_index_operands
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns") and (found := find(inner)) is not None:
                    return found
        return None

    fn = functools.partial(tpu_paged_attention, scale=SCALE, interpret=True, **blocks)
    return find(jax.make_jaxpr(fn)(q, k, v, meta).jaxpr)


# The page list in HBM (a budget of 0 bytes): each KV block's 2 indices are copied into SMEM two blocks ahead of
# their pages; LONG's 6 pages are 3 of those chunks, and lengths 1, page - 1, page, page + 1 one each.
@pytest.mark.parametrize("dtype", [jnp.bfloat16, "int8"])
@pytest.mark.parametrize("batch", sorted(CASES))
def test_page_list_in_hbm(batch, dtype, monkeypatch):
    monkeypatch.setattr(tpu_attention, "SMEM_PAGE_LIST_BYTES", 0)
    kv_lens, q_lens, extra_tokens = CASES[batch]
    q, k, v, meta = make_case(len(batch), 8, 2, kv_lens, q_lens, dtype=dtype, extra_tokens=extra_tokens)
    assert scalar_prefetch_count(q, k, v, meta, block_q=4, pages_per_block=2) == 6
    assert max_error(q, k, v, meta, block_q=4, pages_per_block=2) < TOLERANCE[dtype]


@pytest.mark.parametrize("budget", [0, 1 << 20])  # HBM, SMEM
def test_full_page_list(budget, monkeypatch):
    # Every request has 3 pages and the table no spare column: the flat list is full, and the last request's second
    # block (pages 3 and 4 of 3) reads its indices past the list's end (the HBM path pads the list by a block; the
    # interpreter raises on an out-of-bounds read).
    monkeypatch.setattr(tpu_attention, "SMEM_PAGE_LIST_BYTES", budget)
    kv_lens = [3 * PAGE, 2 * PAGE + 1, 3 * PAGE - 1]
    q, k, v, meta = make_case(2, 4, 1, kv_lens, [1, PAGE + 1, 2], dtype=jnp.bfloat16, spare_columns=0)
    assert scalar_prefetch_count(q, k, v, meta, block_q=4, pages_per_block=2) == (6 if budget == 0 else 7)
    assert max_error(q, k, v, meta, block_q=4, pages_per_block=2) < TOLERANCE[jnp.bfloat16]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, "int8"])
def test_page_list_in_hbm_with_window_layer_and_padded_head_dim(dtype, monkeypatch):
    # The HBM page list beside the other paths: a sliding window (the first blocks skipped), layer 1 of a stack,
    # head_dim 64 (padded to 128 lanes).
    import dataclasses

    monkeypatch.setattr(tpu_attention, "SMEM_PAGE_LIST_BYTES", 0)
    q, k, v, meta = make_case(9, 8, 2, *CASES["mixed"][:2], dtype=dtype, head_dim=64)
    meta = dataclasses.replace(meta, sliding_window=10)
    k_stack, v_stack = LayerPool(stack_layers(k, v), jnp.int32(1)), LayerPool(stack_layers(v, k), jnp.int32(1))
    assert max_error(q, k_stack, v_stack, meta, block_q=4, pages_per_block=1) < TOLERANCE[dtype]


# Decode rows of 1 to 3 KV blocks (2 pages of 8: 16 keys) with padding rows between them (no new tokens, and no
# cached positions or some the step does not attend), 15 tokens in 4 query blocks: each program walks several short
# sequences, starting each one's first block while the previous one's last is computed, the slot carried across.
MANY_KV = [1, 17, 0, 33, 16, 20, 40, 5, 48, 2, 0, 0, 31, 9, 47, 3, 24, 12, 1, 32]
MANY_Q = [1, 1, 0, 1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1]


@pytest.mark.parametrize(("page_list", "dtype", "window"), [
    ("smem", jnp.bfloat16, None), ("hbm", jnp.bfloat16, None), ("hbm", "int8", None), ("smem", "int8", 20),
    ("hbm", jnp.bfloat16, 20)])  # a window of 20: the 33- and 48-long rows' walks start at their second block
def test_walk_across_many_short_sequences(page_list, dtype, window, monkeypatch):
    import dataclasses

    monkeypatch.setattr(tpu_attention, "SMEM_PAGE_LIST_BYTES", 0 if page_list == "hbm" else 1 << 20)
    q, k, v, meta = make_case(13, 8, 2, MANY_KV, MANY_Q, dtype=dtype, extra_tokens=1)
    meta = dataclasses.replace(meta, sliding_window=window)
    assert max_error(q, k, v, meta, block_q=4, pages_per_block=2) < TOLERANCE[dtype]


@pytest.mark.parametrize("page_list", ["smem", "hbm"])
def test_walk_leaves_no_copy_in_flight(page_list, monkeypatch, capfd):
    # Every copy started is waited for: only a block of this program's walk is prefetched (never the first block of
    # the next query block's sequence). With copies done when started, the interpreter reports a semaphore left
    # non-zero at kernel exit (on a TPU: a copy landing in the next program's buffers).
    from jax.experimental.pallas import tpu as pltpu

    monkeypatch.setattr(tpu_attention, "SMEM_PAGE_LIST_BYTES", 0 if page_list == "hbm" else 1 << 20)
    q, k, v, meta = make_case(19, 4, 1, MANY_KV, MANY_Q, dtype=jnp.float32)
    eager = pltpu.InterpretParams(dma_execution_mode="eager")
    assert max_error(q, k, v, meta, interpret=eager, block_q=4, pages_per_block=2) < 2e-5
    assert "at kernel exit" not in capfd.readouterr().out


@pytest.mark.parametrize("page_list_smem_bytes", [0, 1 << 20])
def test_rows_without_new_tokens_are_skipped(page_list_smem_bytes):
    # The kernel called with the padding rows' cached lengths left in (kernel_inputs zeroes them): a row with no new
    # token is no block of the walk, so no page of it is fetched (cu_pages gives it none) and the others are exact.
    q, k, v, meta = make_case(17, 4, 1, MANY_KV, MANY_Q, dtype=jnp.float32)
    pages, cu_pages, cu_q, _, num_seqs = kernel_inputs(meta)
    out = ragged_paged_attention(q, k.reshape(1, -1, PAGE, HEAD_DIM), v.reshape(1, -1, PAGE, HEAD_DIM), pages,
                                 cu_pages, cu_q, meta.kv_lens, num_seqs, scale=SCALE, block_q=4, pages_per_block=2,
                                 interpret=True, page_list_smem_bytes=page_list_smem_bytes)
    ref = native_paged_attention(q, k, v, meta, SCALE)
    assert float(jnp.abs(out - ref).max()) < 2e-5


def mosaic_kernel(lowered_text: str) -> str:
    """The Mosaic kernel a step lowered for TPU carries (its tpu_custom_call's serialized body), as MLIR text."""
    import base64

    from jax._src.interpreters import mlir
    from jax._src.lib import tpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager

    (body,) = set(re.findall(r'custom_call_config\\22: \{\\22body\\22: \\22([A-Za-z0-9+/=]+)', lowered_text))
    context = mlir.make_ir_context()
    tpu.register_dialect(context)
    context.allow_unregistered_dialects = True  # the serialized form's stable_mosaic version attribute
    with context, ir.Location.unknown():
        module = ir.Module.parse(base64.b64decode(body))
        PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
        return str(module)


def smem_operands(kernel: str) -> list[str]:
    """The shapes of the kernel's SMEM operands (scalar prefetch and scratch), from its signature."""
    signature = re.search(r"func\.func @jsgl_ragged_paged_attention\w*\(([^\n]*)\) attributes", kernel).group(1)
    return re.findall(r"memref<([\dx]+)xi32, #tpu\.memory_space<smem>>", signature)


@pytest.mark.parametrize("kind", ["TPU v5 lite", "TPU v6 lite"])
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.int8])
def test_long_page_list_stays_in_hbm_when_lowered(kv_dtype, kind, monkeypatch):
    # 64 requests x 8192 pages (128k positions in pages of 16): a 2 MiB flat list. The Mosaic kernel takes it in HBM
    # (memory space any) and its SMEM operands are the lengths and two blocks' indices, a few hundred bytes; a short
    # list (8 x 64 pages) is scalar-prefetched whole.
    monkeypatch.setitem(lowering.TARGET_KINDS, "tpu", (kind, 1, "tpu"))
    s = jax.ShapeDtypeStruct
    for batch, width in [(64, 8192), (8, 64)]:
        values = s((8, 4096, 16, 128), kv_dtype)
        args = [s((64, 32, 128), jnp.bfloat16), values, values, s((batch * width,), jnp.int32),
                s((batch + 1,), jnp.int32), s((batch + 1,), jnp.int32), s((batch,), jnp.int32), s((1,), jnp.int32)]
        if kv_dtype == jnp.int8:
            args += [s((8, 4096, 16), jnp.float32)] * 2
        fn = jax.jit(functools.partial(ragged_paged_attention, scale=0.088, block_q=16, pages_per_block=8))
        kernel = mosaic_kernel(lowering.lower_for(fn, *args, platform="tpu").as_text())
        smem = smem_operands(kernel)
        smem_bytes = 4 * sum(int(np.prod([int(d) for d in shape.split("x")])) for shape in smem)
        if batch * width * 4 > tpu_attention.SMEM_PAGE_LIST_BYTES:
            assert f"memref<{batch * width + 8}xi32, #tpu.memory_space<any>>" in kernel
            assert "2x8" in smem and smem_bytes < 1024, smem
            assert re.search(r"tpu\.enqueue_dma source\(%\w+ : memref<8xi32, #tpu\.memory_space<any>>\) "
                             r"target\(%\w+ : memref<8xi32, #tpu\.memory_space<smem>>\)", kernel)
        else:
            assert str(batch * width) in smem and "2x8" not in smem


@pytest.mark.parametrize("kind", ["TPU v5 lite", "TPU v6 lite"])
def test_lowers_for_tpu(kind, monkeypatch):
    # Llama-3-8B attention shapes (32 query heads over 8 KV heads, head_dim 128), bf16 pages of 16.
    monkeypatch.setitem(lowering.TARGET_KINDS, "tpu", (kind, 1, "tpu"))
    tokens, pages, batch = 64, 512, 8
    s = jax.ShapeDtypeStruct
    args = (s((tokens, 32, 128), jnp.bfloat16), s((8, pages, 16, 128), jnp.bfloat16),
            s((8, pages, 16, 128), jnp.bfloat16), s((batch * 64,), jnp.int32), s((batch + 1,), jnp.int32),
            s((batch + 1,), jnp.int32), s((batch,), jnp.int32), s((1,), jnp.int32))
    fn = jax.jit(functools.partial(ragged_paged_attention, scale=0.088, block_q=16, pages_per_block=8))
    text = lowering.lower_for(fn, *args, platform="tpu").as_text()
    assert text.count("tpu_custom_call") == 1
    assert "jsgl_ragged_paged_attention" in text


@pytest.mark.parametrize("kind", ["TPU v5 lite", "TPU v6 lite"])
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("tokens", [8, 256])  # decode-sized and extend-sized
def test_padded_head_dim_lowers_for_tpu(tokens, head_dim, kv_dtype, kind, monkeypatch):
    # SmolLM2-like heads (9 query heads over 3 KV heads) of 64 and 80: the Mosaic kernel sees q and its output 128
    # lanes wide; the pages stay [Hkv, pages, 16, head_dim] and the result is sliced back to head_dim.
    monkeypatch.setitem(lowering.TARGET_KINDS, "tpu", (kind, 1, "tpu"))
    pages, batch = 512, 8
    s = jax.ShapeDtypeStruct
    values = s((3, pages, 16, head_dim), kv_dtype)
    args = [s((tokens, 9, head_dim), jnp.bfloat16), values, values, s((batch * 64,), jnp.int32),
            s((batch + 1,), jnp.int32), s((batch + 1,), jnp.int32), s((batch,), jnp.int32), s((1,), jnp.int32)]
    if kv_dtype == jnp.int8:
        args += [s((3, pages, 16), jnp.float32)] * 2
    fn = jax.jit(functools.partial(ragged_paged_attention, scale=head_dim**-0.5, block_q=16, pages_per_block=8))
    lowered = lowering.lower_for(fn, *args, platform="tpu")
    text = lowered.as_text()
    assert text.count("tpu_custom_call") == 1 and "jsgl_ragged_paged_attention" in text
    assert re.search(r"tpu_custom_call[^\n]*\(tensor<[^\n]*tensor<3x\d+x128xbf16>", text)
    assert lowered.out_info.shape == (tokens, 9, head_dim)


def test_int8_lowers_for_tpu():
    # The 8-bit format's kernel (int8 pages + per-token scales, four DMA streams) lowers too.
    tokens, pages, batch = 64, 512, 8
    s = jax.ShapeDtypeStruct
    values, scales = s((8, pages, 16, 128), jnp.int8), s((8, pages, 16), jnp.float32)
    args = (s((tokens, 32, 128), jnp.bfloat16), values, values, s((batch * 64,), jnp.int32),
            s((batch + 1,), jnp.int32), s((batch + 1,), jnp.int32), s((batch,), jnp.int32), s((1,), jnp.int32),
            scales, scales)
    fn = jax.jit(functools.partial(ragged_paged_attention, scale=0.088, block_q=16, pages_per_block=8))
    assert lowering.lower_for(fn, *args, platform="tpu").as_text().count("tpu_custom_call") == 1


def test_backend_by_name_on_tpu_and_a_readable_error_elsewhere():
    from jsgl.engine.backends import resolve_backends

    # auto is the kernel on a TPU (checked on the device before the first step: test_kernel_self_check.py).
    assert resolve_backends(platform="tpu", dtype="bfloat16", kv_dtype="bfloat16", page_size=16).attention == "tpu"
    assert resolve_backends("tpu", platform="tpu", dtype="bfloat16", kv_dtype="bfloat16", page_size=16).attention \
        == "tpu"
    with pytest.raises(ValueError, match="the Mosaic kernel for TPUs; this platform is 'cpu'"):
        resolve_backends("tpu", platform="cpu")


def test_backend_interprets_here_and_lowers_mosaic_for_tpu():
    # The registered backend chooses per lowering platform: interpreted on this CPU, Mosaic when lowered for TPU.
    backend = get_attention_backend("tpu")
    q, k, v, meta = make_case(3, 8, 2, *CASES["mixed"][:2], dtype=jnp.bfloat16)
    fn = jax.jit(functools.partial(backend, scale=SCALE))
    ref = jax.jit(native_paged_attention, static_argnums=4)(q, k, v, meta, SCALE)
    owned = np.asarray(meta.positions) >= 0
    err = np.abs(np.asarray(fn(q, k, v, meta), np.float32) - np.asarray(ref, np.float32))[owned].max()
    assert err < TOLERANCE[jnp.bfloat16]
    text = lowering.lower_for(fn, q, k, v, meta, platform="tpu").as_text()
    assert text.count("tpu_custom_call") == 1


TPU_KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}
# Each generation's default blocks at pages of 16: 32 tokens x 128 keys (v5e's MXU), 32 x 256 (v6e's).
KERNEL_BLOCKS = {"v5e": "bq32_kv8x16", "v6e": "bq32_kv16x16"}
# Length-free steps (the backend's signature is tokens and requests) over a table of 8k positions: pages of 16.
STEP_LAYOUTS = {"decode": StepLayout(8, 8, 1, 8192, 16), "extend": StepLayout(256, 8, 256, 8192, 16)}


def tpu_step(name: str, generation: str, *, tp: int = 1, scanned: bool = False, kv_dtype=jnp.bfloat16,
             attention: str = "tpu") -> dict:
    """What matters in the whole step of a Llama-3-8B-shaped model (abstract bf16 weights, pages of 16) lowered
    for a TPU generation: Mosaic kernels (defined, called, their block sizes and query heads per call), donated
    pools, gathers out of a pool and scatters into one, partitions."""
    from unittest import mock

    with mock.patch.dict(lowering.TARGET_KINDS, {"tpu": (TPU_KINDS[generation], 1, "tpu")}):
        text = lowered_step(STEP_LAYOUTS[name], "tpu", tp=tp, dtype=jnp.bfloat16, kv_dtype=kv_dtype, scanned=scanned,
                            attention=attention)
    kernel_q = re.findall(r"func\.func private @ragged_paged_attention\(%arg0: tensor<\d+x(\d+)x128x", text)
    return {"mosaic": text.count("custom_call @tpu_custom_call"),
            "kernel_calls": len(re.findall(r"call @ragged_paged_attention\(", text)),
            "blocks": sorted(set(re.findall(r"jsgl_ragged_paged_attention_(\w+)", text))),
            "q_heads": sorted({int(h) for h in kernel_q}), "donated": donated(text),
            "pool_gathers": pool_gathers(text), "pool_scatters": pool_scatters(text), "partitions": partitions(text)}


def expected_step(generation: str, *, tp: int = 1, scanned: bool = False, int8: bool = False) -> dict:
    """The kernel once a layer (once in the scanned loop's body) on each shard's 32 / tp query heads, every pool
    donated (64 unrolled, the two stacks scanned; twice that with the 8-bit format's scales), none gathered or
    scattered into. Two Mosaic kernels: attention and the K/V write (three: the 8-bit format's scales' write;
    test_tpu_kv_write.py)."""
    pools = (2 if scanned else 64) * (2 if int8 else 1)
    return {"mosaic": 2 + int8, "kernel_calls": 1 if scanned else 32, "blocks": [KERNEL_BLOCKS[generation]],
            "q_heads": [32 // tp], "donated": pools, "pool_gathers": 0, "pool_scatters": 0, "partitions": tp}


@pytest.mark.parametrize("scanned", [False, True])
@pytest.mark.parametrize("name", sorted(STEP_LAYOUTS))
@pytest.mark.parametrize("generation", sorted(TPU_KINDS))
def test_engine_step_lowers_for_tpu_with_the_kernel_and_pools_in_place(generation, name, scanned):
    assert tpu_step(name, generation, scanned=scanned) == expected_step(generation, scanned=scanned)


@pytest.mark.parametrize("scanned", [False, True])
def test_int8_engine_step_lowers_for_tpu(scanned):
    got = tpu_step("decode", "v5e", scanned=scanned, kv_dtype=jnp.int8)
    assert got == expected_step("v5e", scanned=scanned, int8=True)


def test_native_step_gathers_every_pool():
    # What the kernel replaces (and what pool_gathers sees): the native path gathers K and V of each layer.
    assert tpu_step("decode", "v5e", attention="native")["pool_gathers"] == 64


TP4_CASES = [(generation, name, scanned) for generation in sorted(TPU_KINDS) for name in sorted(STEP_LAYOUTS)
             for scanned in (False, True)]


def test_tp4_engine_step_lowers_for_tpu_with_a_kernel_per_shard():
    """At tp=4 (forced CPU devices, in a child: the device count is fixed when jax starts) the step is 4 partitions
    and each layer's kernel runs inside the shard_map on its device's 8 query heads over 2 KV heads; the sharded
    pools are still donated, for v5e and v6e, decode and extend, unrolled and scanned, and the 8-bit format."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for generation, name, scanned in TP4_CASES:
        assert got[f"{generation} {name} {scanned}"] == expected_step(generation, tp=4, scanned=scanned)
    assert got["int8"] == expected_step("v6e", tp=4, scanned=True, int8=True)


if __name__ == "__main__":  # the tp=4 child
    summaries = {f"{g} {n} {s}": tpu_step(n, g, tp=4, scanned=s) for g, n, s in TP4_CASES}
    summaries["int8"] = tpu_step("decode", "v6e", tp=4, scanned=True, kv_dtype=jnp.int8)
    print(json.dumps(summaries))

