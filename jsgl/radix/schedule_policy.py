"""Order of the waiting queue (SGLang paper §3 and App. A: cache-aware scheduling).

``order_waiting`` returns the waiting requests in the order the scheduler should try to admit them.

Policies:

* ``lpm`` -- longest cached prefix first (ties: earlier arrival). Uses the cache's read-only
  ``match_len`` so ordering never splits nodes or refreshes LRU times. As in SGLang, a queue longer
  than ``LPM_MAX_QUEUE`` falls back to ``fcfs``: one prefix lookup per request per scheduling step
  costs more than the better order wins back when the queue is that long.
* ``dfs-weight`` -- the paper's DFS order. We build a temporary compressed trie over the waiting
  requests' tokens; a node's weight is the number of waiting requests in its subtree, children are
  visited heavier first, and each node emits the requests that end there before its children (a
  request that is a prefix of others fills the cache for them). The cache's structure enters as the
  tie-break between equally heavy children: the one with the longer already-cached prefix first
  (then earlier arrival). Requests sharing a cached prefix also share that trie path, so the
  grouping is at least as fine as walking the cache tree alone, and it also groups requests whose
  shared prefix is not cached yet.
* ``fcfs`` -- arrival order. ``lof`` -- longest ``max_new_tokens`` first (ties: arrival).
* ``random`` -- shuffled with the given ``random.Random`` (pass a long-lived one; the default is a
  fresh ``Random(0)`` per call, reproducible but the same permutation each time).

Starvation guard: with ``starvation_s`` set, requests that waited at least that long go first, in
arrival order, ahead of whatever the policy says for the rest.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol, TypeVar

POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random")
LPM_MAX_QUEUE = 128


class WaitingRequest(Protocol):
    """What the policies read from a request. ``lof`` also reads ``max_new_tokens: int``."""

    token_ids: list[int]
    arrival_time: float


class PrefixLookup(Protocol):
    """A cache that can say, without side effects, how much of a sequence it holds."""

    def match_len(self, tokens: Sequence[int]) -> int: ...


R = TypeVar("R", bound=WaitingRequest)


def order_waiting(
    waiting: list[R],
    policy: str,
    cache: PrefixLookup | None,
    now: float,
    starvation_s: float | None = None,
    *,
    rng: random.Random | None = None,
) -> list[R]:
    """Return a new list with the waiting requests in admission order (see the module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown schedule policy {policy!r}; known: {', '.join(POLICIES)}")
    starved: list[R] = []
    rest = list(waiting)
    if starvation_s is not None:
        starved = sorted((r for r in rest if now - r.arrival_time >= starvation_s), key=_arrival)
        rest = [r for r in rest if now - r.arrival_time < starvation_s]
    return starved + _by_policy(rest, policy, cache, rng)


def _arrival(r: WaitingRequest) -> float:
    return r.arrival_time


def _by_policy(reqs: list[R], policy: str, cache: PrefixLookup | None, rng: random.Random | None) -> list[R]:
    # sorted() is stable, so equal keys keep the caller's order after the arrival-time tie-break.
    if policy == "fcfs" or (policy == "lpm" and len(reqs) > LPM_MAX_QUEUE):
        return sorted(reqs, key=_arrival)
    if policy == "lof":
        return sorted(reqs, key=lambda r: (-r.max_new_tokens, r.arrival_time))  # type: ignore[attr-defined]
    if policy == "random":
        out = list(reqs)
        (rng if rng is not None else random.Random(0)).shuffle(out)
        return out
    cached = [cache.match_len(r.token_ids) if cache is not None else 0 for r in reqs]
    if policy == "lpm":
        order = sorted(range(len(reqs)), key=lambda i: (-cached[i], reqs[i].arrival_time))
        return [reqs[i] for i in order]
    return [reqs[i] for i in _dfs_weight_order([tuple(r.token_ids) for r in reqs],
                                               [r.arrival_time for r in reqs], cached)]


def _lcp_from(a: tuple[int, ...], b: tuple[int, ...], start: int) -> int:
    """Common prefix length of a and b, given that the first `start` tokens already agree."""
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _dfs_weight_order(seqs: list[tuple[int, ...]], arrival: list[float], cached: list[int]) -> list[int]:
    """Indices of seqs in heavier-subtree-first DFS order of their (implicit) compressed trie.

    With the sequences sorted lexicographically, every trie node is a contiguous run of that order
    (a sequence sorts before its extensions), so a node is just a (lo, hi, depth) range, its weight
    is hi - lo, and its branch point is the common prefix of its first and last member.
    """
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    out: list[int] = []
    stack = [(0, len(order), 0)] if order else []  # explicit stack: the trie can be deep
    while stack:
        lo, hi, depth = stack.pop()
        split = _lcp_from(seqs[order[lo]], seqs[order[hi - 1]], depth)
        # Members ending exactly at the branch point come first in sorted order; emit them now.
        enders = lo
        while enders < hi and len(seqs[order[enders]]) == split:
            enders += 1
        out.extend(sorted(order[lo:enders], key=lambda i: arrival[i]))
        children = []
        start = enders
        while start < hi:
            tok = seqs[order[start]][split]
            end = start + 1
            while end < hi and seqs[order[end]][split] == tok:
                end += 1
            members = order[start:end]
            key = (-(end - start), -max(cached[i] for i in members), min(arrival[i] for i in members))
            children.append((key, start, end))
            start = end
        children.sort()
        # Push in reverse so the heaviest child is popped (and fully explored) first.
        stack.extend((s, e, split + 1) for _, s, e in reversed(children))
    return out
