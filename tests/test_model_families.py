"""Model families against transformers: Llama 3.x (llama3 RoPE scaling), Qwen2/2.5 (q/k/v biases, tied head),
Qwen3 (q/k RMSNorm, head_dim != hidden/heads, a windowed layer) and Mistral with a sliding window shorter than
the prompts.

Tiny random checkpoints are built offline from transformers' config classes and saved as HF folders (float32
safetensors; one bf16 copy) with SmolLM2's tokenizer beside them. Checked: logits at every prompt position,
one-shot and in 8-token extends over a cached prefix, through each engine's own params and attention backend;
greedy generations of a real Engine with the CPU kernels ("auto") and with the pure-JAX path ("native"
attention, XLA matmuls); configs jsgl cannot run exactly are refused with the field named.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from jsgl.experiments.bench_device_engine import perturb_norms_and_biases

from jsgl.engine.engine import Engine
from jsgl.engine.kv_pool import allocate_pool
from jsgl.kernels.attention import AttentionMetadata, get_attention_backend
from jsgl.model.config import ModelConfig, UnsupportedModelError
from jsgl.model.llama import forward_hidden, is_scanned, lm_logits
from jsgl.model.loader import load_model
from jsgl.model.tokenizer import load_tokenizer

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
            bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
MISTRAL_WINDOW = 8
FAMILIES = {
    # original context 64: with head_dim 16 the frequencies fall in all three llama3 bands (kept, smoothed, scaled)
    "llama3": (tf.LlamaConfig, dict(rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0})),
    "qwen2": (tf.Qwen2Config, dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1e6})),
    # head_dim 32 != 64 / 4; layer 1 windowed (use_sliding_window from max_window_layers on)
    "qwen3": (tf.Qwen3Config, dict(head_dim=32, use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "mistral": (tf.MistralConfig, dict(sliding_window=MISTRAL_WINDOW, head_dim=16)),
}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch of his house.",
    "1, 2, 3,",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
]
NEW_TOKENS = 20


def build_checkpoint(family: str, folder, dtype: torch.dtype = torch.float32) -> tf.PreTrainedModel:
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config_cls(**TINY, **extra))
    model = perturb_norms_and_biases(model).to(dtype).eval()
    model.save_pretrained(folder, safe_serialization=True)
    load_tokenizer("smollm2-135m").save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, tf.PreTrainedModel]]:
    torch.set_num_threads(2)
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        out[family] = (str(folder), build_checkpoint(family, folder))
    return out


def hf_logits(model: tf.PreTrainedModel, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def jsgl_logits(config: ModelConfig, params, backend: str, ids: list[int], chunk: int = 32) -> np.ndarray:
    """Logits of every position from the forward over a fresh pool (shuffled slots), in extends of ``chunk``
    tokens each over the prefix already in the pool (one prefill when ``chunk >= len(ids)``). Padded like the
    runner pads (to ``chunk`` tokens, a 32-wide slot table) so each chunk size compiles once."""
    assert len(ids) <= 32
    kv = allocate_pool(config, 256, stacked=is_scanned(params))
    slots = np.random.default_rng(0).permutation(np.arange(1, 256))[:32].astype(np.int32)
    table = jnp.asarray(slots)[None]
    attention = get_attention_backend(backend)
    out = []
    for start in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - start)
        pad = chunk - n  # padding tokens: position 0, written to the reserved slot 0, outside the request
        meta = AttentionMetadata(jnp.asarray(list(range(start, start + n)) + [0] * pad, jnp.int32),
                                 jnp.zeros(1, jnp.int32), jnp.full(1, n, jnp.int32), table,
                                 jnp.full(1, start + n, jnp.int32), max_q_len=chunk)
        tokens = jnp.asarray(ids[start:start + n] + [0] * pad, jnp.int32)
        write = jnp.asarray(list(slots[start:start + n]) + [0] * pad, jnp.int32)
        logits, kv = _forward(params, kv, tokens, write, meta, config, attention)
        out.append(np.asarray(logits)[:n])
    return np.concatenate(out)


@functools.partial(jax.jit, static_argnums=(5, 6))
def _forward(params, kv, token_ids, write_slots, meta, config, attention):
    hidden, kv = forward_hidden(params, kv, token_ids, write_slots, meta, config, attention)
    return lm_logits(params, hidden), kv


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def hf_greedy(model: tf.PreTrainedModel, ids: list[int]) -> list[int]:
    model.generation_config.eos_token_id = None  # like ignore_eos
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_configs_parsed_as_transformers_builds_them(checkpoints):
    configs = {family: load_model(folder)[0] for family, (folder, _) in checkpoints.items()}
    assert configs["llama3"].rope_scaling and dict(configs["llama3"].rope_scaling)["rope_type"] == "llama3"
    assert configs["qwen2"].attention_bias and configs["qwen2"].tie_word_embeddings
    assert configs["qwen3"].qk_norm and configs["qwen3"].head_dim == 32 and configs["qwen3"].layer_windows == (0, 6)
    assert configs["mistral"].layer_windows == (MISTRAL_WINDOW, MISTRAL_WINDOW)
    tokenizer = load_tokenizer(checkpoints["mistral"][0])
    assert all(len(tokenizer(p).input_ids) > MISTRAL_WINDOW for p in PROMPTS[::2])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_match_transformers(checkpoints, family):
    folder, model = checkpoints[family]
    tokenizer = load_tokenizer(folder)
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    refs = [hf_logits(model, ids) for ids in prompt_ids]
    expected = [hf_greedy(model, ids) for ids in prompt_ids]
    # auto: the CPU kernels (packed matmuls; paged attention and its fused RoPE + write form where it applies),
    # with 16-token prefill chunks so the prompt runs as extends over a cached prefix. native: pure JAX, its layers
    # unrolled and scanned (one lax.scan per run of equal windows: two runs for qwen3), which must agree exactly.
    unrolled = {}
    for backend, matmul, layers in (("auto", "auto", "auto"), ("native", "xla", "unrolled"),
                                    ("native", "xla", "scanned")):
        engine = Engine(model=folder, num_kv_slots=1024, max_running_requests=8, chunked_prefill_size=16,
                        attention_backend=backend, matmul_backend=matmul, layers=layers)
        try:
            runner = engine.runner
            assert is_scanned(runner.params) == (layers == "scanned")
            for i, (ids, ref) in enumerate(zip(prompt_ids, refs)):
                for chunk in (32, 8):
                    ours = jsgl_logits(runner.config, runner.params, runner.attention_backend, ids, chunk)
                    assert relative_error(ours, ref) < 1e-4, (backend, chunk, relative_error(ours, ref))
                    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))
                    if layers == "unrolled":
                        unrolled[i, chunk] = ours
                    elif layers == "scanned":
                        np.testing.assert_array_equal(ours, unrolled[i, chunk])
            outs = engine.generate(PROMPTS, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
            for prompt, out, want in zip(PROMPTS, outs, expected):
                assert out.token_ids == want, (backend, prompt)
        finally:
            engine.shutdown()


@pytest.mark.parametrize("page_size,layers", [(1, "unrolled"), (4, "unrolled"), (4, "scanned")])
@pytest.mark.parametrize("family", ["mistral"])
def test_pallas_backend_honours_the_window(checkpoints, family, page_size, layers):
    # The GPU backend's kernels (here in Pallas interpret mode) mask the window themselves, in 16-token extends
    # and in decode past the window; with pages of 4 slots they read the engine's page tables; scanned (the
    # TPU default), each layer's from the stacked pools.
    folder, model = checkpoints[family]
    tokenizer = load_tokenizer(folder)
    expected = [hf_greedy(model, tokenizer(p).input_ids) for p in PROMPTS]
    # Mixed steps, as a GPU's default: the short prompts decode beside the long one's later chunks.
    engine = Engine(model=folder, num_kv_slots=1024, chunked_prefill_size=16, attention_backend="pallas",
                    matmul_backend="xla", page_size=page_size, layers=layers, mixed_prefill_tokens=8)
    try:
        outs = engine.generate(PROMPTS, {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
        assert [out.token_ids for out in outs] == expected
        assert engine.stats()["mixed_steps"] > 0
    finally:
        engine.shutdown()


@pytest.mark.slow  # the kernel's programs run in the Pallas TPU interpreter, in Python: ~35 s
def test_tpu_kernel_engine_matches_transformers(checkpoints, monkeypatch):
    # An engine with the backends a TPU resolves (the Mosaic kernel, scanned layers, XLA matmuls, pages of 16), the
    # kernel interpreted on this CPU: transformers' greedy tokens. Qwen3 (one family, for the suite's time: the kernel
    # path is the same for Llama's) has head_dim 32, through the kernel's padding to 128 lanes, and a windowed layer
    # (6 keys, shorter than the prompts), through its sliding window;
    # 16-token chunks make prompts extends over their own first chunks, and a follow-up extends a radix-cached prefix.
    from jsgl.engine import engine as engine_module
    from jsgl.engine.backends import resolve_backends

    monkeypatch.setattr(engine_module, "resolve_backends",
                        lambda *args, **options: resolve_backends(*args, **{**options, "platform": "tpu"}))
    folder, model = checkpoints["qwen3"]
    tokenizer = load_tokenizer(folder)
    expected = [hf_greedy(model, tokenizer(p).input_ids) for p in PROMPTS]
    engine = engine_module.Engine(model=folder, num_kv_slots=1024, chunked_prefill_size=16, page_size=16,
                                  precompile="off", weights_cache="off", mixed_prefill_tokens=8)  # a TPU's default
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        assert (engine.backends.attention, engine.backends.matmul, engine.backends.scanned) == ("tpu", "xla", True)
        assert [out.token_ids for out in engine.generate(PROMPTS, greedy)] == expected
        assert engine.stats()["mixed_steps"] > 0  # decodes beside a prompt's chunks, in one kernel call
        # A follow-up over the first prompt: its whole pages come from the radix cache, the rest is one extend.
        follow_up = PROMPTS[0] + " The farmer waves."
        out = engine.generate(follow_up, greedy)
        assert out.cached_tokens >= 16 and out.token_ids == hf_greedy(model, tokenizer(follow_up).input_ids)
    finally:
        engine.shutdown()


def test_bfloat16_checkpoint_loads_exactly(tmp_path):
    """A bf16 checkpoint is read as stored (bf16, not a float32 copy); upcast (the CPU policy) it computes what
    transformers computes after loading the file in float32, and an engine with dtype bfloat16 holds exactly the
    file's bits."""
    from jsgl.engine.engine import Engine

    build_checkpoint("qwen3", tmp_path, torch.bfloat16)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    config, params = load_model(tmp_path)
    assert all(str(np.asarray(w).dtype) == "bfloat16" for w in jax.tree.leaves(params))
    ids = load_tokenizer(str(tmp_path))(PROMPTS[0]).input_ids
    ours = jsgl_logits(config, jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), params), "native", ids)
    assert relative_error(ours, hf_logits(model, ids)) < 1e-4
    engine = Engine(model=str(tmp_path), dtype="bfloat16", kv_cache_gb=0.01)
    try:
        got = np.asarray(engine.runner.params["layers"][1]["wq"])
        assert got.dtype == params["layers"][1]["wq"].dtype
        np.testing.assert_array_equal(got.view(np.uint16), params["layers"][1]["wq"].view(np.uint16))
        assert engine.generate(PROMPTS[0], {"max_new_tokens": 3, "ignore_eos": True}).completion_tokens == 3
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family,rope", [
    ("llama3", {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}}),  # transformers >= 5's form
    ("llama3", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),  # older config.json files
    ("llama3", {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 10000.0}),
])
def test_rope_frequencies_match_transformers(family, rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config_cls, _ = FAMILIES[family]
    hf_config = config_cls(**TINY, **rope)
    kind = hf_config.rope_parameters["rope_type"]
    ref, _ = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    for raw in ({**TINY, **rope, "model_type": "llama"}, hf_config.to_dict()):
        ours = ModelConfig.from_hf(json.loads(json.dumps(raw))).rope_inv_freq()
        np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)


