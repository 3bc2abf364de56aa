"""Token-level index: for every FSM state, which vocabulary tokens may come next and where they lead.

Built by walking every token's bytes through the byte FSM (jsgl.fsm.byte_fsm) from every state. The
walk is vectorised over the vocabulary: tokens are pre-sorted by length (longest first), so at byte
position j the tokens still being walked are a prefix of the surviving set and each position is one
numpy gather. Most tokens die on their first byte in most states, so the first step also compacts.

Layout per state s (state numbers are the byte FSM's: 0 is the start, states below
`num_char_states` sit on character boundaries, the rest are mid-UTF-8-character):
  masks[s]         packed uint32 bitmask, ceil(V/32) words, bit i of word i>>5 = token i allowed
                   (little-endian bit order); EOS/special tokens are never set here -- the
                   constraint adds EOS in accepting states.
  token_ids/next_states[indptr[s]:indptr[s+1]]  allowed token ids (sorted) and their next state.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from jsgl.errors import InvalidRequestError
from jsgl.fsm.budget import DEFAULT_BUDGET, BuildGuard
from jsgl.fsm.byte_fsm import ByteFSM, to_byte_fsm
from jsgl.fsm.jump_forward import jump_forward_table
from jsgl.fsm.regex_fsm import DEAD, CharFSM
from jsgl.fsm.vocab import VocabBytes

FORMAT_VERSION = 1


@dataclass(eq=False)
class TokenIndex:
    pattern: str
    vocab_size: int  # bitmask covers ids [0, vocab_size); >= len(tokenizer) if padded for the model
    accepting: np.ndarray  # bool [S]
    masks: np.ndarray  # uint32 [S, ceil(vocab_size/32)]
    indptr: np.ndarray  # int64 [S+1]
    token_ids: np.ndarray  # int32 [nnz]
    next_states: np.ndarray  # int32 [nnz]
    byte_transitions: np.ndarray  # int32 [S, 256] (for walking text after jump-forward)
    num_char_states: int
    jump_strings: list[str]  # per state; "" for mid-character states
    eos_ids: tuple[int, ...]  # the tokenizer's generation-ending ids (default for constraints)
    build_seconds: float = 0.0
    start_state: int = 0

    @property
    def num_states(self) -> int:
        return int(self.accepting.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.masks, self.indptr, self.token_ids, self.next_states,
                                      self.byte_transitions, self.accepting))

    @property
    def num_words(self) -> int:
        return int(self.masks.shape[1])

    def mask(self, state: int) -> np.ndarray:
        """Read-only packed bitmask of the regular tokens allowed in `state` (no EOS)."""
        return self.masks[state]

    def allowed_token_ids(self, state: int) -> np.ndarray:
        return self.token_ids[self.indptr[state] : self.indptr[state + 1]]

    def has_tokens(self, state: int) -> bool:
        return bool(self.indptr[state + 1] > self.indptr[state])

    def next_state(self, state: int, token_id: int) -> int:
        """State after `token_id`, or DEAD (-1) when the token is not allowed in `state`."""
        lo, hi = int(self.indptr[state]), int(self.indptr[state + 1])
        i = lo + int(np.searchsorted(self.token_ids[lo:hi], token_id))
        if i < hi and int(self.token_ids[i]) == token_id:
            return int(self.next_states[i])
        return DEAD

    def walk_bytes(self, data: bytes, state: int | None = None) -> int:
        s = self.start_state if state is None else state
        table = self.byte_transitions
        for b in data:
            s = int(table[s, b])
            if s == DEAD:
                return DEAD
        return s

    def state_after_text(self, text: str, state: int | None = None) -> int:
        """State reached by appending `text` (from `state`, default the start); DEAD if it leaves the
        language. This is what lets the FSM follow retokenized output: only the characters matter."""
        return self.walk_bytes(text.encode("utf-8"), state)

    def is_char_boundary(self, state: int) -> bool:
        return 0 <= state < self.num_char_states

    def jump_forward_string(self, state: int) -> str:
        return self.jump_strings[state] if self.is_char_boundary(state) else ""

    # ---- persistence (plain arrays, no pickle) ----
    def save(self, path: Path) -> None:
        joined = "".join(self.jump_strings)
        offsets = np.cumsum([0] + [len(s) for s in self.jump_strings]).astype(np.int64)
        tmp = path.with_name(path.name + f".tmp{time.monotonic_ns()}")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:  # 0600: clients' text
                self._write(f, joined, offsets)
            tmp.replace(path)  # atomic: concurrent readers never see a half-written file
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk leaves no partial file
            raise

    def _write(self, f: BinaryIO, joined: str, offsets: np.ndarray) -> None:
        np.savez(
            f,
            meta=np.array([FORMAT_VERSION, self.vocab_size, self.num_char_states, self.start_state]),
            pattern=_encode_text(self.pattern),
            accepting=self.accepting,
            masks=self.masks,
            indptr=self.indptr,
            token_ids=self.token_ids,
            next_states=self.next_states,
            byte_transitions=self.byte_transitions,
            jump_chars=_encode_text(joined),
            jump_offsets=offsets,
            eos_ids=np.array(self.eos_ids, dtype=np.int64),
            build_seconds=np.array(self.build_seconds),
        )

    @classmethod
    def load(cls, path: Path) -> TokenIndex:
        with np.load(path, allow_pickle=False) as z:
            version, vocab_size, num_char, start = (int(x) for x in z["meta"])
            if version != FORMAT_VERSION:
                raise ValueError(f"{path}: index format {version}, expected {FORMAT_VERSION}")
            joined, off = _decode_text(z["jump_chars"]), z["jump_offsets"]
            masks = z["masks"]
            masks.setflags(write=False)
            return cls(
                pattern=_decode_text(z["pattern"]),
                vocab_size=vocab_size,
                accepting=z["accepting"],
                masks=masks,
                indptr=z["indptr"],
                token_ids=z["token_ids"],
                next_states=z["next_states"],
                byte_transitions=z["byte_transitions"],
                num_char_states=num_char,
                jump_strings=[joined[off[i] : off[i + 1]] for i in range(len(off) - 1)],
                eos_ids=tuple(int(x) for x in z["eos_ids"]),
                build_seconds=float(z["build_seconds"]),
                start_state=start,
            )


def _encode_text(text: str) -> np.ndarray:
    # Code points as integers: numpy's unicode dtype would drop trailing NULs.
    return np.array([ord(c) for c in text], dtype=np.uint32)


def _decode_text(codes: np.ndarray) -> str:
    return "".join(map(chr, codes.tolist()))


_EMPTY = (np.zeros(0, np.int32), np.zeros(0, np.int32))


def _walk_vocab(table: np.ndarray, sink: int, state: int, vocab: VocabBytes) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, next states) of the tokens whose every byte has a transition from `state`."""
    cur = table[state, vocab.columns[0]]
    alive = np.flatnonzero(cur != sink)
    if alive.size == 0:
        return alive.astype(np.int32), alive.astype(np.int32)
    cur = cur[alive]
    neg_len = -vocab.lengths[alive]  # non-decreasing: the tokens with len > j form a prefix
    for j in range(1, int(-neg_len[0])):
        m = int(np.searchsorted(neg_len, -j, side="left"))
        if m == 0:
            break
        cur[:m] = table[cur[:m], vocab.columns[j, alive[:m]]]
    ok = cur != sink
    ids, nxt = vocab.order[alive[ok]], cur[ok]
    perm = np.argsort(ids, kind="stable")
    return ids[perm].astype(np.int32), nxt[perm].astype(np.int32)


