"""Tokenizers through `transformers`: from a GGUF's vocab/merges/template, or from an HF folder."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from jsgl.model.registry import model_cache_dir, resolve_model_path

# The special tokens a GGUF names by id (tokenizer.ggml.<key>), as transformers' get_gguf_tokenizer reads them.
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


@lru_cache(maxsize=4)
def load_tokenizer(model: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model name/path; a GGUF's is converted once and saved beside its weights."""
    path = resolve_model_path(model)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    saved = model_cache_dir(path) / "tokenizer"
    if (saved / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(saved)
    tok = gguf_tokenizer(path)
    tok.save_pretrained(saved)
    return tok


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer `AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)` builds, without torch.

    transformers reads the GGUF's metadata with a reader that imports torch (only a test dependency here), then
    converts it with torch-free code. Here the `gguf` package reads the metadata and transformers' own converter
    (`convert_gguf_tokenizer`) builds the backend, wrapped in the class AutoTokenizer picks. transformers before
    5.24 (whose GGUF tokenizer code differs from the get_gguf_tokenizer mirrored below) keeps its own path."""
    try:
        import transformers.integrations.gguf.gguf_tokenizer_mapping as converter
    except ImportError:  # before 5.20 the converter lived in transformers.integrations.ggml
        converter = None
    # 5.24+ reads the file's add_bos/add_eos flags, as _tokenizer_fields does
    if converter is None or "ggml.add_bos_token" not in converter.GGUF_TOKENIZER_MAPPING["tokenizer_config"]:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    metadata = _gguf_metadata(path)
    tokenizer_class = _tokenizer_class(metadata["general.architecture"])
    if tokenizer_class is None:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer_dict, tokenizer_config = _tokenizer_fields(metadata, converter.GGUF_TOKENIZER_MAPPING)
    backend, extra = converter.convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return tokenizer_class(tokenizer_object=backend, name_or_path=str(path), **tokenizer_config, **extra)


def _gguf_metadata(path: Path) -> dict[str, Any]:
    """The file's architecture and tokenizer.* metadata as Python values (strings, ints, lists)."""
    import gguf  # here: only a GGUF's first load needs it

    fields = gguf.GGUFReader(str(path)).fields
    return {k: f.contents() for k, f in fields.items() if k == "general.architecture" or k.startswith("tokenizer.")}


def _tokenizer_fields(metadata: dict[str, Any],
                      mapping: dict[str, dict[str, str]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(tokenizer_dict, tokenizer_config)` as transformers' get_gguf_tokenizer (5.24+) makes them."""
    tokenizer, config = ({name: metadata[f"tokenizer.{key}"] for key, name in mapping[group].items()
                          if f"tokenizer.{key}" in metadata} for group in ("tokenizer", "tokenizer_config"))
    kind = tokenizer.get("tokenizer_type")
    if kind == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":  # its chat template writes <bos> itself
        config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return tokenizer, config


def _tokenizer_class(architecture: str) -> type | None:
    """The class AutoTokenizer picks for the GGUF's model type (TokenizersBackend unless the type has its own),
    or None for an architecture that is no model type (transformers renames some: qwen2moe -> qwen2_moe), which
    is left to transformers."""
    from transformers import TokenizersBackend
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    if architecture not in CONFIG_MAPPING:
        return None
    cls = TOKENIZER_MAPPING.get(CONFIG_MAPPING[architecture], None)
    # a backend not built on `tokenizers` (MistralCommonBackend): AutoTokenizer takes TokenizersBackend for a GGUF
    return cls if isinstance(cls, type) and issubclass(cls, TokenizersBackend) else TokenizersBackend


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_eos: list[int] | None = None) -> set[int]:
    """Token ids that end generation: the tokenizer's EOS plus chat end-of-turn markers it knows."""
    ids = set(generation_eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for marker in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<|end|>"):
        if marker in vocab:
            ids.add(int(vocab[marker]))
    return ids
