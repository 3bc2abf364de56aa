"""Regex -> minimal deterministic character FSM, built with interegular.

interegular gives a DFA over an *alphabet of classes*: every explicit character of the pattern maps to
a class id, and the special symbol `anything_else` stands for every character the pattern never names
(it is how `[^"]` or `.` reach characters outside the pattern). We keep exactly that shape: a dense
transition table over class ids plus a char -> class dict, where a character missing from the dict is
in `other_class`. Dead states (from which no accepting state is reachable) are pruned so that every
transition that exists can still lead to a match -- the token index relies on that to never allow a
token that strands the model.
"""

from __future__ import annotations

import re
from collections import deque
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import interegular
import numpy as np
from interegular.fsm import anything_else

from jsgl.errors import InvalidRequestError
from jsgl.fsm import interegular_patch
from jsgl.fsm.budget import DEFAULT_BUDGET, BuildBudget, BuildGuard, BuildPreempted
from jsgl.fsm.static_check import check_regex

interegular_patch.install()

DEAD = -1


@dataclass(frozen=True, eq=False)
class CharFSM:
    """A minimal, trimmed DFA over characters. States are 0..num_states-1 in BFS order; 0 is the start."""

    pattern: str
    char_class: dict[str, int]  # explicit characters -> class id
    other_class: int  # class of every character not in char_class (interegular's anything_else)
    transitions: np.ndarray  # int32 [num_states, num_classes]; DEAD = no live continuation
    accepting: np.ndarray  # bool [num_states]
    start: int = field(default=0)

    @property
    def num_states(self) -> int:
        return int(self.transitions.shape[0])

    @property
    def num_classes(self) -> int:
        return int(self.transitions.shape[1])

    def class_of(self, ch: str) -> int:
        return self.char_class.get(ch, self.other_class)

    def step(self, state: int, ch: str) -> int:
        return int(self.transitions[state, self.class_of(ch)])

    def walk(self, text: str, state: int | None = None) -> int:
        """State after reading `text` from `state` (default: start); DEAD once it leaves the language."""
        s = self.start if state is None else state
        for ch in text:
            s = int(self.transitions[s, self.class_of(ch)])
            if s == DEAD:
                return DEAD
        return s

    def accepts(self, text: str) -> bool:
        s = self.walk(text)
        return s != DEAD and bool(self.accepting[s])

    @cached_property
    def class_chars(self) -> list[list[str]]:
        """Explicit characters of each class, sorted (the `other_class` list is empty by construction)."""
        out: list[list[str]] = [[] for _ in range(self.num_classes)]
        for ch, k in self.char_class.items():
            out[k].append(ch)
        for chars in out:
            chars.sort()
        return out


_HEX = set("0123456789abcdefABCDEF")


def _expand_unicode_escapes(pattern: str) -> str:
    r"""Rewrite \uXXXX / \UXXXXXXXX (which interegular rejects) as the characters themselves.

    Characters >= U+0100 are never regex metacharacters, so they can stand literally (also inside a
    class); lower ones become \xHH, which interegular understands. `\\` pairs are copied untouched so
    an escaped backslash followed by `u` (as in JSON string regexes) is left alone.
    """
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch != "\\" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = pattern[i + 1]
        width = 4 if nxt == "u" else 8 if nxt == "U" else 0
        digits = pattern[i + 2 : i + 2 + width]
        if width and len(digits) == width and set(digits) <= _HEX:
            cp = int(digits, 16)
            out.append(f"\\x{cp:02x}" if cp < 0x100 else chr(cp))
            i += 2 + width
        else:
            out.append(pattern[i : i + 2])
            i += 2
    return "".join(out)


