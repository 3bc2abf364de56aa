"""Load weights into one params pytree, tensor by tensor: from GGUF (dequantized) or HF safetensors folders.

A GGUF's converted weights are cached as an orbax checkpoint (``jsgl.model.checkpoint``) beside the saved
tokenizer, so the second start skips dequantization; ``load_placed`` also keeps the params as an engine holds
them (cast, padded and sharded) and restores them onto their devices.

The params pytree (matrices stored [in, out] so the model computes ``x @ w``; one dict per layer,
not stacked: XLA CPU copies a layer's slice out of a stacked array before its matmul, which halved
decode speed)::

    embed [V, D], final_norm [D], lm_head [D, V] (absent when tied to embed)
    layers: list of L dicts: attn_norm [D], wq [D, Hq*hd], wk/wv [D, Hkv*hd], wo [Hq*hd, D],
            (bq [Hq*hd], bk/bv [Hkv*hd] with attention bias; bo [D] where the checkpoint has it),
            (q_norm/k_norm [hd]: Qwen3), mlp_norm [D], w_gate/w_up [D, I], w_down [I, D]

An HF checkpoint must hold exactly the tensors its config implies: a missing one or one jsgl would not use
(an MLP bias, a norm of another architecture) is refused by name rather than run approximately.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jsgl.errors import ModelNotFoundError
from jsgl.kernels.quant import QuantBlocks
from jsgl.model import checkpoint
from jsgl.model.config import ModelConfig, UnsupportedModelError, read_hf_config, refuse
from jsgl.model.registry import model_cache_dir, resolve_model_path
from jsgl.paths import cache_dir

Params = dict[str, Any]
log = logging.getLogger("jsgl.model.loader")

# Our per-layer name -> (GGUF tensor name, HF tensor name); matrices are [out, in] in both files.
_LAYER_TENSORS = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "wq": ("attn_q.weight", "self_attn.q_proj.weight"),
    "wk": ("attn_k.weight", "self_attn.k_proj.weight"),
    "wv": ("attn_v.weight", "self_attn.v_proj.weight"),
    "wo": ("attn_output.weight", "self_attn.o_proj.weight"),
    "bq": ("attn_q.bias", "self_attn.q_proj.bias"),
    "bk": ("attn_k.bias", "self_attn.k_proj.bias"),
    "bv": ("attn_v.bias", "self_attn.v_proj.bias"),
    "bo": ("attn_output.bias", "self_attn.o_proj.bias"),
    "q_norm": ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    "k_norm": ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    "mlp_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "w_gate": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "w_up": ("ffn_up.weight", "mlp.up_proj.weight"),
    "w_down": ("ffn_down.weight", "mlp.down_proj.weight"),
}
_GLOBAL_TENSORS = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "final_norm": ("output_norm.weight", "model.norm.weight"),
    "lm_head": ("output.weight", "lm_head.weight"),
}


WEIGHTS_CACHES = ("auto", "orbax", "off")
Put = Callable[[str, np.ndarray], Any]  # (key: "embed", "layers.3.wq", ...; the tensor) -> what the params hold


def load_model(model: str | os.PathLike, dtype: Any = None,
               placer: Callable[[ModelConfig], Put] | None = None,
               skip: Collection[str] = ()) -> tuple[ModelConfig, Params]:
    """Config and params of a model alias, .gguf file (float32, dequantized) or HF folder (its bfloat16 or
    float16 kept, anything else float32), as numpy arrays.

    ``dtype``: every tensor cast to it as it is read. ``placer(config)``: a function called on each tensor as
    soon as it is read and converted, whose result the params hold instead (the engine puts each on its device,
    or its shards on theirs): tensor by tensor, the host then holds about one tensor at a time, never the model
    (an HF folder; a GGUF is held whole while converted, or read back from its converted weights).

    ``skip``: flat names ("lm_head", "layers.3.wq") left out of the params: for a GGUF, the matrices the CPU
    kernels take from the file's own blocks (``load_gguf_blocks``), whose float32 copies nobody would read."""
    path = resolve_model_path(model)
    if path.is_dir():
        if skip:
            raise ValueError("skip: only a GGUF model's tensors can be left out (an HF folder has no blocks)")
        config = ModelConfig.from_hf(read_hf_config(path))
        return config, _load_hf(path, config, _putter(config, dtype, placer))
    cache = model_cache_dir(path)
    for stale in ("params.safetensors", "params.v2.safetensors", "config.json"):  # the hand-made cache before orbax
        (cache / stale).unlink(missing_ok=True)
    converted = _converted_path(path)
    if checkpoint.exists(converted):
        hf_config, params = checkpoint.restore(converted, skip=skip)
    else:
        hf_config, params = _load_gguf(path)
        if jax.process_count() == 1:  # across processes orbax saves as one program, not into a folder of each own
            checkpoint.save(converted, params, hf_config)
    config = ModelConfig.from_hf(hf_config)
    flat = {name: x for name, x in _flatten(params).items() if name not in skip}
    del params
    put = _putter(config, dtype, placer)
    return config, _unflatten({name: put(name, flat.pop(name)) for name in list(flat)})


