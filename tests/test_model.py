"""The JAX model against transformers on the real SmolLM2 GGUF: logits, prompt logprobs, greedy ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jsgl.engine.kv_pool import allocate_pool
from jsgl.kernels.attention import AttentionMetadata, native_paged_attention
from jsgl.model.llama import forward_hidden, lm_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "Question: What is 12 + 30?\nAnswer:",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "Les fleurs du jardin sont",
]


def jsgl_logits(engine, ids: list[int]) -> np.ndarray:
    """Full-sequence logits from the functional model on a fresh pool, shuffled (non-contiguous) slots."""
    cfg = engine.model_config
    kv = allocate_pool(cfg, 256)
    slots = np.random.default_rng(0).permutation(np.arange(1, 256))[: len(ids)].astype(np.int32)
    n = len(ids)
    meta = AttentionMetadata(
        positions=jnp.arange(n, dtype=jnp.int32), q_start=jnp.zeros(1, jnp.int32),
        q_len=jnp.full(1, n, jnp.int32), block_table=jnp.asarray(slots)[None], kv_lens=jnp.full(1, n, jnp.int32),
        max_q_len=n)
    hidden, _ = forward_hidden(engine.runner.params, kv, jnp.asarray(ids), jnp.asarray(slots), meta, cfg,
                               native_paged_attention)
    return np.asarray(lm_logits(engine.runner.params, hidden))


def hf_logits(hf_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_logits_match_transformers(engine, hf_model, tokenizer, prompt):
    ids = tokenizer(prompt).input_ids
    ours, ref = jsgl_logits(engine, ids), hf_logits(hf_model, ids)
    assert ours.shape == ref.shape == (len(ids), engine.model_config.vocab_size)
    logit_range = ref.max() - ref.min()
    assert np.abs(ours - ref).max() < 1e-3 * logit_range
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_prompt_logprobs_match_transformers(engine, hf_model, tokenizer):
    prompt = PROMPTS[2]
    ids = tokenizer(prompt).input_ids
    out = engine.generate(prompt, {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 0,
                                   "top_logprobs_num": 3})
    ref = torch.log_softmax(torch.tensor(hf_logits(hf_model, ids)), -1).numpy()
    assert out.input_logprobs[0] is None and len(out.input_logprobs) == len(ids)
    expected = ref[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(out.input_logprobs[1:], expected, atol=2e-3)
    top = out.input_top_logprobs[1]
    assert [t for _, t in top] == list(np.argsort(-ref[0])[:3])
    assert out.completion_tokens == 0 and out.finish_reason == "length"


def test_greedy_matches_transformers(engine, hf_model, tokenizer):
    prompts = PROMPTS[:5] + PROMPTS[5:]
    outs = engine.generate(prompts, {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True})
    for prompt, out in zip(prompts, outs):
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        ref_new = ref[0, len(ids):].tolist()
        # transformers stops at EOS; with ignore_eos we continue, so compare up to its length.
        assert out.token_ids[: len(ref_new)] == ref_new, prompt
        assert out.completion_tokens == 32


def test_jit_step_updates_pool_in_place(engine):
    """The donated pool buffers are reused: their device pointers do not change across steps."""
    pools = lambda: engine.runner.kv[0] + engine.runner.kv[1]
    before = [pool.unsafe_buffer_pointer() for pool in pools()]
    engine.generate("Hello", {"max_new_tokens": 4, "temperature": 0})
    assert [pool.unsafe_buffer_pointer() for pool in pools()] == before
    assert all(isinstance(pool, jax.Array) for pool in pools())


def test_bfloat16_engine_matches_transformers_in_bfloat16(hf_model, tokenizer):
    """dtype=bfloat16: weights and KV pool in bfloat16 (matmuls accumulate in float32; norms, RoPE and softmax in
    float32), prompt logprobs near transformers' bfloat16 model on the same GGUF, and its greedy choices mostly
    the float32 reference's."""
    import copy

    from jsgl.engine.engine import Engine

    engine = Engine(dtype="bfloat16", kv_cache_gb=0.1)
    try:
        layer = engine.runner.params["layers"][0]
        assert all(w.dtype == jnp.bfloat16 for w in layer.values())
        assert all(pool.dtype == jnp.bfloat16 for pool in engine.runner.kv[0])
        assert engine.memory_plan.kv_bytes_per_token == engine.model_config.kv_bytes_per_token // 2
        prompt = PROMPTS[2]
        ids = tokenizer(prompt).input_ids
        out = engine.generate(prompt, {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 0})
    finally:
        engine.shutdown()
    bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    with torch.no_grad():
        ref16 = torch.log_softmax(bf16(torch.tensor([ids])).logits[0].float(), -1).numpy()
    ref32 = torch.log_softmax(torch.tensor(hf_logits(hf_model, ids)), -1).numpy()
    targets = (np.arange(len(ids) - 1), ids[1:])
    ours = np.asarray(out.input_logprobs[1:])
    gap16, gap32 = np.abs(ours - ref16[targets]), np.abs(ref16[targets] - ref32[targets])
    assert np.median(gap16) < 0.05 and gap16.max() < 0.5, (gap16, gap32)  # bfloat16 rounding, not a bug
    assert np.median(gap16) <= 2 * np.median(gap32) + 0.01  # as close to HF bf16 as HF bf16 is to float32


