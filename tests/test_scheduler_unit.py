"""Scheduler, step by step, on hand-worked scenarios: the real Scheduler, SlotAllocator, RadixCache and Sequence,
with the forward faked (each step advances ``num_computed`` by the chunk and appends a token where the batch
samples, as OutputProcessor.absorb does). Every expectation below is worked out by hand from the policy the
scheduler documents: extend steps first but never twice in a row while sequences decode, chunked prefill within
``chunk_size``, in-batch deferral of a shared uncached prefix, the attention budget and padding limit, retraction
of the newest request, and the KV bookkeeping (what goes to the prefix cache, what back to the allocator).

test_scheduler_state_machine.py checks the invariants over random runs; this file pins the exact decisions.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from jsgl.engine.detokenizer import IncrementalDetokenizer
from jsgl.engine.kv_pool import SlotAllocator
from jsgl.engine.model_runner import bucket
from jsgl.engine.request import FinishReason, SamplingParams
from jsgl.engine.scheduler import (
    FILL_SHARED_RATIO,
    IN_BATCH_PREFIX_MIN,
    MAX_DEFERRED_SCAN,
    PADDING_FACTOR,
    Batch,
    Scheduler,
)
from jsgl.engine.sequence import Sequence
from jsgl.radix.no_cache import NoPrefixCache
from jsgl.radix.radix_cache import RadixCache

TOKEN = 7  # the "sampled" token


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def make(capacity=64, page=1, cache="radix", chunk_size=32, max_running=8, budget=1 << 40, attention_bytes=None,
         order=None, padded=True, max_context=4096, match_fraction=1.0, **policy):
    alloc = SlotAllocator(capacity + page, page)
    prefix = {"radix": lambda: RadixCache(page, free_slots=alloc.free), "none": lambda: NoPrefixCache(page),
              "null": lambda: None}[cache]()
    extra = {} if padded else {"padded_attention": False}  # padded attention is the default
    sched = Scheduler(alloc, prefix, max_running=max_running, chunk_size=chunk_size, max_context=max_context,
                      attention_budget_bytes=budget, attention_bytes=attention_bytes or (lambda *a: 0),
                      order_waiting=order, match_fraction=match_fraction, **extra, **policy)
    return sched, alloc


def seq(prompt, max_new=8, arrival=0.0, rid="r", **params):
    return Sequence(rid=rid, prompt_ids=list(prompt), params=SamplingParams(max_new_tokens=max_new, ignore_eos=True,
                                                                            **params),
                    detok=IncrementalDetokenizer(CharTokenizer(), []), seed=0, stop_ids=set(), arrival_time=arrival)


def step(sched, expect=True):
    """EngineLoop.step with a fake forward: absorb each row, retire finished requests, then after_step."""
    batch = sched.schedule()
    if batch is None:
        assert not expect, "nothing scheduled"
        return None
    for i, (s, c) in enumerate(zip(batch.seqs, batch.chunks)):
        s.num_computed += c
        if batch.samples(i) and not s.finished:
            s.output_ids.append(TOKEN)
            if len(s.output_ids) >= s.max_new_tokens:
                s.finish_reason = FinishReason.LENGTH
    for s in batch.seqs:
        if s.finished:
            sched.drop(s)
    sched.after_step(batch)
    return batch


def shape(batch):
    return batch.is_decode, [s.rid for s in batch.seqs], batch.chunks, batch.sampling


def private_slots(sched):
    return sum(len(s.slots) - s.num_cached for s in [*sched.prefilling, *sched.running])


def assert_pool_accounted(sched, alloc):
    """Every usable slot is free, in the prefix cache, or a live sequence's own."""
    assert alloc.num_free() + sched.cache.total_size() + private_slots(sched) == alloc.capacity


# ------------------------------------------------------------------------------------------ basics
def test_batch_samples_only_rows_that_reach_the_end_and_keeps_that_after_the_step():
    a, b = seq(range(10), rid="a"), seq(range(10), rid="b")
    a.num_computed = 6
    batch = Batch(False, [a, b], [4, 3])
    assert batch.sampling == [True, False] and batch.samples(0) and not batch.samples(1)
    a.num_computed, a.output_ids = 10, [1, 2, 3]  # absorbing (a jump-forward) changes the sequence
    assert batch.samples(0)


def test_token_limit_is_the_smaller_of_context_and_pool():
    assert make(capacity=64, max_context=4096)[0].token_limit == 64
    assert make(capacity=64, max_context=50)[0].token_limit == 50


def test_queues_and_work():
    sched, _ = make(chunk_size=4)
    assert not sched.has_work() and sched.num_active() == 0 and sched.schedule() is None
    assert sched.stats.steps == 0
    a, b = seq(range(10), rid="a"), seq(range(50, 53), rid="b")
    sched.add(a)
    sched.add(b)
    assert sched.waiting == [a, b] and sched.has_work() and sched.num_active() == 0
    step(sched)  # a: 4 of 10 (the budget), prefilling
    assert sched.prefilling == [a] and sched.waiting == [b] and sched.num_active() == 1 and sched.has_work()
    step(sched)  # a: 4 more
    step(sched)  # a: its last 2, samples; b: 2 of 3
    assert sched.running == [a] and sched.prefilling == [b] and sched.num_active() == 2
    sched.drop(a)
    sched.drop(b)
    assert not sched.has_work() and sched.num_active() == 0


def test_null_cache_means_no_prefix_cache():
    sched, _ = make(cache="null", page=4)
    assert isinstance(sched.cache, NoPrefixCache) and sched.cache.page_size == 4


# ---------------------------------------------------------------------------------- chunked prefill
def test_chunked_prefill_then_decode_with_exact_stats():
    sched, alloc = make(chunk_size=16, cache="none")
    a = seq(range(40), max_new=3, rid="a")
    sched.add(a)
    assert shape(step(sched)) == (False, ["a"], [16], [False])
    assert (a.num_computed, len(a.slots)) == (16, 16) and sched.prefilling == [a]
    assert sched.has_work() and not sched.waiting and not sched.running  # a prefill in progress is work
    # No request decodes yet, so extend steps may follow each other.
    assert shape(step(sched)) == (False, ["a"], [16], [False])
    assert shape(step(sched)) == (False, ["a"], [8], [True])
    assert sched.running == [a] and not sched.prefilling and a.output_ids == [TOKEN]
    assert shape(step(sched)) == (True, ["a"], [1], [True])
    assert len(a.slots) == 41 and alloc.num_free() == 64 - 41
    assert sched.has_work() and not sched.waiting and not sched.prefilling
    assert shape(step(sched)) == (True, ["a"], [1], [True])
    assert a.finish_reason == FinishReason.LENGTH and not sched.has_work()
    assert alloc.num_free() == 64  # no prefix cache: everything back to the allocator
    s = sched.stats
    assert (s.steps, s.extend_steps, s.decode_steps, s.batched_requests) == (5, 3, 2, 5)
    assert (s.prompt_tokens, s.cached_tokens, s.computed_prefill_tokens, s.retractions) == (40, 0, 40, 0)


def test_last_chunk_of_one_token():
    sched, _ = make(chunk_size=16, cache="none")
    a = seq(range(33), rid="a")
    sched.add(a)
    assert [step(sched).chunks for _ in range(3)] == [[16], [16], [1]]
    assert sched.running == [a] and a.output_ids == [TOKEN]


