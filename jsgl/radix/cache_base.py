"""What the radix tree and the flat-table ablation share: counters, sizes, page alignment, stats."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np


class PrefixCacheBase:
    """Bookkeeping common to prefix caches; subclasses keep ``_evictable``/``_protected`` up to date."""

    def __init__(self, page_size: int = 1, free_slots: Callable[[np.ndarray], None] | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        # Default: just forget freed slots (tools and tests that keep no pool).
        self.free_slots = free_slots if free_slots is not None else (lambda slots: None)
        # Counters for the engine's metrics; they survive reset() (they describe the engine's life).
        self.evicted_tokens_total = 0
        self.query_tokens_total = 0  # tokens looked up by match_prefix
        self.hit_tokens_total = 0  # of which found in the cache
        self.match_time_s = 0.0
        self.insert_time_s = 0.0
        self.evict_time_s = 0.0
        # A logical clock, not wall time: strictly increasing, so LRU order is deterministic.
        self._clock = itertools.count(1)
        self._evictable = 0  # tokens (slots) held only by unlocked entries
        self._protected = 0  # tokens (slots) held by a locked entry

    def page_aligned_len(self, n: int) -> int:
        """Longest length <= n made of whole pages: the part of a sequence the cache can hold."""
        return n - n % self.page_size

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        """Distinct pool slots held by the cache."""
        return self._evictable + self._protected

    @property
    def time_s(self) -> float:
        """Time spent in cache operations (match, insert, evict)."""
        return self.match_time_s + self.insert_time_s + self.evict_time_s

    def stats(self) -> dict[str, float]:
        return {
            "cached_tokens": self.total_size(),
            "evictable_tokens": self._evictable,
            "protected_tokens": self._protected,
            "evicted_tokens_total": self.evicted_tokens_total,
            "hit_rate": self.hit_tokens_total / self.query_tokens_total if self.query_tokens_total else 0.0,
            "tree_time_s": self.time_s,
        }

    def format_tree(self, max_tokens: int = 8) -> str:
        raise NotImplementedError

    def pretty_print(self) -> None:
        print(self.format_tree())