def _converted_path(gguf: Path) -> Path:
    return model_cache_dir(gguf) / checkpoint.folder_name(np.float32, 1)


def placed_checkpoint_path(model: str | os.PathLike, dtype: Any, tp: int) -> Path:
    """Where the orbax checkpoint of a model's params as placed at (dtype, tp) lives (``jsgl.model.checkpoint``)."""
    path = resolve_model_path(model)
    if path.is_file() and np.dtype(dtype) == np.float32 and tp == 1:
        return _converted_path(path)  # a GGUF's converted weights are these params
    return cache_dir() / "checkpoints" / model_cache_dir(path).name / checkpoint.folder_name(dtype, tp)


def load_placed(model: str | os.PathLike, dtype: Any, tp: int, placer: Callable[[ModelConfig], Put],
                sharding: Callable[[ModelConfig], checkpoint.ShardingOf],
                cache: str = "auto", skip: Collection[str] = ()) -> tuple[ModelConfig, Params]:
    """``load_model``'s params as the engine holds them (``placer``), through an orbax checkpoint of them per
    (model, dtype, tp): restored onto ``sharding(config)`` when it exists, saved after loading when not.

    ``cache``: "orbax" for any model; "auto" for GGUF models only (an HF folder's safetensors are already a
    checkpoint, read tensor by tensor: a second copy of an 8B model would cost 16 GB of disk); "off": none
    (a GGUF's converted weights, its float32 tp=1 checkpoint, are still kept: converting is the slow part).
    ``skip``: as ``load_model``'s; params without them are never saved as a checkpoint."""
    if cache not in WEIGHTS_CACHES:
        raise ValueError(f"weights cache must be one of {', '.join(WEIGHTS_CACHES)}, not {cache!r}")
    path = resolve_model_path(model)
    if cache == "off" or (cache == "auto" and path.is_dir()):
        return load_model(model, dtype, placer, skip)
    saved = placed_checkpoint_path(path, dtype, tp)
    if checkpoint.exists(saved):
        config = ModelConfig.from_hf(json.loads((saved / "config.json").read_text()))  # refuses what jsgl can't run
        try:
            return config, checkpoint.restore(saved, sharding(config), skip)[1]
        except Exception:  # a damaged checkpoint: load from the model and save it again
            log.warning("could not restore %s; loading %s instead", saved, path, exc_info=True)
            shutil.rmtree(saved, ignore_errors=True)
    config, params = load_model(model, dtype, placer, skip)
    # (A GGUF's float32 tp=1 params are its converted weights: saved already.)
    if not checkpoint.exists(saved) and not skip:
        config_file = path / "config.json" if path.is_dir() else _converted_path(path) / "config.json"
        checkpoint.save(saved, params, json.loads(config_file.read_text()))
    return config, params


def _putter(config: ModelConfig, dtype: Any, placer: Callable[[ModelConfig], Put] | None) -> Put:
    """Cast each tensor (keeping its memory layout: a transposed view stays one) and hand it to the placer; with
    none, the params are C-contiguous host arrays."""
    place = placer(config) if placer is not None else None

    def put(name: str, x: np.ndarray) -> Any:
        if dtype is not None and x.dtype != dtype:
            x = x.astype(dtype)
        return place(name, x) if place is not None else np.ascontiguousarray(x)

    return put




def _flatten(params: Params) -> dict[str, np.ndarray]:
    flat = {k: v for k, v in params.items() if k != "layers"}
    for i, layer in enumerate(params["layers"]):
        flat.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return flat


def _unflatten(flat: dict[str, np.ndarray]) -> Params:
    params: Params = {}
    layers: dict[int, dict[str, np.ndarray]] = {}
    for key, value in flat.items():
        if key.startswith("layers."):
            _, index, name = key.split(".", 2)
            layers.setdefault(int(index), {})[name] = value
        else:
            params[key] = value
    params["layers"] = [layers[i] for i in range(len(layers))]
    return params


