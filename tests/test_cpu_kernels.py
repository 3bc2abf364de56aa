"""The C++ CPU kernels (jsgl.kernels.cpu) against numpy, the native attention and XLA's matmul path."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsgl.cache_security import MAGIC
from jsgl.kernels import cpu
from jsgl.kernels.attention import AttentionMetadata, native_paged_attention

# `cpu.available()` falls back quietly for users (no compiler, no AVX2); here, on hardware that has
# AVX-512 or AVX2 + FMA + F16C, a kernel that does not build is an error, not a skip.
SUPPORTED = cpu.hardware_supported()
pytestmark = pytest.mark.skipif(not SUPPORTED,
                                reason="the CPU kernels need an x86-64 CPU with AVX-512 or AVX2 (hardware)")


def test_kernels_build_and_register():
    assert cpu.available(), f"the CPU kernels failed to build or register: {cpu.unavailable_reason()}"
    # Built for the widest vectors the CPU has: AVX-512 where it is, else AVX2 (two registers a vector).
    assert cpu.vector_isa() == ("avx512" if "avx512f" in Path("/proc/cpuinfo").read_text() else "avx2")


def test_the_built_library_is_cached_sealed_and_the_next_load_takes_it_from_the_cache(monkeypatch):
    assert cpu.available(), cpu.unavailable_reason()
    _, key = cpu._build_command()
    cached = cpu._kernels_dir() / f"jsgl_cpu_{key}.so"
    assert cached.read_bytes().startswith(MAGIC) and cached.stat().st_mode & 0o777 == 0o600
    monkeypatch.setattr(cpu, "_build", lambda *args: pytest.fail("built again though the cache holds it"))
    assert cpu._load_library().jsgl_avx512() in (0, 1)  # a second copy, loaded from the verified bytes
    assert sorted(p.name for p in cached.parent.iterdir()) == [cached.name]  # no scratch directory left


# ------------------------------------------------------------------------------------------------- matmul


@pytest.mark.parametrize("m", [1, 7, 8, 9, 16, 33, 130])
@pytest.mark.parametrize("k,n", [(32, 1), (77, 47), (576, 48), (64, 50), (576, 200)])
def test_packed_matmul_matches_numpy(m, k, n):
    # Row counts around the 8-row micro-kernel, column counts around the 48-column panel.
    rng = np.random.default_rng(m * 1000 + k + n)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    y = jax.jit(cpu.packed_matmul)(jnp.asarray(x), cpu.pack_weight([jnp.asarray(w)]))
    assert y.shape == (m, n) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ w, atol=2e-4 * np.sqrt(k), rtol=0)


@pytest.mark.parametrize("m,k,n", [(17, 576, 96), (64, 1536, 200), (130, 576, 960)])
def test_prefill_matmul_error_stays_near_float32(m, k, n):
    """From 17 rows the product runs on AMX where the CPU has it, as three bfloat16 products of split values
    (cpu_amx.h): its error against float64, relative to sum |x||w|, must stay under 4e-6 (measured ~1.3e-6;
    the AVX-512 float32 kernel ~3e-7, which the same bound covers where it runs; one bfloat16 product would be
    ~4e-3)."""
    rng = np.random.default_rng(m + k + n)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32) / np.sqrt(k)
    y = np.asarray(jax.jit(cpu.packed_matmul)(jnp.asarray(x), cpu.pack_weight([jnp.asarray(w)])))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert (np.abs(y - exact) / scale).max() < 4e-6


def test_amx_is_used_where_the_cpu_has_it_and_can_be_switched_off():
    """Prefill's AMX path runs where the CPU lists amx_bf16 (unless the OS withholds the tiles), and
    JSGL_NO_AMX=1 keeps the AVX-512 kernels (read once per process: a child process checks it)."""
    import os
    import subprocess
    import sys

    if "amx_bf16" not in Path("/proc/cpuinfo").read_text():
        assert not cpu.amx_enabled()
    code = "from jsgl.kernels import cpu; print(cpu.available(), cpu.amx_enabled())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "JSGL_NO_AMX": "1"}, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.split() == ["True", "False"], out.stderr[-2000:]


@pytest.mark.parametrize("m", [5, 40])  # the register kernels; AMX (where the CPU has it)
def test_packed_layer_blocks_match_jnp(m):
    """The layer's blocks through the kernels (fused q/k/v and gate/up, norm, SwiGLU and residual inside the
    calls) equal the same blocks in plain jnp, on small random weights."""
    from jsgl.model import llama

    rng = np.random.default_rng(0)
    d, inter = 96, 64
    shapes = {"wq": (d, 96), "wk": (d, 32), "wv": (d, 32), "wo": (96, d), "w_gate": (d, inter), "w_up": (d, inter),
              "w_down": (inter, d), "attn_norm": (d,), "mlp_norm": (d,)}
    layer = {name: jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[0]))
             for name, shape in shapes.items()}
    packed = llama.with_packed_weights({"layers": [layer], "embed": jnp.zeros((8, d))})["layers"][0]
    assert packed["wq+wk+wv"].splits == (96, 32, 32) and packed["wq+wk+wv"].panels.shape == (4, d, 48)
    h, attn = (jnp.asarray(rng.standard_normal((m, n), np.float32)) for n in (d, 96))
    close = lambda got, want: np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-5)
    close(llama._normed_qkv(h, packed, 1e-5), jnp.concatenate(llama._normed_qkv(h, layer, 1e-5), axis=-1))
    close(llama._attention_output(h, attn, packed), llama._attention_output(h, attn, layer))
    close(llama._mlp(h, packed, 1e-5), llama._mlp(h, layer, 1e-5))


def test_swiglu_prologue_on_large_activations():
    """silu(gate) * up in the kernel stays finite and right where exp(-gate) over- or underflows."""
    gate = jnp.asarray(np.array([[-200.0, -90.0, -20.0, -1.0, 0.0, 1.0, 20.0, 90.0, 200.0] * 2], np.float32))
    up = jnp.ones_like(gate)
    w = jnp.eye(18, dtype=jnp.float32)
    got = cpu.packed_matmul(jnp.concatenate([gate, up], axis=-1), cpu.pack_weight([w]), swiglu=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.nn.silu(gate)), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------- decode attention


def decode_case(seed, q_heads, kv_heads, head_dim, kv_lens, *, q_lens=None, extra_tokens=2, spread=1.0):
    """A decode batch (or, with q_lens, an extend batch: each request's last q_len positions are new) over
    shuffled pool slots; kv_len 0 rows are padding (q_len 0)."""
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(kv_lens, np.int32)
    batch, width = len(kv_lens), int(kv_lens.max()) + 3
    num_slots = int(kv_lens.sum()) + 5
    slots = rng.permutation(np.arange(1, num_slots))
    block_table = np.zeros((batch, width), np.int32)
    offset = 0
    for b, n in enumerate(kv_lens):
        block_table[b, :n] = slots[offset: offset + n]
        offset += n
    q_len = (kv_lens > 0).astype(np.int32) if q_lens is None else np.asarray(q_lens, np.int32)
    q_start = (np.cumsum(q_len) - q_len).astype(np.int32)
    num_tokens = int(q_len.sum()) + extra_tokens
    positions = np.zeros(num_tokens, np.int32)
    for b in range(batch):
        positions[q_start[b]: q_start[b] + q_len[b]] = kv_lens[b] - q_len[b] + np.arange(q_len[b])
    max_q = 1 if q_lens is None else int(2 ** np.ceil(np.log2(max(q_len.max(), 1))))
    meta = AttentionMetadata(jnp.asarray(positions), jnp.asarray(q_start), jnp.asarray(q_len),
                             jnp.asarray(block_table), jnp.asarray(kv_lens), max_q)
    pool = lambda: jnp.asarray(rng.standard_normal((kv_heads, num_slots, head_dim), np.float32))
    q = jnp.asarray(spread * rng.standard_normal((num_tokens, q_heads, head_dim), np.float32))
    return q, pool(), pool(), meta


@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (3, 3, 16), (7, 1, 32), (16, 1, 128)])
def test_decode_attention_matches_native(q_heads, kv_heads, head_dim):
    # Lengths 1, around the 16-key score blocks, long; a padding row mid-batch; padding tokens at the end.
    q, k, v, meta = decode_case(q_heads + head_dim, q_heads, kv_heads, head_dim, [1, 5, 16, 17, 0, 37, 300])
    scale = head_dim**-0.5
    got = jax.jit(cpu.cpu_paged_attention, static_argnums=4)(q, k, v, meta, scale)
    want = jax.jit(native_paged_attention, static_argnums=4)(q, k, v, meta, scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    assert not np.asarray(got)[-2:].any()  # tokens no request owns stay zero


def test_decode_attention_softmax_is_stable_for_large_scores():
    q, k, v, meta = decode_case(7, 9, 3, 64, [40, 3], spread=60.0)  # scores in the thousands
    got = jax.jit(cpu.cpu_paged_attention, static_argnums=4)(q, k, v, meta, 0.125)
    want = jax.jit(native_paged_attention, static_argnums=4)(q, k, v, meta, 0.125)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=0)


def test_short_extend_matches_native():
    """Jump-forward-like extends (a few new tokens per request, causal over them, full over the prefix, mixed
    with decode rows and a padding row) run in the kernel and equal the native path."""
    q, k, v, meta = decode_case(3, 9, 3, 64, [6, 40, 1, 0, 23], q_lens=[3, 11, 1, 0, 1])
    assert meta.max_q_len == 16
    got = jax.jit(cpu.cpu_paged_attention, static_argnums=4)(q, k, v, meta, 0.125)
    want = jax.jit(native_paged_attention, static_argnums=4)(q, k, v, meta, 0.125)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


# decode; short extends with a padding row; prefill chunks (70 tokens: the RoPE and writes in three threaded blocks)
@pytest.mark.parametrize("q_lens", [None, [3, 11, 1, 0, 1], [6, 40, 1, 0, 23]])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 48)])  # vector and scalar RoPE
def test_rope_write_attention_equals_the_three_steps(q_lens, q_heads, kv_heads, head_dim):
    """The fused call (RoPE on q and k from the q|k|v output, K/V written into the pools, attention) gives the
    model's composition: rope, scatter, native attention. Padding tokens (slot 0) write nothing: the reserved
    slot is never read, and the kernel's threads would all write it at once."""
    from jsgl.model.llama import rope, rope_tables

    kv_lens = [6, 40, 1, 0, 23]
    q, k_pool, v_pool, meta = decode_case(5, q_heads, kv_heads, head_dim, kv_lens, q_lens=q_lens)
    rng = np.random.default_rng(1)
    num_tokens = q.shape[0]
    k_new, v_new = (jnp.asarray(rng.standard_normal((num_tokens, kv_heads, head_dim), np.float32)) for _ in range(2))
    qkv = jnp.concatenate([x.reshape(num_tokens, -1) for x in (q, k_new, v_new)], axis=-1)
    positions, table = np.asarray(meta.positions), np.asarray(meta.block_table)
    rows = np.repeat(np.arange(len(kv_lens)), np.asarray(meta.q_len))
    slots = np.zeros(num_tokens, np.int32)  # padding tokens: slot 0
    slots[: len(rows)] = table[rows, positions[: len(rows)]]
    inv_freq = 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
    cos_sin = rope_tables(meta.positions, jnp.asarray(inv_freq, jnp.float32))
    q_width, kv_width = q_heads * head_dim, kv_heads * head_dim

    def three_steps(qkv, k_pool, v_pool):
        q, k, v = (x.reshape(num_tokens, -1, head_dim) for x in jnp.split(qkv, [q_width, q_width + kv_width], -1))
        k_pool = k_pool.at[:, slots].set(rope(k, *cos_sin).swapaxes(0, 1))
        v_pool = v_pool.at[:, slots].set(v.swapaxes(0, 1))
        return native_paged_attention(rope(q, *cos_sin), k_pool, v_pool, meta, 0.125), k_pool, v_pool

    fused = jax.jit(lambda *a: cpu.cpu_rope_write_attention(*a, jnp.asarray(slots), *cos_sin, meta, 0.125))
    k_before, v_before = np.asarray(k_pool), np.asarray(v_pool)
    got, want = fused(qkv, k_pool, v_pool), jax.jit(three_steps)(qkv, k_pool, v_pool)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=2e-5, rtol=0)
    for got_pool, want_pool, before in zip(got[1:], want[1:], (k_before, v_before)):
        np.testing.assert_allclose(np.asarray(got_pool)[:, 1:], np.asarray(want_pool)[:, 1:], atol=2e-5, rtol=0)
        np.testing.assert_array_equal(np.asarray(got_pool)[:, 0], before[:, 0])


