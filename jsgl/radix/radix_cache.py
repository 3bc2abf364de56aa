"""RadixAttention's radix tree (SGLang paper §3 and App. A): host-side bookkeeping, no JAX.

The tree maps token-id sequences to the KV-pool slots that hold their keys and values. Each edge
(a ``TreeNode``) carries a run of token ids and, position for position, the pool slot of each token,
so a shared prefix is stored once and every request that starts with it reuses the same slots.

Ownership contract with the engine:

* ``match_prefix`` hands back the slots of the longest cached prefix and the node where it ends.
  The caller locks that node (``inc_lock_ref``) for as long as it reads those slots; a locked node
  and all its ancestors are never evicted.
* ``insert(tokens, slots)`` adds a finished (or chunk-prefilled) sequence. It never frees: it
  returns ``prefix_len``, the number of leading tokens the tree already held, and for that range the
  tree keeps its own slots. The caller frees its duplicates, i.e. ``slots[cached_len:prefix_len]``
  where ``cached_len`` is what its own ``match_prefix`` returned (the slots before ``cached_len``
  are the tree's own, which the caller's lock kept alive). Equivalently: the slots in
  ``slots[:prefix_len]`` that differ from the tree's.
* ``evict`` is the only place slots go back to the pool, through the ``free_slots`` callback.
* ``reset`` drops the tree WITHOUT calling ``free_slots`` (for tools and tests that keep no pool).
  The engine's flush instead evicts everything (``evict(total_size())``), which hands every slot
  back through ``free_slots``.

Paging (``page_size > 1``): every edge holds a whole number of pages, children are keyed by their
first page (a tuple), matching and splitting happen at page boundaries only, and ``match_prefix``
/ ``insert`` look at the page-aligned part of their input only. The trailing partial page of an
insert is NOT cached; its slots stay the caller's to free (``page_aligned_len`` says where it
starts). Slots stay per token, as in the pool.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from jsgl.radix.cache_base import PrefixCacheBase

ChildKey = int | tuple[int, ...]


def empty_slots() -> np.ndarray:
    return np.empty(0, dtype=np.int32)


class TreeNode:
    """One edge of the radix tree: a run of tokens and the pool slot of each."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access_time", "uid")
    _uids = itertools.count()

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: TreeNode | None) -> None:
        self.key = key  # token ids, np.int32
        self.value = value  # pool slots, np.int32, len(value) == len(key)
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent = parent  # None for the root and for evicted nodes
        # Number of live locks held on this node or any descendant (locks propagate to the root).
        self.lock_ref = 0
        self.last_access_time = 0
        self.uid = next(TreeNode._uids)  # heap tie-break, so nodes themselves are never compared

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, t={self.last_access_time})"


