"""RadixCache / FlatCache / schedule-policy tests: hypothesis state machines plus examples."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import examples
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jsgl.radix.flat_cache import FlatCache
from jsgl.radix.radix_cache import RadixCache, TreeNode
from jsgl.radix.schedule_policy import LPM_MAX_QUEUE, order_waiting

SEQS = st.lists(st.integers(0, 2), min_size=0, max_size=9)  # tiny alphabet: lots of shared prefixes
MACHINE_SETTINGS = settings(max_examples=examples(100), stateful_step_count=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])


class Pool:
    """A tiny allocator: hands out fresh slot ids and checks every slot comes back exactly once."""

    def __init__(self) -> None:
        self.next = 0
        self.live: set[int] = set()
        self.freed: set[int] = set()

    def alloc(self, n: int) -> np.ndarray:
        out = np.arange(self.next, self.next + n, dtype=np.int32)
        self.next += n
        self.live.update(out.tolist())
        return out

    def free(self, slots: np.ndarray) -> None:
        for s in np.asarray(slots).tolist():
            assert s in self.live, f"slot {s} freed twice or never allocated"
            self.live.remove(s)
            self.freed.add(s)


def tree_slots(cache: RadixCache) -> list[int]:
    return [s for n in cache.iter_nodes() for s in n.value.tolist()]


def path_tokens(cache: RadixCache, node: TreeNode) -> list[int]:
    parts = []
    while node is not cache.root:
        parts.append(node.key.tolist())
        node = node.parent
    return [t for p in reversed(parts) for t in p]


def path_slots(cache: RadixCache, node: TreeNode) -> list[int]:
    parts = []
    while node is not cache.root:
        parts.append(node.value.tolist())
        node = node.parent
    return [s for p in reversed(parts) for s in p]


# ---------------------------------------------------------------------------- radix state machine


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    run = 1  # each drawn token stands for a run of this many: sequences long enough for large pages

    def _long(self, tokens: list[int]) -> list[int]:
        return [t for t in tokens for _ in range(self.run)]

    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool()
        self.cache = RadixCache(page_size=self.page_size, free_slots=self._on_free)
        self.held: list[tuple[list[int], np.ndarray, TreeNode]] = []  # running requests
        # An independent model of recency: for each cached token (by its prefix), the number of the last
        # operation that touched it. An operation touches the nodes its tokens lie in, whole (the tree keeps
        # one access time per node).
        self.clock = 0
        self.access: dict[tuple[int, ...], int] = {}
        self.evicted_log: list[list[int]] | None = None  # slots freed by the running evict(), in order

    def _pages(self, node: TreeNode) -> list[tuple[int, ...]]:
        """The node's pages, each named by the token prefix that ends with it."""
        path = path_tokens(self.cache, node)
        start = len(path) - len(node.key)
        return [tuple(path[:k]) for k in range(start + self.page_size, len(path) + 1, self.page_size)]

    def _touch(self, tokens: list[int], n: int) -> None:
        """Record an operation that read or wrote the first n tokens (call after it)."""
        self.clock += 1
        for node in self.cache.iter_nodes():
            first = self._pages(node)[0]
            if len(first) <= n and list(first) == tokens[: len(first)]:  # the operation went through it
                self.access.update(dict.fromkeys(self._pages(node), self.clock))

    def _last_access(self, node: TreeNode) -> int:
        return max(self.access[page] for page in self._pages(node))

    def _on_free(self, slots: np.ndarray) -> None:
        if self.evicted_log is not None:
            self.evicted_log.append(slots.tolist())
        in_tree = set(tree_slots(self.cache))
        locked = {s for n in self.cache.iter_nodes() if n.lock_ref > 0 for s in n.value.tolist()}
        for _, held_slots, _ in self.held:
            locked.update(held_slots.tolist())
        assert not in_tree & set(slots.tolist()), "freed slots still referenced by the tree"
        assert not locked & set(slots.tolist()), "eviction freed a locked node's slots"
        self.pool.free(slots)

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _finish(self, tokens: list[int], cached: np.ndarray) -> int:
        """What the engine does when a request ends: insert, free duplicates and the partial page."""
        slots = np.concatenate([cached, self.pool.alloc(len(tokens) - len(cached))])
        prefix_len = self.cache.insert(tokens, slots)
        n = self._aligned(len(tokens))
        self._touch(tokens, n)
        assert prefix_len >= len(cached)
        self.pool.free(slots[len(cached):prefix_len])  # our duplicates of tokens already cached
        self.pool.free(slots[n:])  # the uncached partial page
        got, _ = self.cache.match_prefix(tokens)
        self._touch(tokens, len(got))
        assert len(got) == n
        assert got[: len(cached)].tolist() == cached.tolist()  # our lock kept those slots alive
        assert got[prefix_len:].tolist() == slots[prefix_len:n].tolist()
        return prefix_len

    @rule(tokens=SEQS)
    def match_and_lock(self, tokens: list[int]) -> None:
        self._match_and_lock(self._long(tokens))

    def _match_and_lock(self, tokens: list[int]) -> None:
        expect = self.cache.match_len(tokens)
        slots, node = self.cache.match_prefix(tokens)
        self._touch(tokens, len(slots))
        assert len(slots) == expect and len(slots) % self.page_size == 0
        assert path_tokens(self.cache, node) == tokens[: len(slots)]  # node covers exactly the prefix
        self.cache.inc_lock_ref(node)
        self.held.append((tokens, slots, node))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), extra=SEQS)
    def match_extension(self, i: int, extra: list[int]) -> None:
        """A follow-up call of a running program: extends a running request's tokens."""
        self._match_and_lock(self.held[i % len(self.held)][0] + self._long(extra))

    @rule(tokens=SEQS)
    def insert_fresh(self, tokens: list[int]) -> None:
        self._finish(self._long(tokens), np.empty(0, np.int32))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), extra=SEQS)
    def finish_request(self, i: int, extra: list[int]) -> None:
        tokens, cached, node = self.held.pop(i % len(self.held))
        self._finish(tokens[: len(cached)] + self._long(extra), cached)
        self.cache.dec_lock_ref(node)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def abort_request(self, i: int) -> None:
        _, _, node = self.held.pop(i % len(self.held))
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        n *= self.run
        before = self.cache.evictable_size()
        # Snapshot the tree with the model's access times, then replay the eviction against it: each
        # freed leaf must be the least recently used unlocked leaf at that moment (a parent left childless
        # and unlocked joins the candidates), and it stops as soon as n tokens are freed.
        nodes = {node.uid: node for node in self.cache.iter_nodes()}
        last = {uid: self._last_access(node) for uid, node in nodes.items()}
        parent = {uid: node.parent.uid for uid, node in nodes.items()}
        children = {uid: {c.uid for c in node.children.values()} for uid, node in nodes.items()}
        locked = {uid for _, _, held in self.held for uid in (n.uid for n in self._ancestry(held))}
        owner = {s: uid for uid, node in nodes.items() for s in node.value.tolist()}
        size = {uid: len(node.key) for uid, node in nodes.items()}
        self.evicted_log = []
        try:
            freed = self.cache.evict(n)
        finally:
            log, self.evicted_log = self.evicted_log, None
        assert freed >= min(n, before)  # everything unlocked is reachable by the cascade
        assert freed <= before and self.cache.evictable_size() == before - freed
        candidates = {uid for uid in nodes if not children[uid] and uid not in locked}
        total = 0
        for slots in log:
            uid = owner[slots[0]]
            assert [owner[s] for s in slots] == [uid] * size[uid], "eviction freed part of a node"
            assert uid in candidates, "evicted a locked node or one with children"
            assert last[uid] == min(last[c] for c in candidates), (
                "evicted a leaf that is not the least recently used", last[uid], sorted(last[c] for c in candidates))
            assert total < n, "evicted more leaves than needed"
            total += size[uid]
            candidates.remove(uid)
            up = parent[uid]
            if up in children:
                children[up].discard(uid)
                if not children[up] and up not in locked:
                    candidates.add(up)
        assert total == freed

    def _ancestry(self, node: TreeNode) -> list[TreeNode]:
        out = []
        while node is not self.cache.root:
            out.append(node)
            node = node.parent
        return out

    @invariant()
    def tree_is_well_formed(self) -> None:
        paths = set()
        for node in self.cache.iter_nodes():
            assert node.parent is not None and node.parent.children[self.cache._child_key(node.key)] is node
            assert len(node.key) == len(node.value) > 0 and len(node.key) % self.page_size == 0
            firsts = [tuple(c.key[: self.page_size].tolist()) for c in node.children.values()]
            assert len(firsts) == len(set(firsts)), "siblings share a first token/page"
            path = tuple(path_tokens(self.cache, node))
            assert path not in paths
            paths.add(path)

    @invariant()
    def sizes_and_locks_match_the_model(self) -> None:
        expect_lock: dict[int, int] = {}
        for _, _, node in self.held:
            while node is not self.cache.root:
                expect_lock[node.uid] = expect_lock.get(node.uid, 0) + 1
                node = node.parent
        evictable = protected = 0
        for node in self.cache.iter_nodes():
            assert node.lock_ref == expect_lock.get(node.uid, 0) >= 0
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (self.cache.evictable_size(), self.cache.protected_size()) == (evictable, protected)
        assert self.cache.total_size() == evictable + protected == len(tree_slots(self.cache))

    @invariant()
    def every_slot_is_in_the_tree_or_freed(self) -> None:
        slots = tree_slots(self.cache)
        assert len(slots) == len(set(slots)), "a slot is referenced twice"
        assert set(slots) == self.pool.live, "a slot leaked or a freed slot is still in the tree"
        assert self.pool.live | self.pool.freed == set(range(self.pool.next))

    @invariant()
    def held_prefixes_are_intact(self) -> None:
        for tokens, slots, node in self.held:
            assert path_tokens(self.cache, node) == tokens[: len(slots)]
            assert path_slots(self.cache, node) == slots.tolist()  # read without touching LRU

    def teardown(self) -> None:
        for _, _, node in self.held:
            self.cache.dec_lock_ref(node)
        self.held.clear()
        self.cache.evict(10**9)
        assert self.cache.num_nodes() == 0 and self.cache.total_size() == 0
        assert not self.pool.live and self.pool.freed == set(range(self.pool.next))


