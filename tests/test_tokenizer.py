"""A GGUF's tokenizer without torch (issue #35): `pip install jsgl` has no torch, and transformers' own GGUF
reader imports it. jsgl reads the metadata with the `gguf` package and converts it with transformers' converter;
the result must be the tokenizer transformers builds from the same file, in every respect a caller can see."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from jsgl.model.registry import resolve_model_path
from jsgl.model.tokenizer import gguf_tokenizer

pytestmark = pytest.mark.slow  # each case reads a 94 MB GGUF's vocabulary and builds a tokenizer (2-5 s)

REPO = Path(__file__).parent.parent
TEXTS = [
    "", "Hello, world!", "The quick brown fox jumps over the lazy dog.", "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\n", "def f(x):\n    return x ** 2\n", "1234567890 3.14159 -42",
    "naïve café résumé", "Привет, мир", "你好，世界", "こんにちは", "🤖🚀👍🏽", "e\u0301 vs é", "\u00a0nbsp\u200bzwsp",
    "<|im_start|>user\nhi<|im_end|>", "a<|im_end|>b<|endoftext|>", "<s>x</s><unk>", "<think>x</think>",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 🤖, what's 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "<|im_end|> naïve"},
]

# Run with torch unimportable (as after `pip install jsgl`) and a fresh cache, so the GGUF is converted here.
WITHOUT_TORCH = r"""
import json, sys
sys.modules["torch"] = None  # `import torch` raises ImportError; transformers sees no torch
from jsgl.model.tokenizer import load_tokenizer
texts, chat = json.loads(sys.argv[1])
tok = load_tokenizer("smollm2-135m")
out = {"ids": [tok(t).input_ids for t in texts], "decoded": [tok.decode(tok(t).input_ids) for t in texts],
       "chat": tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
       "special": tok.special_tokens_map, "eos": tok.eos_token_id}
out["chat_ids"] = tok(out["chat"]).input_ids
load_tokenizer.cache_clear()  # the second load reads the tokenizer saved beside the converted weights
out["reloaded"] = [load_tokenizer("smollm2-135m")(t).input_ids for t in texts]
out["torch_imported"] = sys.modules.get("torch") is not None or any(m.startswith("torch.") for m in sys.modules)
print(json.dumps(out))
"""


def test_default_tokenizer_loads_without_torch(tmp_path, tokenizer):
    env = {**os.environ, "JSGL_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, json.dumps([TEXTS, CHAT])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert not out["torch_imported"]
    assert list(tmp_path.glob("models/*/tokenizer/tokenizer.json"))  # converted once, then saved
    assert out["decoded"] == TEXTS and out["reloaded"] == out["ids"]
    assert out["special"]["eos_token"] == "<|im_end|>" and out["ids"][14][-1] == out["eos"]
    assert out["chat"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert out["chat"].endswith("<|im_start|>assistant\n")
    # the same as the session's tokenizer (the one saved in the shared cache, or converted in this process)
    assert out["ids"] == [tokenizer(t).input_ids for t in TEXTS]
    assert out["chat"] == tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert out["chat_ids"] == tokenizer(out["chat"]).input_ids


def _copy_with(src: gguf.GGUFReader, dst: Path, arch: str, replace: dict[str, tuple[Any, Any, Any]]) -> Path:
    """A tensor-free GGUF with `src`'s metadata under architecture `arch`, with `replace`'s keys set to their
    (value, type, array element type); a replaced vocabulary drops src's other tokenizer.ggml.* keys."""
    old = src.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in replace or (
                "tokenizer.ggml.tokens" in replace and key.startswith("tokenizer.ggml.")):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key.replace(f"{old}.", f"{arch}.", 1), field.contents(), kind, sub_type=sub)
    for key, (value, kind, sub) in replace.items():
        writer.add_key_value(key, value, kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _sentencepiece_vocab() -> dict[str, tuple[Any, Any, Any]]:
    """A small sentencepiece ("llama") vocabulary with byte fallback and no add_bos flag: the merges come from
    the scores, and BOS is added by default (llama.cpp's rule, which jsgl mirrors from transformers)."""
    array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "\u2581t", "th", "\u2581th", "he", "\u2581the", "in",
              "\u2581in", "er", "on", "\u2581a", "\u2581o", "ll", "llo", "\u2581hello", "\u2581w", "or", "ld"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]  # unknown, control, byte, normal
    return {
        "tokenizer.ggml.model": ("llama", string, None),
        "tokenizer.ggml.tokens": (tokens, array, string),
        "tokenizer.ggml.scores": ([-float(i) for i in range(len(tokens))], array, gguf.GGUFValueType.FLOAT32),
        "tokenizer.ggml.token_type": (types, array, gguf.GGUFValueType.INT32),
        "tokenizer.ggml.bos_token_id": (1, gguf.GGUFValueType.UINT32, None),
        "tokenizer.ggml.eos_token_id": (2, gguf.GGUFValueType.UINT32, None),
        "tokenizer.ggml.unknown_token_id": (0, gguf.GGUFValueType.UINT32, None),
    }


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    """The default model's GGUF; its tokenizer metadata under architecture qwen2 (whose tokenizer class is
    Qwen2Tokenizer, not TokenizersBackend); a sentencepiece vocabulary (llama's other tokenizer type)."""
    folder = tmp_path_factory.mktemp("ggufs")
    default = resolve_model_path("smollm2-135m")
    reader = gguf.GGUFReader(str(default))
    return {"smollm2": default,
            "qwen2": _copy_with(reader, folder / "qwen2.gguf", "qwen2", {}),
            "sentencepiece": _copy_with(reader, folder / "sp.gguf", "llama", _sentencepiece_vocab())}


