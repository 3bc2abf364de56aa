"""The engine end to end on this device, against transformers (part of `jsgl bench device`).

Tiny random checkpoints of each family jsgl serves (Llama 3 with llama3 RoPE, Qwen2 with biases and a tied
head, Qwen3 with q/k norms and a windowed layer, Mistral with a window shorter than the prompts) are built
offline from transformers' config classes, with a byte-level BPE tokenizer trained here on a few sentences
(no file from a hub), and saved as HF folders. jsgl's `Engine` on the default device (Pallas attention on a
GPU, at page sizes 1 and 16; the Mosaic kernel on a TPU, at 16; 16-token prefill chunks, so prompts also run as
extends over a cached prefix) generates greedily, in float32 and in bfloat16. transformers (float32, on the CPU:
the reference) then scores prompt + jsgl's tokens in one forward. Each token jsgl chose must be transformers'
argmax up to the precision of the run: its logit within ``tolerance x max|logit|`` of the best one (float32
matmuls may run as TF32 on a GPU, so exact token equality would test the matmul unit, not jsgl).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch of his house.",
    "1, 2, 3,",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
            bos_token_id=1, eos_token_id=2)
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}  # of max|logit| over the scored positions


def families() -> dict[str, tuple[Any, dict]]:
    import transformers as tf

    return {
        "llama3": (tf.LlamaConfig, dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "rope_theta": 500000.0,
                                                         "original_max_position_embeddings": 64})),
        "qwen2": (tf.Qwen2Config, dict(tie_word_embeddings=True)),
        "qwen3": (tf.Qwen3Config, dict(head_dim=32, use_sliding_window=True, sliding_window=6, max_window_layers=1)),
        "mistral": (tf.MistralConfig, dict(sliding_window=8, head_dim=16)),
    }


def train_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained on the prompts and a little more text: real merges, made offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = PROMPTS + [__doc__ or ""] * 4 + [" ".join(str(i) for i in range(200))]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def perturb_norms_and_biases(model: Any) -> Any:
    """A random transformers model with its norms and biases away from their init (1, 0), so that a checkpoint
    reader that dropped one would show."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.normal_(1, 0.3)
    return model


def build_checkpoint(family: str, folder: Path, tokenizer: Any) -> Any:
    import torch
    import transformers as tf

    config_cls, extra = families()[family]
    torch.manual_seed(0)
    model = perturb_norms_and_biases(
        tf.AutoModelForCausalLM.from_config(config_cls(vocab_size=len(tokenizer), **TINY, **extra)))
    model = model.float().eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return model


@dataclasses.dataclass
class EngineCheck:
    family: str
    dtype: str
    page_size: int
    tokens: int  # tokens jsgl generated (all prompts)
    exact: int  # of them, transformers' argmax exactly
    worst_gap: float  # max over tokens of (best logit - chosen logit) / max|logit|

    @property
    def ok(self) -> bool:
        return self.worst_gap <= TOLERANCE[self.dtype]

    def row(self) -> str:
        return (f"{self.family:8s} {self.dtype:8s} page {self.page_size:2d}: {self.exact}/{self.tokens} tokens "
                f"transformers' argmax, worst gap {self.worst_gap:.1e} of max|logit| "
                f"(tolerance {TOLERANCE[self.dtype]:.0e}) [{'ok' if self.ok else 'FAIL'}]")


def engine_defaults_report() -> str:
    """What an `Engine` left at its defaults picks on this device (a tiny Llama 3 checkpoint): the platform,
    dtypes, page size and backends it reports, and its memory plan."""
    from jsgl.engine.engine import Engine

    with tempfile.TemporaryDirectory(prefix="jsgl-device-defaults-") as root:
        build_checkpoint("llama3", Path(root), train_tokenizer())
        engine = Engine(model=root)
        try:
            stats = engine.stats()
            keys = ("platform", "device_kind", "device_count", "dtype", "kv_dtype", "page_size",
                    "attention_backend", "matmul_backend")
            return ", ".join(f"{k} {stats[k]}" for k in keys) + "\n" + engine.memory_plan.render()
        finally:
            engine.shutdown()


def run_engine_checks(new_tokens: int = 16, page_sizes: tuple[int, ...] = (1, 16),
                      dtypes: tuple[str, ...] = ("float32", "bfloat16"), attention: str = "pallas",
                      family_names: tuple[str, ...] | None = None) -> list[EngineCheck]:
    import numpy as np
    import torch

    from jsgl.engine.engine import Engine

    tokenizer = train_tokenizer()
    results = []
    with tempfile.TemporaryDirectory(prefix="jsgl-device-engine-") as root:
        for family in family_names or tuple(families()):
            folder = Path(root) / family
            model = build_checkpoint(family, folder, tokenizer)
            for dtype in dtypes:
                for page_size in page_sizes:
                    engine = Engine(model=str(folder), num_kv_slots=2048, chunked_prefill_size=16,
                                    attention_backend=attention, matmul_backend="xla", page_size=page_size,
                                    dtype=dtype)
                    try:
                        # As the engine tokenizes (transformers may pick the family's own tokenizer class,
                        # whose pre-tokenizer differs from the one trained here).
                        prompt_ids = [engine.tokenizer(prompt).input_ids for prompt in PROMPTS]
                        outs = engine.generate(PROMPTS, {"max_new_tokens": new_tokens, "temperature": 0,
                                                         "ignore_eos": True})
                    finally:
                        engine.shutdown()
                    exact, tokens, worst = 0, 0, 0.0
                    for ids, out in zip(prompt_ids, outs):
                        assert out.prompt_tokens == len(ids), (family, out.prompt_tokens, len(ids))
                        with torch.no_grad():
                            logits = model(torch.tensor([ids + out.token_ids])).logits[0].numpy()
                        scored = logits[len(ids) - 1:len(ids) - 1 + len(out.token_ids)]
                        chosen = scored[np.arange(len(out.token_ids)), out.token_ids]
                        gap = (scored.max(-1) - chosen) / np.abs(scored).max()
                        exact += int((scored.argmax(-1) == np.asarray(out.token_ids)).sum())
                        tokens += len(out.token_ids)
                        worst = max(worst, float(gap.max()))
                    results.append(EngineCheck(family, dtype, page_size, tokens, exact, worst))
    return results
