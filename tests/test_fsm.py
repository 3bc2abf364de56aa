"""jsgl.fsm on the real SmolLM2 tokenizer: token index soundness/completeness, jump-forward, JSON schema.

The oracle for "is this byte string a prefix of some match" is built directly on interegular's FSM,
independently of jsgl.fsm's own char/byte FSMs.
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict, deque
from functools import cache, lru_cache

import interegular
import numpy as np
import pytest
from conftest import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from interegular.fsm import anything_else

from jsgl.engine.request import InvalidRequestError
from jsgl.fsm import (
    DEAD,
    RegexConstraint,
    TokenIndex,
    build_token_index,
    compile_regex,
    json_schema_to_regex,
    vocab_bytes,
)
from jsgl.model.tokenizer import load_tokenizer

IP = r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
PERSON = r'\{"name": "[^"\\]{1,20}", "age": [0-9]{1,3}, "city": "(Paris|London|北京)"\}'
LITERALS = r"(The quick brown fox jumps over the lazy dog|The quick brown fox sleeps in the sun all day)"
CHINESE = r"(你好|世界|中文)+[，。！]?"
CJK_RANGE = r"姓名：[一-龥]{2,4}，年龄：[0-9]{1,3}"
FREE_TEXT = r'"[^"]{0,30}"'  # anything_else with multi-byte characters split across tokens

# Fillers for the anything_else class when generating strings: ASCII, Latin-1, CJK, emoji.
POOL = [chr(c) for c in range(0x20, 0x7F)] + list("éßжΩ中文字😀🎉\n")


@lru_cache(maxsize=1)
def tok():
    return load_tokenizer("smollm2-135m")


@cache
def index_for(pattern: str) -> TokenIndex:
    return build_token_index(compile_regex(pattern), vocab_bytes(tok()))


@cache
def nested_json_regex() -> str:
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        street: str = Field(max_length=12)
        zip: int = Field(ge=0, le=99999)

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int
        address: Address
        tags: list[str] = Field(max_length=2)

    return json_schema_to_regex(Person)


class Oracle:
    """Prefix-viability of byte strings, straight from interegular's FSM."""

    def __init__(self, pattern: str) -> None:
        self.fsm = fsm = interegular.parse_pattern(pattern).to_fsm()
        rev: dict = defaultdict(set)
        for s, trans in fsm.map.items():
            for t in trans.values():
                rev[t].add(s)
        self.live = set(fsm.finals)
        queue = deque(self.live)
        while queue:
            for s in rev[queue.popleft()]:
                if s not in self.live:
                    self.live.add(s)
                    queue.append(s)
        self.dist = {s: 0 for s in fsm.finals}  # characters to the nearest final (BFS backwards)
        queue = deque(fsm.finals)
        while queue:
            t = queue.popleft()
            for s in rev[t]:
                if s not in self.dist:
                    self.dist[s] = self.dist[t] + 1
                    queue.append(s)
        self.chars = {k: [c for c in v if c is not anything_else] for k, v in fsm.alphabet.by_transition.items()}
        self.else_keys = {k for k, v in fsm.alphabet.by_transition.items() if anything_else in v}

    def step(self, s, ch: str):
        return self.fsm.map.get(s, {}).get(self.fsm.alphabet[ch])

    def live_edges(self, s) -> list:
        return [(k, t) for k, t in self.fsm.map.get(s, {}).items() if t in self.live]

    def viable(self, data: bytes) -> bool:
        for cut in range(4):
            try:
                head = data[: len(data) - cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            tail = data[len(data) - cut :]
            s = self.fsm.initial
            for ch in head:
                s = self.step(s, ch)
                if s is None or s not in self.live:
                    return False
            return not tail or self._tail_viable(s, tail)
        return False

    def _tail_viable(self, s, tail: bytes) -> bool:
        lead = tail[0]
        if lead < 0xC2 or lead > 0xF4:
            return False
        n = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        if len(tail) >= n:
            return False
        cp = lead & (0xFF >> (n + 1))
        for b in tail[1:]:
            cp = (cp << 6) | (b & 0x3F)
        free = 6 * (n - len(tail))  # the code points whose encoding starts with `tail`
        first, span = cp << free, 1 << free
        for k, _ in self.live_edges(s):
            if any(c.encode("utf-8").startswith(tail) for c in self.chars[k]):
                return True
            if k in self.else_keys:
                for cp in range(first, first + span):
                    if 0xD800 <= cp < 0xE000 or cp > 0x10FFFF:
                        continue
                    c = chr(cp)
                    if c.encode("utf-8").startswith(tail) and self.fsm.alphabet[c] == k:
                        return True
        return False


@cache
def oracle_for(pattern: str) -> Oracle:
    return Oracle(pattern)


def random_match(oracle: Oracle, rnd: random.Random, budget: int) -> str:
    """Random walk over the oracle FSM; after `budget` characters, head for the nearest final."""
    fsm, dist = oracle.fsm, oracle.dist
    out: list[str] = []
    s = fsm.initial
    while True:
        options = []
        for k, t in oracle.live_edges(s):
            choices = oracle.chars[k] + ([c for c in POOL if fsm.alphabet[c] == k] if k in oracle.else_keys else [])
            if choices and (len(out) < budget or dist[t] < dist[s]):
                options.append((choices, t))
        if s in fsm.finals and (not options or len(out) >= budget or rnd.random() < 0.15):
            return "".join(out)
        # Weight classes by size (capped) so wide classes like [^"] produce long runs.
        choices, s = rnd.choices(options, weights=[min(len(c), 10) for c, _ in options])[0]
        out.append(rnd.choice(choices))


def bit(mask: np.ndarray, i: int) -> bool:
    return bool((int(mask[i >> 5]) >> (i & 31)) & 1)


PATTERNS = [IP, DATE, PERSON, LITERALS, CHINESE, CJK_RANGE, FREE_TEXT, "NESTED"]
EOS = 2


@pytest.mark.parametrize("name", PATTERNS, ids=["ip", "date", "person", "literals", "chinese", "cjk_range",
                                                "free_text", "nested"])
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tokenized_matches_walk_and_masks_are_exact(name: str, data) -> None:
    pattern = nested_json_regex() if name == "NESTED" else name
    index, oracle, vb = index_for(pattern), oracle_for(pattern), vocab_bytes(tok())
    rnd = data.draw(st.randoms(use_true_random=False))
    text = random_match(oracle, rnd, data.draw(st.integers(0, 60)))
    assert re.fullmatch(pattern, text, flags=re.DOTALL)
    ids = tok().encode(text, add_special_tokens=False)
    assert b"".join(vb.token_bytes[i] for i in ids) == text.encode()

    c = RegexConstraint(index, eos_ids=[0, EOS])
    probe_at = rnd.randrange(len(ids) + 1)
    prefix = b""
    for step, tid in enumerate(ids + [EOS]):
        mask = c.allowed_token_bitmask()
        if step == probe_at:  # sampled completeness/soundness against the oracle
            allowed = set(index.allowed_token_ids(c.state).tolist())
            assert allowed == set(np.flatnonzero(np.unpackbits(
                mask.view(np.uint8), bitorder="little")[: vb.size]).tolist()) - {0, EOS}
            sample = rnd.sample(range(17, vb.size), 60) + rnd.sample(sorted(allowed), min(30, len(allowed)))
            for t in sample:
                assert (t in allowed) == oracle.viable(prefix + vb.token_bytes[t]), (prefix, vb.token_bytes[t])
            assert not any(bit(mask, t) for t in range(1, 17) if t != EOS)
            assert bit(mask, EOS) == c.is_accepting()
        assert bit(mask, tid), (text, step, tid)
        c.advance(tid)
        prefix += vb.token_bytes[tid]
    assert c.is_terminated() and c.is_accepting()
    assert index.accepting[index.state_after_text(text)]


def test_bitmask_format_and_specials() -> None:
    index, vb = index_for(PERSON), vocab_bytes(tok())
    assert index.masks.dtype == np.uint32 and index.masks.shape[1] == (vb.size + 31) // 32 == 1536
    c = RegexConstraint(index)
    assert c.eos_ids == {0, 2}
    ids = index.allowed_token_ids(0)
    assert all(bit(c.allowed_token_bitmask(), int(i)) for i in ids)
    assert not any(vb.token_bytes[i] == b"" for i in ids)
    with pytest.raises(ValueError):
        c.advance(EOS)  # not accepting yet
    with pytest.raises(ValueError):
        c.advance(tok().encode("x")[0])
    assert not c.allowed_token_bitmask().flags.writeable


def test_jump_forward_strings() -> None:
    index = index_for(PERSON)
    assert index.jump_forward_string(0) == '{"name": "'
    c = RegexConstraint(index)
    assert c.jump_forward_text() == '{"name": "'
    c.advance_text('{"name": "Bob')
    assert c.jump_forward_text() == ""  # inside a free string: the model chooses
    c.advance_text('"')
    assert index.jump_forward_string(c.state) == ', "age": '
    assert c.jump_forward_text() == ', "age":'  # trailing space left for the model's " 42" token
    assert RegexConstraint(index, jump_trailing_space=True).copy().jump_forward_text() == '{"name": "'
    c.advance_text(', "age": 7')
    assert c.jump_forward_text() == ""  # accepting-free but digits or "," may follow
    c.advance_text(', "city": "')
    assert c.jump_forward_text() == ""  # Paris / London / 北京
    c.advance_text("Lo")
    assert c.jump_forward_text() == 'ndon"}'

    lit = index_for(LITERALS)
    assert lit.jump_forward_string(0) == "The quick brown fox "
    assert RegexConstraint(lit).jump_forward_text() == "The quick brown fox"
    assert lit.jump_forward_string(lit.state_after_text("The quick brown fox j")) == "umps over the lazy dog"

    ab = index_for(r"ab(cd)?")
    assert ab.jump_forward_string(0) == "ab"
    assert ab.jump_forward_string(ab.state_after_text("ab")) == ""  # accepting: EOS is a choice
    assert ab.jump_forward_string(ab.state_after_text("abc")) == "d"
    assert index_for(r"a[^b]").jump_forward_string(1) == ""  # anything_else is never singular
    assert index_for(r"(?i)ab").jump_forward_string(0) == ""  # {A, a}: two characters


def test_jump_forward_chinese_and_mid_character() -> None:
    index, vb = index_for(r"你好世界[0-9]"), vocab_bytes(tok())
    assert index.jump_forward_string(0) == "你好世界"
    first = tok().encode("你好世界")[0]
    assert len(vb.token_bytes[first]) < 3  # splits 你 (3 bytes)
    c = RegexConstraint(index)
    c.advance(first)
    assert not index.is_char_boundary(c.state) and c.jump_forward_text() == ""
    c.reset("你")
    assert c.jump_forward_text() == "好世界"


def test_engine_style_jump_forward_with_retokenization() -> None:
    """Simulate the engine: sample (here: follow a target), jump whenever forced, retokenize the
    whole output, and check the FSM state agrees with walking the new token ids."""
    index, t = index_for(nested_json_regex()), tok()
    target = json.dumps({"name": "Zoë", "age": 31, "address": {"street": "Rue 9", "zip": 75001},
                         "tags": ["a", "b"]})
    c = RegexConstraint(index)
    output, jumps = "", []
    while output != target:
        jump = c.jump_forward_text()
        if jump:
            jumps.append(jump)
            output += jump
            c.advance_text(jump)
            state = index.start_state
            for tid in t.encode(output, add_special_tokens=False):  # retokenized output
                state = index.next_state(state, tid)
                assert state != DEAD
            assert state == c.state == c.state_after_text(output)
            continue
        tid = t.encode(target[len(output):], add_special_tokens=False)[0]
        assert bit(c.allowed_token_bitmask(), tid)
        c.advance(tid)
        output = t.decode(t.encode(output, add_special_tokens=False) + [tid])
    assert jumps[0] == '{"name": "' and ' "age":' in jumps  # the model wrote the '",' token itself
    assert c.is_accepting() and c.is_terminated()


def test_vocab_bytes_match_decode_and_index_roundtrip(tmp_path) -> None:
    vb, t = vocab_bytes(tok()), tok()
    rnd = random.Random(0)
    for i in rnd.sample(range(17, vb.size), 2000):
        assert vb.token_bytes[i].decode("utf-8", errors="replace") == t.decode([i])
    assert vb.size == 49152 and vb.eos_ids == (0, 2) and set(range(17)) <= vb.special_ids
    index = index_for("ab\x00c\x00")  # NULs survive the disk format
    index.save(tmp_path / "i.npz")
    loaded = TokenIndex.load(tmp_path / "i.npz")
    assert loaded.jump_strings[0] == index.jump_strings[0] == "ab\x00c\x00"
    assert loaded.pattern == index.pattern


def test_invalid_regex_raises() -> None:
    from jsgl.fsm import get_index_async, validate_regex

    for bad in ["(a", "a**", r"(a)\1", r"a\b", "[z-a]", "a(?=b)c"]:
        with pytest.raises(InvalidRequestError):
            compile_regex(bad)
    with pytest.raises(InvalidRequestError):
        validate_regex("(a")
    with pytest.raises(InvalidRequestError):
        get_index_async("(unclosed", tok()).result(timeout=30)
    assert compile_regex("^ab$").accepts("ab")
    assert compile_regex(r"[\u4e00-\u9fa5]+").accepts("中文")
