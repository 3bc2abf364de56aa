"""Regexes for integer ranges (JSON Schema minimum/maximum on integers), canonical decimal form."""

from __future__ import annotations


def _alt(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _same_length(lo: str, hi: str) -> list[str]:
    """Alternatives matching the digit strings in [lo, hi]; lo and hi have equal length."""
    if lo == hi:
        return [lo]
    n = len(lo)
    if lo[0] == hi[0]:
        return [lo[0] + _alt(_same_length(lo[1:], hi[1:]))]
    if lo[1:] == "0" * (n - 1) and hi[1:] == "9" * (n - 1):
        return [f"[{lo[0]}-{hi[0]}]" + (f"[0-9]{{{n - 1}}}" if n > 1 else "")]
    parts = [lo[0] + _alt(_same_length(lo[1:], "9" * (n - 1)))]
    a, b = int(lo[0]) + 1, int(hi[0]) - 1
    if a <= b:
        parts.append(f"[{a}-{b}][0-9]{{{n - 1}}}")
    parts.append(hi[0] + _alt(_same_length("0" * (n - 1), hi[1:])))
    return parts


def _non_negative(lo: int, hi: int | None) -> list[str]:
    """Alternatives for canonical non-negative integers in [lo, hi] (hi None: unbounded)."""
    parts: list[str] = []
    length = len(str(lo))
    top = hi if hi is not None else 10**length - 1
    while lo <= top:
        end = min(top, 10 ** len(str(lo)) - 1)
        parts += _same_length(str(lo), str(end))
        lo = end + 1
    if hi is None:
        parts.append(f"[1-9][0-9]{{{length},}}")  # every longer number
    return parts


def int_range_regex(lo: int | None, hi: int | None) -> str:
    """Regex for the integers in [lo, hi]; either bound may be None (unbounded)."""
    parts: list[str] = []
    if hi is None or hi >= 0:  # the non-negative part
        parts += _non_negative(max(lo, 0) if lo is not None else 0, hi)
    if lo is None or lo < 0:  # the negative part, written as "-" + a positive range
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        neg_hi = None if lo is None else -lo
        parts += ["-" + _alt(_non_negative(neg_lo, neg_hi))]
    return _alt(parts)
