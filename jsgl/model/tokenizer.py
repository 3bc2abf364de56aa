"""Tokenizers through `transformers`: from a GGUF's vocab/merges/template, or from an HF folder."""

from __future__ import annotations

import os
from functools import lru_cache

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from jsgl.model.registry import model_cache_dir, resolve_model_path


@lru_cache(maxsize=4)
def load_tokenizer(model: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model name/path; a GGUF's is converted once and saved beside its weights."""
    path = resolve_model_path(model)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    saved = model_cache_dir(path) / "tokenizer"
    if (saved / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(saved)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.save_pretrained(saved)
    return tok


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

