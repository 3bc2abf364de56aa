"""A drop-in `interegular.fsm.crawl` that is fast and obeys the current build's budget.

Every interegular FSM operation (concatenate, star, times, union, ...) is one `crawl`: a BFS that
discovers meta-states through `follow`. The original finds each new meta-state with `list.index`,
a linear scan per transition, so building a chain of n states is O(n^2): `"maxLength": 256`
took 11.7 s, `[\\s\\S]{1,2000}` 16 s. This version keeps a dict from meta-state to number (same
numbering, so the resulting FSM is identical) and, inside a budgeted build (`BuildGuard.active`),
checks the deadline / cancellation once per state and the state count and meta-state sizes on
every new state -- the only way to stop interegular, whose construction can otherwise run forever
(`maxLength: 1000000`) or fill gigabytes with huge meta-states (`(a{1,99}){1,100}`: 1.3 GB).
`union` skips merging an alphabet with itself, which took most of the time of patterns with large classes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import interegular.fsm as ifsm

from jsgl.fsm.budget import current_guard

_original_crawl = ifsm.crawl
_original_union = ifsm.Alphabet.union


def _key(state: Any) -> Hashable:
    """A hashable stand-in equal exactly when the original `==` is: union/intersection (`parallel`)
    and `everythingbut` use dicts {fsm index: substate}; `star`/`times` start from a plain set."""
    if isinstance(state, dict):
        return frozenset(state.items())
    return frozenset(state) if isinstance(state, set) else state


def crawl(alphabet: ifsm.Alphabet, initial: Any, final: Callable[[Any], bool],
          follow: Callable[[Any, Any], Any]) -> ifsm.FSM:
    guard = current_guard()
    max_states = guard.budget.max_states if guard is not None else None
    max_elements = guard.budget.max_automaton_elements if guard is not None else None
    elements = 0  # total size of the meta-states kept: interegular's memory and per-state work
    states = [initial]
    number = {_key(initial): 0}
    finals: set[int] = set()
    fsm_map: dict[int, dict[Any, int]] = {}
    transitions = list(alphabet.by_transition)
    i = 0
    while i < len(states):
        if guard is not None:
            guard.check()
        state = states[i]
        if final(state):
            finals.add(i)
        row: dict[Any, int] = {}
        for transition in transitions:
            try:
                nxt = follow(state, transition)
            except ifsm.OblivionError:
                continue
            key = nxt if type(nxt) is frozenset else _key(nxt)  # the common case, inlined (-10%)
            j = number.get(key)
            if j is None:
                j = number[key] = len(states)
                states.append(nxt)
                if max_states is not None:
                    elements += len(nxt) if isinstance(nxt, frozenset | dict) else 1
                    if j >= max_states or elements > max_elements:  # type: ignore[operator]
                        guard.fail_automaton(j + 1, elements)  # type: ignore[union-attr]
            row[transition] = j
        fsm_map[i] = row
        i += 1
    return ifsm.FSM(alphabet=alphabet, states=range(len(states)), initial=0, finals=finals, map=fsm_map,
                    __no_validation__=True)


def union(*alphabets: ifsm.Alphabet) -> tuple[ifsm.Alphabet, tuple[dict[Any, Any], ...]]:
    """interegular's `Alphabet.union`, which every FSM operation calls first, walks every character of
    every alphabet: ~45 ms per operation for the 21 K characters of [一-龥], unchecked by the guard. The
    sub-automata of one pattern share one alphabet object, which needs no merging: same alphabet, each
    transition key standing for itself."""
    first = alphabets[0]
    if all(a is first for a in alphabets):
        identity = {key: key for key in first.by_transition}
        return first, tuple(identity for _ in alphabets)
    guard = current_guard()
    if guard is not None:
        guard.check()
    return _original_union(*alphabets)


def install() -> None:
    """Replace interegular's crawl and Alphabet.union (idempotent). FSM methods look `crawl` up in their
    module's globals, and call `Alphabet.union` through the class."""
    ifsm.crawl = crawl
    ifsm.Alphabet.union = union  # type: ignore[method-assign]
