"""Token index (jsgl.fsm.token_index) and jump-forward (jsgl.fsm.jump_forward) on a small hand-made vocabulary.

Fast enough for a mutation-testing loop (no model, no real tokenizer). The references are independent of
jsgl.fsm: the `regex` module's partial matching says whether a byte string can still be extended to a full
match (a token is allowed exactly when it can), and forced strings are computed by asking `regex` which
characters may come next; the remaining expectations are worked by hand on the vocabulary below.
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import CancelledError

import numpy as np
import pytest
import regex

from jsgl.errors import ConstraintBudgetError, InvalidRequestError
from jsgl.fsm import (
    DEAD,
    CharFSM,
    RegexConstraint,
    TokenIndex,
    build_token_index,
    compile_regex,
    jump_forward_string,
    jump_forward_table,
    jump_target,
)
from jsgl.fsm.budget import BuildBudget, BuildGuard
from jsgl.fsm.jump_forward import singular_char
from jsgl.fsm.token_index import FORMAT_VERSION
from jsgl.fsm.vocab import VocabBytes

# Token id -> bytes; id 0 is the (special) end-of-sequence token. Multi-byte characters are also split into
# partial tokens: é = C3 A9, 中 = E4 B8 AD, 文 = E6 96 87.
TOKENS: list[bytes] = [
    b"",  # 0: <eos>
    *(c.encode() for c in "abcdexyz0129-\":{} "),  # 1..19: single characters
    b"ab", b"bc", b"abc", b"cd", b"de", b"12", b"x1", b'"a', b'a"', b'": ', b' "', b"abcde",
    "é".encode(), b"\xc3", b"\xa9", b"\xa9a",
    "中".encode(), b"\xe4", b"\xe4\xb8", b"\xb8\xad", b"\xad", "文".encode(), "中文".encode(), b"\xad\xe6\x96",
    b"\x87", b"\x01", b"\x00",
]
EOS = 0


@functools.cache
def vocab(tokens: tuple[bytes, ...] = tuple(TOKENS)) -> VocabBytes:
    """The vocabulary as jsgl.fsm.vocab lays it out (without loading a tokenizer, which imports transformers):
    regular tokens sorted longest first, their lengths and a byte-per-position column table."""
    regular = [i for i, t in enumerate(tokens) if t]
    order = np.array(sorted(regular, key=lambda i: -len(tokens[i])), dtype=np.int32)
    lengths = np.array([len(tokens[i]) for i in order], dtype=np.int32)
    columns = np.zeros((int(lengths[0]), len(order)), dtype=np.uint8)
    for col, i in enumerate(order.tolist()):
        columns[: len(tokens[i]), col] = list(tokens[i])
    return VocabBytes(fingerprint="tiny", size=len(tokens), token_bytes=list(tokens), special_ids=frozenset({EOS}),
                      eos_ids=(EOS,), order=order, lengths=lengths, columns=columns)


def index_for(pattern: str, vocab_size: int | None = None) -> TokenIndex:
    # Built afresh in each test (milliseconds on this vocabulary): a cached index would hide from mutmut's
    # per-test coverage that the test depends on build_token_index.
    return build_token_index(compile_regex(pattern), vocab(), vocab_size)


# ---- the reference: can a byte string still be extended to a full match? ----

def _completions(pattern: str, tail: bytes) -> list[str]:
    """Characters whose UTF-8 encoding starts with `tail`, an incomplete (1-3 byte) sequence; of those the
    pattern does not name, one stands for all (the patterns here name non-ASCII characters only literally,
    never in ranges, so the others all behave alike)."""
    lead = tail[0]
    if not 0xC2 <= lead <= 0xF4 or any(not 0x80 <= b <= 0xBF for b in tail[1:]):
        return []
    n = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    if len(tail) >= n:
        return []
    cp = lead & (0xFF >> (n + 1))
    for b in tail[1:]:
        cp = (cp << 6) | (b & 0x3F)
    free = 6 * (n - len(tail))
    out = [c for c in set(pattern) if c.encode("utf-8").startswith(tail)]
    for c in range(cp << free, (cp + 1) << free):
        ch = chr(c)
        if not 0xD800 <= c < 0xE000 and c <= 0x10FFFF and ch not in pattern and ch.encode("utf-8").startswith(tail):
            return [*out, ch]
    return out


@functools.cache
def viable(pattern: str, data: bytes) -> bool:
    """Some full match of `pattern` starts with the bytes `data` (which may end mid-character)."""
    for cut in range(4):
        head, tail = data[: len(data) - cut], data[len(data) - cut :]
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not tail:
            return regex.fullmatch(pattern, text, partial=True) is not None
        if regex.fullmatch(pattern, text, partial=True) is None:
            return False
        return any(regex.fullmatch(pattern, text + ch, partial=True) for ch in _completions(pattern, tail))
    return False


def complete_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def bits(mask: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist())


MASK_PATTERNS = [
    r"abc|abd|x[0-9]+",
    r"(ab|c)*d",
    r'"[^"]{0,3}"',
    r"中文?|é+a",
    r"[0-9]{1,2}-[0-9]",
    r'\{"a": (0|12)\}',
    r"中|x[0-9]",  # the 6-byte token 中文 outlives every other token walked here, and dies on its 4th byte
]


@pytest.mark.parametrize("pattern", MASK_PATTERNS)
def test_masks_and_transitions_match_regex_reference(pattern: str) -> None:
    """Walk the token graph breadth-first from the start: at every prefix reached, the allowed tokens are
    exactly the tokens that keep the bytes a prefix of some match, and each one leads to a state whose own
    allowed set again matches the reference for the longer prefix."""
    index, vb = index_for(pattern), vocab()
    regular = range(1, vb.size)
    expanded: set[int] = set()
    frontier = [(b"", index.start_state)]
    checked = 0
    while frontier:
        prefix, state = frontier.pop(0)
        want = {t for t in regular if viable(pattern, prefix + TOKENS[t])}
        ids = index.allowed_token_ids(state)
        assert ids.tolist() == sorted(want), prefix
        assert bits(index.mask(state)) == want, prefix
        assert index.has_tokens(state) == bool(want)
        text = complete_text(prefix)
        assert index.is_char_boundary(state) == (text is not None), prefix
        assert bool(index.accepting[state]) == (text is not None and regex.fullmatch(pattern, text) is not None)
        assert index.walk_bytes(prefix) == state and index.walk_bytes(prefix, index.start_state) == state
        if text is not None:
            assert index.state_after_text(text) == state
        else:
            assert index.jump_forward_string(state) == ""
        for t in regular:
            nxt = index.next_state(state, t)
            assert (nxt != DEAD) == (t in want), (prefix, TOKENS[t])
            if nxt != DEAD and state not in expanded and len(prefix) < 8:
                frontier.append((prefix + TOKENS[t], nxt))
        expanded.add(state)
        checked += 1
    assert checked >= 5


def test_token_dead_states_are_pruned() -> None:
    """'a\\x02b' needs byte 0x02, which no token supplies: after 'a' only 'c' may follow, so 'a' is allowed
    (it leads on to 'ac') but the ways into the \\x02 branch are not."""
    index = index_for("a\x02b|ac|ab\x02")
    a, b, c = TOKENS.index(b"a"), TOKENS.index(b"b"), TOKENS.index(b"c")
    assert index.allowed_token_ids(0).tolist() == [a]  # "ab" only leads to "ab\x02"
    after_a = index.next_state(0, a)
    assert index.allowed_token_ids(after_a).tolist() == [c]
    assert index.next_state(after_a, b) == DEAD
    assert bits(index.mask(after_a)) == {c}
    end = index.next_state(after_a, c)
    assert index.accepting[end] and not index.has_tokens(end)
    assert index.allowed_token_ids(end).size == 0 and not bits(index.mask(end))
    # A constraint no token sequence can satisfy is rejected.
    for pattern in ("\x02|a\x02", "\x02a*"):  # in the second, state 1 (after \x02) is live: only 0 counts
        with pytest.raises(InvalidRequestError, match="matches no string the tokenizer can produce"):
            build_token_index(compile_regex(pattern), vocab())
    # ... but one reachable only through a single-character token is fine.
    assert index_for("\x01").allowed_token_ids(0).tolist() == [TOKENS.index(b"\x01")]


def test_multibyte_tokens_and_character_boundaries() -> None:
    index = index_for(r"中文?|é+a")
    e4, e4b8, b8ad, ad = (TOKENS.index(t) for t in (b"\xe4", b"\xe4\xb8", b"\xb8\xad", b"\xad"))
    zh, zhwen, c3, a9, a9a = (TOKENS.index(t) for t in ("中".encode(), "中文".encode(), b"\xc3", b"\xa9",
                                                          b"\xa9a"))
    e_acute = TOKENS.index("é".encode())
    assert index.allowed_token_ids(0).tolist() == sorted([e_acute, c3, zh, e4, e4b8, zhwen])
    s = index.next_state(0, e4)  # one byte into 中
    assert not index.is_char_boundary(s) and index.jump_forward_string(s) == ""
    assert index.allowed_token_ids(s).tolist() == [b8ad]  # \xb8 alone is not a token
    s2 = index.next_state(s, b8ad)
    assert s2 == index.next_state(0, zh) == index.state_after_text("中") and index.is_char_boundary(s2)
    assert index.accepting[s2] and index.jump_forward_string(s2) == ""
    assert index.next_state(index.next_state(0, e4b8), ad) == s2
    s3 = index.next_state(0, c3)
    assert index.allowed_token_ids(s3).tolist() == sorted([a9, a9a])
    assert index.next_state(s3, a9a) == index.state_after_text("éa")
    assert index.accepting[index.state_after_text("éa")] and not index.accepting[index.state_after_text("é")]
    assert index.state_after_text("中a") == DEAD and index.walk_bytes(b"\xe4\xb8") != DEAD
    assert index.walk_bytes(b"\xe4\xb8", index.start_state) == index.next_state(0, e4b8)
    # Every state past the character states is mid-character: the two numberings are disjoint.
    assert all(not index.is_char_boundary(s) for s in range(index.num_char_states, index.num_states))
    assert index.num_states > index.num_char_states and len(index.jump_strings) == index.num_states
    assert index.jump_strings[index.num_char_states:] == [""] * (index.num_states - index.num_char_states)


def test_walk_stops_at_the_first_dead_byte() -> None:
    index = index_for(r"中文?|é+a")
    table = index.byte_transitions
    assert index.walk_bytes(b"z") == DEAD
    # Whatever follows a dead byte, the walk stays dead (a walk going on would read the table's last row).
    for b in range(256):
        assert index.walk_bytes(bytes([ord("z"), b])) == DEAD
        assert index.walk_bytes(bytes([ord("z"), b]), 0) == DEAD
    assert any(table[-1, b] != DEAD for b in range(256))  # so the check above can fail
    assert index.state_after_text("zé") == DEAD
    assert not index.is_char_boundary(DEAD) and index.jump_forward_string(DEAD) == ""
    assert not index.is_char_boundary(index.num_char_states)
    assert index.is_char_boundary(index.num_char_states - 1) and index.is_char_boundary(0)


def test_next_state_lookup_edges() -> None:
    index = index_for(r"abc|abd|x[0-9]+")
    x = TOKENS.index(b"x")
    after_x = index.next_state(0, x)
    digits = [TOKENS.index(t) for t in (b"0", b"1", b"2", b"9", b"12")]
    assert index.allowed_token_ids(after_x).tolist() == sorted(digits)
    for t in digits:
        assert index.next_state(after_x, t) == index.state_after_text("x" + TOKENS[t].decode())
    # Ids below, between and above the allowed ones (the binary search's edges) are refused.
    for t in (0, 1, min(digits) - 1, max(digits) + 1, len(TOKENS) - 1, len(TOKENS) + 5):
        if t not in digits:
            assert index.next_state(after_x, t) == DEAD
    # The last state's row: x1 leads to a state whose tokens are the digits again.
    s = index.next_state(after_x, TOKENS.index(b"12"))
    assert index.allowed_token_ids(s).tolist() == sorted(digits) and index.accepting[s]
    assert index.next_state(s, TOKENS.index(b"9")) == s


def test_jump_forward_strings_in_the_index() -> None:
    index = index_for(r'\{"a": (0|12)\}')
    assert index.jump_forward_string(0) == '{"a": '
    assert index.jump_forward_string(index.state_after_text('{"a": 1')) == "2}"
    assert index.jump_forward_string(index.state_after_text('{"a": ')) == ""
    assert index.jump_forward_string(index.state_after_text('{"a": 0}')) == ""
    assert RegexConstraint(index).jump_forward_text() == '{"a":'
    # DEAD (-1) is no state: no forced text, although jump_strings[-1] (the last state's) is not empty here.
    loop = index_for("(abc)*")  # states 0 -a-> 1 -b-> 2 -c-> 0, breadth-first
    assert loop.num_states == loop.num_char_states == 3 and loop.jump_strings == ["", "bc", "c"]
    assert loop.jump_forward_string(DEAD) == "" and loop.jump_forward_string(loop.state_after_text("ab")) == "c"


def test_index_layout_vocab_size_and_metadata() -> None:
    pattern = r"abc|abd|x[0-9]+"
    vb = vocab()
    assert vb.size == len(TOKENS) == 46
    index = index_for(pattern)
    n = index.num_states
    assert index.vocab_size == 46 and index.num_words == 2 and index.masks.shape == (n, 2)
    assert index.masks.dtype == np.uint32 and not index.masks.flags.writeable
    assert index.indptr.dtype == np.int64 and index.indptr[0] == 0 and np.all(np.diff(index.indptr) >= 0)
    assert index.token_ids.dtype == np.int32 and index.next_states.dtype == np.int32
    assert index.indptr[-1] == len(index.token_ids) == len(index.next_states) == sum(len(bits(m)) for m in index.masks)
    assert index.byte_transitions.shape == (n, 256) and index.accepting.shape == (n,)
    assert index.nbytes == n * 2 * 4 + (n + 1) * 8 + 2 * 4 * len(index.token_ids) + n * 256 * 4 + n
    assert index.pattern == pattern and index.eos_ids == (EOS,) and index.start_state == 0
    assert 0 < index.build_seconds < 30
    # Every state's mask is exactly its allowed ids; bit i of word i >> 5, little-endian.
    for s in range(n):
        words = index.masks[s]
        want = np.zeros(2, dtype=np.uint32)
        for t in index.allowed_token_ids(s).tolist():
            want[t >> 5] |= np.uint32(1 << (t & 31))
        assert words.tolist() == want.tolist()
    # Padded to the model's vocabulary: more words, nothing set past the tokenizer's ids.
    padded = index_for(pattern, 100)
    assert padded.vocab_size == 100 and padded.num_words == 4
    assert all(bits(padded.masks[s]) == bits(index.masks[s]) for s in range(n))
    assert index_for(pattern, 10).vocab_size == 46  # never below the tokenizer's own size
    assert index_for(pattern, 64).num_words == 2 and index_for(pattern, 65).num_words == 3


def test_words_round_up_to_whole_uint32() -> None:
    tokens = tuple(TOKENS[:32])  # exactly 32 ids: one word
    vb = vocab(tokens)
    index = build_token_index(compile_regex("[a-e]+"), vb)
    assert index.num_words == 1 and index.vocab_size == 32
    assert bits(index.mask(0)) == {t for t in range(1, 32) if regex.fullmatch("[a-e]+", tokens[t].decode())}


def test_save_load_roundtrip(tmp_path) -> None:
    pattern = '"[^"]{0,3}"\x00中'
    index = index_for(pattern, 70)
    assert len(set(index.jump_strings)) > 2  # strings of different lengths, and empty ones
    path = tmp_path / "i.npz"
    index.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["i.npz"]  # no temporary file left behind
    loaded = TokenIndex.load(path)
    for name in ("accepting", "masks", "indptr", "token_ids", "next_states", "byte_transitions"):
        a, b = getattr(index, name), getattr(loaded, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert loaded.pattern == pattern and loaded.vocab_size == 70 and loaded.eos_ids == (EOS,)
    assert loaded.num_char_states == index.num_char_states and loaded.start_state == 0
    assert loaded.jump_strings == index.jump_strings and loaded.jump_strings[index.state_after_text('"ab"')] == "\x00中"
    assert loaded.build_seconds == index.build_seconds
    assert not loaded.masks.flags.writeable
    with np.load(path) as z:
        assert z["meta"].tolist() == [FORMAT_VERSION, 70, index.num_char_states, 0]
        arrays = dict(z)
    # Overwriting keeps the newest; a file from another format version is refused.
    other = index_for(r"abc|abd|x[0-9]+")
    other.save(path)
    assert TokenIndex.load(path).pattern == r"abc|abd|x[0-9]+"
    arrays["meta"] = np.array([FORMAT_VERSION + 1, 70, index.num_char_states, 0])
    old = tmp_path / "old.npz"
    with open(old, "wb") as f:
        np.savez(f, **arrays)
    with pytest.raises(ValueError, match=f"index format {FORMAT_VERSION + 1}, expected {FORMAT_VERSION}"):
        TokenIndex.load(old)
    # Plain arrays only: a file smuggling in a pickled object array is refused, not unpickled.
    arrays["meta"] = np.array([FORMAT_VERSION, 70, index.num_char_states, 0])
    arrays["eos_ids"] = np.array([EOS], dtype=object)
    with open(old, "wb") as f:
        np.savez(f, **arrays)
    with pytest.raises(ValueError, match="allow_pickle"):
        TokenIndex.load(old)


def test_start_state_and_trailing_nul_survive_save(tmp_path) -> None:
    index = index_for("ab\x00")
    after_a = index.state_after_text("a")
    dataclasses.replace(index, start_state=after_a).save(tmp_path / "s.npz")  # an index resumed mid-match
    loaded = TokenIndex.load(tmp_path / "s.npz")
    assert loaded.start_state == after_a and loaded.pattern == "ab\x00"
    assert loaded.jump_strings[0] == "ab\x00" and loaded.state_after_text("b\x00") != DEAD
    assert loaded.state_after_text("ab\x00") == DEAD  # walks start from the saved start state


def _budget(**kw) -> BuildBudget:
    return BuildBudget(**kw)


def test_index_byte_budget_is_exact() -> None:
    """The budget counts, per byte state, its mask words, byte row, indptr entry and accepting flag, then 8
    bytes per allowed token; an index exactly at the limit is built. In "(a中)*" the last character state
    is the one before 中, so the byte FSM only reaches its full size after its last own budget check."""
    pattern = r"(a中)*"
    ref = index_for(pattern)
    n, words, nnz = ref.num_states, ref.num_words, len(ref.token_ids)
    fixed = n * (words * 4 + 256 * 4 + 8 + 1)
    total = fixed + 8 * nnz
    fsm = compile_regex(pattern)
    built = build_token_index(fsm, vocab(), guard=BuildGuard(_budget(max_index_bytes=total)))
    assert np.array_equal(built.masks, ref.masks)
    with pytest.raises(ConstraintBudgetError, match="the token index is at least"):
        build_token_index(fsm, vocab(), guard=BuildGuard(_budget(max_index_bytes=total - 1)))
    with pytest.raises(ConstraintBudgetError, match="the token index's per-state tables is at least"):
        build_token_index(fsm, vocab(), guard=BuildGuard(_budget(max_index_bytes=fixed - 1)))
    build_token_index(fsm, vocab(), guard=BuildGuard(_budget(max_index_bytes=fixed + 8 * nnz)))
    # Padding the vocabulary adds mask words to every state.
    with pytest.raises(ConstraintBudgetError):
        build_token_index(fsm, vocab(), 100, guard=BuildGuard(_budget(max_index_bytes=total)))


def test_index_budget_stops_the_byte_fsm_early() -> None:
    """The byte budget is already enforced while the byte FSM grows: 中(é|文) has 3 character states, 中
    adds 2 mid-character states and é/文 3 more; with a budget of exactly the 3 character rows the build
    stops at 5 rows, before the last 3 exist. Padding to 2**23 ids makes each state's row about 1 MiB."""
    fsm = compile_regex("中(é|文)")
    assert fsm.num_states == 3
    words = 2**23 // 32
    row = words * 4 + 256 * 4 + 8 + 1
    limit = r"per-state tables is at least 5 MiB \(the server's limit is 3 MiB"
    with pytest.raises(ConstraintBudgetError, match=limit):
        build_token_index(fsm, vocab(), 2**23, guard=BuildGuard(_budget(max_index_bytes=3 * row)))
    assert index_for("中(é|文)").num_states == 8


