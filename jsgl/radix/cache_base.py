"""The prefix-cache seam: what the scheduler calls, and the bookkeeping every implementation shares.

Implementations: `RadixCache` (the paper's tree), `FlatCache` (the no-tree ablation) and `NoPrefixCache`
(the no-cache ablation). The scheduler depends on this interface only.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class PrefixCacheBase(abc.ABC):
    """A map from token prefixes to KV slots with LRU eviction and lock refs. Subclasses keep
    ``_evictable``/``_protected`` up to date.

    Ownership: `insert` takes the slots past the prefix it already held; the caller frees its copies of
    that prefix. A handle from `match_prefix` is locked (`inc_lock_ref`) while a request reads its slots.
    """

    keeps_prefixes = True  # False: nothing inserted is ever matched (the scheduler skips sharing work)

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

    @abc.abstractmethod
    def match_prefix(self, tokens: Sequence[int] | np.ndarray) -> tuple[np.ndarray, Any]:
        """Slots of the longest cached (page-aligned) prefix of `tokens`, and a handle to lock it by."""

    @abc.abstractmethod
    def match_len(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Length of the cached prefix, without side effects (for schedule policies)."""

    def continuation(self, tokens: Sequence[int] | np.ndarray, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` cached tokens that follow ``tokens`` when a cached run extends them (the most recently
        used branch), read-only: speculative decoding's drafts. A cache without token runs has none."""
        return []

    @abc.abstractmethod
    def insert(self, tokens: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray) -> int:
        """Cache tokens -> slots; return how many leading tokens the cache did not take (it already held
        them): the caller frees its own slots for those."""

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked slots (LRU) if possible; return how many were freed."""

    @abc.abstractmethod
    def inc_lock_ref(self, handle: Any) -> int:
        """Protect a matched prefix from eviction; return tokens moved to protected."""

    @abc.abstractmethod
    def dec_lock_ref(self, handle: Any) -> int:
        """Undo one inc_lock_ref; return tokens that became evictable again."""

    @abc.abstractmethod
    def reset(self, force: bool = False) -> None:
        """Forget everything without freeing slots (refused while anything is locked unless `force`)."""

    @abc.abstractmethod
    def format_tree(self, max_tokens: int = 8) -> str:
        """A readable dump of the cache's contents."""

    def pretty_print(self) -> None:
        print(self.format_tree())