def _strip_anchors(pattern: str) -> str:
    """Matching is always full-match, so a leading `^` / trailing `$` (which interegular rejects)
    are redundant; drop them. Anchors elsewhere stay and are reported as unsupported."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$"):
        backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
        if backslashes % 2 == 0:
            pattern = pattern[:-1]
    return pattern


def validate_regex(pattern: str, budget: BuildBudget | None = None) -> str:
    """Cheap syntax and size check (no FSM construction); returns the interegular-ready pattern.

    Raises InvalidRequestError for a bad or unsupported pattern, ConstraintBudgetError (a subclass)
    for one obviously over `budget` (default DEFAULT_BUDGET): see `static_check`.
    """
    return _validate(_string(pattern), budget or DEFAULT_BUDGET)[0]


def _string(pattern: object) -> str:
    if not isinstance(pattern, str):
        raise InvalidRequestError(f"regex must be a string, not {type(pattern).__name__}")
    return pattern


@lru_cache(maxsize=64)  # the engine validates on submit and again when queueing (54 ms for a 5 K schema)
def _validate(pattern: str, budget: BuildBudget) -> tuple[str, int]:
    """(interegular-ready pattern, static cost). Python's `re` is the reference for what a valid
    pattern is (interegular accepts some patterns Python rejects, like `a**`); interegular's parser
    then reports features it cannot express."""
    cost = check_regex(pattern, budget)
    try:
        re.compile(pattern)
    except re.error as e:
        raise InvalidRequestError(f"invalid regex {pattern!r}: {e}") from None
    expanded = _strip_anchors(_expand_unicode_escapes(pattern))
    try:
        interegular.parse_pattern(expanded)
    except RecursionError:
        raise InvalidRequestError("regex nests too deeply for constrained decoding") from None
    except Exception as e:  # interegular raises bare Exception subclasses
        raise InvalidRequestError(
            f"regex {pattern!r} is not supported for constrained decoding: {type(e).__name__}: {e}"
        ) from None
    return expanded, cost


def regex_cost(pattern: str, budget: BuildBudget | None = None) -> int:
    """Validate `pattern` like `validate_regex` and return its static cost estimate (expanded size)."""
    return _validate(_string(pattern), budget or DEFAULT_BUDGET)[1]


def _minimize(table: np.ndarray, accepting: np.ndarray, guard: BuildGuard) -> tuple[np.ndarray, np.ndarray]:
    """Hopcroft's partition refinement (O(K n log n); the simpler Moore rounds go quadratic on the
    long chains that `{m,n}` repeats produce). Returns (block of each state, representative of each
    block). DEAD edges go to an explicit sink so the DFA is complete."""
    n, k_count = table.shape
    sink = n
    full = np.vstack([np.where(table >= 0, table, sink), np.full((1, k_count), sink)])
    acc = np.append(accepting, False)
    # Preimages per class as CSR: states s with full[s, k] == t are order[bounds[t]:bounds[t+1]].
    inverse: list[tuple[list[int], list[int]]] = []
    for k in range(k_count):
        col = full[:, k]
        order = np.argsort(col, kind="stable")
        inverse.append((order.tolist(), np.searchsorted(col[order], np.arange(n + 2)).tolist()))
    blocks = [set(np.flatnonzero(acc).tolist()), set(np.flatnonzero(~acc).tolist())]
    block = [0 if a else 1 for a in acc.tolist()]
    smaller = 0 if len(blocks[0]) <= len(blocks[1]) else 1
    work = {(smaller, k) for k in range(k_count)}
    rounds = 0
    while work:
        rounds += 1
        if rounds % 256 == 0:  # a round is microseconds; a clock read per round would be ~5%
            guard.check()
        b, k = work.pop()
        order, bounds = inverse[k]
        touched: dict[int, list[int]] = {}
        for t in blocks[b]:
            for s in order[bounds[t] : bounds[t + 1]]:
                touched.setdefault(block[s], []).append(s)
        for y, members in touched.items():
            if len(members) == len(blocks[y]):
                continue  # the splitter does not separate block y
            new = len(blocks)
            blocks[y] -= set(members)
            blocks.append(set(members))
            for s in members:
                block[s] = new
            half = new if len(members) <= len(blocks[y]) else y
            for c in range(k_count):
                work.add((new, c) if (y, c) in work else (half, c))
    _, part = np.unique(np.array(block[:n], dtype=np.int64), return_inverse=True)
    part = part.reshape(-1)
    reps = np.zeros(int(part.max()) + 1 if n else 0, dtype=np.int64)
    reps[part[::-1]] = np.arange(n)[::-1]  # first state of each block
    return part, reps


def compile_regex(pattern: str, guard: BuildGuard | None = None) -> CharFSM:
    """Regex (Python syntax, full-match semantics) -> CharFSM. Raises InvalidRequestError, and
    ConstraintBudgetError / CancelledError when `guard` (default: DEFAULT_BUDGET from now) says so."""
    guard = guard or BuildGuard(DEFAULT_BUDGET)
    expanded = validate_regex(pattern, guard.budget)
    guard.check()
    try:
        with guard.active():  # interegular's crawl (interegular_patch) polls the guard per state
            fsm = interegular.parse_pattern(expanded).to_fsm()
    except (InvalidRequestError, CancelledError, BuildPreempted):
        raise  # the guard's verdicts (budget errors are InvalidRequestErrors)
    except RecursionError:
        raise InvalidRequestError("regex nests too deeply for constrained decoding") from None
    except Exception as e:
        raise InvalidRequestError(f"regex {pattern!r} cannot be turned into an FSM: {e}") from None
    guard.check()

    # Class ids: interegular's transition keys, made contiguous; anything_else gets one too (even when
    # absent) so every character has a class.
    keys = sorted({k for k in fsm.alphabet.values()})
    kid = {k: i for i, k in enumerate(keys)}
    char_class: dict[str, int] = {}
    other_class = len(keys)
    for sym, k in fsm.alphabet.items():
        if sym is anything_else:
            other_class = kid[k]
        else:
            char_class[sym] = kid[k]
    num_classes = max(len(keys), other_class + 1)

    # Reachable states in BFS order.
    order = {fsm.initial: 0}
    queue = deque([fsm.initial])
    while queue:
        guard.tick()  # these loops take microseconds a state, for up to max_states (20 K) states
        s = queue.popleft()
        for t in fsm.map.get(s, {}).values():
            if t not in order:
                order[t] = len(order)
                queue.append(t)
    n = len(order)
    table = np.full((n, num_classes), DEAD, dtype=np.int64)
    accepting = np.zeros(n, dtype=bool)
    for s, i in order.items():
        guard.tick()
        accepting[i] = s in fsm.finals
        for k, t in fsm.map.get(s, {}).items():
            table[i, kid[k]] = order[t]

    # Trim: keep only states that can still reach an accepting state.
    src, cls = np.nonzero(table >= 0)
    preds: list[list[int]] = [[] for _ in range(n)]
    for a, b in zip(src.tolist(), table[src, cls].tolist(), strict=True):
        preds[b].append(a)
    live = accepting.copy()
    queue = deque(np.flatnonzero(live).tolist())
    while queue:
        guard.tick()
        for a in preds[queue.popleft()]:
            if not live[a]:
                live[a] = True
                queue.append(a)
    if not live[0]:
        raise InvalidRequestError(f"the constraint matches no string (regex {pattern!r})")
    guard.check()
    table = np.where((table >= 0) & live[np.maximum(table, 0)], table, DEAD)

    part, reps = _minimize(table, accepting, guard)
    q_table = np.where(table[reps] >= 0, part[np.maximum(table[reps], 0)], DEAD)
    q_accepting = accepting[reps]

    # Renumber blocks in BFS order from the start block; drop blocks of dead states (unreachable now).
    start = int(part[0])
    new_id = {start: 0}
    queue = deque([start])
    while queue:
        guard.tick()
        b = queue.popleft()
        for t in q_table[b]:
            t = int(t)
            if t >= 0 and t not in new_id:
                new_id[t] = len(new_id)
                queue.append(t)
    blocks = sorted(new_id, key=new_id.__getitem__)
    remap = np.full(len(reps), DEAD, dtype=np.int64)
    for b, i in new_id.items():
        remap[b] = i
    final_table = np.where(q_table[blocks] >= 0, remap[np.maximum(q_table[blocks], 0)], DEAD)
    return CharFSM(
        pattern=pattern,
        char_class=char_class,
        other_class=other_class,
        transitions=final_table.astype(np.int32),
        accepting=q_accepting[blocks].copy(),
    )
