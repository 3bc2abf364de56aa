"""Continuous batching: admits waiting sequences, chunks long prefills, decodes the running batch.

Each step is either an extend step (prefill chunks of newly admitted or partly prefilled sequences,
after any cached prefix) or a decode step (one token for every running sequence). Extend steps go
first so new requests start quickly; alternating keeps each step one of two shape families, which
keeps compilation bounded. KV slots come from the allocator; when it runs short the prefix cache
evicts unreferenced leaves, and a decode step that still cannot fit retracts the newest sequences.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from jsgl.engine.kv_pool import SlotAllocator
from jsgl.engine.model_runner import bucket
from jsgl.engine.sequence import Sequence
from jsgl.engine.sequence_kv import SequenceKV
from jsgl.radix.cache_base import PrefixCacheBase
from jsgl.radix.no_cache import NoPrefixCache

# Shared uncached tokens that make a request wait one step for the tree: small enough that short shared parts
# (the LLM judge's forks) are computed once.
IN_BATCH_PREFIX_MIN = 8
MAX_DEFERRED_SCAN = 64
# A deferred request fills a step's leftover budget when it shares at most 1/FILL_SHARED_RATIO of its new tokens
# with the batch (the LLM judge's forks, 9 shared tokens of ~30, still wait: their hit rate is Fig. 13's).
FILL_SHARED_RATIO = 8
PADDING_FACTOR = 2  # an extend batch's padded attention rows may be at most this times its tokens


@dataclasses.dataclass
class Batch:
    is_decode: bool
    seqs: list[Sequence]
    chunks: list[int]  # new tokens computed for each sequence this step
    stalled: bool = False  # an extend step that running requests waited for
    decoding: bool = False  # every running request's next tokens (speculative decoding may add drafts)
    # Whether sequence i reaches the end of its tokens this step (and so samples the next one): fixed when
    # the batch is made, as absorbing the step changes the sequence (a jump-forward appends several tokens).
    sampling: list[bool] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.sampling = [s.num_computed + c == s.num_tokens for s, c in zip(self.seqs, self.chunks)]

    def samples(self, i: int) -> bool:
        return self.sampling[i]


@dataclasses.dataclass
class SchedulerStats:
    steps: int = 0
    extend_steps: int = 0
    decode_steps: int = 0
    batched_requests: int = 0  # summed over steps (a running total: a per-step list grew with uptime)
    retractions: int = 0
    preemptions: int = 0  # retractions for a waiting request of a higher priority (counted in retractions too)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_prefill_tokens: int = 0
    mixed_steps: int = 0  # steps that carried decode tokens and prefill together


class Scheduler:
    def __init__(self, allocator: SlotAllocator, prefix_cache: PrefixCacheBase | None, *, max_running: int,
                 chunk_size: int, max_context: int, attention_budget_bytes: int,
                 attention_bytes: Any, order_waiting: Any | None = None, padded_attention: bool = True,
                 match_fraction: float = 1.0, mixed_prefill_tokens: int = 0, keys_per_token: float = 1024.0,
                 prefill_share: float = 1.0, priority_scheduling: bool = False, starvation_s: float | None = None):
        self.allocator = allocator
        self.cache = prefix_cache if prefix_cache is not None else NoPrefixCache(allocator.page_size)
        self.kv = SequenceKV(allocator, self.cache, match_fraction)  # each sequence's slots: match, grow, release
        self.max_running = max_running
        self.chunk_size = chunk_size
        # A request stops growing here (FinishReason.LENGTH): past the pool's size it could never be
        # scheduled again, and would wait (or be retracted and recomputed) forever.
        self.token_limit = min(max_context, allocator.capacity)
        self.attention_budget_bytes = attention_budget_bytes
        self.attention_bytes = attention_bytes  # (num_items, max_new, max_len) -> bytes
        # False: attention costs the batch's real lengths (ragged kernel), so chunks of any lengths mix.
        self.padded_attention = padded_attention
        self.order_waiting = order_waiting  # policy hook: list[Sequence] -> list[Sequence]
        self.waiting: list[Sequence] = []
        self.prefilling: list[Sequence] = []  # admitted, prefill not finished (chunked)
        self.running: list[Sequence] = []  # decoding
        # Mixed steps (0: off): while requests decode, each step carries every decode token and at most this many
        # token-equivalents of prefill, so a long prompt never stalls them. A new token attending over L keys costs
        # 1 + L / keys_per_token of them (keys_per_token: attended keys that cost as much as a token's matmuls).
        self.mixed_prefill_tokens = mixed_prefill_tokens
        self.keys_per_token = keys_per_token
        # While requests decode, prefill steps take at most this share of the time: a prefill step that made them
        # wait is paid back by decode steps (``account``) before the next one. 1: prefill and decode alternate.
        self.prefill_share = prefill_share
        self._prefill_debt = 0.0  # seconds of decoding owed to the running requests
        self._last_prefill = (0.0, 0.0)  # the last extend step's end (time.monotonic) and duration
        self.stats = SchedulerStats()
        self._last_was_extend = False
        # Off (SGLang's default): every request counts as priority 0, for the queue's order and for preemption.
        self.priority_scheduling = priority_scheduling
        # A request waiting this long since it arrived goes first whatever its priority, and no priority preempts it.
        self.starvation_s = starvation_s
        self._now = time.monotonic()  # the step's clock, for the starvation guard
        self._prioritized = False  # a request with a priority arrived: the queue's priority order is kept from then

    # ------------------------------------------------------------------------------------ state
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._prioritized = self._prioritized or self._priority(seq) != 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def num_active(self) -> int:
        return len(self.prefilling) + len(self.running)

    # ---------------------------------------------------------------------------------- batching
    def schedule(self) -> Batch | None:
        self.running = [s for s in self.running if not s.finished]
        self._now = time.monotonic()
        # A waiting request that outranks a running one gets a plain extend step: there it may preempt (a mixed
        # step keeps every running request in it).
        if self.running and (self.prefilling or self.waiting) and self.mixed_prefill_tokens \
                and not self.padded_attention and not (self._prioritized and self._outranked(self.running)):
            batch = self._schedule_mixed()
            if batch is not None:
                self._last_was_extend = False  # every running request decoded in it
                self.count_step(batch.is_decode, len(batch.seqs))
                self.stats.mixed_steps += not (batch.is_decode or batch.decoding)  # decoding: no prefill in it
            return batch
        if not self.running:
            self._prefill_debt = 0.0
        # Extend steps go first, but never twice in a row while sequences are decoding, nor while they are owed
        # time: a long prompt's chunks then interleave with decode steps instead of stalling them.
        owed = self._last_was_extend or self._prefill_debt > 0
        batch = None if (owed and self.running) else self._schedule_extend()
        if batch is not None and self.running:
            batch.stalled = True
        if batch is None and self.running:
            batch = self._schedule_decode()
        if batch is None:
            batch = self._schedule_extend()
        self._last_was_extend = batch is not None and not batch.is_decode
        if batch is not None:
            self.count_step(batch.is_decode, len(batch.seqs))
        return batch

    def account(self, batch: Batch, seconds: float) -> None:
        """A step took ``seconds``: a prefill step that running requests waited for puts them owed decoding time
        (its share of the time is ``prefill_share``); decode steps pay it back."""
        if not batch.is_decode:
            self._last_prefill = (time.monotonic(), seconds)
        if batch.stalled and self.prefill_share < 1.0:
            self._prefill_debt += seconds * (1.0 - self.prefill_share) / self.prefill_share
        elif batch.is_decode or not batch.stalled:
            self._prefill_debt = max(0.0, self._prefill_debt - seconds) if self.running else 0.0

    def count_as_decode(self, batch: Batch) -> None:
        """A running batch with a jump-forward's run, scheduled as an extend step, ran as a decode step (speculative
        decoding's verify rows): counted and remembered as one."""
        if not batch.is_decode:
            batch.is_decode = True
            self.stats.extend_steps -= 1
            self.stats.decode_steps += 1
            self._last_was_extend = False

    def count_step(self, is_decode: bool, num_requests: int) -> None:
        """Count a step in the stats (also one the engine dispatched without scheduling: overlap)."""
        self.stats.steps += 1
        self.stats.batched_requests += num_requests
        if is_decode:
            self.stats.decode_steps += 1
        else:
            self.stats.extend_steps += 1

    def _schedule_mixed(self) -> Batch | None:
        """Every running request's decode token(s), plus prefill within ``mixed_prefill_tokens``."""
        decode = self._schedule_decode()
        if decode is None:  # all retracted for memory
            return self._schedule_extend()
        return self._schedule_extend(self.mixed_prefill_tokens, decode.seqs, decode.chunks) or decode

    def _affordable(self, seq: Sequence, budget: int, weighted: bool, at: int | None = None) -> int:
        """New tokens of ``seq`` that ``budget`` pays for: tokens, or ``weighted``, token-equivalents at its context
        (``at``, default what it has computed; at least one token)."""
        if not weighted:
            return budget
        context = seq.num_computed if at is None else at
        return max(1, int(budget / (1 + context / self.keys_per_token)))

    def _cost(self, seq: Sequence, chunk: int, weighted: bool) -> int:
        # Whole tokens: a fractional budget left would admit an empty chunk.
        return math.ceil(chunk * (1 + seq.num_computed / self.keys_per_token)) if weighted else chunk

    def _schedule_extend(self, budget: int | None = None, seqs: list[Sequence] | None = None,
                         chunks: list[int] | None = None) -> Batch | None:
        """An extend batch: prompts' chunks within ``budget`` tokens (default ``chunk_size``). With ``seqs`` and
        ``chunks`` (a mixed step's decodes) the chunks join them, and the budget is in token-equivalents: long
        contexts get shorter chunks. While requests wait, a prefill under way takes at most half the budget."""
        mixed = seqs is not None
        base = len(seqs) if mixed else 0
        seqs, chunks = (list(seqs), list(chunks)) if mixed else ([], [])
        budget = self.chunk_size if budget is None else budget
        admitting = bool(self.waiting) and self.num_active() < self.max_running

        def fits(seq: Sequence, chunk: int) -> bool:
            items = len(seqs) + 1
            max_new = max([chunk, *chunks])
            max_len = max([seq.num_computed + chunk, *(s.num_computed + c for s, c in zip(seqs, chunks))])
            if not seqs:
                return True
            # Attention is padded to [requests, longest chunk]: a short extend next to a long chunk
            # would pay for the long one, so such mixes wait for the next step.
            padded_rows = bucket(items) * bucket(max_new, 16)
            if self.padded_attention and padded_rows > PADDING_FACTOR * bucket(sum(chunks) + chunk, 16):
                return False
            return self.attention_bytes(items, max_new, max_len) <= self.attention_budget_bytes

        # A prefill under way is what stalls others: beside decodes or arrivals its chunk shrinks as its context
        # grows (the step's cost stays that of ``budget`` short-context tokens), and arrivals get the rest.
        fair = mixed or self.prefill_share < 1.0
        shrink = fair and (mixed or admitting or bool(self.running))
        # Long prompts are prefilled one at a time: while one is under way, a prompt that needs several steps too
        # waits, so those behind it (a short request) are not held up by each in turn.
        long_under_way = fair and any(s.num_tokens - s.num_computed > self.chunk_size for s in self.prefilling)
        continuing = self._beside_arrivals(budget, long_under_way) if fair and admitting and self.prefilling \
            else budget
        continued: list[int] = []  # rows of prefills under way
        for seq in list(self.prefilling):
            if continuing <= 0 or seq not in self.prefilling:  # (retracted by an older one, below)
                break
            chunk = min(seq.num_tokens - seq.num_computed, self._affordable(seq, continuing, shrink))
            if chunk <= 0 or not fits(seq, chunk) or not self._grow_prefill(seq, seq.num_computed + chunk):
                break
            cost = self._cost(seq, chunk, shrink)
            continued.append(len(seqs))
            seqs.append(seq)
            chunks.append(chunk)
            budget -= cost
            continuing -= cost
        if self.waiting and self.order_waiting is not None:
            self.waiting = self.order_waiting(self.waiting)
        if self._prioritized:
            self.waiting.sort(key=self._queue_rank)  # stable: the policy's order within a rank
        # A waiting request may retract running ones of a lower priority (a mixed step is not scheduled then).
        preempting = self._prioritized and not mixed and self._outranked(self.running)
        deferred: list[Sequence] = []
        held: list[Sequence] = []  # long prompts behind the long prefill under way
        while self.waiting and budget > 0 and (self.num_active() < self.max_running or preempting):
            seq = self.waiting.pop(0)
            self.kv.match_prefix(seq)
            if long_under_way and seq.num_tokens - seq.num_computed > self.chunk_size:
                self.kv.release(seq)
                held.append(seq)
                if len(held) + len(deferred) >= MAX_DEFERRED_SCAN:
                    break
                continue
            if self._shared_uncached(seq, seqs) >= IN_BATCH_PREFIX_MIN:
                # Its prefix is being computed in this very step: admit it next step, when the tree
                # has that prefix, instead of computing the same tokens twice.
                self.kv.release(seq)
                deferred.append(seq)
                if len(held) + len(deferred) >= MAX_DEFERRED_SCAN:  # bound the scan of a long queue per step
                    break
                continue
            if self.num_active() >= self.max_running and not (preempting and self._preempt_for(seq)):
                self.kv.release(seq)
                self.waiting.insert(0, seq)
                break
            chunk = min(seq.num_tokens - seq.num_computed, self._affordable(seq, budget, mixed))
            attention_fits = preempting and fits(seq, chunk)  # (before _admit releases its prefix)
            if not self._admit(seq, chunk, seqs, chunks, fits):
                # Short of KV: a lower priority gives its own (the retracted one goes to the front, this one before).
                retry = attention_fits and self._preempt_for(seq)
                self.waiting.insert(0, seq)
                if retry:
                    continue
                break
            budget -= self._cost(seq, chunk, mixed)
        # Budget left over while requests wait only for a prefix this step computes: fill it with those that share
        # little beside what they bring (they compute the shared tokens again). MMLU's four subjects share a
        # 10-token header; deferring them all left its first step at 382 of 512 tokens, one step more in twelve.
        for seq in list(deferred):
            if budget <= 0 or self.num_active() >= self.max_running:
                break
            self.kv.match_prefix(seq)
            new = seq.num_tokens - seq.num_computed
            if self._shared_uncached(seq, seqs) * FILL_SHARED_RATIO > new:
                self.kv.release(seq)
            elif self._admit(seq, min(new, self._affordable(seq, budget, mixed)), seqs, chunks, fits):
                deferred.remove(seq)  # (on failure _admit has released it)
                budget -= self._cost(seq, chunks[-1], mixed)
        self.waiting[:0] = held + deferred
        if not self.padded_attention and not mixed and len(seqs) == len(continued):  # none admitted: theirs again
            for row in continued:
                seq, upto = seqs[row], seqs[row].num_computed + chunks[row]
                if budget <= 0:
                    break
                extra = min(seq.num_tokens - upto, self._affordable(seq, budget, shrink, at=upto))
                if extra > 0 and self.kv.grow(seq, upto + extra):
                    chunks[row] += extra
                    budget -= extra
        if len(seqs) == base:
            return None
        self.stats.computed_prefill_tokens += sum(chunks[base:])
        return Batch(False, seqs, chunks)

    def _beside_arrivals(self, budget: int, long_under_way: bool) -> int:
        """The budget of the prefills under way in a step that admits arrivals: half, and no more than the arrivals
        bring, so a short request's first step costs about twice what it alone would (the whole budget when no
        arrival would be admitted)."""
        half, arriving = budget // 2, 0
        for seq in self.waiting[:MAX_DEFERRED_SCAN]:
            if seq.admitted:  # retracted earlier: not an arrival
                continue
            new = seq.num_tokens - self.cache.match_len(seq.token_ids[:seq.num_tokens - 1])
            if long_under_way and new > self.chunk_size:
                continue  # held behind the long prefill (below)
            arriving += new
            if arriving >= half:
                return half
        return arriving or budget

    def _owe_the_wait(self, seq: Sequence) -> None:
        """A request that arrived during a prefill step waited for it as running requests do: it is owed its share
        of decoding (``account``), so a short request is not stalled again by the next chunk."""
        end, seconds = self._last_prefill
        waited = end - max(seq.arrival_time, end - seconds)
        if waited > 0 and self.prefill_share < 1.0:
            self._prefill_debt = max(self._prefill_debt, waited * (1.0 - self.prefill_share) / self.prefill_share)

    def _admit(self, seq: Sequence, chunk: int, seqs: list[Sequence], chunks: list[int], fits: Any) -> bool:
        """Add a waiting sequence (its prefix matched) to the extend batch being built, or release it: False."""
        if not fits(seq, chunk) or not self.kv.grow(seq, seq.num_computed + chunk):
            self.kv.release(seq)
            return False
        if not seq.admitted:
            seq.admitted = True
            if seq.num_computed + chunk == seq.num_tokens and len(seq.output_ids) < seq.max_new_tokens:
                self._owe_the_wait(seq)  # its whole prefill in this step, and it will decode
            seq.cached_tokens_reported = seq.num_cached
            self.stats.prompt_tokens += seq.num_tokens
            self.stats.cached_tokens += seq.num_cached
        self.prefilling.append(seq)
        seqs.append(seq)
        chunks.append(chunk)
        return True

    def _shared_uncached(self, seq: Sequence, batch: list[Sequence]) -> int:
        """How many tokens past its cached prefix ``seq`` shares with a sequence already in this extend batch
        (0 without a prefix cache: nothing would be reused)."""
        if not self.cache.keeps_prefixes or not batch:
            return 0
        tokens, longest = seq.token_ids, 0
        for other in batch:
            other_tokens = other.token_ids
            limit = min(len(tokens), len(other_tokens))
            common = seq.num_cached
            while common < limit and tokens[common] == other_tokens[common]:
                common += 1
            longest = max(longest, common - seq.num_cached)
        return longest

    def _priority(self, seq: Sequence) -> int:
        """The priority ``seq`` is scheduled by: its own with priority scheduling on, else 0."""
        return seq.params.priority if self.priority_scheduling else 0

    def _starved(self, seq: Sequence) -> bool:
        """Whether ``seq`` has waited past the starvation guard since it arrived (retracted or not)."""
        return self.starvation_s is not None and self._now - seq.arrival_time >= self.starvation_s

    def _queue_rank(self, seq: Sequence) -> tuple[int, int]:
        # Starved requests first whatever their priority, in the policy's order (its guard's: arrival), then priority.
        return (0, 0) if self._starved(seq) else (1, -self._priority(seq))

    def _outranked(self, running: list[Sequence]) -> bool:
        """Whether a waiting request has a higher priority than a running one (starved ones neither preempt nor
        are preempted: they go first by order alone)."""
        waiting = [self._priority(s) for s in self.waiting if not self._starved(s)]
        preemptible = [self._priority(s) for s in running if not self._starved(s)]
        return bool(waiting and preemptible) and max(waiting) > min(preemptible)

    def _preempt_for(self, seq: Sequence) -> bool:
        """Retract the running request of the lowest priority (the newest of those) if it is below ``seq``'s; a
        starved request is never the victim, so a flood of higher priorities cannot keep retracting it."""
        preemptible = [s for s in self.running if not self._starved(s)]
        if not preemptible or self._starved(seq):
            return False
        victim = min(preemptible, key=lambda s: (self._priority(s), -s.arrival_time))
        if self._priority(victim) >= self._priority(seq):
            return False
        self.retract(victim)
        self.stats.preemptions += 1
        return True

    def _schedule_decode(self) -> Batch | None:
        # Lowest priority, then newest, first out when memory runs short, so older requests keep making progress
        # (starved ones last of all).
        self.running.sort(key=lambda s: (*self._queue_rank(s), s.arrival_time))
        while self.running:
            short = [s for s in self.running if len(s.slots) < s.num_tokens]
            if all(self.kv.grow(s, s.num_tokens) for s in short):
                break
            self.retract(self.running[-1])
        if not self.running:
            return None
        # Usually one token each; a jump-forward leaves several forced tokens to compute, which turns
        # this step into an extend step over the same running batch.
        chunks = [s.num_tokens - s.num_computed for s in self.running]
        return Batch(all(c == 1 for c in chunks), list(self.running), chunks, decoding=True)

    def _grow_prefill(self, seq: Sequence, upto: int) -> bool:
        """``grow`` for a prefill under way; short of slots, newer prefills give theirs back (the newest first), so
        the oldest always progresses: two half-done prompts that the pool cannot both hold would wait forever."""
        while not self.kv.grow(seq, upto):
            newer = self.prefilling[self.prefilling.index(seq) + 1:]
            if not newer:
                return False
            self.retract(newer[-1])
        return True

    def retract(self, seq: Sequence) -> None:
        """Free a running (or prefilling) sequence's KV and requeue it; its tokens so far are recomputed later
        (those the prefix cache keeps are reused)."""
        (self.running if seq in self.running else self.prefilling).remove(seq)
        self.kv.release(seq)
        self.waiting.insert(0, seq)
        self.stats.retractions += 1

    def after_step(self, batch: Batch) -> None:
        """Cache fresh prefill KV; move sequences whose prefill completed into the running set."""
        if not batch.is_decode:
            for seq, chunk in zip(batch.seqs, batch.chunks):
                # (A mixed step's one-token decodes are not prefill: they go in when the request finishes.)
                if not seq.finished and (chunk > 1 or seq in self.prefilling):
                    self.kv.cache_computed_prefix(seq)
        for i, seq in enumerate(batch.seqs):
            # Prefill is over once the request has sampled; a jump-forward on that sample leaves forced tokens
            # to compute, which decode steps do (held in `prefilling`, it could never be retracted: a deadlock).
            if seq in self.prefilling and (seq.finished or batch.samples(i)):
                self.prefilling.remove(seq)
                if not seq.finished:
                    self.running.append(seq)
        self.running = [s for s in self.running if not s.finished]

    def drop(self, seq: Sequence) -> None:
        """Remove a sequence from every queue (finished or aborted) and free its KV."""
        if seq.prefix_node is not None or len(seq.slots):
            self.kv.release(seq)
        for queue in (self.waiting, self.prefilling, self.running):
            if seq in queue:
                queue.remove(seq)