BASE = {"model_type": "llama", **TINY}


@pytest.mark.parametrize("change,field", [
    ({"model_type": "gemma2"}, "model_type"),
    ({"model_type": "mixtral"}, "model_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
     "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}},
     "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}},
     "rope_parameters.mrope_section"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4, "layer_types": ["full_attention"]},
     "layer_types"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
])
def test_unsupported_configs_refused_by_name(change, field):
    with pytest.raises(UnsupportedModelError, match=f"^{field}="):
        ModelConfig.from_hf({**BASE, **change})


def test_windows_follow_transformers_layer_types():
    qwen = {**BASE, "model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 16, "max_window_layers": 2}
    assert ModelConfig.from_hf(qwen).layer_windows == ()  # use_sliding_window false (Qwen2.5's configs)
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True}).layer_windows == (0, 0, 16, 16)
    hf = tf.Qwen2Config(**{**TINY, "num_hidden_layers": 4}, use_sliding_window=True, sliding_window=16,
                        max_window_layers=2)
    assert ModelConfig.from_hf(hf.to_dict()).layer_windows == (0, 0, 16, 16)
    # A window of the whole context masks nothing: full attention (the CPU kernels stay on).
    assert ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": 512}).layer_windows == ()
    assert ModelConfig.from_hf({**BASE, "sliding_window": 4}).layer_windows == ()  # Llama: ignored, as by HF