@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (7, 1, 32), (4, 2, 48), (16, 1, 128)])
def test_prefill_attention_matches_native(q_heads, kv_heads, head_dim):
    """Prefill chunks (the blocked flash path: 8+ new tokens) beside short extends, decode rows and a padding
    row: a fresh prompt, chunks over cached prefixes of 1-300 tokens, token runs past one 16-token work item
    and not a multiple of 4 rows or 16 keys."""
    kv_lens = [70, 301, 9, 0, 40, 200, 3]
    q_lens = [70, 37, 8, 0, 7, 1, 3]
    q, k, v, meta = decode_case(11, q_heads, kv_heads, head_dim, kv_lens, q_lens=q_lens)
    got = jax.jit(cpu.cpu_paged_attention, static_argnums=4)(q, k, v, meta, head_dim**-0.5)
    want = jax.jit(native_paged_attention, static_argnums=4)(q, k, v, meta, head_dim**-0.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)
    assert not np.asarray(got)[-2:].any()


def test_prefill_attention_softmax_is_stable_for_large_scores():
    """The online softmax rescales as later key blocks raise a row's maximum (scores in the thousands)."""
    q, k, v, meta = decode_case(12, 9, 3, 64, [90, 40], q_lens=[90, 20], spread=60.0)
    got = jax.jit(cpu.cpu_paged_attention, static_argnums=4)(q, k, v, meta, 0.125)
    want = jax.jit(native_paged_attention, static_argnums=4)(q, k, v, meta, 0.125)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------- in the model