def test_int8_kv_engine_serves_a_batch_close_to_float32(engine, tokenizer):
    """kv_dtype=int8 (the 8-bit format: int8 rows, a float32 scale per token and head): the pools are Int8Pools,
    the memory plan counts their bytes (3.8x float32's slots in the same budget), and a batch served end to end
    (the CPU matmul kernels, native attention over the dequantized rows) stays near the float32 engine: prompt
    logprobs within int8 rounding and greedy generations mostly the same tokens."""
    from jsgl.engine.engine import Engine
    from jsgl.kernels.kv_quant import Int8Pool

    greedy = {"max_new_tokens": 16, "temperature": 0}
    scored = {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 0}
    int8 = Engine(kv_dtype="int8", kv_cache_gb=0.1)
    try:
        assert all(isinstance(pool, Int8Pool) and pool.values.dtype == jnp.int8 for pool in int8.runner.kv[0])
        assert int8.runner.attention_backend == "native"  # the CPU kernel reads float32 pools only
        cfg = int8.model_config
        assert int8.memory_plan.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
        ratio = cfg.kv_bytes_per_token / int8.memory_plan.kv_bytes_per_token
        assert abs(int8.allocator.num_slots / (0.1 * (1 << 30) / cfg.kv_bytes_per_token) - ratio) < 0.01
        outs = int8.generate(PROMPTS, greedy)
        scores = int8.generate(PROMPTS, scored)
    finally:
        int8.shutdown()
    ref_outs, ref_scores = engine.generate(PROMPTS, greedy), engine.generate(PROMPTS, scored)
    gaps = np.concatenate([np.abs(np.asarray(a.input_logprobs[1:]) - np.asarray(b.input_logprobs[1:]))
                           for a, b in zip(scores, ref_scores)])
    assert np.median(gaps) < 0.05 and gaps.max() < 0.5, gaps
    same = [a.token_ids == b.token_ids for a, b in zip(outs, ref_outs)]
    agree = np.mean([np.mean(np.asarray(a.token_ids[:8]) == np.asarray(b.token_ids[:8]))
                     for a, b in zip(outs, ref_outs)])
    assert all(len(o.token_ids) == 16 or o.finish_reason.value == "stop" for o in outs)
    assert sum(same) >= len(PROMPTS) // 2 and agree >= 0.75, (same, agree)


@pytest.mark.parametrize("dtype,kv_dtype", [("float32", "float32"), ("bfloat16", "int8")])
def test_scanned_layers_give_the_unrolled_logits(tokenizer, dtype, kv_dtype):
    """layers=scanned (the TPU default: one layer compiled, a lax.scan over stacked weights and stacked
    pools) against layers=unrolled on the real model, same backends (pure JAX). float32: identical prompt logprobs
    at every position, and identical greedy tokens and logprobs over a batch whose requests decode and extend
    together. bfloat16 weights with the 8-bit KV: within bfloat16's rounding (XLA rounds activations to bfloat16
    at the scan's layer boundary, and where its fusions of the unrolled layers differ)."""
    from jsgl.engine.engine import Engine
    from jsgl.kernels.kv_quant import LayerPool

    greedy = {"max_new_tokens": 24, "temperature": 0, "return_logprob": True}
    scored = {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 0}
    results = {}
    for layers in ("unrolled", "scanned"):
        engine = Engine(layers=layers, attention_backend="native", matmul_backend="xla", dtype=dtype,
                        kv_dtype=kv_dtype, kv_cache_gb=0.05, precompile="off")
        try:
            assert engine.stats()["layers"] == layers
            if layers == "scanned":  # one K and one V stack [Hkv, L, N, D], the weights stacked over layers
                k_stack = engine.runner.kv[0]
                assert not isinstance(k_stack, list) and k_stack.shape[1] == engine.model_config.num_layers
                assert engine.runner.params["layers"]["wq"].shape[0] == engine.model_config.num_layers
                assert LayerPool(k_stack, jnp.int32(0)).shape == (k_stack.shape[0], *k_stack.shape[2:])
            pointers = lambda runner: [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(runner.kv)]  # noqa: E731
            before = pointers(engine.runner)
            outs = engine.generate(PROMPTS, greedy)
            prompt = engine.generate(PROMPTS[2], scored)
            assert pointers(engine.runner) == before  # the donated pools (stacks, scanned) are updated in place
            results[layers] = ([(o.token_ids, o.output_logprobs) for o in outs], prompt.input_logprobs)
        finally:
            engine.shutdown()
    assert len(results["scanned"][1]) == len(tokenizer(PROMPTS[2]).input_ids)
    if dtype == "float32":
        assert results["scanned"] == results["unrolled"]
        return
    gap = np.abs(np.asarray(results["scanned"][1][1:]) - np.asarray(results["unrolled"][1][1:]))
    assert np.median(gap) < 0.05 and gap.max() < 0.5, gap
    firsts = [(a[0][0], b[0][0]) for a, b in zip(results["scanned"][0], results["unrolled"][0])]
    assert sum(a == b for a, b in firsts) >= len(firsts) - 1, firsts