class PagedRadixMachine(RadixMachine):
    page_size = 2


class AcceleratorPagedRadixMachine(RadixMachine):
    """Pages of 16, a GPU's and a TPU's default; runs of 5 make divergences fall inside and across pages."""

    page_size = 16
    run = 5


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = MACHINE_SETTINGS
TestPagedRadixMachine = PagedRadixMachine.TestCase
TestPagedRadixMachine.settings = MACHINE_SETTINGS
TestAcceleratorPagedRadixMachine = AcceleratorPagedRadixMachine.TestCase
TestAcceleratorPagedRadixMachine.settings = MACHINE_SETTINGS


# ---------------------------------------------------------------------------- flat state machine


class FlatMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool()
        self.cache = FlatCache(free_slots=self._on_free)
        self.held: list[tuple[list[int], np.ndarray, object]] = []

    def _held_slots(self) -> set[int]:
        return {s for e in self.cache.entries() for s in e.value.tolist()}

    def _on_free(self, slots: np.ndarray) -> None:
        assert not self._held_slots() & set(slots.tolist()), "freed slots still held by an entry"
        for _, cached, _ in self.held:
            assert not set(cached.tolist()) & set(slots.tolist()), "freed a locked entry's slots"
        self.pool.free(slots)

    @rule(tokens=SEQS)
    def match_and_lock(self, tokens: list[int]) -> None:
        slots, entry = self.cache.match_prefix(tokens)
        assert len(slots) == len(entry.key) and list(entry.key) == tokens[: len(slots)]
        self.cache.inc_lock_ref(entry)
        self.held.append((tokens, slots, entry))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), extra=SEQS)
    def match_extension(self, i: int, extra: list[int]) -> None:
        tokens, cached, _ = self.held[i % len(self.held)]
        self.match_and_lock(tokens[: len(cached)] + extra)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), extra=SEQS)
    def finish_request(self, i: int, extra: list[int]) -> None:
        tokens, cached, entry = self.held.pop(i % len(self.held))
        tokens = tokens[: len(cached)] + extra
        slots = np.concatenate([cached, self.pool.alloc(len(extra))])
        prefix_len = self.cache.insert(tokens, slots)
        assert prefix_len in (0, len(tokens))
        self.pool.free(slots[len(cached):prefix_len])
        if not tokens:  # empty sequences are not cached
            assert prefix_len == 0
        self.cache.dec_lock_ref(entry)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        before = self.cache.evictable_size()
        assert self.cache.evict(n) >= min(n, before)

    @invariant()
    def conservation(self) -> None:
        held = self._held_slots()
        assert held == self.pool.live and self.pool.live | self.pool.freed == set(range(self.pool.next))
        assert self.cache.total_size() == len(held)
        locked = {s for e in self.cache.entries() if e.lock_ref for s in e.value.tolist()}
        assert self.cache.protected_size() == len(locked)

    def teardown(self) -> None:
        for _, _, entry in self.held:
            self.cache.dec_lock_ref(entry)
        self.held.clear()
        self.cache.evict(10**9)
        assert not self.cache.entries() and self.cache.total_size() == 0 and not self.pool.live


