"""Pallas paged-attention kernels vs the pure-JAX reference, in Pallas interpret mode on CPU.

Tiny shapes on purpose: interpret mode runs the kernel body once per grid step. Pools use shuffled,
non-contiguous slots; lengths include 1 and non-multiples of the KV block; GQA ratios 1, 3 and 7.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsgl.kernels.attention import AttentionMetadata, get_attention_backend, native_paged_attention
from jsgl.kernels.lowering import lower_for
from jsgl.kernels.pallas_attention import (
    paged_decode_attention,
    paged_extend_attention,
    pallas_paged_attention,
)


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    """The kernels interpreted, not chosen per lowering platform: that choice traces the compiled Triton
    variant too (~1 s a test here); tests/test_gpu_lowering.py checks it, and the tests below that lower for
    CUDA pass interpret=False."""
    import jsgl.kernels.pallas_attention as pallas_attention

    monkeypatch.setattr(pallas_attention, "INTERPRET", True)


HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
def extra(*values):
    """A further case of a parametrized test: in the full suite, not in the quick loop (`-m "not slow"`,
    where the first case of each test runs)."""
    return pytest.param(*values, marks=pytest.mark.slow)


GQA = [(9, 3), extra(3, 3), extra(7, 1)]  # (Hq, Hkv): group 3, 1, 7


def make_case(
    seed, num_q_heads, num_kv_heads, kv_lens, q_lens, *, width=None, gap=0, extra_tokens=0, dtype=jnp.float32
):
    """Random pool + a batch whose requests own shuffled slots; returns (q, k_pool, v_pool, meta)."""
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(kv_lens, np.int32)
    q_lens = np.asarray(q_lens, np.int32)
    batch = len(kv_lens)
    width = width or int(kv_lens.max())
    num_slots = int(kv_lens.sum()) + 7  # a few never-used slots, plus the dummy slot 0
    slots = rng.permutation(np.arange(1, num_slots))
    block_table = np.zeros((batch, width), np.int32)
    off = 0
    for b, n in enumerate(kv_lens):
        block_table[b, :n] = slots[off : off + n]
        off += n
    # Ragged flat token layout with optional gaps between requests and padding tokens at the end.
    q_start = np.zeros(batch, np.int32)
    t = 0
    for b in range(batch):
        q_start[b] = t
        t += q_lens[b] + gap
    num_tokens = t + extra_tokens
    positions = np.full(num_tokens, -1, np.int32)
    for b in range(batch):
        positions[q_start[b] : q_start[b] + q_lens[b]] = kv_lens[b] - q_lens[b] + np.arange(q_lens[b])
    meta = AttentionMetadata(
        positions=jnp.asarray(positions),
        q_start=jnp.asarray(q_start),
        q_len=jnp.asarray(q_lens),
        block_table=jnp.asarray(block_table),
        kv_lens=jnp.asarray(kv_lens),
        max_q_len=max(1, int(q_lens.max())),
    )
    k_pool = jnp.asarray(rng.standard_normal((num_kv_heads, num_slots, HEAD_DIM)), dtype)
    v_pool = jnp.asarray(rng.standard_normal((num_kv_heads, num_slots, HEAD_DIM)), dtype)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_q_heads, HEAD_DIM)), dtype)
    return q, k_pool, v_pool, meta


_reference = jax.jit(native_paged_attention, static_argnums=4)


def reference(q, k_pool, v_pool, meta):
    return _reference(q, k_pool, v_pool, meta, SCALE)


def run(kernel, q, k_pool, v_pool, meta, **kwargs):
    """The kernel under ``jax.jit`` (eager dispatch of the wrapper ops costs more than the kernel here)."""
    return jax.jit(functools.partial(kernel, scale=SCALE, interpret=True, **kwargs))(q, k_pool, v_pool, meta)


def assert_close(out, ref, atol=1e-4):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("num_q_heads,num_kv_heads,num_splits", [(9, 3, 3), extra(3, 3, 1), extra(7, 1, 2)])
def test_decode_matches_reference(num_q_heads, num_kv_heads, num_splits):
    # Lengths 1, < block, == block, non-multiples, > several blocks; one padding row (q_len 0) and
    # padding tokens at the end of the flat batch; table width 37 is not a multiple of block_k.
    kv_lens = [1, 5, 8, 37, 0, 19]
    q_lens = [1, 1, 1, 1, 0, 1]
    q, k, v, meta = make_case(
        num_q_heads * 10 + num_splits, num_q_heads, num_kv_heads, kv_lens, q_lens, width=37, extra_tokens=2
    )
    ref = reference(q, k, v, meta)
    out = run(paged_decode_attention, q, k, v, meta, block_k=8, num_splits=num_splits)
    assert_close(out, ref)


def test_decode_gpu_tiling_and_auto_splits():
    # block_h=16 (the GPU minimum: the group of 3 is padded to 16 rows), default split-K heuristic,
    # more splits than some requests have blocks (empty splits must merge to nothing).
    q, k, v, meta = make_case(7, 6, 2, [3, 70, 1, 16], [1, 1, 1, 1], width=72)
    ref = reference(q, k, v, meta)
    out = run(paged_decode_attention, q, k, v, meta, block_k=8, block_h=16)
    assert_close(out, ref)
    out = run(paged_decode_attention, q, k, v, meta, block_k=16, num_splits=8)
    assert_close(out, ref)


def test_decode_bfloat16():
    q, k, v, meta = make_case(3, 8, 2, [9, 30, 1], [1, 1, 1], dtype=jnp.bfloat16)
    ref = reference(*(x.astype(jnp.float32) for x in (q, k, v)), meta)
    out = run(paged_decode_attention, q, k, v, meta, block_k=8, num_splits=2)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=2e-2, rtol=0)


# --------------------------------------------------------------------------------------------------- extend


@pytest.mark.parametrize("prefix", [False, True], ids=["prefill", "with_prefix"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", GQA)
def test_extend_matches_reference(num_q_heads, num_kv_heads, prefix):
    # q_len 1, a padding row (q_len 0), several query blocks (9 > block_q=4), non-multiples of block_k;
    # gaps between requests and trailing padding tokens in the flat batch must come back as zeros.
    q_lens = [1, 9, 0, 3, 6]
    prefixes = [4, 0, 0, 13, 2] if prefix else [0, 0, 0, 0, 0]
    kv_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    q, k, v, meta = make_case(
        num_q_heads + 100 * prefix,
        num_q_heads,
        num_kv_heads,
        kv_lens,
        q_lens,
        width=max(kv_lens) + 3,
        gap=1,
        extra_tokens=3,
    )
    ref = reference(q, k, v, meta)
    out = run(paged_extend_attention, q, k, v, meta, block_q=4, block_k=8)
    assert_close(out, ref)
    tail = np.asarray(out[-3:])
    assert np.all(tail == 0)


def test_extend_single_block_tiles():
    # One query tile covering a whole request and a KV block longer than every request.
    q, k, v, meta = make_case(5, 4, 2, [7, 2, 11], [7, 1, 5])
    ref = reference(q, k, v, meta)
    out = run(paged_extend_attention, q, k, v, meta, block_q=8, block_k=16)
    assert_close(out, ref)


# ------------------------------------------------------------------------------------------------ page tables


def paged(case, page_size, seed=0):
    """The same batch over a pool of pages: each request owns shuffled whole pages of ``page_size`` slots (page 0
    holds the dummy slot), the table holds pages. Returns (q, k_pool, v_pool, page meta, slot meta): the slot
    meta is the page table expanded here in numpy, for the reference."""
    q, k_pool, _, meta = case
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(meta.kv_lens)
    pages_of = [-(-int(n) // page_size) for n in kv_lens]
    width = max(pages_of) + 1  # one more page than the longest request needs: padding pages too
    order = rng.permutation(np.arange(1, sum(pages_of) + 3))
    table, off = np.zeros((len(kv_lens), width), np.int32), 0
    for b, n in enumerate(pages_of):
        table[b, :n] = order[off: off + n]
        off += n
    num_slots = (int(order.max()) + 1) * page_size
    shape = (k_pool.shape[0], num_slots, HEAD_DIM)
    k_pool = jnp.asarray(rng.standard_normal(shape), k_pool.dtype)
    v_pool = jnp.asarray(rng.standard_normal(shape), k_pool.dtype)
    slots = (table[:, :, None] * page_size + np.arange(page_size)).reshape(len(kv_lens), -1)
    page_meta = dataclasses.replace(meta, block_table=jnp.asarray(table), page_size=page_size)
    slot_meta = dataclasses.replace(meta, block_table=jnp.asarray(slots))
    assert np.array_equal(np.asarray(page_meta.slot_table()), slots)
    return q, k_pool, v_pool, page_meta, slot_meta


@pytest.mark.parametrize("page_size", [4, extra(16)])  # 16 > block_k: the KV block grows to one page
def test_decode_reads_page_tables(page_size):
    q, k, v, pages, slots = paged(make_case(21, 9, 3, [1, 5, 8, 37, 0, 19], [1, 1, 1, 1, 0, 1], extra_tokens=2),
                                  page_size)
    ref = reference(q, k, v, slots)
    assert_close(reference(q, k, v, pages), ref)  # the native path expands the table
    assert_close(run(paged_decode_attention, q, k, v, pages, block_k=8, num_splits=2), ref)


@pytest.mark.parametrize("page_size", [4, extra(16)])
def test_extend_reads_page_tables(page_size):
    q_lens, prefixes = [1, 9, 0, 3, 6], [4, 0, 0, 13, 2]
    kv_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    q, k, v, pages, slots = paged(make_case(22, 9, 3, kv_lens, q_lens, gap=1, extra_tokens=3), page_size)
    ref = reference(q, k, v, slots)
    assert_close(reference(q, k, v, pages), ref)
    assert_close(run(paged_extend_attention, q, k, v, pages, block_q=4, block_k=8), ref)


def test_page_size_must_divide_the_kv_block():
    q, k, v, pages, _ = paged(make_case(23, 4, 2, [9, 3], [1, 1]), 4)
    with pytest.raises(ValueError, match="page_size"):
        run(paged_decode_attention, q, k, v, dataclasses.replace(pages, page_size=3), block_k=8)


# ------------------------------------------------------------------------------------------------ dispatcher


def test_backend_registered_and_dispatches():
    assert get_attention_backend("pallas").attend is pallas_paged_attention
    fn = jax.jit(
        functools.partial(
            pallas_paged_attention, scale=SCALE, decode_block_k=8, extend_block_q=4, extend_block_k=8, interpret=True
        )
    )
    for q_lens, kv_lens in (([1, 1, 0], [6, 17, 0]), ([2, 5, 0], [6, 17, 0])):
        q, k, v, meta = make_case(11, 9, 3, kv_lens, q_lens, extra_tokens=1)
        assert meta.is_decode == (max(q_lens) == 1)
        assert_close(fn(q, k, v, meta), reference(q, k, v, meta))


# ---------------------------------------------------------------------------------------- GPU lowering (CPU)


def _triton_modules(fn, *args):
    """Lower ``fn`` for CUDA on this (GPU-less) machine and return the Triton IR modules it embeds."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as tl  # private, but jax is pinned: breakage must fail

    hlo = lower_for(jax.jit(fn), *args, platform="cuda").compiler_ir("stablehlo")
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region:
                for inner in block:
                    if inner.name == "stablehlo.custom_call":
                        calls.append(inner)
                    walk(inner)

    walk(hlo.operation)
    modules = []
    for call in calls:
        if "triton" not in ir.StringAttr(call.attributes["call_target_name"]).value:
            continue
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        with tl._new_ir_context():
            module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            assert module.operation.verify()
            modules.append(str(module))
    return modules


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_to_triton_ir(dtype):
    # Checks the compiled (non-interpret) path down to verified Triton IR with Llama-like head sizes.
    # It does not run Triton's PTX compiler: that needs a GPU build of jaxlib (see experiments/bench_device.py).
    batch, width, num_slots = 2, 256, 1024
    k = jax.ShapeDtypeStruct((8, num_slots, 128), dtype)
    for max_q_len in (1, 32):
        tokens = batch * max_q_len
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        meta = AttentionMetadata(
            i32(tokens), i32(batch), i32(batch), i32(batch, width), i32(batch), max_q_len=max_q_len
        )
        q = jax.ShapeDtypeStruct((tokens, 32, 128), dtype)
        fn = functools.partial(pallas_paged_attention, scale=0.088, interpret=False)
        modules = _triton_modules(fn, q, k, k, meta)
        assert len(modules) == 1
        assert "tt.dot" in modules[0] and "scf.for" in modules[0]
        assert "tf32" not in modules[0]  # float32 dots stay IEEE (tt.dot's default input precision)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", GQA)