def test_budget_is_shared_and_extends_alternate_with_decodes():
    sched, _ = make(chunk_size=32, cache="none")
    a, b, c = seq(range(20), rid="a"), seq(range(20), rid="b"), seq(range(5), rid="c")
    for s in (a, b, c):
        sched.add(s)
    # a takes 20 of the 32 tokens, b the other 12; c waits (no budget left).
    assert shape(step(sched)) == (False, ["a", "b"], [20, 12], [True, False])
    assert sched.waiting == [c] and sched.running == [a] and sched.prefilling == [b]
    # a decodes: never two extend steps in a row while a request decodes.
    assert shape(step(sched)) == (True, ["a"], [1], [True])
    # b's prefill goes on first, then c is admitted with what is left of the budget.
    assert shape(step(sched)) == (False, ["b", "c"], [8, 5], [True, True])
    assert shape(step(sched)) == (True, ["a", "b", "c"], [1, 1, 1], [True] * 3)
    assert sched.stats.computed_prefill_tokens == 45 and sched.stats.prompt_tokens == 45
    # No more waiting work: decode after decode.
    assert shape(step(sched)) == (True, ["a", "b", "c"], [1, 1, 1], [True] * 3)
    assert sched.stats.extend_steps == 2 and sched.stats.decode_steps == 3


def test_max_running_caps_admission():
    sched, _ = make(max_running=2, cache="none")
    for r in "abc":
        sched.add(seq(range(4), rid=r))
    assert shape(step(sched))[1] == ["a", "b"]
    assert [s.rid for s in sched.waiting] == ["c"]
    step(sched)  # decode a, b
    assert shape(step(sched)) == (True, ["a", "b"], [1, 1], [True, True])  # still full: c keeps waiting


def test_order_waiting_hook_picks_admission_order():
    seen = []

    def reverse(waiting):
        seen.append([s.rid for s in waiting])
        return waiting[::-1]

    sched, _ = make(order=reverse, max_running=2, cache="none")
    for r in "abc":
        sched.add(seq(range(4), rid=r))
    assert shape(step(sched))[1] == ["c", "b"]
    assert seen == [["a", "b", "c"]] and [s.rid for s in sched.waiting] == ["a"]


def test_a_prompt_that_does_not_fit_the_pool_now_waits_without_kv():
    sched, alloc = make(capacity=40, chunk_size=64, cache="none")
    a, b = seq(range(30), rid="a"), seq(range(30), rid="b")
    sched.add(a)
    sched.add(b)
    assert shape(step(sched)) == (False, ["a"], [30], [True])
    assert sched.waiting == [b] and len(b.slots) == 0 and b.num_computed == 0 and not b.admitted
    assert alloc.num_free() == 10 and sched.stats.prompt_tokens == 30


def test_prefill_of_an_admitted_request_stops_where_the_pool_runs_out():
    sched, alloc = make(capacity=24, chunk_size=16, cache="none")
    a, b = seq(range(4), rid="a", max_new=30), seq(range(30), rid="b")
    sched.add(a)
    sched.add(b)
    assert shape(step(sched)) == (False, ["a", "b"], [4, 12], [True, False])
    assert shape(step(sched)) == (True, ["a"], [1], [True])  # a: 5 slots, b: 12
    # b's next 16 need 16 slots, 7 are free: the prefill loop stops, nothing is admitted; a decodes instead.
    assert shape(step(sched)) == (True, ["a"], [1], [True])
    assert (b.num_computed, len(b.slots), alloc.num_free()) == (12, 12, 6)
    # A short request still fits beside b's stalled prefill: it is admitted although b waits.
    c = seq(range(100, 105), rid="c")
    sched.add(c)
    assert shape(step(sched)) == (False, ["c"], [5], [True])
    assert sched.prefilling == [b] and b.num_computed == 12 and alloc.num_free() == 1


# ------------------------------------------------------------------------------ attention limits
def test_attention_budget_sees_the_batch_shape_and_defers_what_does_not_fit():
    calls = []

    def attention_bytes(items, max_new, max_len):
        calls.append((items, max_new, max_len))
        return items * max_new * max_len

    sched, alloc = make(chunk_size=64, attention_bytes=attention_bytes, budget=2 * 20 * 30, cache="none")
    a, b, c = seq(range(30), rid="a"), seq(range(20), rid="b"), seq(range(5), rid="c")
    for s in (a, b, c):
        sched.add(s)
    # a alone always fits; a+b: 2 items, longest chunk 30, longest row 30 -> 1800 > 1200: b waits, and so c.
    assert shape(step(sched)) == (False, ["a"], [30], [True])
    assert calls == [(2, 30, 30)]
    assert sched.waiting == [b, c] and len(b.slots) == 0 and alloc.num_free() == 34


def test_attention_budget_is_inclusive():
    sched, _ = make(chunk_size=64, attention_bytes=lambda items, new, length: items * new * length,
                    budget=2 * 30 * 30, cache="none")
    for r, n in (("a", 30), ("b", 20), ("c", 5)):
        sched.add(seq([ord(r)] * n, rid=r))
    # a+b: exactly the budget, admitted; a+b+c: 3 x 30 x 30 over it.
    assert shape(step(sched))[1] == ["a", "b"] and [s.rid for s in sched.waiting] == ["c"]


def test_attention_budget_max_len_counts_the_cached_prefix():
    calls = []

    def attention_bytes(items, max_new, max_len):
        calls.append((items, max_new, max_len))
        return 0

    sched, _ = make(chunk_size=64, attention_bytes=attention_bytes)
    shared = [1] * 20
    sched.add(seq(shared + [2], rid="a", max_new=1))
    step(sched)  # a computes and caches its 21 tokens, then finishes
    c, b = seq([9] * 6, rid="c"), seq(shared + [3, 4, 5], rid="b")
    sched.add(c)
    sched.add(b)
    calls.clear()
    assert shape(step(sched)) == (False, ["c", "b"], [6, 3], [True, True])
    assert b.cached_tokens_reported == 20
    # b's check: 2 items, longest chunk 6 (c's), longest row 23 (b's own: 20 cached + 3 new).
    assert calls == [(2, 6, 23)]


def test_padded_attention_keeps_short_chunks_apart_from_a_long_one():
    sched, _ = make(capacity=256, chunk_size=256)
    a, b, c = seq([1] * 100, rid="a"), seq([2], rid="b"), seq([3], rid="c")
    for s in (a, b, c):
        sched.add(s)
    # a+b: 2 x 128 padded rows = 2 x bucket(101, 16): exactly the limit, fits.
    # a+b+c: 4 x 128 = 512 > 2 x bucket(102, 16) = 256: c waits for the next step.
    assert bucket(2) * bucket(100, 16) == PADDING_FACTOR * bucket(101, 16)
    assert shape(step(sched)) == (False, ["a", "b"], [100, 1], [True, True])
    assert [s.rid for s in sched.waiting] == ["c"]