TestFlatMachine = FlatMachine.TestCase
TestFlatMachine.settings = MACHINE_SETTINGS


# ---------------------------------------------------------------------------- radix examples


def test_split_on_partial_match() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert cache.num_nodes() == 1
    slots, node = cache.match_prefix([1, 2, 9])
    assert slots.tolist() == [10, 11] and node.key.tolist() == [1, 2]
    assert cache.num_nodes() == 2 and [c.key.tolist() for c in node.children.values()] == [[3, 4]]
    assert cache.match_len([1, 2, 3, 4, 5]) == 4 and cache.num_nodes() == 2  # read-only lookup


def test_insert_returns_cached_prefix_len_and_keeps_tree_slots() -> None:
    cache = RadixCache()
    assert cache.insert([1, 2, 3], [0, 1, 2]) == 0
    assert cache.insert([1, 2, 3, 4, 5], [7, 8, 9, 3, 4]) == 3
    assert cache.insert([1, 2], [5, 6]) == 2  # ends inside a node: nothing added, no split
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == [0, 1, 2, 3, 4]
    assert cache.total_size() == 5
    with pytest.raises(ValueError):
        cache.insert([1, 2], [1])


def test_lru_eviction_order_and_cascade() -> None:
    freed: list[list[int]] = []
    cache = RadixCache(free_slots=lambda s: freed.append(s.tolist()))
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [0, 1, 3])  # splits [1,2 | 3], adds [4]
    cache.insert([5, 6], [4, 5])
    cache.match_prefix([1, 2, 3])  # [1,2,3] is now the most recent; [1,2,4] is older than [5,6]
    assert cache.evict(1) == 1 and freed == [[3]]
    assert cache.evict(2) == 2 and freed[-1] == [4, 5]
    _, node = cache.match_prefix([1, 2])
    cache.inc_lock_ref(node)
    assert cache.evict(100) == 1 and freed[-1] == [2]  # [1,2] is locked: only its child goes
    assert cache.protected_size() == 2 and cache.evictable_size() == 0
    cache.dec_lock_ref(node)
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(node)
    assert cache.evict(100) == 2 and cache.total_size() == 0 and cache.evicted_tokens_total == 6
    with pytest.raises(ValueError):
        cache.inc_lock_ref(node)  # evicted handle


