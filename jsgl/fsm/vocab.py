"""The vocabulary as byte strings: what each token id really appends to the output.

For byte-level BPE (GPT-2 style, SmolLM2, Llama-3, Qwen) a token's surface form is a string of
stand-in characters, one per byte; inverting that table gives the exact bytes, including tokens
that are only part of a UTF-8 character. The inverse table is rebuilt here (it is a fixed,
well-known construction) rather than imported from a tokenizer class that may not exist.
SentencePiece-style vocabularies are handled approximately (`<0xNN>` byte tokens, `▁` as space).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np


def byte_level_decoder() -> dict[str, int]:
    """Stand-in character -> byte for byte-level BPE: printable Latin-1 bytes stand for themselves,
    the other 68 bytes are shifted to U+0100.. in increasing byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


@dataclass(frozen=True, eq=False)
class VocabBytes:
    fingerprint: str  # hash of every token's bytes + the special ids: the tokenizer's identity
    size: int  # number of token ids (len(tokenizer))
    token_bytes: list[bytes]  # b"" for special tokens
    special_ids: frozenset[int]  # added/special tokens: never allowed by a regex
    eos_ids: tuple[int, ...]  # generation-ending ids (subset of special_ids in practice)
    # Regular tokens sorted by byte length, longest first, for the vectorised walk in token_index.
    order: np.ndarray  # int32 [n] token ids
    lengths: np.ndarray  # int32 [n] byte lengths (non-increasing)
    columns: np.ndarray  # uint8 [max_len, n] byte j of each token (column-major: gathers per position)


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.decoder is not None:
        return '"ByteLevel"' in json.dumps(json.loads(backend.decoder.__getstate__()))
    return hasattr(tokenizer, "byte_decoder")


_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_bytes(tokenizer: Any, special: frozenset[int]) -> list[bytes]:
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    out: list[bytes] = []
    if _is_byte_level(tokenizer):
        dec = byte_level_decoder()
        for i, piece in enumerate(pieces):
            if i in special or piece is None:
                out.append(b"")
                continue
            try:
                out.append(bytes(dec[c] for c in piece))
            except KeyError:  # a non-byte-level added token that is not marked special
                out.append(piece.encode("utf-8"))
        return out
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            out.append(b"")
        elif m := _SP_BYTE.fullmatch(piece):
            out.append(bytes([int(m.group(1), 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out


def _special_ids(tokenizer: Any) -> frozenset[int]:
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None}
    added = getattr(tokenizer, "get_added_vocab", None)
    if added is not None:
        ids.update(int(i) for i in added().values())
    return frozenset(ids)


def build_vocab_bytes(tokenizer: Any) -> VocabBytes:
    from jsgl.model.tokenizer import stop_token_ids  # here: build workers import this module without transformers

    eos = tuple(sorted(stop_token_ids(tokenizer)))
    special = _special_ids(tokenizer) | set(eos)
    token_bytes = _token_bytes(tokenizer, special)
    h = hashlib.sha256()
    h.update(repr((len(token_bytes), sorted(special), eos)).encode())
    for b in token_bytes:
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    lens = np.fromiter((len(b) for b in token_bytes), dtype=np.int32, count=len(token_bytes))
    regular = np.flatnonzero(lens > 0)  # empty tokens would let the model loop without progress
    order = regular[np.argsort(-lens[regular], kind="stable")].astype(np.int32)
    lengths = lens[order]
    max_len = int(lengths[0]) if len(order) else 0
    columns = np.zeros((max_len, len(order)), dtype=np.uint8)
    for col, tid in enumerate(order):
        b = token_bytes[tid]
        columns[: len(b), col] = np.frombuffer(b, dtype=np.uint8)
    return VocabBytes(
        fingerprint=h.hexdigest(),
        size=len(token_bytes),
        token_bytes=token_bytes,
        special_ids=frozenset(special),
        eos_ids=eos,
        order=order,
        lengths=lengths,
        columns=columns,
    )


_cache: dict[int, tuple[Any, VocabBytes]] = {}  # id(tokenizer) -> (tokenizer kept alive, vocab)
_lock = threading.Lock()


def vocab_bytes(tokenizer: Any) -> VocabBytes:
    """Memoised per tokenizer object (holding a reference so the id cannot be reused)."""
    key = id(tokenizer)
    with _lock:
        hit = _cache.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
    vb = build_vocab_bytes(tokenizer)
    with _lock:
        _cache[key] = (tokenizer, vb)
    return vb