def test_padding_limit_uses_the_longest_chunk_whichever_comes_first():
    sched, _ = make(capacity=256, chunk_size=256)
    a, b, c = seq([2], rid="a"), seq([3], rid="b"), seq([1] * 100, rid="c")
    for s in (a, b, c):
        sched.add(s)
    # a+b: 2 x 16 <= 2 x 16. a+b+c: 4 x 128 > 2 x bucket(102, 16) = 256: c waits although it comes last.
    assert shape(step(sched)) == (False, ["a", "b"], [1, 1], [True, True])
    assert [s.rid for s in sched.waiting] == ["c"]


def test_ragged_attention_mixes_chunks_of_any_length():
    sched, _ = make(capacity=256, chunk_size=256, padded=False)
    for r, n in (("a", 100), ("b", 1), ("c", 1)):
        sched.add(seq([ord(r)] * n, rid=r))
    assert shape(step(sched)) == (False, ["a", "b", "c"], [100, 1, 1], [True, True, True])


# ---------------------------------------------------------------------------------- prefix cache
def test_admission_takes_the_cached_prefix_and_counts_it_once():
    sched, alloc = make(chunk_size=64)
    shared = list(range(30))
    a = seq(shared + [40], rid="a", max_new=1)
    sched.add(a)
    step(sched)
    assert a.finished and sched.cache.total_size() == 31 and alloc.num_free() == 64 - 31
    b = seq(shared + [41, 42], rid="b")
    sched.add(b)
    assert shape(step(sched)) == (False, ["b"], [2], [True])
    assert b.cached_tokens_reported == 30 and b.num_cached == 32  # 32 once its own tokens are cached
    # b holds its prefix locked (the shared 30, then its own 2 once computed); a's last token is evictable.
    assert (sched.cache.total_size(), sched.cache.protected_size()) == (33, 32)
    s = sched.stats
    assert (s.prompt_tokens, s.cached_tokens, s.computed_prefill_tokens) == (31 + 32, 30, 31 + 2)
    assert_pool_accounted(sched, alloc)
    step(sched)  # decode b
    c = seq(shared + [41, 50], rid="c")  # b's prompt is cached too now: 31 tokens hit
    sched.add(c)
    assert shape(step(sched)) == (False, ["c"], [1], [True])
    assert c.cached_tokens_reported == 31
    assert (s.prompt_tokens, s.cached_tokens, s.computed_prefill_tokens) == (31 + 32 + 32, 30 + 31, 31 + 2 + 1)
    assert_pool_accounted(sched, alloc)


@pytest.mark.parametrize("fraction, hit", [(1.0, 30), (0.5, 15), (0.25, 7), (0.0, 0)])
def test_a_match_fraction_reuses_only_the_leading_part_of_each_match(fraction, hit):
    """Fig. 8(a)(b)'s sweep: the rest of the match is recomputed; its duplicate slots go back to the pool."""
    sched, alloc = make(chunk_size=64, match_fraction=fraction)
    shared = list(range(30))
    a = seq(shared + [40], rid="a", max_new=1)
    sched.add(a)
    step(sched)
    b = seq(shared + [41, 42], rid="b", max_new=1)
    sched.add(b)
    assert shape(step(sched)) == (False, ["b"], [32 - hit], [True])
    assert b.cached_tokens_reported == hit and sched.stats.cached_tokens == hit
    assert sched.cache.total_size() == 33  # the recomputed prefix was the tree's already: stored once
    assert_pool_accounted(sched, alloc)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched, _ = make(chunk_size=64)
    prompt = list(range(12))
    sched.add(seq(prompt, rid="a", max_new=1))
    step(sched)
    b = seq(prompt, rid="b")
    sched.add(b)
    assert shape(step(sched)) == (False, ["b"], [1], [True])
    assert b.cached_tokens_reported == 11


@pytest.mark.parametrize(("start", "cached"), [(-1, 11), (5, 4), (1, 0), (0, 0)])
def test_prompt_logprobs_recompute_from_the_first_position_asked_for(start, cached):
    """Prompt token j's logprob comes from position j-1: those positions are computed even when cached."""
    sched, _ = make(chunk_size=64)
    prompt = list(range(12))
    sched.add(seq(prompt, rid="a", max_new=1))
    step(sched)
    b = seq(prompt, rid="b", return_logprob=True, logprob_start_len=start)
    sched.add(b)
    assert shape(step(sched)) == (False, ["b"], [12 - cached], [True])
    assert b.cached_tokens_reported == cached


def test_cached_prefix_is_page_aligned():
    sched, alloc = make(chunk_size=64, page=4)
    prompt = list(range(14))
    sched.add(seq(prompt, rid="a", max_new=1))
    step(sched)
    assert sched.cache.total_size() == 12  # 14 computed: the whole pages only
    assert alloc.num_free() == 64 - 12
    b = seq(prompt + [50], rid="b")
    sched.add(b)
    assert shape(step(sched)) == (False, ["b"], [3], [True])
    assert b.cached_tokens_reported == 12 and len(b.slots) == 16


def test_prefill_chunks_enter_the_cache_as_they_are_computed():
    sched, alloc = make(chunk_size=10, page=4)
    a = seq(list(range(30)), rid="a")
    sched.add(a)
    step(sched)
    # 10 computed, 8 of them whole pages: cached now (a request admitted next step shares them).
    assert (a.num_cached, sched.cache.total_size(), sched.cache.protected_size()) == (8, 8, 8)
    slots, _ = sched.cache.match_prefix(a.token_ids[:8])
    assert slots.tolist() == a.slots[:8].tolist()
    step(sched)
    assert (a.num_cached, sched.cache.total_size(), sched.cache.protected_size()) == (20, 20, 20)
    assert_pool_accounted(sched, alloc)
    sched.drop(a)  # each chunk moved a's lock to the longer prefix: none is left behind
    assert (sched.cache.total_size(), sched.cache.protected_size(), sched.cache.evictable_size()) == (20, 0, 20)
    sched.cache.evict(20)
    assert alloc.num_free() == 64


def test_decode_steps_do_not_insert_into_the_cache():
    sched, alloc = make(chunk_size=64)
    a = seq(list(range(8)), rid="a", max_new=5)
    sched.add(a)
    step(sched)
    assert sched.cache.total_size() == 8
    step(sched)
    step(sched)
    assert a.num_computed == 10 and sched.cache.total_size() == 8 and a.num_cached == 8
    assert_pool_accounted(sched, alloc)


def test_duplicate_prefill_switches_to_the_trees_copy_and_frees_its_own():
    sched, alloc = make(chunk_size=64)
    n = IN_BATCH_PREFIX_MIN - 1
    prompt = list(range(n))  # shared by both but under IN_BATCH_PREFIX_MIN: computed twice in one batch
    a, b = seq(prompt, rid="a"), seq(prompt, rid="b")
    sched.add(a)
    sched.add(b)
    assert shape(step(sched)) == (False, ["a", "b"], [n, n], [True, True])
    assert b.slots.tolist() == a.slots.tolist() and b.num_cached == n
    assert alloc.num_free() == 64 - n and sched.cache.total_size() == n
    assert sched.cache.protected_size() == n
    step(sched)  # decode: each its own slot for its next position
    assert alloc.num_free() == 64 - n - 2 and a.slots[n] != b.slots[n]
    assert_pool_accounted(sched, alloc)