def test_page_size_two_matches_whole_pages() -> None:
    cache = RadixCache(page_size=2)
    assert cache.insert([1, 2, 3, 4, 5], [0, 1, 2, 3, 4]) == 0  # only 4 tokens (2 pages) stored
    assert cache.total_size() == 4
    assert cache.match_len([1, 2, 3, 9]) == 2  # the second page differs in its second token
    slots, node = cache.match_prefix([1, 2, 3, 9])
    assert slots.tolist() == [0, 1] and node.key.tolist() == [1, 2]
    assert cache.match_len([1, 2, 3]) == 2 and cache.match_len([1]) == 0
    assert cache.insert([1, 2, 3, 7], [5, 6, 7, 8]) == 2
    assert sorted(c.key.tolist() for c in node.children.values()) == [[3, 4], [3, 7]]


def test_reset_drops_tree_without_freeing() -> None:
    freed: list[np.ndarray] = []
    cache = RadixCache(free_slots=freed.append)
    cache.insert([1, 2], [0, 1])
    _, node = cache.match_prefix([1, 2])
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0 and cache.num_nodes() == 0 and not freed
    assert "root" in cache.format_tree()


# ---------------------------------------------------------------------------- flat examples


def test_flat_cache_reuses_whole_entries_only() -> None:
    freed: list[list[int]] = []
    cache = FlatCache(free_slots=lambda s: freed.append(s.tolist()))
    assert cache.insert([1, 2, 3], [0, 1, 2]) == 0
    assert cache.match_len([1, 2]) == 0  # a partial entry is no hit, and nothing is split
    assert cache.match_prefix([1, 2, 9])[0].tolist() == []
    slots, entry = cache.match_prefix([1, 2, 3, 4])
    assert slots.tolist() == [0, 1, 2] and entry.key == (1, 2, 3)
    assert cache.insert([1, 2, 4], [3, 4, 5]) == 0  # duplicates tokens [1, 2]: that is the ablation
    assert cache.insert([1, 2, 3], [6, 7, 8]) == 3  # existing key: caller frees its copy
    assert cache.total_size() == 6
    cache.inc_lock_ref(entry)
    assert cache.insert([1, 2, 3, 4], [0, 1, 2, 9]) == 0  # shares the locked entry's slots
    assert cache.protected_size() == 3 and cache.evictable_size() == 4
    slots2, entry2 = cache.match_prefix([1, 2, 3, 4, 5])
    assert entry2.key == (1, 2, 3, 4) and slots2.tolist() == [0, 1, 2, 9]  # longest entry wins
    assert cache.inc_lock_ref(entry2) == 1 and cache.protected_size() == 4  # shared slots count once
    cache.dec_lock_ref(entry2)
    assert cache.evict(100) == 4 and sorted(x for f in freed for x in f) == [3, 4, 5, 9]
    cache.dec_lock_ref(entry)
    assert cache.evict(100) == 3 and cache.total_size() == 0