def test_checkpoint_tensors_must_match_the_config(tmp_path, checkpoints):
    from safetensors.numpy import load_file, save_file

    folder, _ = checkpoints["qwen2"]
    weights = load_file(f"{folder}/model.safetensors")
    config = json.loads(open(f"{folder}/config.json").read())

    def save(tensors: dict, **changes) -> None:
        save_file(tensors, tmp_path / "model.safetensors")
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))

    save({**weights, "model.layers.0.mlp.up_proj.bias": np.zeros(128, np.float32)})
    with pytest.raises(UnsupportedModelError, match="model.layers.0.mlp.up_proj.bias"):
        load_model(tmp_path)
    save({k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.bias"})
    with pytest.raises(UnsupportedModelError, match="self_attn.k_proj.bias"):
        load_model(tmp_path)
    save(weights, tie_word_embeddings=False)  # untied, yet no lm_head.weight in the file
    with pytest.raises(UnsupportedModelError, match="^tie_word_embeddings="):
        load_model(tmp_path)


def test_cpu_backend_declines_windowed_layers():
    """The C++ kernels do not mask a window: with one set they hand the call to the native path."""
    from jsgl.kernels import cpu

    if not cpu.hardware_supported():
        pytest.skip("the CPU kernels need an x86-64 CPU with AVX-512 or AVX2 (hardware)")
    assert cpu.available(), "the CPU kernels failed to build"
    q = jnp.zeros((1, 4, 16), jnp.float32)
    meta = AttentionMetadata(jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32),
                             jnp.ones((1, 1), jnp.int32), jnp.ones(1, jnp.int32))
    pools = jnp.zeros((2, 4, 16), jnp.float32)
    assert cpu._kernel_serves(q, pools, meta)
    assert not cpu._kernel_serves(q, pools, dataclasses.replace(meta, sliding_window=4))
    qkv = jnp.zeros((1, 8 * 16), jnp.float32)
    tables = jnp.ones((1, 1, 16), jnp.float32)
    windowed = dataclasses.replace(meta, sliding_window=4)
    assert cpu.cpu_rope_write_attention(qkv, pools, pools, jnp.ones(1, jnp.int32), tables, tables, windowed,
                                        0.25) is None


# ------------------------------------------------------------------------------------------------------- GGUF
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def write_gguf(model: tf.PreTrainedModel, arch: str, path) -> None:
    """An F32 GGUF as llama.cpp's convert_hf_to_gguf writes one: its LlamaModel interleaves each q/k head's rotary
    halves (``permute``); Qwen2/Qwen3 tensors are stored as in HF."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)  # Qwen3's head_dim differs from D / H
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    for name, t in model.state_dict().items():
        t = t.float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{i}.{_GGUF_NAMES[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if module == "self_attn.q_proj" else c.num_key_value_heads
                t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        writer.add_tensor(gguf_name, np.ascontiguousarray(t))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,config_cls", [("llama", tf.LlamaConfig), ("qwen2", tf.Qwen2Config),
                                             ("qwen3", tf.Qwen3Config)])
def test_gguf_files_match_transformers(tmp_path, monkeypatch, arch, config_cls):
    # llama.cpp permutes q/k for Llama only: a Qwen GGUF read with Llama's un-permutation is a wrong model.
    # transformers' own GGUF reader checks the file is written as llama.cpp writes it.
    monkeypatch.setenv("JSGL_CACHE_DIR", str(tmp_path / "cache"))  # converted weights go to the jsgl cache
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config_cls(**TINY)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1 if "norm" in name else 0, 0.3)
    write_gguf(model, arch, tmp_path / "tiny.gguf")
    ids = list(range(100, 130))
    ref = hf_logits(model, ids)
    from_file = tf.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    assert relative_error(hf_logits(from_file.eval(), ids), ref) < 1e-6
    config, params = load_model(tmp_path / "tiny.gguf")
    assert config.architecture == arch and config.qk_norm == (arch == "qwen3")
    assert relative_error(jsgl_logits(config, jax.tree.map(jnp.asarray, params), "native", ids), ref) < 1e-4