def test_state_limit_and_deadline() -> None:
    fsm = compile_regex(r"abc|abd|x[0-9]+")
    n = fsm.num_states
    build_token_index(fsm, vocab(), guard=BuildGuard(_budget(max_states=n)))
    with pytest.raises(ConstraintBudgetError, match=f"the regex automaton needs more than {n} states"):
        build_token_index(fsm, vocab(), guard=BuildGuard(_budget(max_states=n - 1)))
    # A fake clock advancing one second per reading: the guard reads it once when made, then at every
    # check: once per character state while the byte FSM is built, then (at least) once per byte state in
    # the vocabulary walk and in each pass after it.
    ticks = iter(range(10_000))
    build_token_index(fsm, vocab(), guard=BuildGuard(_budget(max_build_seconds=10_000),
                                                     clock=lambda: float(next(ticks))))
    readings = next(ticks)
    byte_states = index_for(r"abc|abd|x[0-9]+").num_states
    assert readings > n + 4 * byte_states  # byte FSM, walk, liveness, filter, masks
    ticks = iter(range(10_000))
    with pytest.raises(ConstraintBudgetError, match="time limit"):
        build_token_index(fsm, vocab(), guard=BuildGuard(_budget(max_build_seconds=n + 1),
                                                         clock=lambda: float(next(ticks))))
    ticks = iter(range(10_000))
    build_token_index(fsm, vocab(), guard=BuildGuard(_budget(max_build_seconds=readings - 1),
                                                     clock=lambda: float(next(ticks))))
    guard = BuildGuard(_budget())
    guard.cancelled.set()
    with pytest.raises(CancelledError):
        build_token_index(fsm, vocab(), guard=guard)