def test_backend_resolution():
    assert cpu.resolve_matmul_backend("auto") == ("gguf" if jax.default_backend() == "cpu" else "xla")
    assert cpu.resolve_matmul_backend("auto", tp=2) == "xla"
    with pytest.raises(ValueError, match="does not shard"):
        cpu.resolve_matmul_backend("packed", tp=2)
    with pytest.raises(ValueError, match="unknown matmul backend"):
        cpu.resolve_matmul_backend("mkl")


@pytest.fixture(scope="module")
def smollm():
    from jsgl.model.loader import load_gguf_blocks, load_model

    cfg, params = load_model("smollm2-135m")
    return cfg, params, load_gguf_blocks("smollm2-135m")


def test_gguf_blocks_are_the_dequantized_weights(smollm):
    """Q4_1 layer blocks (Q/K rows unpermuted) and the Q8_0 embedding rebuild the loader's float32 weights."""
    _, params, (layers, head) = smollm
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        b = layers[7][name]
        assert b.kind == "q4_1" and b.q.max() <= 15
        w = np.repeat(b.d, 32, axis=1) * b.q + np.repeat(b.m, 32, axis=1)
        np.testing.assert_array_equal(w.T, params["layers"][7][name])
    assert head.kind == "q8_0" and head.m is None
    np.testing.assert_array_equal(np.repeat(head.d, 32, axis=1) * head.q, params["embed"])


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 17, 40])  # wide (folded scales), 16-column, dequantized paths
def test_quant_matmul_matches_float32_kernel(smollm, m):
    """The kernel over GGUF blocks dequantizes exactly. From 5 rows on it also sums in the float32 kernel's
    order, bit for bit; up to 4 rows it takes the block scales out of the inner sum, so only the rounding
    differs: its error against float64 stays within that of the float32 kernel."""
    _, params, (layers, head) = smollm
    rng = np.random.default_rng(m)
    cases = [([layers[3][name] for name in names], [params["layers"][3][name] for name in names], k)
             for names, k in ((("wq", "wk", "wv"), 576), (("w_down",), 1536))]
    cases.append(([head], [params["embed"].T], 576))
    for blocks, weights, k in cases:
        x = rng.standard_normal((m, k), np.float32)
        quant, dense = cpu.pack_quant(blocks), cpu.pack_weight([jnp.asarray(w) for w in weights])
        assert quant.kind == blocks[0].kind and quant.splits == dense.splits
        got = np.asarray(cpu.packed_matmul(jnp.asarray(x), quant))
        want = np.asarray(cpu.packed_matmul(jnp.asarray(x), dense))
        if m > 4:
            np.testing.assert_array_equal(got, want)
        else:
            exact = x.astype(np.float64) @ np.concatenate(weights, axis=1).astype(np.float64)
            assert np.abs(got - exact).max() <= 2 * np.abs(want - exact).max()