# ---------------------------------------------------------------------------- schedule policies


@dataclasses.dataclass
class Req:
    token_ids: list[int]
    arrival_time: float
    max_new_tokens: int = 16


def test_lpm_puts_longest_cached_prefix_first() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    reqs = [Req([9, 9], 0.0), Req([1, 2, 7], 1.0), Req([1, 2, 3, 4, 5], 2.0), Req([1, 8], 3.0)]
    nodes_before = cache.num_nodes()
    out = order_waiting(reqs, "lpm", cache, now=4.0)
    assert [r.arrival_time for r in out] == [2.0, 1.0, 3.0, 0.0]
    assert cache.num_nodes() == nodes_before  # ordering must not split the tree
    big = [Req([1, 2, 3, 4], float(i)) for i in range(LPM_MAX_QUEUE + 1)][::-1]
    assert [r.arrival_time for r in order_waiting(big, "lpm", cache, now=0.0)] == sorted(
        r.arrival_time for r in big)  # long queues fall back to fcfs


def test_dfs_weight_groups_shared_prefixes() -> None:
    cache = RadixCache()
    cache.insert([5, 5], [0, 1])
    reqs = [Req([1, 2, 3], 0.0), Req([5, 5, 1], 1.0), Req([1, 2, 4], 2.0), Req([7], 3.0),
            Req([1, 2], 4.0), Req([5, 5, 2], 5.0), Req([1, 9], 6.0)]
    out = [r.token_ids for r in order_waiting(reqs, "dfs-weight", cache, now=10.0)]
    # The [1,...] subtree (4 requests) first; inside it [1,2] (prefix of two others) then its
    # children, then [1,9]; then the [5,5] group (2, cached); then [7].
    assert out == [[1, 2], [1, 2, 3], [1, 2, 4], [1, 9], [5, 5, 1], [5, 5, 2], [7]]
    # Equal weights: the cached group goes first.
    two = [Req([3, 1], 0.0), Req([3, 2], 1.0), Req([5, 5, 7], 2.0), Req([5, 5, 8], 3.0)]
    assert [r.token_ids[0] for r in order_waiting(two, "dfs-weight", cache, now=5.0)] == [5, 5, 3, 3]


def test_fcfs_lof_random_and_unknown() -> None:
    reqs = [Req([1], 2.0, 5), Req([2], 0.0, 50), Req([3], 1.0, 5)]
    assert [r.arrival_time for r in order_waiting(reqs, "fcfs", None, now=3.0)] == [0.0, 1.0, 2.0]
    assert [r.token_ids for r in order_waiting(reqs, "lof", None, now=3.0)] == [[2], [3], [1]]
    import random
    shuffled = order_waiting(reqs, "random", None, now=3.0, rng=random.Random(1))
    assert sorted(r.arrival_time for r in shuffled) == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="dfs-weight"):
        order_waiting(reqs, "sjf", None, now=3.0)


def test_starvation_guard_goes_first_in_arrival_order() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    reqs = [Req([9], 5.0), Req([8], 1.0), Req([1, 2, 3], 9.0), Req([7], 0.0)]
    out = order_waiting(reqs, "lpm", cache, now=10.0, starvation_s=6.0)
    assert [r.arrival_time for r in out] == [0.0, 1.0, 9.0, 5.0]


# ---------------------------------------------------------------------------- radix details (mutation testing)