class RadixCache(PrefixCacheBase):
    """Prefix cache over KV-pool slots with LRU eviction of unlocked leaves."""

    def __init__(self, page_size: int = 1, free_slots: Callable[[np.ndarray], None] | None = None) -> None:
        super().__init__(page_size, free_slots)
        self._new_tree()

    def _new_tree(self) -> None:
        self.root = TreeNode(empty_slots(), empty_slots(), None)
        self.root.lock_ref = 1  # the root is never evictable; its count is not part of the sizes
        self._evictable = 0
        self._protected = 0

    def _aligned(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(tokens, dtype=np.int32)
        if arr.ndim != 1:
            raise ValueError(f"token sequence must be 1-D, got shape {arr.shape}")
        return arr[: self.page_aligned_len(len(arr))]

    def _child_key(self, tokens: np.ndarray) -> ChildKey:
        if self.page_size == 1:
            return int(tokens[0])
        return tuple(tokens[: self.page_size].tolist())

    def _common_len(self, a: np.ndarray, b: np.ndarray) -> int:
        """Length of the common prefix of a and b, rounded down to whole pages."""
        n = min(len(a), len(b))
        diff = np.flatnonzero(a[:n] != b[:n])
        k = int(diff[0]) if diff.size else n
        return k - k % self.page_size

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut child after k tokens; return the new upper node (which takes child's place)."""
        parent = child.parent
        assert parent is not None and 0 < k < len(child.key)
        upper = TreeNode(child.key[:k], child.value[:k], parent)
        # upper has exactly child's descendants plus child, so it carries the same lock count;
        # sizes do not change because the same tokens stay under the same lock state.
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        parent.children[self._child_key(upper.key)] = upper
        child.key = child.key[k:]
        child.value = child.value[k:]
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        return upper

    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from node up to (excluding) the root; rejects evicted or foreign nodes."""
        path = []
        while node is not self.root:
            if node.parent is None:
                raise ValueError("node is not in this tree (evicted, or from before a reset)")
            path.append(node)
            node = node.parent
        return path

    def iter_nodes(self) -> Iterator[TreeNode]:
        """All nodes except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def match_prefix(self, tokens: Sequence[int] | np.ndarray) -> tuple[np.ndarray, TreeNode]:
        """Slots of the longest cached (page-aligned) prefix and the node where it ends.

        Splits the last node if the match ends inside it, so the returned node covers exactly the
        prefix and locking it protects nothing more. Marks the whole path as just used.
        """
        t0 = time.perf_counter()
        key = self._aligned(tokens)
        now = next(self._clock)
        node = self.root
        node.last_access_time = now
        parts: list[np.ndarray] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(self._child_key(key[pos:]))
            if child is None:
                break
            k = self._common_len(child.key, key[pos:])
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access_time = now
            parts.append(child.value)
            pos += k
            node = child
        self.query_tokens_total += len(key)
        self.hit_tokens_total += pos
        slots = np.concatenate(parts) if parts else empty_slots()
        self.match_time_s += time.perf_counter() - t0
        return slots, node

    def match_len(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Length of the cached prefix, read-only: no split, no LRU update (for the scheduler)."""
        key = self._aligned(tokens)
        node = self.root
        pos = 0
        while pos < len(key):
            child = node.children.get(self._child_key(key[pos:]))
            if child is None:
                break
            k = self._common_len(child.key, key[pos:])
            pos += k
            if k < len(child.key):
                break
            node = child
        return pos

    def continuation(self, tokens: Sequence[int] | np.ndarray, max_tokens: int) -> list[int]:
        key = np.asarray(tokens, dtype=np.int32)
        node, pos, within = self.root, 0, 0  # the walk stands ``within`` tokens into ``node``'s run
        while pos < len(key):
            rest = key[pos:]
            if len(rest) >= self.page_size:
                child = node.children.get(self._child_key(rest))
            else:  # a partial page: the most recently used child whose first page starts with it
                child = max((c for c in node.children.values() if np.array_equal(c.key[:len(rest)], rest)),
                            key=lambda c: c.last_access_time, default=None)
            if child is None:
                return []
            n = min(len(child.key), len(rest))
            if not np.array_equal(child.key[:n], rest[:n]):
                return []
            node, pos, within = child, pos + n, n
        out: list[int] = []
        while len(out) < max_tokens:
            out.extend(node.key[within: within + max_tokens - len(out)].tolist())
            if not node.children:
                break
            node, within = max(node.children.values(), key=lambda c: c.last_access_time), 0
        return out

    def insert(self, tokens: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray) -> int:
        """Cache tokens -> slots; return how many leading tokens were already cached.

        Frees nothing: for ``[:prefix_len]`` the tree keeps its own slots and the caller frees its
        duplicates (see the module docstring). With paging, only the page-aligned part is stored.
        """
        t0 = time.perf_counter()
        key = np.asarray(tokens, dtype=np.int32)
        value = np.asarray(slots, dtype=np.int32)
        if key.shape != value.shape or key.ndim != 1:
            raise ValueError(f"tokens and slots must be 1-D, same length: {key.shape} vs {value.shape}")
        n = self.page_aligned_len(len(key))
        now = next(self._clock)
        node = self.root
        node.last_access_time = now
        pos = 0
        while pos < n:
            ck = self._child_key(key[pos:n])
            child = node.children.get(ck)
            if child is None:
                # Copies: the tree must not alias arrays the caller may reuse.
                leaf = TreeNode(key[pos:n].copy(), value[pos:n].copy(), node)
                leaf.last_access_time = now
                node.children[ck] = leaf
                self._evictable += n - pos
                break
            k = self._common_len(child.key, key[pos:n])
            if k < len(child.key):
                if pos + k == n:  # the new sequence ends inside child: nothing to add, no split
                    child.last_access_time = now
                    pos = n
                    break
                child = self._split(child, k)  # diverges inside child: make a branch point
            child.last_access_time = now
            pos += k
            node = child
        self.insert_time_s += time.perf_counter() - t0
        return pos

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens (whole leaves, least recently used first) if that many are
        evictable; return how many were freed (may exceed the request by part of one leaf)."""
        if num_tokens <= 0:
            return 0
        t0 = time.perf_counter()
        heap = [(n.last_access_time, n.uid, n) for n in self.iter_nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key)]
            node.parent = None  # marks the node evicted; stale handles then fail loudly
            self._evictable -= len(node.key)
            freed += len(node.key)
            self.free_slots(node.value)
            # Cascade: a parent left childless and unlocked is now an LRU candidate itself.
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.uid, parent))
        self.evicted_tokens_total += freed
        self.evict_time_s += time.perf_counter() - t0
        return freed

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Protect node and its ancestors from eviction; return tokens moved to protected."""
        delta = 0
        for n in self._path_to_root(node):
            if n.lock_ref == 0:
                self._evictable -= len(n.key)
                self._protected += len(n.key)
                delta += len(n.key)
            n.lock_ref += 1
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one inc_lock_ref; return tokens that became evictable again."""
        path = self._path_to_root(node)
        # Check before touching anything so a double unlock cannot leave counts half-updated.
        if any(n.lock_ref <= 0 for n in path):
            raise AssertionError("dec_lock_ref on a node that is not locked")
        delta = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += len(n.key)
                self._protected -= len(n.key)
                delta += len(n.key)
        return delta

    def reset(self, force: bool = False) -> None:
        """Drop the whole tree without calling free_slots (the engine's flush resets the pool).

        Refuses while any node is locked (a running request still reads those slots) unless
        force=True. Old node handles become invalid; counters are kept.
        """
        if self._protected and not force:
            raise RuntimeError(f"reset with {self._protected} tokens locked by running requests")
        self._new_tree()

    def num_nodes(self) -> int:
        return sum(1 for _ in self.iter_nodes())

    def format_tree(self, max_tokens: int = 8) -> str:
        lines = [f"root (evictable={self._evictable}, protected={self._protected})"]
        stack = [(c, 1) for c in reversed(list(self.root.children.values()))]
        while stack:
            node, depth = stack.pop()
            toks = node.key[:max_tokens].tolist()
            more = "..." if len(node.key) > max_tokens else ""
            lines.append(f"{'  ' * depth}{toks}{more} len={len(node.key)} lock={node.lock_ref} "
                         f"t={node.last_access_time}")
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        return "\n".join(lines)