def test_duplicate_prefill_of_a_partly_cached_request_frees_only_its_own_copies():
    sched, alloc = make(chunk_size=64)
    base = list(range(10))
    sched.add(seq(base + [90], rid="p", max_new=1))
    step(sched)  # caches 11 tokens
    n = IN_BATCH_PREFIX_MIN - 1  # uncached and shared, under the deferral threshold
    a, b = seq(base + [91] * n, rid="a"), seq(base + [91] * n, rid="b")
    sched.add(a)
    sched.add(b)
    assert shape(step(sched)) == (False, ["a", "b"], [n, n], [True, True])
    assert a.num_cached == b.num_cached == 10 + n and b.slots.tolist() == a.slots.tolist()
    assert sched.cache.total_size() == 11 + n and alloc.num_free() == 64 - 11 - n
    assert_pool_accounted(sched, alloc)


# ---------------------------------------------------------------------------------- in-batch deferral
@pytest.mark.parametrize(("shared", "deferred"), [(IN_BATCH_PREFIX_MIN, True), (IN_BATCH_PREFIX_MIN - 1, False)])
def test_in_batch_deferral_threshold(shared, deferred):
    sched, alloc = make(chunk_size=128)
    a, b = seq([1] * shared + [2], rid="a"), seq([1] * shared + [3], rid="b")
    sched.add(a)
    sched.add(b)
    batch = step(sched)
    if deferred:
        assert shape(batch)[1] == ["a"] and sched.waiting == [b]
        assert len(b.slots) == 0 and b.prefix_node is None and not b.admitted
        # Next step the tree has the prefix: b computes its last token only, after a decode.
        assert shape(step(sched)) == (True, ["a"], [1], [True])
        assert shape(step(sched)) == (False, ["b"], [1], [True])
        assert b.cached_tokens_reported == shared and sched.stats.cached_tokens == shared
    else:
        assert shape(batch) == (False, ["a", "b"], [shared + 1] * 2, [True, True])
    assert_pool_accounted(sched, alloc)


def test_leftover_budget_goes_to_a_request_sharing_only_a_short_header():
    """MMLU's subjects share a short header: a step's leftover budget goes to another subject's prompt, which
    computes the header again, instead of idling; one that shares much of what it brings still waits."""
    sched, alloc = make(capacity=1024, chunk_size=128, padded=False)
    m = IN_BATCH_PREFIX_MIN
    a = seq([7] * m + [1] * 60, rid="a")  # m + 60 tokens
    b = seq([7] * m + [2] * (FILL_SHARED_RATIO * m), rid="b")  # shares m of its (ratio + 1) m new tokens: fills
    c = seq([7] * m + [3] * m, rid="c")  # shares m of 2m: waits for the tree
    for s in (a, b, c):
        sched.add(s)
    assert shape(step(sched)) == (False, ["a", "b"], [m + 60, 128 - m - 60], [True, False])
    # b computed the header again (none of it reported cached); after the step it uses the tree's copy
    assert [s.rid for s in sched.waiting] == ["c"] and b.cached_tokens_reported == 0
    assert b.slots[:m].tolist() == a.slots[:m].tolist()
    assert_pool_accounted(sched, alloc)
    assert shape(step(sched))[:2] == (True, ["a"])  # a decodes between two extend steps
    # b's rest, and c, which now finds the header in the tree
    assert shape(step(sched))[1:3] == (["b", "c"], [(FILL_SHARED_RATIO + 1) * m - (128 - m - 60), m])
    assert c.cached_tokens_reported == m
    assert_pool_accounted(sched, alloc)


def test_deferral_counts_shared_tokens_beyond_the_cached_prefix():
    sched, _ = make(capacity=512, chunk_size=128)
    sched.add(seq([1] * 16 + [0], rid="p", max_new=1))
    step(sched)  # caches [1] * 16 (+ the 0)
    m = IN_BATCH_PREFIX_MIN
    # b shares 16 + m - 1 tokens with a, of which 16 are cached: m - 1 uncached, not enough to wait.
    a, b = seq([1] * (16 + m + 2) + [2], rid="a"), seq([1] * (16 + m - 1) + [3], rid="b")
    sched.add(a)
    sched.add(b)
    assert shape(step(sched)) == (False, ["a", "b"], [m + 3, m], [True, True])
    assert a.cached_tokens_reported == b.cached_tokens_reported == 16
    # 16 + m shared, m uncached: d waits.
    sched.add(seq([5] * 16 + [0], rid="q", max_new=1))
    step(sched)  # decode a, b
    step(sched)  # q
    c, d = seq([5] * (16 + m + 2) + [2], rid="c"), seq([5] * (16 + m) + [3], rid="d")
    sched.add(c)
    sched.add(d)
    step(sched)  # decode a, b
    assert shape(step(sched))[1] == ["c"] and [s.rid for s in sched.waiting] == ["d"]


def test_deferral_compares_with_every_request_in_the_batch():
    sched, _ = make(capacity=256, chunk_size=256)
    a, b, c = seq([4] * 40, rid="a"), seq([1] * 40 + [2], rid="b"), seq([1] * 40 + [3], rid="c")
    for s in (a, b, c):
        sched.add(s)
    assert shape(step(sched))[1] == ["a", "b"] and sched.waiting == [c]


def test_a_follow_up_that_extends_a_prompt_in_the_batch_waits_for_it():
    sched, _ = make(capacity=256, chunk_size=256)
    a, b = seq([1] * 40, rid="a"), seq([1] * 40 + [5, 6], rid="b")
    sched.add(a)
    sched.add(b)
    assert shape(step(sched))[1] == ["a"] and sched.waiting == [b]
    step(sched)  # decode a
    assert shape(step(sched)) == (False, ["b"], [2], [True])
    assert b.cached_tokens_reported == 40


def test_no_deferral_without_a_prefix_cache():
    sched, _ = make(capacity=256, chunk_size=128, cache="none")
    a, b = seq([1] * 40 + [2], rid="a"), seq([1] * 40 + [3], rid="b")
    sched.add(a)
    sched.add(b)
    assert shape(step(sched)) == (False, ["a", "b"], [41, 41], [True, True])


def test_deferred_requests_keep_their_place_ahead_of_the_queue_and_the_scan_is_bounded():
    # Ragged attention: the padding limit would otherwise keep this many small chunks apart.
    sched, _ = make(capacity=8192, chunk_size=4096, max_running=200, padded=False)
    prefix = [1] * 40
    a = seq(prefix + [0], rid="a")
    siblings = [seq(prefix + [2, i], rid=f"s{i}") for i in range(MAX_DEFERRED_SCAN)]
    other = seq([3] * 10, rid="other")
    for s in (a, *siblings, other):
        sched.add(s)
    # The 64 siblings are deferred; the scan stops there, so `other` (which shares nothing) waits too.
    assert shape(step(sched))[1] == ["a"]
    assert sched.waiting == [*siblings, other]
    assert all(len(s.slots) == 0 and s.prefix_node is None for s in siblings)
    step(sched)  # decode a
    batch = step(sched)
    assert shape(batch)[1] == [s.rid for s in siblings] + ["other"]
    assert batch.chunks == [2] * MAX_DEFERRED_SCAN + [10]


