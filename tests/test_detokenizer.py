"""IncrementalDetokenizer on its own: text built token by token must be the whole output's text, whatever a token
boundary splits (a UTF-8 character's bytes) and whatever jump-forward appended as text.

Tokenizers: one token per byte (a character of several bytes always spans tokens), the real SmolLM2 tokenizer
(byte-level BPE: emoji and CJK split across tokens), and the SentencePiece-style one of sentencepiece_tokenizer.py
(a token's leading space is dropped when it comes first in a decode).
"""

from __future__ import annotations

import pytest
from sentencepiece_tokenizer import sentencepiece_tokenizer

from jsgl.engine.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token id = one byte of UTF-8; an incomplete character decodes as U+FFFD, as byte-level BPE does."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def byte_ids(text: str) -> list[int]:
    return list(text.encode())


def stream(detok: IncrementalDetokenizer, ids: list[int], start: int = 0) -> list[str]:
    """Feed `ids[:start+1]`, `ids[:start+2]`, ... as the engine does after each step; the deltas shown."""
    deltas = []
    for n in range(start + 1, len(ids) + 1):
        detok.add(ids[:n])
        deltas.append(detok.stream_delta(final=n == len(ids)))
    return deltas


# ----------------------------------------------------------------------------- multi-byte characters
@pytest.mark.parametrize("text", ["é", "naïve café", "中文字", "a😀b", "🎉🎉", "ж\nΩ"])
def test_a_character_split_across_steps_keeps_its_bytes(text):
    detok = IncrementalDetokenizer(ByteTokenizer(), [])
    deltas = stream(detok, byte_ids(text))
    assert detok.text == text and "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)  # held back until complete, never shown half


def test_a_character_split_across_steps_keeps_its_bytes_on_the_real_tokenizer(tokenizer):
    text = "Emoji 😀🎉, 中文字 and naïve café."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some token ends inside a character
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = stream(detok, ids)
    assert detok.text == text and "".join(deltas) == text and all("\ufffd" not in d for d in deltas)


# ------------------------------------------------------------------------------------ after a jump
def test_the_forced_text_is_not_repeated_by_the_tokens_after_a_jump():
    """A jump appends its text and the tokens it stands for (here the sampled "b" retokenized with the forced
    "cd": drop 1, then b, c, d); the next sampled token adds only its own text."""
    detok = IncrementalDetokenizer(ByteTokenizer(), [])
    stream(detok, byte_ids("ab"))
    detok.append_forced("cd", len(byte_ids("abcd")))
    assert detok.stream_delta(final=False) == "cd"
    deltas = stream(detok, byte_ids("abcde"), start=4)
    assert detok.text == "abcde" and deltas == ["e"]


def test_a_jump_of_multi_byte_text_then_more_multi_byte_text():
    detok = IncrementalDetokenizer(ByteTokenizer(), [])
    stream(detok, byte_ids("姓名"))
    detok.append_forced("：", len(byte_ids("姓名：")))
    stream(detok, byte_ids("姓名：张三"), start=len(byte_ids("姓名：")))
    assert detok.text == "姓名：张三"


def test_a_word_sampled_after_a_jump_keeps_its_leading_space():
    """SentencePiece-style: "▁27" decoded alone is "27". After a jump over '"age":' it must read " 27"."""
    tok = sentencepiece_tokenizer()
    ids = tok('{"name": "Paris", "age": 27}', add_special_tokens=False).input_ids
    pieces = tok.convert_ids_to_tokens(ids)
    jump_end = pieces.index("▁27")
    detok = IncrementalDetokenizer(tok, [])
    stream(detok, ids[:2])
    detok.append_forced(tok.decode(ids[:jump_end])[len(detok.text):], jump_end)
    stream(detok, ids, start=jump_end)
    assert detok.text == '{"name": "Paris", "age": 27}'
