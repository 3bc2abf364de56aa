"""Character FSM -> byte FSM over UTF-8, so tokens that split a multi-byte character still walk.

Byte-level BPE tokens are byte strings; many of them end (or start) in the middle of a UTF-8
sequence (Chinese characters are often two tokens). Walking tokens over *characters* would need
"pending partial bytes" in the state; instead every character edge s --c--> t becomes the byte path
utf8(c), with fresh intermediate states for the partial sequences. The character states keep their
numbers (0..num_char_states-1) so "is this a character boundary" is a single comparison.

The `anything_else` class covers infinitely many characters, so it cannot be expanded character by
character. It becomes generic "any valid UTF-8 sequence" paths (respecting the lead-byte ranges of
RFC 3629, no surrogates, no overlong forms), with exceptions carved out only for the explicit
non-ASCII characters whose target differs from the anything_else target. Intermediate nodes are
hash-consed, so e.g. a CJK range shares its 64-way continuation nodes across states.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jsgl.fsm.budget import DEFAULT_BUDGET, BuildGuard
from jsgl.fsm.regex_fsm import DEAD, CharFSM

# lead byte -> (continuation bytes still to come, lowest and highest allowed second byte)
_LEADS: dict[int, tuple[int, int, int]] = {}
for _b in range(0xC2, 0xE0):
    _LEADS[_b] = (1, 0x80, 0xBF)
for _b in range(0xE0, 0xF0):
    _LEADS[_b] = (2, 0xA0 if _b == 0xE0 else 0x80, 0x9F if _b == 0xED else 0xBF)
for _b in range(0xF0, 0xF5):
    _LEADS[_b] = (3, 0x90 if _b == 0xF0 else 0x80, 0x8F if _b == 0xF4 else 0xBF)


@dataclass(frozen=True, eq=False)
class ByteFSM:
    transitions: np.ndarray  # int32 [num_states, 256]; DEAD = byte not allowed
    accepting: np.ndarray  # bool [num_states]; intermediate (mid-character) states never accept
    num_char_states: int  # states below this are the CharFSM's states, i.e. character boundaries

    @property
    def num_states(self) -> int:
        return int(self.transitions.shape[0])

    def walk(self, data: bytes, state: int = 0) -> int:
        s = state
        table = self.transitions
        for b in data:
            s = int(table[s, b])
            if s == DEAD:
                return DEAD
        return s


class _Builder:
    def __init__(self, num_char_states: int) -> None:
        self.rows: list[np.ndarray] = [np.full(256, DEAD, np.int32) for _ in range(num_char_states)]
        self.memo: dict[tuple, int] = {}

    def node(self, lo: int, hi: int, remaining: int, exc: dict[bytes, int], else_t: int) -> int:
        """State reading one byte in [lo, hi] with `remaining` bytes (this one included) left in the
        character; `exc` maps the rest of explicit characters' encodings to their targets, everything
        else goes to `else_t` (DEAD if the anything_else class has no transition)."""
        if not exc and else_t == DEAD:
            return DEAD
        key = (lo, hi, remaining, frozenset(exc.items()), else_t)
        got = self.memo.get(key)
        if got is not None:
            return got
        nid = len(self.rows)
        row = np.full(256, DEAD, np.int32)
        self.rows.append(row)
        self.memo[key] = nid
        if remaining == 1:
            row[lo : hi + 1] = else_t
            for suffix, t in exc.items():
                row[suffix[0]] = t
            return nid
        row[lo : hi + 1] = self.node(0x80, 0xBF, remaining - 1, {}, else_t)
        groups: dict[int, dict[bytes, int]] = {}
        for suffix, t in exc.items():
            groups.setdefault(suffix[0], {})[suffix[1:]] = t
        for b, sub in groups.items():
            row[b] = self.node(0x80, 0xBF, remaining - 1, sub, else_t)
        return nid


def to_byte_fsm(fsm: CharFSM, guard: BuildGuard | None = None, state_bytes: int = 0) -> ByteFSM:
    """`state_bytes`: what each byte state will cost in the token index; with the guard, the build
    stops as soon as the states made so far exceed the index budget (before the vocabulary walk)."""
    guard = guard or BuildGuard(DEFAULT_BUDGET)
    n = fsm.num_states
    builder = _Builder(n)
    # Explicit characters per class, split into ASCII bytes and multi-byte encodings.
    ascii_by_class: list[list[int]] = [[] for _ in range(fsm.num_classes)]
    multi_by_class: list[list[bytes]] = [[] for _ in range(fsm.num_classes)]
    for k, chars in enumerate(fsm.class_chars):
        for ch in chars:
            try:
                enc = ch.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates can never appear in decoded text
                continue
            if len(enc) == 1:
                ascii_by_class[k].append(enc[0])
            else:
                multi_by_class[k].append(enc)

    per_row: dict[tuple[int, ...], np.ndarray] = {}  # states with identical rows share byte rows
    for s in range(n):
        guard.check()
        if state_bytes:
            guard.check_index_bytes(len(builder.rows) * state_bytes, "the token index's per-state tables")
        trow = fsm.transitions[s]
        key = tuple(int(x) for x in trow)
        cached = per_row.get(key)
        if cached is not None:
            builder.rows[s][:] = cached
            continue
        else_t = int(trow[fsm.other_class])
        row = builder.rows[s]
        row[:128] = else_t
        exc_by_lead: dict[int, dict[bytes, int]] = {}
        for k in range(fsm.num_classes):
            if k == fsm.other_class:
                continue
            t = int(trow[k])
            for b in ascii_by_class[k]:
                row[b] = t
            if t == else_t:
                continue  # behaves exactly like an unnamed character: no exception needed
            for enc in multi_by_class[k]:
                exc_by_lead.setdefault(enc[0], {})[enc[1:]] = t
        for lead, (cont, lo, hi) in _LEADS.items():
            row[lead] = builder.node(lo, hi, cont, exc_by_lead.get(lead, {}), else_t)
        per_row[key] = row.copy()

    # The memo's keys name every explicit character once per state (1.2 GB for [一-龥]{0,999}); freed all at
    # once on return, they took 0.7 s without a budget check.
    for i in range(len(builder.memo)):
        if i % 64 == 0:
            guard.check()
        builder.memo.popitem()
    accepting = np.zeros(len(builder.rows), dtype=bool)
    accepting[:n] = fsm.accepting
    return ByteFSM(transitions=np.stack(builder.rows), accepting=accepting, num_char_states=n)