def test_native_decode_path_equals_general_path(num_q_heads, num_kv_heads):
    """max_q_len == 1 takes a shorter route through the native backend; it must agree with the general one
    (run by declaring a wider static bucket), including a padding row mid-batch and padding tokens."""
    q, k, v, meta = make_case(3, num_q_heads, num_kv_heads, [4, 0, 1, 37, 9], [1, 0, 1, 1, 1], extra_tokens=3)
    assert meta.max_q_len == 1
    general = dataclasses.replace(meta, max_q_len=4)
    fast, slow = reference(q, k, v, meta), reference(q, k, v, general)
    live = np.asarray(meta.q_start)[np.asarray(meta.q_len) > 0]
    assert_close(fast[live], slow[live], atol=1e-5)


# ------------------------------------------------------------------------------------------- sliding window


def dense_window_reference(q, k_pool, v_pool, meta, window):
    """Query by query in numpy: keys ``j <= pos``, ``j < kv_len`` and ``pos - j < window`` (transformers'
    ``kv_idx > q_idx - sliding_window``); rows no request covers are zeros."""
    q, k_pool, v_pool = (np.asarray(x, np.float64) for x in (q, k_pool, v_pool))
    group = q.shape[1] // k_pool.shape[0]
    out = np.zeros_like(q)
    for b in range(len(meta.q_len)):
        start, kv_len = int(meta.q_start[b]), int(meta.kv_lens[b])
        for t in range(start, start + int(meta.q_len[b])):
            pos = int(meta.positions[t])
            keys = [j for j in range(kv_len) if j <= pos and pos - j < window]
            slots = np.asarray(meta.block_table[b])[keys]
            for h in range(q.shape[1]):
                scores = k_pool[h // group, slots] @ q[t, h] * SCALE
                p = np.exp(scores - scores.max())
                out[t, h] = p @ v_pool[h // group, slots] / p.sum()
    return out


@pytest.mark.parametrize("window", [5, extra(1), extra(16)])
def test_sliding_window_native_decode_and_extend(window):
    # Decode and extend (with a cached prefix longer than the window) against the dense loop.
    for q_lens, kv_lens in (([1, 1, 0, 1], [30, 3, 0, 17]), ([6, 1, 0, 9], [30, 3, 0, 13])):
        q, k, v, meta = make_case(window, 6, 2, kv_lens, q_lens, extra_tokens=2)
        meta = dataclasses.replace(meta, sliding_window=window)
        out = reference(q, k, v, meta)
        live = np.concatenate([np.arange(s, s + n) for s, n in zip(np.asarray(meta.q_start), q_lens) if n])
        np.testing.assert_allclose(np.asarray(out)[live], dense_window_reference(q, k, v, meta, window)[live],
                                   atol=1e-5)


@pytest.mark.parametrize("window", [8, extra(3), extra(20)])
def test_sliding_window_pallas_decode(window):
    # Windows inside one KV block, spanning blocks, and longer than some requests; split-K over the window.
    q, k, v, meta = make_case(window + 1, 9, 3, [1, 5, 37, 0, 19], [1, 1, 1, 0, 1], width=40, extra_tokens=1)
    meta = dataclasses.replace(meta, sliding_window=window)
    ref = reference(q, k, v, meta)
    for num_splits in (1, 3):
        assert_close(run(paged_decode_attention, q, k, v, meta, block_k=8, num_splits=num_splits), ref)


@pytest.mark.parametrize("window", [7, extra(2), extra(30)])
def test_sliding_window_pallas_extend(window):
    # Query tiles whose first rows' windows start in different KV blocks; a prefix longer than the window.
    q_lens, prefixes = [9, 1, 0, 12], [20, 4, 0, 0]
    kv_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    q, k, v, meta = make_case(window + 2, 6, 2, kv_lens, q_lens, gap=1, extra_tokens=2)
    meta = dataclasses.replace(meta, sliding_window=window)
    assert_close(run(paged_extend_attention, q, k, v, meta, block_q=4, block_k=8), reference(q, k, v, meta))


def test_windowed_kernels_lower_to_triton_ir():
    # The window's extra mask and loop bounds stay inside the compiled (non-interpret) kernels.
    batch, width = 2, 256
    k = jax.ShapeDtypeStruct((8, 1024, 128), jnp.float32)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    for max_q_len in (1, 32):
        tokens = batch * max_q_len
        meta = AttentionMetadata(i32(tokens), i32(batch), i32(batch), i32(batch, width), i32(batch),
                                 max_q_len=max_q_len, sliding_window=100)
        fn = functools.partial(pallas_paged_attention, scale=0.088, interpret=False)
        modules = _triton_modules(fn, jax.ShapeDtypeStruct((tokens, 32, 128), jnp.float32), k, k, meta)
        assert len(modules) == 1 and "tt.dot" in modules[0]


# -------------------------------------------------------------------------------------------- 8-bit KV pools


def _int8_pools(k, v):
    """The same K/V as an 8-bit pool (each row quantized as the model writes it) and its dequantized float32
    values: attention over the latter is what the 8-bit pool must give."""
    from jsgl.kernels import kv_quant

    pools = [kv_quant.Int8Pool(*kv_quant.quantize(x)) for x in (k, v)]
    return pools, [kv_quant.dequantize(p.values, p.scales) for p in pools]


def test_int8_rows_round_trip_within_half_a_step():
    from jsgl.kernels import kv_quant

    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 50, HEAD_DIM)) * 4, jnp.float32)
    x = x.at[1, 7].set(0.0)  # an all-zero row: scale 0, values 0, no NaN
    values, scales = kv_quant.quantize(x)
    assert values.dtype == jnp.int8 and scales.shape == (3, 50) and int(jnp.abs(values).max()) == 127
    err = np.abs(np.asarray(kv_quant.dequantize(values, scales)) - np.asarray(x))
    assert (err <= np.asarray(scales)[..., None] * 0.5001 + 1e-6).all() and float(scales[1, 7]) == 0.0
    assert kv_quant.bytes_per_head_token(jnp.int8, 64) == 68 and kv_quant.bytes_per_head_token(jnp.float32, 64) == 256