def test_deferral_below_the_scan_bound_admits_what_follows():
    sched, _ = make(chunk_size=4096, capacity=1024, max_running=20, padded=False)
    prefix = [1] * 40
    a = seq(prefix + [0], rid="a")
    siblings = [seq(prefix + [2, i], rid=f"s{i}") for i in range(3)]
    other = seq([3] * 10, rid="other")
    for s in (a, *siblings, other):
        sched.add(s)
    assert shape(step(sched))[1] == ["a", "other"]
    assert sched.waiting == siblings


# ------------------------------------------------------------------------------------ decode, retraction
def test_decode_orders_by_arrival_and_retracts_the_newest():
    sched, alloc = make(capacity=8, chunk_size=8, cache="none")
    new, old = seq(range(4), rid="new", arrival=2.0), seq(range(4), rid="old", arrival=1.0)
    late = seq(range(4), rid="late", arrival=3.0)
    for s in (new, old, late):
        sched.add(s)
    assert shape(step(sched)) == (False, ["new", "old"], [4, 4], [True, True])
    assert alloc.num_free() == 0 and sched.waiting == [late]
    # Both need a 5th slot, none is free: the newest arrival gives its KV back and waits first in line.
    assert shape(step(sched)) == (True, ["old"], [1], [True])
    assert sched.waiting == [new, late] and sched.stats.retractions == 1
    assert (len(new.slots), new.num_computed, new.num_cached, new.output_ids) == (0, 0, 0, [TOKEN])
    assert (len(old.slots), alloc.num_free()) == (5, 3)


def test_retracted_request_is_recomputed_and_counted_once():
    sched, alloc = make(capacity=16, chunk_size=16)
    a, b = seq(range(6), rid="a", arrival=1.0, max_new=6), seq(range(10, 18), rid="b", arrival=2.0, max_new=6)
    sched.add(a)
    sched.add(b)
    step(sched)  # a: 6 + 1 token, b: 8 + 1: 14 slots; cache: 6 + 8
    step(sched)  # decode: 16 slots
    assert sched.stats.retractions == 0 and alloc.num_free() == 0
    batch = step(sched)  # both need one more: b is retracted, its cached prefix stays in the tree
    assert shape(batch) == (True, ["a"], [1], [True])
    assert sched.waiting == [b] and sched.stats.retractions == 1 and b.output_ids == [TOKEN, TOKEN]
    assert_pool_accounted(sched, alloc)
    retracted_prompt_stats = (sched.stats.prompt_tokens, sched.stats.cached_tokens)
    while b not in sched.prefilling and b not in sched.running and not b.finished:
        step(sched)
    assert retracted_prompt_stats == (sched.stats.prompt_tokens, sched.stats.cached_tokens) == (14, 0)
    assert b.cached_tokens_reported == 0