def _added(tok: Any) -> dict[int, dict[str, Any]]:
    return {i: t.__getstate__() for i, t in tok.added_tokens_decoder.items()}


def _chat_ids(tok: Any) -> list[int]:
    out = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# transformers' own GGUF reader, the reference, needs torch
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch for transformers' GGUF reader")
@pytest.mark.parametrize("name", ["smollm2", "qwen2", "sentencepiece"])
def test_same_tokenizer_as_transformers_gguf_reader(gguf_files, name, tmp_path):
    from transformers import AutoTokenizer

    path = gguf_files[name]
    ours, ref = gguf_tokenizer(path), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert type(ours) is type(ref)
    # the whole `tokenizers` pipeline: vocab, merges, normalizer, pre-tokenizer, post-processor, decoder, added
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert ours.get_vocab() == ref.get_vocab() and len(ours) == len(ref)
    assert _added(ours) == _added(ref)
    for attr in ("special_tokens_map", "all_special_tokens", "all_special_ids", "chat_template", "add_bos_token",
                 "add_eos_token", "model_max_length", "padding_side", "truncation_side",
                 "clean_up_tokenization_spaces"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    for special in (True, False):
        ids = [ref(t, add_special_tokens=special).input_ids for t in TEXTS]
        assert [ours(t, add_special_tokens=special).input_ids for t in TEXTS] == ids
        for skip in (True, False):
            assert [ours.decode(i, skip_special_tokens=skip) for i in ids] == \
                   [ref.decode(i, skip_special_tokens=skip) for i in ids]
    # arbitrary id runs, cutting UTF-8 sequences and mixing special tokens
    runs = [list(range(0, 300)), *np.random.default_rng(0).integers(0, len(ref), (20, 12)).tolist()]
    assert [ours.decode(r) for r in runs] == [ref.decode(r) for r in runs]
    assert ours.convert_ids_to_tokens(runs[0]) == ref.convert_ids_to_tokens(runs[0])
    if ref.chat_template:
        assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
               ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert _chat_ids(ours) == _chat_ids(ref)
    # saved, as load_tokenizer saves it: the same files, but for where each was loaded from
    ours.save_pretrained(tmp_path / "ours")
    ref.save_pretrained(tmp_path / "ref")
    files = sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == files
    for file in files:
        a, b = ((tmp_path / side / file).read_text() for side in ("ours", "ref"))
        if file == "tokenizer_config.json":
            origin = ("name_or_path", "is_local", "local_files_only")
            a, b = ({k: v for k, v in json.loads(text).items() if k not in origin} for text in (a, b))
        assert a == b, file
