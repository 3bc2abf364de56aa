"""A sequence's KV slots through its life: the cached prefix it starts from, the slots it grows into, what it
shares through the prefix cache as it computes, and where each slot goes when it leaves.

Every slot a sequence holds is either the prefix cache's (locked by the sequence's ``prefix_node`` while it runs)
or its own (from the allocator). Releasing hands the computed whole pages to the cache, which keeps the first copy
of a token run: our duplicates and everything else return to the allocator.
"""

from __future__ import annotations

import numpy as np

from jsgl.engine.kv_pool import SlotAllocator
from jsgl.engine.sequence import Sequence
from jsgl.radix.cache_base import PrefixCacheBase


class SequenceKV:
    def __init__(self, allocator: SlotAllocator, cache: PrefixCacheBase, match_fraction: float = 1.0):
        self.allocator = allocator
        self.cache = cache
        # Fig. 8(a)(b)'s hit-rate sweep: admission reuses only this leading fraction of each prefix match (the
        # rest is recomputed, and its duplicate slots freed when the sequence is inserted back).
        self.match_fraction = match_fraction

    def match_prefix(self, seq: Sequence) -> None:
        """Start ``seq`` from the longest cached prefix of its tokens (whole pages), locked while it holds it."""
        # Always compute at least the last token (its logits pick the next one), and recompute
        # from where prompt logprobs are wanted (they need the logits of the preceding position).
        limit = seq.num_tokens - 1
        if seq.wants_prompt_logprobs:
            limit = min(limit, max(seq.params.logprob_start_len - 1, 0))
        if self.match_fraction < 1.0:
            limit = min(limit, int(self.cache.match_len(seq.token_ids[:limit]) * self.match_fraction))
        slots, node = self.cache.match_prefix(seq.token_ids[:limit])
        page = self.allocator.page_size
        usable = len(slots) - len(slots) % page
        seq.slots, seq.prefix_node = np.asarray(slots[:usable], np.int32), node
        seq.num_computed = seq.num_cached = usable
        self.cache.inc_lock_ref(node)

    def grow(self, seq: Sequence, upto: int, evict: bool = True) -> bool:
        """Make sure ``seq`` has slots for positions [0, upto), evicting from the cache if short (unless not
        ``evict``: a speculative draft is not worth a cached prefix); False when they cannot be had (the engine's
        overlapped decode step asks for the position after the last token)."""
        missing = upto - len(seq.slots)
        if missing <= 0:
            return True
        new = self._alloc(missing) if evict else self.allocator.alloc(missing)
        if new is None:
            return False
        seq.slots = np.concatenate([seq.slots, new])
        return True

    def shrink(self, seq: Sequence, upto: int) -> None:
        """Give back ``seq``'s own slots past position ``upto`` (whole pages): a verify step's rejected drafts."""
        page = self.allocator.page_size
        keep = max(-(-upto // page) * page, seq.num_cached)
        if len(seq.slots) > keep:
            self.allocator.free(seq.slots[keep:])
            seq.slots = seq.slots[:keep]

    def _alloc(self, num: int) -> np.ndarray | None:
        if num <= 0:
            return np.zeros(0, np.int32)
        slots = self.allocator.alloc(num)
        if slots is None:
            self.cache.evict(num - self.allocator.num_free())
            slots = self.allocator.alloc(num)
        return slots

    def cache_computed_prefix(self, seq: Sequence) -> None:
        """Insert what an unfinished sequence has computed, so requests admitted later share it now.

        Where the tree already held some of those tokens (another request computed them first), our
        duplicate slots are freed and the sequence switches to the tree's copies.
        """
        keep = seq.num_computed - seq.num_computed % self.allocator.page_size
        if not self.cache.keeps_prefixes or keep <= seq.num_cached:
            return
        tokens = seq.token_ids[:keep]
        already = self.cache.insert(tokens, seq.slots[:keep])
        self.allocator.free(seq.slots[seq.num_cached: max(already, seq.num_cached)])
        slots, node = self.cache.match_prefix(tokens)
        seq.slots = np.concatenate([np.asarray(slots, np.int32), seq.slots[keep:]])
        self.cache.inc_lock_ref(node)
        if seq.prefix_node is not None:
            self.cache.dec_lock_ref(seq.prefix_node)
        seq.prefix_node, seq.num_cached = node, keep

    def release(self, seq: Sequence) -> None:
        """Give a sequence's KV back: what the prefix cache takes stays there, the rest goes to the allocator."""
        computed = seq.num_computed
        keep = computed - computed % self.allocator.page_size
        if keep > 0:
            already = self.cache.insert(seq.token_ids[:keep], seq.slots[:keep])
            # The cache already held [0, already); our own copies of [num_cached, already) duplicate it.
            self.allocator.free(seq.slots[seq.num_cached: max(already, seq.num_cached)])
        else:
            keep = seq.num_cached
        self.allocator.free(seq.slots[max(keep, seq.num_cached):])
        if seq.prefix_node is not None:
            self.cache.dec_lock_ref(seq.prefix_node)
        seq.slots = np.zeros(0, np.int32)
        seq.prefix_node = None
        seq.num_computed = seq.num_cached = 0