def test_metrics_counters_and_lock_deltas() -> None:
    """Hit/query counters, and what inc/dec_lock_ref return, against hand-counted values."""
    cache = RadixCache()
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4, 5], [0, 1, 3, 4])  # splits [1,2 | 3], adds [4,5]
    slots, node = cache.match_prefix([1, 2, 4, 9])  # 4 looked up, 3 found
    assert slots.tolist() == [0, 1, 3] and slots.dtype == np.int32
    cache.match_prefix([7, 8])  # 2 looked up, none found
    assert (cache.query_tokens_total, cache.hit_tokens_total) == (6, 3)
    miss, _ = cache.match_prefix([9])
    assert miss.dtype == np.int32 and len(miss) == 0
    assert node.key.dtype == np.int32 and node.value.dtype == np.int32  # the documented node types
    # node is [4] (split from [4,5]) under [1,2]: locking moves 1 + 2 tokens to protected.
    assert cache.inc_lock_ref(node) == 3
    assert cache.inc_lock_ref(node) == 0  # already locked: nothing moves
    _, sibling = cache.match_prefix([1, 2, 3])
    assert cache.inc_lock_ref(sibling) == 1  # only [3]: [1,2] is locked already
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 1  # [4]; [1,2] stays locked by sibling
    assert cache.dec_lock_ref(sibling) == 3  # [3] and [1,2]
    assert cache.evictable_size() == 5 and cache.protected_size() == 0


def test_operation_times_accumulate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each operation adds (end - start) of a fake clock that ticks 1 s per reading."""
    import types

    from jsgl.radix import radix_cache

    ticks = iter(range(1000, 2000))
    monkeypatch.setattr(radix_cache, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    cache = RadixCache()
    cache.insert([1, 2], [0, 1])
    cache.insert([3], [2])
    cache.match_prefix([1, 2])
    cache.match_prefix([3])
    cache.match_prefix([4])
    cache.evict(1)
    cache.evict(5)
    cache.evict(0)  # nothing asked: returns before timing anything
    assert (cache.insert_time_s, cache.match_time_s, cache.evict_time_s) == (2.0, 3.0, 2.0)
    assert cache.time_s == 7.0


def test_insert_refreshes_recency_and_ending_inside_a_node_does_not_split() -> None:
    freed: list[list[int]] = []
    cache = RadixCache(free_slots=lambda s: freed.append(s.tolist()))
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([4], [3])
    assert cache.insert([1, 2, 3], [5, 6, 7]) == 3  # re-inserting makes [1,2,3] the most recent
    assert cache.evict(1) == 1 and freed == [[3]]  # [4] is the least recently used
    assert cache.insert([1, 2], [8, 9]) == 2 and cache.num_nodes() == 1  # ends inside: no split
    assert cache.evict(1) == 3 and freed[-1] == [0, 1, 2]
    assert cache.evict(0) == 0 and cache.evicted_tokens_total == 4


def test_error_messages() -> None:
    cache = RadixCache()
    with pytest.raises(ValueError, match="must be 1-D, got shape"):
        cache.match_prefix([[1, 2]])
    with pytest.raises(ValueError, match="same length"):
        cache.insert([1, 2], [1])
    cache.insert([1, 2], [0, 1])
    _, node = cache.match_prefix([1, 2])
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="reset with 2 tokens locked"):
        cache.reset()
    cache.dec_lock_ref(node)
    with pytest.raises(AssertionError, match="^dec_lock_ref on a node that is not locked$"):
        cache.dec_lock_ref(node)
    cache.evict(2)
    with pytest.raises(ValueError, match=r"^node is not in this tree \(evicted, or from before a reset\)$"):
        cache.inc_lock_ref(node)


def test_format_tree_by_hand() -> None:
    cache = RadixCache()
    cache.insert(list(range(1, 10)), list(range(9)))  # t=1: a 9-token node
    cache.insert(list(range(1, 18)), list(range(17)))  # t=2: touches it, adds an 8-token child
    cache.insert([20], [17])  # t=3
    _, node = cache.match_prefix(list(range(1, 10)))  # t=4
    cache.inc_lock_ref(node)
    assert cache.format_tree() == (
        "root (evictable=9, protected=9)\n"
        "  [1, 2, 3, 4, 5, 6, 7, 8]... len=9 lock=1 t=4\n"
        "    [10, 11, 12, 13, 14, 15, 16, 17] len=8 lock=0 t=2\n"
        "  [20] len=1 lock=0 t=3")
    assert repr(node) == "TreeNode(len=9, lock_ref=1, t=4)"