def _token_live_states(bfsm: ByteFSM, per_state: list[tuple[np.ndarray, np.ndarray]],
                       guard: BuildGuard) -> np.ndarray:
    """States from which some token sequence reaches an accepting state. A byte FSM state can be
    live over bytes yet dead over tokens when no token supplies a needed byte (the vocabulary lacks
    a few control bytes); tokens into such states must not be allowed."""
    n = bfsm.num_states
    preds: list[list[int]] = [[] for _ in range(n)]
    for s, (_, nxt) in enumerate(per_state):
        guard.check()  # a unique() per state: ~60 us each for a 49 K vocabulary
        for t in np.unique(nxt):
            preds[int(t)].append(s)
    live = bfsm.accepting.copy()
    queue = deque(np.flatnonzero(live).tolist())
    while queue:
        t = queue.popleft()
        for s in preds[t]:
            if not live[s]:
                live[s] = True
                queue.append(s)
    return live


def build_token_index(fsm: CharFSM, vocab: VocabBytes, vocab_size: int | None = None,
                      guard: BuildGuard | None = None) -> TokenIndex:
    """Index of `fsm` over `vocab`. Raises ConstraintBudgetError when the index would exceed the
    guard's byte budget (checked before and during the walk, so memory never balloons first) or its
    deadline passes, CancelledError when the build is released, and InvalidRequestError when no
    token sequence reaches an accepting state."""
    t0 = time.perf_counter()
    guard = guard or BuildGuard(DEFAULT_BUDGET)
    if fsm.num_states > guard.budget.max_states:  # compile_regex's automata are already bounded
        guard.fail_states(fsm.num_states + 1, "the regex automaton")
    size = max(vocab.size, vocab_size or 0)
    words = (size + 31) // 32
    # Per state: bitmask words, byte transitions, indptr, accepting; plus 8 bytes per allowed token.
    state_bytes = words * 4 + 256 * 4 + 8 + 1
    bfsm = to_byte_fsm(fsm, guard, state_bytes)
    n = bfsm.num_states
    fixed_bytes = n * state_bytes
    guard.check_index_bytes(fixed_bytes, "the token index's per-state tables")
    sink = n  # DEAD redirected to an absorbing extra row so the walk needs no branching
    table = np.vstack([bfsm.transitions, np.full((1, 256), sink, np.int32)])
    table[table == DEAD] = sink
    per_state: list[tuple[np.ndarray, np.ndarray]] = []
    allowed = 0
    for s in range(n):  # ~1 ms a state for a 49 K vocabulary
        guard.check()
        ids, nxt = _walk_vocab(table, sink, s, vocab)
        per_state.append((ids, nxt))
        allowed += len(ids)
        guard.check_index_bytes(fixed_bytes + 8 * allowed, "the token index")

    # Each loop below is up to ~1 s over thousands of states (8 K states of [^x]{0,999}: 2.5 s in all), so
    # each polls the guard: the time and memory limits hold to ~10% only if every long loop does.
    live = _token_live_states(bfsm, per_state, guard)
    if not live[0]:  # the start state (char state 0)
        raise InvalidRequestError(
            f"the constraint matches no string the tokenizer can produce (regex {fsm.pattern!r})")
    for s, (ids, nxt) in enumerate(per_state):
        guard.check()
        keep = live[nxt]
        per_state[s] = (ids[keep], nxt[keep])

    counts = np.fromiter((len(ids) for ids, _ in per_state), dtype=np.int64, count=n)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    masks = np.zeros((n, words), dtype=np.uint32)
    token_ids = np.empty(int(indptr[-1]), np.int32)
    next_states = np.empty(int(indptr[-1]), np.int32)
    for s in range(n):  # filled state by state (not concatenated), so the per-state arrays go as they are copied
        guard.check()
        ids, nxt = per_state[s]
        per_state[s] = _EMPTY
        bits = np.zeros(words * 32, dtype=bool)
        bits[ids] = True
        masks[s] = np.packbits(bits, bitorder="little").view("<u4")
        token_ids[indptr[s] : indptr[s + 1]] = ids
        next_states[indptr[s] : indptr[s + 1]] = nxt

    guard.check()
    jumps = jump_forward_table(fsm, guard) + [""] * (n - bfsm.num_char_states)
    masks.setflags(write=False)
    return TokenIndex(
        pattern=fsm.pattern,
        vocab_size=size,
        accepting=bfsm.accepting,
        masks=masks,
        indptr=indptr,
        token_ids=token_ids,
        next_states=next_states,
        byte_transitions=bfsm.transitions,
        num_char_states=bfsm.num_char_states,
        jump_strings=jumps,
        eos_ids=vocab.eos_ids,
        build_seconds=time.perf_counter() - t0,
    )