def _to_in_out(layer: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Matrices [out, in] -> [in, out]; norms and biases stay 1-D."""
    return {name: np.ascontiguousarray(w.T) if w.ndim == 2 else w for name, w in layer.items()}


def _finish(tensors: dict[str, np.ndarray], per_layer: list[dict[str, np.ndarray]], tied: bool) -> Params:
    params: Params = {"embed": tensors["embed"], "final_norm": tensors["final_norm"]}
    if not tied:
        params["lm_head"] = np.ascontiguousarray(tensors["lm_head"].T)
    params["layers"] = [_to_in_out(layer) for layer in per_layer]
    return params


# ---------------------------------------------------------------------------------------------- GGUF
_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# llama.cpp's converter interleaves the rotary halves of q/k only for these (its LlamaModel; Qwen's rope is
# NEOX-style, stored as in HF): transformers' GGUF reader undoes it for "llama" alone, likewise.
_PERMUTED_QK = ("llama", "mistral")


def _unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion, which interleaves each head's rotary halves for its RoPE kernel."""
    out_dim = weight.shape[0]
    return (
        weight.reshape(num_heads, out_dim // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_config(reader: Any) -> dict[str, Any]:
    def field(name: str, default: Any = None) -> Any:
        f = reader.fields.get(name)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        refuse("GGUF general.architecture", arch, f"jsgl reads {', '.join(_GGUF_ARCHITECTURES)} GGUF files")
    names = {t.name for t in reader.tensors}
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    heads = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    head_dim = field(f"{arch}.attention.key_length") or hidden // heads
    # What llama.cpp stores for RoPE scaling and windows, which jsgl does not read from a GGUF (yet): refuse
    # rather than run without it. (Llama 3.1 GGUFs carry their llama3 scaling as the rope_freqs tensor.)
    if field(f"{arch}.rope.scaling.type", "none") not in ("none", None):
        refuse(f"GGUF {arch}.rope.scaling.type", field(f"{arch}.rope.scaling.type"), "use the HF checkpoint")
    if "rope_freqs.weight" in names:
        refuse("GGUF tensor rope_freqs.weight", "present", "per-frequency RoPE factors: use the HF checkpoint")
    if field(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        refuse(f"GGUF {arch}.rope.dimension_count", field(f"{arch}.rope.dimension_count"),
               f"partial RoPE (head_dim {head_dim})")
    if field(f"{arch}.attention.sliding_window") is not None:
        refuse(f"GGUF {arch}.attention.sliding_window", field(f"{arch}.attention.sliding_window"),
               "use the HF checkpoint")
    known = {g for g, _ in _GLOBAL_TENSORS.values()} | {g for g, _ in _LAYER_TENSORS.values()}
    for name in sorted(names):
        if (name.split(".", 2)[-1] if name.startswith("blk.") else name) not in known:
            refuse("GGUF tensor", name, "jsgl's forward would not use it")
    return {
        "model_type": arch,
        "vocab_size": field(f"{arch}.vocab_size") or int(embed.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": field(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": field(f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
    }


def _load_gguf(path: Path) -> tuple[dict[str, Any], Params]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    hf_config = _gguf_config(reader)
    config = ModelConfig.from_hf(hf_config)

    def tensor(name: str) -> np.ndarray:
        t = by_name[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

    by_name = {t.name: t for t in reader.tensors}
    tensors = {ours: tensor(g) for ours, (g, _) in _GLOBAL_TENSORS.items() if g in by_name}
    per_layer = []
    for i in range(config.num_layers):
        layer = {ours: tensor(f"blk.{i}.{g}") for ours, (g, _) in _LAYER_TENSORS.items()
                 if f"blk.{i}.{g}" in by_name}
        if config.architecture in _PERMUTED_QK:
            for name, heads in (("wq", config.num_heads), ("wk", config.num_kv_heads),
                                ("bq", config.num_heads), ("bk", config.num_kv_heads)):
                if name in layer:
                    layer[name] = _unpermute_qk(layer[name], heads)
        _check_layer(layer, config, i, gguf_names=True)
        per_layer.append(layer)
    return hf_config, _finish(tensors, per_layer, config.tie_word_embeddings)


def _quant_blocks(t: Any) -> QuantBlocks | None:
    import gguf

    kind = {gguf.GGMLQuantizationType.Q4_1: "q4_1", gguf.GGMLQuantizationType.Q8_0: "q8_0"}.get(t.tensor_type)
    if kind is None:
        return None
    rows = int(t.shape[1])
    blocks = np.asarray(t.data).reshape(rows, -1, 20 if kind == "q4_1" else 34)
    half = lambda b: b.copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "q8_0":
        return QuantBlocks(kind, blocks[..., 2:].copy().view(np.int8).reshape(rows, -1), half(blocks[..., :2]), None)
    codes = blocks[..., 4:]  # element j of a block in the low nibble of byte j, element j + 16 in the high
    q = np.concatenate([codes & 0x0F, codes >> 4], axis=-1).reshape(rows, -1)
    return QuantBlocks(kind, q, half(blocks[..., :2]), half(blocks[..., 2:4]))


def load_gguf_blocks(model: str | os.PathLike) -> tuple[list[dict[str, QuantBlocks]], QuantBlocks | None] | None:
    """The layer matrices (by our names) and the LM head (``output`` or, tied, ``token_embd``) that the
    GGUF file stores as Q4_1 or Q8_0 blocks, for the CPU kernels that compute on them directly. None for an
    HF folder."""
    import gguf

    path = resolve_model_path(model)
    if path.is_dir():
        return None
    # Cached beside the converted weights: opening the GGUF parses its whole metadata (the 49k-entry
    # vocabulary and merges), ~6.5 s of every engine start here, for blocks that never change.
    cache_file = model_cache_dir(path) / "blocks.v1.safetensors"
    if cache_file.exists():
        return _load_blocks(cache_file)
    reader = gguf.GGUFReader(str(path))
    config = ModelConfig.from_hf(_gguf_config(reader))
    by_name = {t.name: t for t in reader.tensors}
    layers = []
    for i in range(config.num_layers):
        layer = {}
        for ours, (g, _) in _LAYER_TENSORS.items():
            t = by_name.get(f"blk.{i}.{g}")
            blocks = _quant_blocks(t) if t is not None and len(t.shape) == 2 else None
            if blocks is not None:
                if ours in ("wq", "wk") and config.architecture in _PERMUTED_QK:
                    heads = config.num_heads if ours == "wq" else config.num_kv_heads
                    blocks = QuantBlocks(blocks.kind, *(None if a is None else _unpermute_qk(a, heads)
                                                        for a in (blocks.q, blocks.d, blocks.m)))
                layer[ours] = blocks
        layers.append(layer)
    head = by_name.get("output.weight") or by_name["token_embd.weight"]
    result = layers, _quant_blocks(head)
    _save_blocks(cache_file, *result)
    return result


def _save_blocks(file: Path, layers: list[dict[str, QuantBlocks]], head: QuantBlocks | None) -> None:
    tensors: dict[str, np.ndarray] = {}
    kinds: dict[str, str] = {"num_layers": str(len(layers))}
    named = [(f"layers.{i}.{name}", b) for i, layer in enumerate(layers) for name, b in layer.items()]
    for key, blocks in named + ([("head", head)] if head is not None else []):
        kinds[key] = blocks.kind
        tensors.update({f"{key}.{part}": np.ascontiguousarray(getattr(blocks, part))
                        for part in ("q", "d", "m") if getattr(blocks, part) is not None})
    tmp = file.with_suffix(".tmp")
    save_file(tensors, tmp, metadata=kinds)
    os.replace(tmp, file)


def _load_blocks(file: Path) -> tuple[list[dict[str, QuantBlocks]], QuantBlocks | None]:
    from safetensors import safe_open

    with safe_open(file, "np") as f:
        kinds = f.metadata()
        arrays = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118  (safe_open is not a dict)

    def blocks(key: str) -> QuantBlocks:
        return QuantBlocks(kinds[key], arrays[f"{key}.q"], arrays[f"{key}.d"], arrays.get(f"{key}.m"))

    layers: list[dict[str, QuantBlocks]] = [{} for _ in range(int(kinds["num_layers"]))]
    for key in kinds:
        if key.startswith("layers."):
            _, index, name = key.split(".", 2)
            layers[int(index)][name] = blocks(key)
    return layers, blocks("head") if "head" in kinds else None


# ------------------------------------------------------------------------------------------------ HF
def _expected_layer_tensors(config: ModelConfig) -> set[str]:
    """Our names of the tensors every layer of ``config`` has: transformers' module for it would create exactly
    these (o_proj's bias with ``attention_bias`` outside Qwen2, whose o_proj never has one)."""
    names = {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"}
    if config.attention_bias:
        names |= {"bq", "bk", "bv"} | (set() if config.architecture == "qwen2" else {"bo"})
    if config.qk_norm:
        names |= {"q_norm", "k_norm"}
    return names


def _check_layer(layer: dict[str, np.ndarray], config: ModelConfig, index: int, *, gguf_names: bool = False) -> None:
    """A layer's tensors are those its config implies: nothing missing, nothing jsgl would ignore."""
    expected = _expected_layer_tensors(config)
    column = 0 if gguf_names else 1
    missing, extra = sorted(expected - layer.keys()), sorted(layer.keys() - expected)
    if missing:
        raise UnsupportedModelError(f"layer {index} has no {_LAYER_TENSORS[missing[0]][column]}, which "
                                    f"{config.architecture} with this config needs")
    if extra:
        refuse(f"tensor {_LAYER_TENSORS[extra[0]][column]} (layer {index})", "present",
               f"{config.architecture} with this config has no such tensor")


# Buffers older transformers saved with the weights; recomputed from the config, never read.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
                       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                       "BOOL": np.bool_}


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where one tensor of a .safetensors file lies; ``read()`` reads it (and only it) into a fresh array."""

    file: Path
    offset: int
    nbytes: int
    dtype: Any
    shape: tuple[int, ...]

    def read(self) -> np.ndarray:
        # A plain read into a new buffer, not a memory map: a mapped file's pages stay resident (and counted)
        # until it is unmapped, so mapping a checkpoint and reading it through costs the whole file.
        buffer = np.empty(self.nbytes, np.uint8)
        with open(self.file, "rb") as f:
            f.seek(self.offset)
            if f.readinto(buffer) != self.nbytes:
                raise UnsupportedModelError(f"{self.file.name}: truncated tensor data")
        return buffer.view(self.dtype).reshape(self.shape)


def read_safetensors(file: Path) -> dict[str, StoredTensor]:
    """Every tensor of a .safetensors file, by name, unread, in its stored dtype (bfloat16 through ml_dtypes:
    safetensors' numpy reader refuses it): a sharded checkpoint costs host memory only for the tensor being
    converted."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise UnsupportedModelError(f"{file.name}: tensor {name} has dtype {entry['dtype']}, which jsgl does "
                                        "not read")
        start, end = entry["data_offsets"]
        out[name] = StoredTensor(file, 8 + header_len + start, end - start, _SAFETENSORS_DTYPES[entry["dtype"]],
                                 tuple(entry["shape"]))
    return out


def _load_hf(path: Path, config: ModelConfig, put: Put) -> Params:
    """Each tensor read, converted (matrices to [in, out]; bfloat16 or float16 kept, anything else float32, unless
    ``put`` casts it) and handed to ``put`` in turn."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has config.json but no *.safetensors weights: download them beside it "
                                 "(an HF folder's *.safetensors; jsgl does not read PyTorch .bin files)")
    raw: dict[str, StoredTensor] = {}
    for f in files:
        raw.update(read_safetensors(f))

    def get(ours: str, name: str, transpose: bool = False) -> Any:
        x = raw[name].read()
        if x.dtype not in (np.float16, ml_dtypes.bfloat16):
            x = x.astype(np.float32)
        # A matrix goes on as a transposed view of what was read: the engine's placer transposes it on its device
        # (jsgl.model.placement), each device's block under tensor parallelism; with no placer the host copies it.
        return put(ours, x.T if transpose and x.ndim == 2 else x)

    if not config.tie_word_embeddings and _GLOBAL_TENSORS["lm_head"][1] not in raw:
        refuse("tie_word_embeddings", False, "the checkpoint has no lm_head.weight (transformers would "
               "initialise it randomly)")
    names = [[ours for ours, (_, h) in _LAYER_TENSORS.items() if f"model.layers.{i}.{h}" in raw]
             for i in range(config.num_layers)]
    for i, layer_names in enumerate(names):  # the whole checkpoint checked before any tensor is read
        _check_layer(dict.fromkeys(layer_names), config, i)
    # What the forward reads (a tied checkpoint's stored lm_head too: the embedding serves as the head).
    known = {h for _, h in _GLOBAL_TENSORS.values()} | {f"model.layers.{i}.{_LAYER_TENSORS[o][1]}"
                                                        for i, layer_names in enumerate(names) for o in layer_names}
    leftover = sorted(n for n in raw.keys() - known if not n.endswith(_IGNORED_HF_SUFFIXES))
    if leftover:
        refuse("tensor", leftover[0], f"jsgl's {config.architecture} forward would not use it "
               f"({len(leftover)} such tensors)")
    params: Params = {"embed": get("embed", _GLOBAL_TENSORS["embed"][1]),
                      "final_norm": get("final_norm", _GLOBAL_TENSORS["final_norm"][1])}
    if not config.tie_word_embeddings:
        params["lm_head"] = get("lm_head", _GLOBAL_TENSORS["lm_head"][1], transpose=True)
    params["layers"] = [{ours: get(f"layers.{i}.{ours}", f"model.layers.{i}.{_LAYER_TENSORS[ours][1]}", True)
                         for ours in layer_names} for i, layer_names in enumerate(names)]
    return params
