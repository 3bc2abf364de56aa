"""Loading HF folders (config.json + safetensors): Llama/Mistral/Qwen2 against transformers' own forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jsgl.engine.kv_pool import allocate_pool
from jsgl.kernels.attention import AttentionMetadata, native_paged_attention
from jsgl.model.llama import forward_hidden, lm_logits
from jsgl.model.loader import load_model


def logits_of(model_dir, ids: list[int]) -> np.ndarray:
    cfg, params = load_model(model_dir)
    params = jax.tree.map(jnp.asarray, params)
    n = len(ids)
    slots = jnp.arange(1, n + 1, dtype=jnp.int32)
    meta = AttentionMetadata(jnp.arange(n, dtype=jnp.int32), jnp.zeros(1, jnp.int32), jnp.full(1, n, jnp.int32),
                             slots[None], jnp.full(1, n, jnp.int32), max_q_len=n)
    hidden, _ = forward_hidden(params, allocate_pool(cfg, n + 1), jnp.asarray(ids), slots, meta, cfg,
                               native_paged_attention)
    return np.asarray(lm_logits(params, hidden))


def tiny(config_cls, **extra):
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0)
    return config_cls(**{**base, **extra})


@pytest.mark.parametrize("arch", ["llama", "llama3-rope", "mistral", "qwen2", "llama-untied"])
def test_hf_folder_matches_transformers(tmp_path, arch):
    import transformers as tf

    torch.manual_seed(0)
    if arch == "qwen2":
        config = tiny(tf.Qwen2Config, tie_word_embeddings=True)
        model = tf.Qwen2ForCausalLM(config)
    elif arch == "mistral":
        config = tiny(tf.MistralConfig, sliding_window=None)
        model = tf.MistralForCausalLM(config)
    else:
        extra = {"tie_word_embeddings": arch != "llama-untied"}
        if arch == "llama3-rope":
            extra["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        config = tiny(tf.LlamaConfig, **extra)
        model = tf.LlamaForCausalLM(config)
    # Random biases too (Qwen2 has q/k/v bias), so a dropped bias would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.eval().save_pretrained(tmp_path, safe_serialization=True)
    ids = list(np.random.default_rng(0).integers(0, 300, size=150))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    ours = logits_of(tmp_path, ids)
    np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max() + 1e-5)


def test_converted_weights_are_cached(tmp_path, monkeypatch):
    from jsgl.model.registry import model_cache_dir, resolve_model_path

    path = resolve_model_path("smollm2-135m")
    cfg, params = load_model("smollm2-135m")  # the session already converted it once
    converted = model_cache_dir(path) / "params-v1-float32-tp1"  # an orbax checkpoint (jsgl.model.checkpoint)
    assert (converted / "config.json").exists() and (converted / "tree" / "_METADATA").exists()
    assert not (model_cache_dir(path) / "params.v2.safetensors").exists()  # the hand-made cache before it
    assert cfg.num_layers == 30 and cfg.num_heads == 9 and cfg.num_kv_heads == 3 and cfg.vocab_size == 49152
    assert len(params["layers"]) == 30 and "lm_head" not in params  # tied
    assert params["layers"][0]["wq"].shape == (576, 576) and params["layers"][0]["attn_norm"].shape == (576,)


def test_gguf_blocks_cache_equals_the_file(tmp_path, monkeypatch):
    """The blocks an engine start reads from the cache are the GGUF's own, decoded afresh."""
    from jsgl.model import loader

    cached = loader.load_gguf_blocks("smollm2-135m")
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    monkeypatch.setattr(loader, "model_cache_dir", lambda path: fresh_dir)
    fresh = loader.load_gguf_blocks("smollm2-135m")  # parses the GGUF, then writes the cache
    assert (fresh_dir / "blocks.v1.safetensors").exists()
    assert loader.load_gguf_blocks("smollm2-135m")[1].kind == fresh[1].kind
    pairs = [(la[name], lb[name]) for la, lb in zip(cached[0], fresh[0], strict=True) for name in lb]
    assert all(la.keys() == lb.keys() for la, lb in zip(cached[0], fresh[0]))
    assert len(pairs) == 30 * 7
    for a, b in pairs + [(cached[1], fresh[1])]:
        assert a.kind == b.kind and np.array_equal(a.q, b.q) and np.array_equal(a.d, b.d)
        assert (a.m is None) == (b.m is None) and (a.m is None or np.array_equal(a.m, b.m))


def test_the_kernels_blocks_are_never_loaded_as_float32():
    """With the GGUF kernels, the float32 copies of the matrices they read from the file's blocks are skipped:
    every projection of the default model (all Q4_1) and nothing else; restoring without them gives the other
    tensors exactly as a full restore (every engine test on the default kernels runs on params so loaded)."""
    from jsgl.model.llama import PROJECTIONS, packed_from_blocks
    from jsgl.model.loader import load_gguf_blocks

    skip = packed_from_blocks(load_gguf_blocks("smollm2-135m"))
    projections = {name for group in PROJECTIONS for name in group}
    assert skip == {f"layers.{i}.{name}" for i in range(30) for name in projections} | {"lm_head"}
    _, full = load_model("smollm2-135m")
    _, partial = load_model("smollm2-135m", skip=skip)
    assert partial.keys() == full.keys() and np.array_equal(partial["embed"], full["embed"])
    for got, want in zip(partial["layers"], full["layers"], strict=True):
        assert got.keys() == want.keys() - projections
        assert all(np.array_equal(got[name], want[name]) for name in got)


def test_unknown_model_names():
    from jsgl.model.registry import resolve_model_path

    with pytest.raises(FileNotFoundError, match="unknown model"):
        resolve_model_path("no-such-model-alias")


def test_to_device_transposes_a_transposed_view_on_the_device():
    """The loader hands HF matrices on as transposed views of what it read; `to_device` uploads them as stored and
    transposes there. Every layout and dtype arrives equal to the host's contiguous copy."""
    import ml_dtypes

    from jsgl.model.loader import to_device

    rng = np.random.default_rng(0)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        stored = rng.standard_normal((48, 80)).astype(dtype)  # [out, in], as a safetensors file holds it
        for x in (stored.T, stored, stored[::2], stored.T.astype(np.float32)):
            placed = to_device(x)
            assert placed.shape == x.shape and placed.dtype == x.dtype
            np.testing.assert_array_equal(np.asarray(placed), np.ascontiguousarray(x))