@pytest.mark.parametrize("max_q", [1, 9])
def test_int8_pools_in_every_attention_path(max_q):
    """Native, and Pallas decode and extend (interpreted), over an 8-bit pool: each equals the reference over
    the dequantized float32 pool, and stays within the quantization's error of the float32 pool's result."""
    q_lens = [1, 1, 1, 0] if max_q == 1 else [1, 9, 3, 0]
    kv_lens = [5, 37, 17, 0] if max_q == 1 else [5, 9, 20, 0]
    q, k, v, meta = make_case(21 + max_q, 9, 3, kv_lens, q_lens, width=40, extra_tokens=1)
    (k8, v8), (kd, vd) = _int8_pools(k, v)
    want = reference(q, kd, vd, meta)
    assert_close(reference(q, k8, v8, meta), want, atol=1e-5)
    kernel = paged_decode_attention if max_q == 1 else paged_extend_attention
    kwargs = {"block_k": 8, "num_splits": 2} if max_q == 1 else {"block_q": 4, "block_k": 8}
    assert_close(run(kernel, q, k8, v8, meta, **kwargs), want, atol=1e-5)
    assert_close(want, reference(q, k, v, meta), atol=5e-2)  # int8 rounding of unit-normal K/V


def test_int8_kernels_lower_to_triton_ir():
    """The 8-bit pools' kernels (int8 rows and their scales gathered, dequantized before the dots) lower to
    verified Triton IR at Llama-like head sizes."""
    from jsgl.kernels import kv_quant

    batch, width, num_slots = 2, 256, 1024
    pool = kv_quant.Int8Pool(jax.ShapeDtypeStruct((8, num_slots, 128), jnp.int8),
                             jax.ShapeDtypeStruct((8, num_slots), jnp.float32))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    for max_q_len in (1, 32):
        tokens = batch * max_q_len
        meta = AttentionMetadata(i32(tokens), i32(batch), i32(batch), i32(batch, width), i32(batch),
                                 max_q_len=max_q_len)
        fn = functools.partial(pallas_paged_attention, scale=0.088, interpret=False)
        modules = _triton_modules(fn, jax.ShapeDtypeStruct((tokens, 32, 128), jnp.bfloat16), pool, pool, meta)
        assert len(modules) == 1 and "tt.dot" in modules[0] and "i8" in modules[0]


