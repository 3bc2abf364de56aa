"""Loading HF folders (config.json + safetensors): Llama/Mistral/Qwen2 against transformers' own forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jsgl.engine.kv_pool import allocate_pool
from jsgl.kernels.attention import AttentionMetadata, native_paged_attention
from jsgl.kernels.quant import QuantBlocks
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


# SmolLM2-135M's GGUF: the Q4_1/Q8_0 matrices of a layer (our name -> the file's), its attention heads.
GGUF_LAYER_MATRICES = {"wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight", "wo": "attn_output.weight",
                       "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight"}
SMOLLM_HEADS = {"wq": 9, "wk": 3}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's q/k rows (convert_hf_to_gguf.py, LlamaModel.permute), written
    here rather than taken from jsgl, which undoes it."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def dequantized(blocks: QuantBlocks) -> np.ndarray:
    """``w[n, k] = d[n, k // 32] * q[n, k] (+ m[n, k // 32])`` in float32, the operations gguf's dequantize does."""
    w = np.repeat(blocks.d, 32, axis=1) * blocks.q.astype(np.float32)
    return w if blocks.m is None else w + np.repeat(blocks.m, 32, axis=1)


def test_gguf_blocks_cache_holds_the_files_values(tmp_path, monkeypatch):
    """The blocks an engine start reads from the cache are the file's: built into an empty cache and read back,
    each matrix dequantizes exactly to what the `gguf` package's own dequantize gives for that tensor (Q/K rows
    in HF order: llama.cpp's permutation of them is the file's order). Compared with values computed without
    jsgl's block code, so neither the cache agreeing with a fresh parse nor a parse bug both share can pass."""
    import gguf

    from jsgl.model import loader
    from jsgl.model.registry import resolve_model_path

    monkeypatch.setattr(loader, "model_cache_dir", lambda path: tmp_path)
    readers, open_reader = [], gguf.GGUFReader  # the file as gguf reads it, kept from the parse (seconds to open)

    def keep_reader(*args: object) -> gguf.GGUFReader:
        readers.append(open_reader(*args))
        return readers[-1]

    monkeypatch.setattr(gguf, "GGUFReader", keep_reader)
    parsed = loader.load_gguf_blocks("smollm2-135m")  # parses the GGUF, then writes the cache
    assert (tmp_path / "blocks.v1.safetensors").exists()
    layers, head = loader.load_gguf_blocks("smollm2-135m")  # from the cache
    assert len(readers) == 1 and readers[0].data.filename == str(resolve_model_path("smollm2-135m"))
    tensors = {t.name: t for t in readers[0].tensors}

    def file_values(name: str) -> np.ndarray:
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type)

    assert len(layers) == 30 and all(set(layer) == set(GGUF_LAYER_MATRICES) for layer in layers)
    for i, layer in enumerate(layers):
        for ours, blocks in layer.items():
            assert blocks.kind == "q4_1" and blocks.q.dtype == np.uint8, (i, ours)
            values = dequantized(blocks)
            if ours in SMOLLM_HEADS:
                values = llama_cpp_permute(values, SMOLLM_HEADS[ours])
            np.testing.assert_array_equal(values, file_values(f"blk.{i}.{GGUF_LAYER_MATRICES[ours]}"), f"{i}.{ours}")
    assert head.kind == "q8_0" and head.m is None and head.q.dtype == np.int8  # tied: the Q8_0 embedding
    np.testing.assert_array_equal(dequantized(head), file_values("token_embd.weight"))
    # And what the parse handed the engine directly is what the cache gives back.
    pairs = [(x[name], y[name]) for x, y in zip(parsed[0], layers, strict=True) for name in x]
    for a, b in pairs + [(parsed[1], head)]:
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

    from jsgl.model.placement import to_device

    rng = np.random.default_rng(0)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        stored = rng.standard_normal((48, 80)).astype(dtype)  # [out, in], as a safetensors file holds it
        for x in (stored.T, stored, stored[::2], stored.T.astype(np.float32)):
            placed = to_device(x)
            assert placed.shape == x.shape and placed.dtype == x.dtype
            np.testing.assert_array_equal(np.asarray(placed), np.ascontiguousarray(x))


def test_to_sharded_places_each_block_of_a_transposed_view():
    """Under tensor parallelism each device's block of a transposed view travels as stored and is transposed there:
    the array equals the host's contiguous copy, split as the sharding says (columns and rows)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jsgl.model.placement import to_sharded

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    stored = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    for spec in (PartitionSpec(None, "tp"), PartitionSpec("tp", None), PartitionSpec()):
        placed = to_sharded(stored.T, NamedSharding(mesh, spec))
        assert placed.sharding.spec == spec
        np.testing.assert_array_equal(np.asarray(placed), stored.T)