# ---- jump-forward on the character FSM ----

# Characters the reference tries as the next one: every character of the patterns below plus a few the
# patterns never name (they stand for interegular's anything_else class).
UNIVERSE = [chr(c) for c in range(0x20, 0x7F)] + list("\x00\n\téß中文字ж😀")


@functools.cache
def forced_text(pattern: str, prefix: str) -> str:
    """The longest text every match extending `prefix` continues with (none after a complete match)."""
    out = ""
    while regex.fullmatch(pattern, prefix + out) is None and len(out) < 60:
        nexts = [c for c in UNIVERSE if regex.fullmatch(pattern, prefix + out + c, partial=True)]
        if len(nexts) != 1:
            break
        out += nexts[0]
    return out


def prefixes_per_state(fsm: CharFSM, pattern: str) -> dict[int, str]:
    """A shortest text reaching each state, found by trying every UNIVERSE character breadth-first."""
    first = {fsm.start: ""}
    frontier = [""]
    while frontier:
        text = frontier.pop(0)
        for c in UNIVERSE:
            s = fsm.walk(text + c)
            if s != DEAD and s not in first:
                first[s] = text + c
                frontier.append(text + c)
    assert len(first) == fsm.num_states, pattern
    return first


JUMP_PATTERNS = [
    r"abc",
    r"ab(cd)?",
    r'\{"name": "[^"\\]{1,5}", "age": [0-9]{1,2}\}',
    r"(The quick fox|The lazy dog)",
    r"x(yz|yw)z",
    r"中文[0-9]字",
    r"[0-9]{2}:00",
    r"(?i)ab",
    r"a[^b]c",
    r"(ab|ac)*d",
    "a\x00b|c",
]