# ------------------------------------------------------------------------------- a scanned model's stacks


def _stacked(pools, layer):
    """Pools of 3 layers stacked as a scanned model holds them (``[Hkv, L, N, D]``), ``pools`` at ``layer`` and
    other (random) layers around it; the ``LayerPool`` of that layer."""
    from jsgl.kernels import kv_quant

    def stack(pool):
        others = jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(5).standard_normal(x.shape), x.dtype), pool)
        layers = [others, others, others]
        layers[layer] = pool
        return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *layers)

    return [kv_quant.LayerPool(stack(pool), jnp.int32(layer)) for pool in pools]


@pytest.mark.parametrize("layer", [1, extra(0), extra(2)])
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("max_q", [1, 9])
def test_kernels_read_a_layer_of_stacked_pools(max_q, quantized, layer):
    """A scanned model's pools (every layer in one stack, the layer indexed in the kernel): decode and extend give
    exactly what they give over that layer's own pool, plain and 8-bit, slot and page tables."""
    q_lens = [1, 1, 1, 0] if max_q == 1 else [1, 9, 3, 0]
    kv_lens = [5, 37, 17, 0] if max_q == 1 else [5, 9, 20, 0]
    q, k, v, pages, _ = paged(make_case(31 + max_q, 9, 3, kv_lens, q_lens, width=40, extra_tokens=1), 4)
    pools = _int8_pools(k, v)[0] if quantized else [k, v]
    kernel = paged_decode_attention if max_q == 1 else paged_extend_attention
    kwargs = {"block_k": 8, "num_splits": 2} if max_q == 1 else {"block_q": 4, "block_k": 8}
    want = run(kernel, q, *pools, pages, **kwargs)
    k_layer, v_layer = _stacked(pools, layer)
    assert np.array_equal(np.asarray(run(kernel, q, k_layer, v_layer, pages, **kwargs)), np.asarray(want))
    assert_close(reference(q, k_layer, v_layer, pages), reference(q, *pools, pages), atol=0)  # the native path


def test_stacked_pool_kernels_lower_to_triton_ir():
    """With the layer's index an input, the kernels over stacked pools lower to verified Triton IR."""
    from jsgl.kernels import kv_quant

    batch, width, num_slots = 2, 256, 1024
    stack = jax.ShapeDtypeStruct((8, 32, num_slots, 128), jnp.bfloat16)
    pool = kv_quant.LayerPool(stack, jax.ShapeDtypeStruct((), jnp.int32))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    for max_q_len in (1, 32):
        tokens = batch * max_q_len
        meta = AttentionMetadata(i32(tokens), i32(batch), i32(batch), i32(batch, width), i32(batch),
                                 max_q_len=max_q_len)
        fn = functools.partial(pallas_paged_attention, scale=0.088, interpret=False)
        modules = _triton_modules(fn, jax.ShapeDtypeStruct((tokens, 32, 128), jnp.bfloat16), pool, pool, meta)
        assert len(modules) == 1 and "tt.dot" in modules[0]