def test_kernel_backends_match_xla_in_the_model(smollm, tokenizer):
    """The real model's prompt logprobs and sampled tokens with the kernels (GGUF blocks or float32 panels,
    and the C++ decode attention) equal XLA's dot + native attention, over a prefill and a decode step."""
    from jsgl.engine.model_runner import ModelRunner
    from jsgl.engine.step_inputs import ForwardItem

    cfg, params, blocks = smollm
    params = jax.tree.map(jnp.asarray, params)
    backends = {"gguf": "cpu", "packed": "cpu", "xla": "native"}
    runners = {name: ModelRunner(cfg, params, 192, matmul_backend=name, attention_backend=attention,
                                 weight_blocks=blocks) for name, attention in backends.items()}
    assert isinstance(runners["gguf"].params["layers"][0]["wq+wk+wv"], cpu.QuantWeight)
    assert isinstance(runners["packed"].params["lm_head"], cpu.PackedWeight)
    ids = np.asarray(tokenizer("The capital of France is").input_ids, np.int32)
    slots = np.arange(1, len(ids) + 2, dtype=np.int32)
    out = {}
    for name, runner in runners.items():
        prefill = runner.run([ForwardItem(ids, 0, slots, target_ids=np.append(ids[1:], 0))], prompt_top_k=0)
        decode = runner.run([ForwardItem(prefill.tokens[:1], len(ids), slots)], top_logprobs=5)
        out[name] = (prefill, decode)
    xla_prefill, xla_decode = out.pop("xla")
    for prefill, decode in out.values():
        np.testing.assert_allclose(prefill.prompt_logprobs[0][:-1], xla_prefill.prompt_logprobs[0][:-1], atol=1e-4)
        assert prefill.tokens[0] == xla_prefill.tokens[0] and decode.tokens[0] == xla_decode.tokens[0]
        np.testing.assert_array_equal(decode.top_logprobs[1], xla_decode.top_logprobs[1])
        np.testing.assert_allclose(decode.top_logprobs[0], xla_decode.top_logprobs[0], atol=1e-4)