@pytest.mark.parametrize("pattern", JUMP_PATTERNS)
def test_jump_forward_matches_regex_reference(pattern: str) -> None:
    fsm = compile_regex(pattern)
    table = jump_forward_table(fsm)
    assert len(table) == fsm.num_states
    for s, text in prefixes_per_state(fsm, pattern).items():
        want = forced_text(pattern, text)
        assert table[s] == want, (pattern, text)
        assert jump_forward_string(fsm, s) == want
        forced, end = jump_target(fsm, s)
        assert forced == want and end == fsm.walk(want, s)
        assert singular_char(fsm, s) == (want[0] if want else None)


def test_jump_forward_hand_worked() -> None:
    fsm = compile_regex(r'\{"a": (true|false)\}')
    assert jump_forward_table(fsm)[0] == '{"a": '
    s = fsm.walk('{"a": t')
    assert jump_target(fsm, s) == ("rue}", fsm.walk('{"a": true}'))
    assert jump_target(fsm, fsm.walk('{"a": true}')) == ("", fsm.walk('{"a": true}'))  # accepting
    ab = compile_regex("ab(cd)?")
    assert jump_forward_table(ab) == ["ab", "b", "", "d", ""]
    assert singular_char(ab, 2) is None  # accepting: EOS is a choice
    assert singular_char(compile_regex("a|b"), 0) is None  # two classes
    assert singular_char(compile_regex("[^a]"), 0) is None  # only anything_else
    assert singular_char(compile_regex("(?i)a"), 0) is None  # one class, two characters


