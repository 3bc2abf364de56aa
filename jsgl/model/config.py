"""Llama-family model configuration, read from HF config.json or GGUF metadata.

``ModelConfig.from_hf`` runs a config exactly or refuses it: every field whose value would change the
computation in a way jsgl does not implement raises :class:`UnsupportedModelError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from jsgl.errors import RefusedError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
# Keys of rope_parameters / rope_scaling that the supported types read (anything else changes RoPE).
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings", "partial_rotary_factor"}
_LAYER_TYPES = ("full_attention", "sliding_attention")
# The fields of the model's shape, which have no default.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Families people ask for, and what they need beyond the Llama block (said when refusing them).
_MISSING = {
    "gemma2": "Gemma 2 needs attention and final logit softcapping, GeGLU, (1 + w) RMSNorms around both "
              "sublayers, a scaled embedding and query_pre_attn_scalar",
    "gemma3": "Gemma 3 needs q/k norms with (1 + w), GeGLU, sandwich norms, per-layer-type RoPE and a scaled "
              "embedding",
    "mixtral": "Mixtral is a mixture of experts",
    "qwen2_moe": "a mixture of experts",
    "qwen3_moe": "a mixture of experts",
    "phi3": "Phi-3 fuses qkv/gate_up and may use longrope",
}


# Llama-3-8B's config.json, for planning and lowering at a real model's shapes without its weights (the GPU
# lowering tests, `jsgl bench device`'s whole-step timings).
LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
             "bos_token_id": 128000, "eos_token_id": 128001,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


class UnsupportedModelError(RefusedError, ValueError):
    """A model config (config.json or GGUF metadata) jsgl cannot run exactly; the message names the field."""


def read_hf_config(path: Path) -> dict[str, Any]:
    """An HF folder's config.json as a dict; one that is not JSON is refused by name."""
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{path / 'config.json'} is not valid JSON ({exc}): replace it with the model's "
                                    "config.json") from None


def refuse(field: str, value: Any, why: str) -> NoReturn:
    raise UnsupportedModelError(f"{field}={value!r} is not supported: {why} (jsgl refuses to run a model "
                                "approximately)")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # hashable: the config stays a static jit arg
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2 always; Llama/Qwen3 with attention_bias: o too)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each head of q and k, before RoPE
    # Sliding window of each layer (0: full attention); () when no layer has one.
    layer_windows: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = cfg.get("model_type", "llama")
        if arch not in SUPPORTED_ARCHITECTURES:
            missing = f"{_MISSING[arch]}; " if arch in _MISSING else ""
            refuse("model_type", arch, f"{missing}jsgl runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        absent = [field for field in _REQUIRED if field not in cfg]
        if absent:
            raise UnsupportedModelError(f"the model's config has no {', '.join(absent)}: not a {arch} config jsgl "
                                        "can read (an HF config.json, or a GGUF file's metadata)")
        _check_fields(cfg)
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            refuse("num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        theta, scaling = _rope(cfg)
        max_pos = cfg.get("max_position_embeddings", 2048)
        layers = cfg["num_hidden_layers"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # transformers' Qwen2 has q/k/v biases whatever the config says; Mistral has none.
            attention_bias=arch == "qwen2" or (arch != "mistral" and bool(cfg.get("attention_bias", False))),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=arch == "qwen3",
            layer_windows=_layer_windows(cfg, arch, layers, max_pos),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None for full attention."""
        return (self.layer_windows[layer] or None) if self.layer_windows else None

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies for rotate-half RoPE, with llama3-style scaling when configured (the formulas of
        transformers' ``_compute_llama3_parameters`` / ``_compute_linear_scaling_rope_parameters``)."""
        inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        scaling = dict(self.rope_scaling or ())
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            factor = scaling["factor"]
            low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
            old_ctx = scaling.get("original_max_position_embeddings", 8192)
            wavelen = 2 * math.pi / inv
            smooth = (old_ctx / wavelen - low) / (high - low)
            scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
            mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
            inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        elif kind == "linear":
            inv = inv / scaling["factor"]
        elif kind not in (None, "default"):
            refuse("rope_scaling.rope_type", kind, f"jsgl implements {', '.join(ROPE_TYPES)}")
        return inv.astype(np.float32)


def _check_fields(cfg: dict[str, Any]) -> None:
    """Fields of a supported model_type whose non-default values jsgl does not compute."""
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        refuse("hidden_act", act, "jsgl's MLP is SwiGLU (silu)")
    if cfg.get("mlp_bias"):
        refuse("mlp_bias", cfg["mlp_bias"], "the MLP projections have no biases in jsgl")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(field) is not None:
            refuse(field, cfg[field], "logit softcapping is not implemented")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        refuse("quantization_config", method, "jsgl loads float checkpoints (or GGUF files)")


def _rope(cfg: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(theta, scaling) from transformers >= 5's ``rope_parameters`` (theta + scaling in one dict) or the older
    ``rope_theta`` + ``rope_scaling``."""
    field, params = "rope_parameters", cfg.get("rope_parameters")
    if not isinstance(params, dict):
        params = {}
    if cfg.get("rope_scaling"):
        field, params = "rope_scaling", {**params, **cfg["rope_scaling"]}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        refuse(f"{field}.rope_type", kind, f"jsgl implements RoPE types {', '.join(ROPE_TYPES)}")
    for key in params:
        if key not in _ROPE_KEYS:
            refuse(f"{field}.{key}", params[key], f"RoPE type {kind!r} in jsgl reads {sorted(_ROPE_KEYS)}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        refuse("partial_rotary_factor", partial, "jsgl rotates the whole head")
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return theta, None if kind == "default" else tuple(sorted(scaling.items()))


def _layer_windows(cfg: dict[str, Any], arch: str, layers: int, max_pos: int) -> tuple[int, ...]:
    """Per-layer sliding windows as transformers 5 applies them: Mistral's ``sliding_window`` on every layer;
    Qwen2/3's only with ``use_sliding_window``, on the layers ``layer_types`` marks (by default those from
    ``max_window_layers`` on). Llama has none (transformers ignores a ``sliding_window`` there too)."""
    if arch == "mistral":
        window = cfg.get("sliding_window")
        types = ["sliding_attention"] * layers
    elif arch in ("qwen2", "qwen3"):
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        first = cfg.get("max_window_layers", 28)
        types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                           for i in range(layers)]
    else:
        return ()
    if len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        refuse("layer_types", types, f"expected {layers} entries of {_LAYER_TYPES}")
    if window is None:
        return ()
    if not isinstance(window, int) or window < 1:
        refuse("sliding_window", window, "a window is a positive number of positions")
    # A window of at least the context never masks a key: run such a model as full attention (the engine
    # caps the context at max_position_embeddings), which keeps the kernels that have no window.
    windows = tuple(window if t == "sliding_attention" and window < max_pos else 0 for t in types)
    return windows if any(windows) else ()