def test_retraction_frees_enough_for_the_oldest_when_several_must_go():
    sched, alloc = make(capacity=12, chunk_size=12, cache="none", padded=False)
    seqs = [seq(range(4), rid=f"r{i}", arrival=float(i)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert shape(step(sched))[1] == ["r0", "r1", "r2"]  # 12 slots, all sampled: each needs a 5th
    batch = step(sched)
    # r2 goes (4 free), r0 and r1 grow; then 2 free.
    assert shape(batch) == (True, ["r0", "r1"], [1, 1], [True, True])
    assert sched.waiting == [seqs[2]] and alloc.num_free() == 2


def test_a_jump_forward_can_retract_several_newer_requests():
    sched, alloc = make(capacity=12, chunk_size=12, cache="none", padded=False)
    r0, r1, r2 = (seq(range(4), rid=f"r{i}", arrival=float(i), max_new=20) for i in range(3))
    for s in (r0, r1, r2):
        sched.add(s)
    step(sched)  # 12 slots, all sampled
    r0.output_ids += [1] * 6  # a jump-forward: r0 now needs 7 more slots, the others one each
    batch = step(sched)
    assert shape(batch) == (False, ["r0"], [7], [True])
    assert sched.waiting == [r1, r2] and sched.stats.retractions == 2 and alloc.num_free() == 1


def test_decode_with_no_request_left_falls_back_to_extend():
    sched, alloc = make(capacity=17, chunk_size=8, cache="none")
    a, b = seq(range(4), rid="a", arrival=1.0, max_new=40), seq(range(16), rid="b", arrival=2.0)
    sched.add(a)
    sched.add(b)
    assert shape(step(sched)) == (False, ["a", "b"], [4, 4], [True, False])
    assert shape(step(sched)) == (True, ["a"], [1], [True])
    assert shape(step(sched)) == (False, ["b"], [8], [False])
    assert (len(a.slots), len(b.slots), alloc.num_free()) == (5, 12, 0)
    # After an extend, a decodes; but a's 7th slot cannot be had, so a is retracted and no decode is left:
    # the step is an extend after all: b's last 4 tokens (a cannot be readmitted in the 1 slot left).
    assert shape(step(sched)) == (False, ["b"], [4], [True])
    assert sched.waiting == [a] and len(a.slots) == 0 and alloc.num_free() == 1
    assert sched.stats.retractions == 1 and sched.stats.extend_steps == 3 and sched.stats.decode_steps == 1


def test_jump_forward_turns_a_decode_into_an_extend_over_the_running_batch():
    sched, _ = make(chunk_size=64, cache="none")
    a, b = seq(range(4), rid="a", arrival=1.0), seq(range(4), rid="b", arrival=2.0)
    sched.add(a)
    sched.add(b)
    step(sched)
    a.output_ids += [1, 2]  # a jump-forward: three output tokens without KV
    batch = sched.schedule()
    assert shape(batch) == (False, ["a", "b"], [3, 1], [True, True])
    assert len(a.slots) == 7 and len(b.slots) == 5


def test_jump_forward_at_the_end_of_a_prefill_moves_to_running():
    sched, _ = make(chunk_size=64, cache="none")
    a = seq(range(4), rid="a")
    sched.add(a)
    batch = sched.schedule()
    a.num_computed = 4
    a.output_ids += [1, 2, 3]  # sampled, then jumped: 2 more tokens to compute
    sched.after_step(batch)
    assert sched.running == [a] and not sched.prefilling


def test_finished_requests_leave_every_queue():
    sched, alloc = make(chunk_size=4, cache="none")
    a, b = seq(range(3), rid="a", max_new=1), seq(range(10), rid="b")
    sched.add(a)
    sched.add(b)
    step(sched)  # a: 3 tokens, finishes at its first; b: 1 of 10
    assert a.finished and sched.prefilling == [b] and not sched.running
    b.finish_reason = FinishReason.ABORT  # aborted between steps
    sched.drop(b)
    assert not sched.has_work() and alloc.num_free() == 64


def test_finished_running_request_is_not_decoded():
    sched, _ = make(chunk_size=64, cache="none")
    a, b = seq(range(4), rid="a", arrival=1.0), seq(range(4), rid="b", arrival=2.0)
    sched.add(a)
    sched.add(b)
    step(sched)
    b.finish_reason = FinishReason.STOP  # finished by the engine, still listed as running
    assert shape(sched.schedule()) == (True, ["a"], [1], [True])


# ------------------------------------------------------------------------------------------- release
def test_release_keeps_whole_computed_pages_in_the_cache_and_frees_the_rest():
    sched, alloc = make(chunk_size=64, page=4)
    a = seq(range(10), rid="a", max_new=8)
    sched.add(a)
    step(sched)  # 10 computed (12 slots), 8 cached
    assert (a.num_cached, len(a.slots)) == (8, 12)
    step(sched)
    step(sched)  # 12 computed, 12 slots
    assert (a.num_computed, len(a.slots), sched.cache.total_size()) == (12, 12, 8)
    sched.drop(a)
    assert sched.cache.total_size() == 12 and sched.cache.protected_size() == 0
    assert alloc.num_free() == 64 - 12
    assert (len(a.slots), a.prefix_node, a.num_computed, a.num_cached) == (0, None, 0, 0)


def test_a_chunk_within_the_last_allocated_page_needs_no_new_slots():
    sched, alloc = make(chunk_size=6, page=4)
    a = seq(range(8), rid="a")
    sched.add(a)
    assert shape(step(sched)) == (False, ["a"], [6], [False])
    assert len(a.slots) == 8 and alloc.num_free() == 64 - 8  # whole pages
    assert shape(step(sched)) == (False, ["a"], [2], [True])
    assert len(a.slots) == 8 and alloc.num_free() == 64 - 8


def test_a_one_token_prompt_is_cached_when_it_finishes():
    sched, alloc = make()
    a = seq([5], rid="a", max_new=1)
    sched.add(a)
    assert shape(step(sched)) == (False, ["a"], [1], [True])
    assert a.finished and sched.cache.total_size() == 1 and alloc.num_free() == 63
    assert sched.cache.match_len([5]) == 1


def test_release_before_any_whole_page_frees_everything():
    sched, alloc = make(chunk_size=3, page=4)
    a = seq(range(10), rid="a")
    sched.add(a)
    step(sched)  # 3 computed: no whole page
    assert len(a.slots) == 4 and a.num_cached == 0
    sched.drop(a)
    assert alloc.num_free() == 64 and sched.cache.total_size() == 0


def test_release_of_a_request_whose_prefix_another_cached_first():
    sched, alloc = make(chunk_size=64)
    n = IN_BATCH_PREFIX_MIN - 1
    prompt = list(range(n))
    a = seq(prompt, rid="a", max_new=1)
    sched.add(a)
    b = seq(prompt + [99], rid="b")
    sched.add(b)
    batch = sched.schedule()  # a and b in one batch: both compute the shared tokens
    assert shape(batch)[1] == ["a", "b"]
    for s, c in zip(batch.seqs, batch.chunks):
        s.num_computed += c
    sched.drop(a)  # a caches its n
    sched.drop(b)  # b's n are already there: b frees its copies, caches its last
    assert sched.cache.total_size() == n + 1 and alloc.num_free() == 64 - n - 1


def test_drop_of_a_waiting_request_frees_nothing():
    sched, alloc = make()
    a = seq(range(5), rid="a")
    sched.add(a)
    sched.drop(a)
    assert not sched.waiting and alloc.num_free() == 64


def test_alloc_evicts_only_what_is_missing():
    sched, alloc = make(capacity=32, chunk_size=64)
    for i in range(3):
        sched.add(seq([10 * i + k for k in range(8)], rid=f"p{i}", max_new=1))
        step(sched)
    assert sched.cache.total_size() == 24 and alloc.num_free() == 8
    a = seq(range(100, 116), rid="a")
    sched.add(a)
    assert shape(step(sched)) == (False, ["a"], [16], [True])
    # 16 needed, 8 free: the least recently used entry (8 tokens) is evicted, the other two stay.
    assert sched.cache.total_size() == 16 + 16 and alloc.num_free() == 0
    assert sched.cache.match_len([0, 1, 2, 3, 4, 5, 6, 7]) == 0
    assert sched.cache.match_len([10 + k for k in range(8)]) == 8


def test_grow_and_alloc_edge_cases():
    sched, alloc = make(capacity=16)
    a = seq(range(4), rid="a")
    a.slots = np.zeros(0, np.int32)
    assert sched.kv.grow(a, 0) and len(a.slots) == 0
    assert sched.kv._alloc(0).dtype == np.int32 and len(sched.kv._alloc(0)) == 0
    assert len(sched.kv._alloc(-3)) == 0 and alloc.num_free() == 16
    assert sched.kv.grow(a, 5) and len(a.slots) == 5 and alloc.num_free() == 11
    assert sched.kv.grow(a, 3) and len(a.slots) == 5
    assert not sched.kv.grow(a, 17) and len(a.slots) == 5 and alloc.num_free() == 11


# ---------------------------------------------------------------- fairness (a long prompt beside decodes)
def test_prefill_share_owes_running_requests_decode_time():
    sched, _ = make(chunk_size=16, cache="none", prefill_share=0.5, keys_per_token=16)
    a = seq(range(4), max_new=20, rid="a")
    sched.add(a)
    assert shape(step(sched)) == (False, ["a"], [4], [True])
    sched.add(seq(range(100, 200), rid="p"))
    assert step(sched).is_decode  # never two extend steps in a row while a decodes
    batch = step(sched)
    assert shape(batch)[:3] == (False, ["p"], [16]) and batch.stalled
    sched.account(batch, 1.0)  # a waited 1 s: at a share of 0.5 it is owed 1 s of decoding
    for seconds in (0.25, 0.75):
        batch = step(sched)
        assert batch.is_decode and not batch.stalled
        sched.account(batch, seconds)
    # Paid back: p's prefill goes on, its chunk shrunk to what 16 tokens at no context cost at 16 keys: 8.
    assert shape(step(sched))[:3] == (False, ["p"], [8])


def test_a_share_of_a_quarter_owes_three_times_the_prefill_step():
    sched, _ = make(chunk_size=16, cache="none", prefill_share=0.25, keys_per_token=16)
    sched.add(seq(range(4), max_new=20, rid="a"))
    step(sched)
    sched.add(seq(range(100, 200), rid="p"))
    step(sched)
    sched.account(step(sched), 1.0)
    decodes = 0
    while (batch := step(sched)).is_decode:
        sched.account(batch, 0.5)
        decodes += 1
    assert decodes == 6


def test_decode_time_beyond_the_debt_banks_no_credit_against_the_next_hold():
    """The debt is decoding owed and never negative: a decode step longer than what was owed does not prepay the
    next prefill step's hold, which the running requests are owed in full again."""
    sched, _ = make(chunk_size=16, cache="none", prefill_share=0.5, keys_per_token=16)
    sched.add(seq(range(4), max_new=40, rid="a"))
    step(sched)
    sched.add(seq(range(100, 200), rid="p"))
    assert step(sched).is_decode
    sched.account(step(sched), 1.0)  # p's chunk held a for 1 s: owed 1 s
    batch = step(sched)
    assert batch.is_decode
    sched.account(batch, 5.0)  # a slow decode step: 4 s more than owed
    assert sched._prefill_debt == 0.0
    batch = step(sched)
    assert not batch.is_decode and batch.stalled
    sched.account(batch, 1.0)  # owed 1 s again, not 1 s less the 4 s decoded beyond the debt
    kinds = []
    for _ in range(3):
        batch = step(sched)
        sched.account(batch, 0.5)
        kinds.append("d" if batch.is_decode else "p")
        assert sched._prefill_debt >= 0.0
    assert kinds == ["d", "d", "p"]


def test_without_a_share_extend_and_decode_alternate_with_whole_chunks():
    sched, _ = make(chunk_size=16, cache="none", keys_per_token=16)  # prefill_share 1 (the Scheduler's default)
    sched.add(seq(range(4), max_new=20, rid="a"))
    step(sched)
    sched.add(seq(range(100, 200), rid="p"))
    kinds = []
    for _ in range(6):
        batch = step(sched)
        sched.account(batch, 1.0)
        kinds.append("d" if batch.is_decode else batch.chunks[0])
    assert kinds == ["d", 16, "d", 16, "d", 16]


@pytest.mark.parametrize("arrival, long_chunk", [(8, 2), (30, 5)])
def test_an_arrivals_step_gives_the_prefill_under_way_what_the_arrival_brings_at_most_half(arrival, long_chunk):
    sched, _ = make(capacity=400, chunk_size=32, cache="none", padded=False, prefill_share=0.5, keys_per_token=32)
    p = seq(range(200), rid="p")
    sched.add(p)
    assert [step(sched).chunks for _ in range(2)] == [[32], [32]]  # alone, nothing shrinks
    sched.add(seq(range(1000, 1000 + arrival), max_new=4, rid="v"))
    # p may take min(arrival, 16) token-equivalents; at 64 keys a token costs 1 + 64/32 = 3 of them: 8 buy 2
    # tokens, 16 buy 5. v gets the rest of the 32 (26 or 17).
    v_chunk = min(arrival, 32 - 3 * long_chunk)
    assert shape(step(sched)) == (False, ["p", "v"], [long_chunk, v_chunk], [False, v_chunk == arrival])


def test_a_short_arrival_is_owed_the_prefill_step_it_waited_for():
    sched, _ = make(capacity=400, chunk_size=32, cache="none", padded=False, prefill_share=0.5, keys_per_token=32)
    sched.add(seq(range(200), rid="p"))
    sched.account(step(sched), 1.0)  # p's first chunk took 1 s ...
    v = seq(range(1000, 1008), max_new=4, rid="v")
    v.arrival_time = time.monotonic() - 0.4  # ... and v arrived 0.6 s into it
    sched.add(v)
    batch = step(sched)
    assert shape(batch)[1] == ["p", "v"]
    sched.account(batch, 0.1)  # v's prefill step (not one that stalled it: it ran there)
    kinds = []
    for _ in range(4):
        batch = step(sched)
        sched.account(batch, 0.1)
        kinds.append("d" if batch.is_decode else "p")
    assert kinds == ["d", "d", "d", "p"]  # 0.4 s owed, 0.1 s paid by its own step: three decode steps
    # One that arrived before the step it waited for is owed only that step.
    sched2, _ = make(capacity=400, chunk_size=32, cache="none", padded=False, prefill_share=0.5, keys_per_token=32)
    sched2.add(seq(range(200), rid="p"))
    sched2.account(step(sched2), 0.2)
    w = seq(range(1000, 1008), max_new=4, rid="w")
    w.arrival_time = time.monotonic() - 5.0
    sched2.add(w)
    step(sched2)
    assert sched2._prefill_debt == pytest.approx(0.2, abs=0.01)


def test_a_prefill_gets_the_budget_back_when_no_arrival_could_be_admitted():
    sched, _ = make(capacity=75, chunk_size=32, cache="none", padded=False, prefill_share=0.5, keys_per_token=32)
    p = seq(range(100), rid="p")
    sched.add(p)
    step(sched), step(sched)
    w = seq(range(1000, 1030), rid="w")
    sched.add(w)
    # p takes 5 (cost 15); w's 17 tokens do not fit the 6 free slots, so p tops up with what 17 buys at 69 keys: 5.
    assert shape(step(sched))[:3] == (False, ["p"], [10])
    assert sched.waiting == [w] and len(p.slots) == 74


def test_mixed_steps_carry_every_decode_and_a_shrinking_prefill():
    sched, _ = make(chunk_size=32, cache="none", padded=False, mixed_prefill_tokens=8, keys_per_token=16)
    a = seq(range(4), max_new=20, rid="a")
    sched.add(a)
    step(sched)
    sched.add(seq(range(100, 200), rid="p"))
    assert shape(step(sched)) == (False, ["a", "p"], [1, 8], [True, False])
    assert shape(step(sched)) == (False, ["a", "p"], [1, 5], [True, False])  # 8 / (1 + 8/16)
    assert shape(step(sched)) == (False, ["a", "p"], [1, 4], [True, False])  # 8 / (1 + 13/16)
    assert sched.stats.mixed_steps == 3 and sched.stats.computed_prefill_tokens == 4 + 17
    assert len(a.output_ids) == 4


def test_mixed_steps_need_ragged_attention():
    sched, _ = make(chunk_size=32, cache="none", mixed_prefill_tokens=8, keys_per_token=16)  # padded attention
    sched.add(seq(range(4), max_new=20, rid="a"))
    step(sched)
    sched.add(seq(range(100, 200), rid="p"))
    assert step(sched).is_decode and shape(step(sched))[:3] == (False, ["p"], [32])


def test_long_prompts_are_prefilled_one_at_a_time_so_a_short_one_behind_them_gets_in():
    sched, _ = make(capacity=400, chunk_size=32, cache="none", padded=False, prefill_share=0.5, keys_per_token=32)
    sched.add(seq(range(100), rid="p1"))
    assert step(sched).chunks == [32]
    p2, v = seq(range(1000, 1100), rid="p2"), seq(range(2000, 2008), max_new=4, rid="v")
    sched.add(p2), sched.add(v)
    # p1 takes 4 (v brings 8; at 32 keys a token costs 2); p2 would need several steps too, so it waits (and does
    # not count); v, behind it, gets in.
    assert shape(step(sched)) == (False, ["p1", "v"], [4, 8], [False, True])
    assert sched.waiting == [p2] and len(p2.slots) == 0


def test_a_long_prompt_mostly_cached_is_not_held_behind_a_long_prefill():
    """Only what is left to compute makes a prompt long: one whose cached prefix leaves a few tokens joins the step
    beside the long prefill under way, however many tokens it has."""
    sched, alloc = make(capacity=400, chunk_size=32, padded=False, prefill_share=0.5, keys_per_token=32)
    shared = list(range(1000, 1100))
    sched.add(seq(shared, max_new=1, rid="c"))
    while sched.has_work():
        step(sched)  # c's 100 tokens are now in the tree
    sched.add(seq(range(100), rid="p1"))
    assert step(sched).chunks == [32]
    p2 = seq(shared + [2000, 2001], rid="p2")
    sched.add(p2)
    batch = step(sched)
    assert shape(batch)[1] == ["p1", "p2"] and batch.chunks[1] == 2  # after its 100 cached tokens
    assert sched.waiting == []
    assert_pool_accounted(sched, alloc)


# ----------------------------------------------------------------------------------------------- priorities
def test_without_priorities_nothing_changes_and_higher_ones_are_admitted_first_in_policy_order():
    sched, _ = make(max_running=8, cache="none", padded=False, priority_scheduling=True)
    for i, prio in enumerate([0, 2, 0, 2, 1]):
        sched.add(seq(range(10 * i, 10 * i + 4), rid=f"r{i}p{prio}", arrival=float(i), priority=prio))
    assert shape(step(sched))[1] == ["r1p2", "r3p2", "r4p1", "r0p0", "r2p0"]  # stable within a priority
    plain, _ = make(max_running=8, cache="none", padded=False)
    for i in range(3):
        plain.add(seq(range(10 * i, 10 * i + 4), rid=f"r{i}", arrival=float(i)))
    assert shape(step(plain))[1] == ["r0", "r1", "r2"] and plain.stats.preemptions == 0


def test_a_higher_priority_preempts_the_lowest_newest_running_request_at_max_running():
    sched, _ = make(max_running=2, cache="none", priority_scheduling=True)
    low_old, low_new = seq(range(4), rid="low-old", arrival=0.0), seq(range(10, 14), rid="low-new", arrival=1.0)
    sched.add(low_old), sched.add(low_new)
    step(sched)
    assert step(sched).is_decode and len(sched.running) == 2
    same = seq(range(20, 24), rid="same", arrival=2.0)
    sched.add(same)
    assert step(sched).is_decode and sched.stats.preemptions == 0  # no higher priority: it waits
    high = seq(range(30, 34), rid="high", arrival=3.0, priority=1)
    sched.add(high)
    batch = step(sched)
    assert shape(batch)[1] == ["high"] and sched.stats.preemptions == 1
    assert [s.rid for s in sched.running] == ["low-old", "high"]
    assert [s.rid for s in sched.waiting] == ["low-new", "same"] and len(low_new.slots) == 0


def test_a_higher_priority_preempts_beside_mixed_steps():
    """Mixed steps (the accelerators' default) keep every running request in them: a waiting request that outranks
    one gets a plain extend step instead, where it preempts as without mixed steps."""
    sched, alloc = make(max_running=2, cache="none", padded=False, mixed_prefill_tokens=8, keys_per_token=16,
                        priority_scheduling=True)
    sched.add(seq(range(4), rid="low-old", arrival=0.0, max_new=20))
    sched.add(seq(range(10, 14), rid="low-new", arrival=1.0, max_new=20))
    step(sched)
    sched.add(seq(range(100, 140), rid="same", arrival=2.0))
    assert step(sched).is_decode and sched.stats.preemptions == 0  # max_running reached: it waits, no mixing
    high = seq(range(30, 34), rid="high", arrival=3.0, priority=1)
    sched.add(high)
    assert shape(step(sched))[1] == ["high"] and sched.stats.preemptions == 1
    assert [s.rid for s in sched.running] == ["low-old", "high"] and sched.stats.mixed_steps == 0
    assert_pool_accounted(sched, alloc)


def test_equal_priorities_still_mix():
    """Once priorities are in use, a waiting request of the running ones' own priority outranks none of them: it
    joins a mixed step as without priorities (only a higher one gets a plain extend step, to preempt)."""
    sched, alloc = make(max_running=4, cache="none", padded=False, mixed_prefill_tokens=8, keys_per_token=16)
    sched.add(seq(range(4), rid="a", max_new=20, priority=2))
    step(sched)
    sched.add(seq(range(100, 140), rid="p", priority=2))
    assert shape(step(sched)) == (False, ["a", "p"], [1, 8], [True, False])
    assert sched.stats.mixed_steps == 1 and sched.stats.preemptions == 0
    assert_pool_accounted(sched, alloc)


def test_a_higher_priority_short_of_kv_takes_a_lower_ones_slots():
    sched, alloc = make(capacity=24, cache="none", chunk_size=32, priority_scheduling=True)
    low = seq(range(16), rid="low", max_new=20)
    sched.add(low)
    step(sched)
    step(sched)
    high = seq(range(100, 116), rid="high", priority=5)
    sched.add(high)
    batch = step(sched)  # 16 slots needed, 7 free: low (priority 0) is retracted for it
    assert shape(batch)[1] == ["high"] and sched.stats.preemptions == 1
    assert sched.waiting == [low] and len(low.slots) == 0
    equal = seq(range(200, 216), rid="equal", priority=5)
    sched.add(equal)
    while not (batch := step(sched)).is_decode:
        pass
    assert sched.stats.preemptions == 1 and equal in sched.waiting  # an equal priority waits its turn
    assert_pool_accounted(sched, alloc)


def test_a_request_held_behind_a_long_prefill_preempts_nobody():
    """Preempting for a request that is then held (a long prompt behind the long prefill under way) only let the
    victim back in, to be preempted again next step: preemption happens once the request is really admitted."""
    sched, alloc = make(capacity=800, max_running=2, cache="none", padded=False, prefill_share=0.5,
                        keys_per_token=32, priority_scheduling=True)
    sched.add(seq(range(4), rid="l1", max_new=40))
    step(sched)
    sched.add(seq(range(1000, 1400), rid="p"))
    while not sched.prefilling:
        sched.account(step(sched), 0.01)
    sched.add(seq(range(2000, 2100), rid="h", priority=1))
    for _ in range(30):
        batch = step(sched, expect=False)
        if batch is not None:
            sched.account(batch, 0.01)
    assert sched.stats.preemptions <= 1
    assert_pool_accounted(sched, alloc)



def test_without_priority_scheduling_a_higher_priority_neither_overtakes_nor_preempts():
    """SGLang's default: `priority` is ignored unless --enable-priority-scheduling; every request counts as 0."""
    sched, _ = make(max_running=1, cache="none")
    first = seq(range(4), rid="first", arrival=0.0, max_new=4)
    sched.add(first)
    sched.add(seq(range(10, 14), rid="high", arrival=1.0, priority=2**31 - 1))
    batches = []
    while not first.finished:
        batches.append(shape(step(sched))[1])
    assert batches == [["first"]] * 4  # admitted first and decoded to the end: nobody preempted it
    assert shape(step(sched))[1] == ["high"] and sched.stats.preemptions == 0


def test_a_high_priority_flood_cannot_starve_an_old_request_past_the_guard():
    """Past starvation_s a request goes first whatever the priorities waiting, and once running no priority
    preempts it (a flood would retract it again and again)."""
    now = time.monotonic()
    sched, _ = make(max_running=2, cache="none", priority_scheduling=True, starvation_s=30.0)
    sched.add(seq(range(4), rid="new-low", arrival=now, max_new=20))
    step(sched), step(sched)  # its prefill, then a decode step: the next step may admit
    old = seq(range(10, 14), rid="old", arrival=now - 31, max_new=20)
    flood = [seq(range(100 + 10 * i, 104 + 10 * i), rid=f"flood{i}", arrival=now, priority=2**31 - 1)
             for i in range(4)]
    for s in [*flood[:2], old, *flood[2:]]:
        sched.add(s)
    batch = step(sched)  # one high-priority flood request preempts new-low; the old one goes first in the queue
    assert shape(batch)[1][0] == "old" and sched.stats.preemptions == 1
    for _ in range(10):
        step(sched, expect=False)
    assert old in sched.running + sched.prefilling or old.finished
    assert sched.stats.preemptions == 1  # nobody retracted the old one for the flood
