"""The "no tree structure" ablation of the SGLang paper's Fig. 8c: a flat table of whole sequences.

Each entry is the full token sequence of one finished request (prompt + output) with the KV-pool
slots that hold it. A new request may reuse an entry only if the entry's WHOLE key is a prefix of
the request's tokens (the longest such entry wins). There is no partial sharing and no splitting:
two requests that share a system prompt but differ afterwards each keep their own copy of it, so
tokens are duplicated across entries; that duplication and the lost hits are what the ablation
measures against ``RadixCache``.

Public interface as ``RadixCache`` (``match_prefix``, ``match_len``, ``insert``, ``evict``,
``inc_lock_ref`` / ``dec_lock_ref``, sizes, ``reset``), with the same ownership contract:
``insert`` never frees and the caller frees ``slots[cached_len:prefix_len]``. ``insert`` returns
the full length for a key that is already in the table and 0 for a new key (which then keeps all
the caller's slots, the reused ones included).

Why slot reference counts: a request that reused entry E has E's slots as the head of its own
sequence, so the entry inserted for it shares those slots with E. A slot is handed back to the pool
only when the last entry holding it is evicted, and the sizes count distinct slots (pool usage),
not the sum of entry lengths. With ``page_size > 1`` only the page-aligned part of a sequence is
stored; the caller keeps (and frees) the trailing partial page, as with ``RadixCache``.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np

from jsgl.radix.cache_base import PrefixCacheBase
from jsgl.radix.radix_cache import empty_slots


class FlatEntry:
    """One cached sequence; also the handle match_prefix returns and the lock calls accept."""

    __slots__ = ("key", "value", "lock_ref", "last_access_time", "uid")
    _uids = itertools.count()

    def __init__(self, key: tuple[int, ...], value: np.ndarray) -> None:
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = 0
        self.uid = next(FlatEntry._uids)

    def __repr__(self) -> str:
        return f"FlatEntry(len={len(self.key)}, lock_ref={self.lock_ref}, t={self.last_access_time})"


class FlatCache(PrefixCacheBase):
    """Whole-sequence prefix cache with LRU eviction of unlocked entries."""

    def __init__(self, page_size: int = 1, free_slots: Callable[[np.ndarray], None] | None = None) -> None:
        super().__init__(page_size, free_slots)
        # The "no match" handle: lock calls on it are no-ops, like on RadixCache's root.
        self.root = FlatEntry((), empty_slots())
        self._new_table()

    def _new_table(self) -> None:
        self._entries: dict[tuple[int, ...], FlatEntry] = {}
        self._len_count: dict[int, int] = {}  # key length -> number of entries, for lookups
        # Per pool slot: entries holding it, and locked entries holding it (grown on demand).
        self._ref = np.zeros(0, dtype=np.int32)
        self._locked = np.zeros(0, dtype=np.int32)
        self._evictable = 0  # distinct slots held only by unlocked entries
        self._protected = 0  # distinct slots held by at least one locked entry

    def _aligned(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, ...]:
        seq = np.asarray(tokens, dtype=np.int32).tolist()
        return tuple(seq[: self.page_aligned_len(len(seq))])

    def _grow(self, max_slot: int) -> None:
        if max_slot >= len(self._ref):
            size = max(2 * len(self._ref), max_slot + 1, 64)
            self._ref = np.concatenate([self._ref, np.zeros(size - len(self._ref), np.int32)])
            self._locked = np.concatenate([self._locked, np.zeros(size - len(self._locked), np.int32)])

    def _longest(self, key: tuple[int, ...]) -> FlatEntry:
        for length in sorted(self._len_count, reverse=True):
            if length <= len(key):
                entry = self._entries.get(key[:length])
                if entry is not None:
                    return entry
        return self.root

    def _check_live(self, entry: FlatEntry) -> None:
        if self._entries.get(entry.key) is not entry:
            raise ValueError("entry is not in this cache (evicted, or from before a reset)")

    # ------------------------------------------------------------------ RadixCache interface

    def match_prefix(self, tokens: Sequence[int] | np.ndarray) -> tuple[np.ndarray, FlatEntry]:
        """Slots of the longest entry whose whole key prefixes tokens, and that entry."""
        t0 = time.perf_counter()
        key = self._aligned(tokens)
        entry = self._longest(key)
        self.query_tokens_total += len(key)
        self.hit_tokens_total += len(entry.key)
        if entry is not self.root:
            entry.last_access_time = next(self._clock)
        self.match_time_s += time.perf_counter() - t0
        return entry.value.copy(), entry

    def match_len(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Length of the entry match_prefix would pick, without touching LRU order."""
        return len(self._longest(self._aligned(tokens)).key)

    def insert(self, tokens: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray) -> int:
        """Add tokens as an entry; return len(key) if it was already there (caller frees its copy),
        else 0. Frees nothing."""
        t0 = time.perf_counter()
        value = np.asarray(slots, dtype=np.int32)
        if value.ndim != 1 or len(value) != len(tokens):
            raise ValueError(f"tokens and slots must be 1-D and the same length, got {len(tokens)} "
                             f"and {value.shape}")
        key = self._aligned(tokens)
        value = value[: len(key)].copy()
        try:
            if not key:
                return 0
            entry = self._entries.get(key)
            if entry is not None:
                entry.last_access_time = next(self._clock)
                return len(key)
            if len(np.unique(value)) != len(value) or value.min() < 0:
                raise ValueError("slots of one sequence must be distinct and non-negative")
            entry = FlatEntry(key, value)
            entry.last_access_time = next(self._clock)
            self._entries[key] = entry
            self._len_count[len(key)] = self._len_count.get(len(key), 0) + 1
            self._grow(int(value.max()))
            self._evictable += int(np.count_nonzero(self._ref[value] == 0))
            self._ref[value] += 1  # distinct within the entry, so fancy-index += is exact
            return 0
        finally:
            self.insert_time_s += time.perf_counter() - t0

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked entries, least recently used first, until num_tokens slots went back to
        the pool or none is left; return the slots freed (shared slots only free with their last
        holder, so an eviction may free fewer tokens than the entry's length)."""
        if num_tokens <= 0:
            return 0
        t0 = time.perf_counter()
        heap = [(e.last_access_time, e.uid, e) for e in self._entries.values() if e.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, entry = heapq.heappop(heap)
            del self._entries[entry.key]
            n = len(entry.key)
            self._len_count[n] -= 1
            if not self._len_count[n]:
                del self._len_count[n]
            self._ref[entry.value] -= 1
            gone = entry.value[self._ref[entry.value] == 0]
            self._evictable -= len(gone)
            freed += len(gone)
            if len(gone):
                self.free_slots(gone)
        self.evicted_tokens_total += freed
        self.evict_time_s += time.perf_counter() - t0
        return freed

    def inc_lock_ref(self, entry: FlatEntry) -> int:
        """Protect entry from eviction; return slots moved from evictable to protected."""
        if entry is self.root:
            return 0
        self._check_live(entry)
        delta = 0
        if entry.lock_ref == 0:
            delta = int(np.count_nonzero(self._locked[entry.value] == 0))
            self._locked[entry.value] += 1
            self._evictable -= delta
            self._protected += delta
        entry.lock_ref += 1
        return delta

    def dec_lock_ref(self, entry: FlatEntry) -> int:
        """Undo one inc_lock_ref; return slots that became evictable again."""
        if entry is self.root:
            return 0
        if entry.lock_ref <= 0:
            raise AssertionError("dec_lock_ref on an entry that is not locked")
        entry.lock_ref -= 1
        delta = 0
        if entry.lock_ref == 0:
            self._locked[entry.value] -= 1
            delta = int(np.count_nonzero(self._locked[entry.value] == 0))
            self._evictable += delta
            self._protected -= delta
        return delta

    def reset(self, force: bool = False) -> None:
        """Drop every entry without calling free_slots (the engine's flush resets the pool)."""
        if self._protected and not force:
            raise RuntimeError(f"reset with {self._protected} slots locked by running requests")
        self._new_table()

    def entries(self) -> list[FlatEntry]:
        return list(self._entries.values())

    def format_tree(self, max_tokens: int = 8) -> str:
        lines = [f"flat table (evictable={self._evictable}, protected={self._protected})"]
        for e in sorted(self._entries.values(), key=lambda e: e.last_access_time):
            more = "..." if len(e.key) > max_tokens else ""
            lines.append(f"  {list(e.key[:max_tokens])}{more} len={len(e.key)} lock={e.lock_ref} "
                         f"t={e.last_access_time}")
        return "\n".join(lines)