def _hand_fsm(transitions: list[list[int]], accepting: list[bool]) -> CharFSM:
    return CharFSM(pattern="hand-made", char_class={"a": 0, "b": 1, "c": 2}, other_class=3,
                   transitions=np.array(transitions, dtype=np.int32), accepting=np.array(accepting))


def test_untrimmed_singular_cycle_terminates() -> None:
    """0 -a-> 1 -b-> 0 forever (no accepting state: only an untrimmed FSM has this), 2 -c-> 0. The forced
    strings stop at the revisit instead of looping, and are prefixes of the forced character sequence."""
    fsm = _hand_fsm([[1, -1, -1, -1], [-1, 0, -1, -1], [-1, -1, 0, -1]], [False, False, False])
    forced, end = jump_target(fsm, 0)
    assert (forced, end) == ("a", 1)  # 'b' would return to state 0, already seen
    assert jump_target(fsm, 2) == ("ca", 1)
    assert jump_forward_string(fsm, 1) == "b"
    table = jump_forward_table(fsm)
    infinite = {0: "ab" * 4, 1: "ba" * 4, 2: "c" + "ab" * 4}
    for s, text in enumerate(table):
        assert 0 < len(text) <= fsm.num_states and infinite[s].startswith(text), (s, text)
    # A chain into a non-singular state and an accepting state.
    fsm = _hand_fsm([[1, -1, -1, -1], [-1, 2, -1, -1], [3, 3, -1, -1], [-1, -1, -1, -1]],
                    [False, False, False, True])
    assert jump_forward_table(fsm) == ["ab", "b", "", ""]
    assert jump_target(fsm, 0) == ("ab", 2)
