"""Where a program state's role contents lie in its text, kept in step as the text is edited.

The contents of `system()`, `user()` and `assistant()` blocks are what the program wrote, not the chat template:
`Runtime` tokenizes them as plain text (`SpannedPrompt`) and `RuntimeEndpoint` sends them as `plain_spans`, so a
`<|im_end|>` in a user's string cannot close the turn. Spans are ``(start, end)`` character ranges, sorted and disjoint.
"""

from __future__ import annotations

Span = tuple[int, int]


def moved(position: int, at: int, old_len: int, new_len: int) -> int:
    """``position`` after ``text[at:at + old_len]`` became ``new_len`` characters (inside it: clamped to the new)."""
    if position <= at:
        return position
    if position >= at + old_len:
        return position + new_len - old_len
    return at + min(position - at, new_len)


def replaced(spans: list[Span], at: int, old_len: int, new_len: int) -> list[Span]:
    """``spans`` after ``text[at:at + old_len]`` became ``new_len`` characters."""
    return [(moved(a, at, old_len, new_len), moved(b, at, old_len, new_len)) for a, b in spans]


def rebased(spans: list[Span], start: int, offset: int) -> list[Span]:
    """The parts of ``spans`` from ``start`` on, with ``start`` moved to ``offset`` (a branch's text joined onto
    its parent's)."""
    return [(max(a, start) - start + offset, b - start + offset) for a, b in spans if b > start]
