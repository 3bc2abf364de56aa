"""Compressed FSM (SGLang paper §4): chains of singular transitions collapsed into one string.

A transition out of state s is *singular* when it is the only way to continue: exactly one
character leads anywhere live and s is not accepting. The accepting condition matters because in
an accepting state the model may also end the output (EOS), so the next character is not decided.
The `anything_else` class stands for infinitely many characters, so a state whose only live class
is anything_else (or a class holding several characters, e.g. case-insensitive `[Aa]`) is never
singular. Following singular transitions from s until the first non-singular state gives the
text that every valid continuation must start with; the engine can append it in one step
("jump forward") instead of decoding it token by token.
"""

from __future__ import annotations

import numpy as np

from jsgl.fsm.budget import BuildGuard
from jsgl.fsm.regex_fsm import DEAD, CharFSM


def singular_char(fsm: CharFSM, state: int) -> str | None:
    """The forced next character of `state`, or None when the model has a choice."""
    if fsm.accepting[state]:
        return None
    live = np.flatnonzero(fsm.transitions[state] != DEAD)
    if len(live) != 1 or int(live[0]) == fsm.other_class:
        return None
    chars = fsm.class_chars[int(live[0])]
    return chars[0] if len(chars) == 1 else None


def jump_target(fsm: CharFSM, state: int) -> tuple[str, int]:
    """(maximal forced string from `state`, state after it). Stops on a revisit as a safeguard; a
    trimmed FSM cannot have a cycle of singular non-accepting states (it could never accept)."""
    out: list[str] = []
    seen = {state}
    s = state
    while (ch := singular_char(fsm, s)) is not None:
        nxt = fsm.step(s, ch)
        if nxt in seen:
            break
        out.append(ch)
        seen.add(nxt)
        s = nxt
    return "".join(out), s


def jump_forward_string(fsm: CharFSM, state: int) -> str:
    return jump_target(fsm, state)[0]


def jump_forward_table(fsm: CharFSM, guard: BuildGuard | None = None) -> list[str]:
    """Forced string of every state. Each state's string is its forced char + the next state's
    string, so states are resolved along chains with memoisation (linear overall). `guard` ticks per
    state (~10 us a state: 20 K states take ~0.2 s)."""
    forced: list[str | None] = []
    for s in range(fsm.num_states):
        if guard is not None:
            guard.tick()
        forced.append(singular_char(fsm, s))
    table: list[str | None] = [None] * fsm.num_states
    for s0 in range(fsm.num_states):
        if guard is not None:
            guard.tick()
        chain: list[int] = []
        on_chain: set[int] = set()
        s = s0
        while table[s] is None and forced[s] is not None and s not in on_chain:
            chain.append(s)
            on_chain.add(s)
            s = fsm.step(s, forced[s])  # type: ignore[arg-type]
        if table[s] is None:
            table[s] = ""  # s is not singular (a singular cycle cannot survive trimming)
        tail: str = table[s]  # type: ignore[assignment]
        for c in reversed(chain):
            tail = forced[c] + tail  # type: ignore[operator]
            table[c] = tail
    return [t or "" for t in table]
