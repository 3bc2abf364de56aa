"""Speculative decoding's parts on real data structures: n-gram lookup, the radix tree's continuations, a draft cut by
a real regex constraint, and folding a verify step's rows into a sequence (acceptance, stops and limits inside a
draft, slots given back)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jsgl.engine.constrained import ConstraintManager
from jsgl.engine.detokenizer import IncrementalDetokenizer
from jsgl.engine.kv_pool import SlotAllocator
from jsgl.engine.model_runner import StepOutput
from jsgl.engine.output_processor import OutputProcessor
from jsgl.engine.request import FinishReason, SamplingParams
from jsgl.engine.sequence import Sequence
from jsgl.engine.sequence_kv import SequenceKV
from jsgl.engine.speculative import (
    NgramProposer,
    SpeculativeSettings,
    Speculator,
    StepCosts,
    choose_rows,
    grammar_cut,
    prompt_lookup,
)
from jsgl.radix.no_cache import NoPrefixCache
from jsgl.radix.radix_cache import RadixCache
from tests.host_model import OracleProposer, host_engine


def test_prompt_lookup_takes_the_latest_longest_match():
    tokens = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3])
    # "1 2 3" occurs at 1 and 5: the later one is followed by 7 8
    assert prompt_lookup(tokens, 2, 1, 4) == [7, 8]
    assert prompt_lookup(tokens, 10, 3, 3) == [7, 8, 6, 1, 2, 3]
    assert prompt_lookup(np.array([4, 5, 6]), 3, 1, 4) == []  # the last token never occurred before
    assert prompt_lookup(np.array([4]), 3, 1, 4) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 3), st.integers(0, 3))
def test_prompt_lookup_proposes_what_followed_an_earlier_occurrence(tokens, k, min_window, extra):
    max_window = min_window + extra
    arr = np.array(tokens)
    proposal = prompt_lookup(arr, k, min_window, max_window)
    assert len(proposal) <= k
    matches = {n: [i for i in range(len(arr) - n) if (arr[i:i + n] == arr[-n:]).all()]
               for n in range(min_window, min(max_window, len(arr) - 1) + 1)}
    longest = max((n for n, hits in matches.items() if hits), default=None)
    if longest is None:
        assert proposal == []
        return
    start = matches[longest][-1] + longest  # the latest occurrence of the longest matching window
    assert proposal == arr[start: start + k].tolist()


@pytest.mark.parametrize("page", [1, 4])
def test_radix_continuation_follows_the_most_recent_branch(page):
    cache = RadixCache(page_size=page)
    first = list(range(1, 17))
    cache.insert(first, np.arange(100, 116))
    assert cache.continuation(first[:5], 3) == [6, 7, 8]  # inside one run, mid-page too
    assert cache.continuation(first[:8], 20) == first[8:]  # as far as the run goes
    assert cache.continuation(first, 4) == []  # nothing cached beyond
    assert cache.continuation([1, 2, 9], 4) == []  # diverges
    other = first[:8] + [50, 51, 52, 53, 54, 55, 56, 57]
    cache.insert(other, np.arange(200, 216))
    cache.match_prefix(other)  # the newest use
    assert cache.continuation(first[:6], 6) == [7, 8, 50, 51, 52, 53]
    cache.match_prefix(first)
    assert cache.continuation(first[:6], 6) == [7, 8, 9, 10, 11, 12]
    assert NoPrefixCache(page).continuation(first[:4], 4) == []


def test_speculator_backs_off_a_request_whose_drafts_fail(tokenizer):
    seq = _sequence(tokenizer, [1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=100)
    spec = Speculator(NgramProposer(NoPrefixCache(1), 1, 4), SpeculativeSettings(num_draft_tokens=3), 10_000)
    assert spec.draft(seq).tokens == [3, 1, 2]
    pauses = []
    for _ in range(4):
        spec.verified(seq, 3, 0)
        skipped = 0
        while spec.draft(seq) is None:  # paused by the request's own progress: each token it gains counts
            seq.output_ids.append(3)
            skipped += 1
        pauses.append(skipped)
    assert pauses == [1, 2, 4, 8]
    seq.output_ids.clear()
    spec.verified(seq, 3, 2)
    assert spec.draft(seq) is not None and spec.stats.accepted == 2 and spec.stats.proposed == 15
    # No room: one sampled token must follow the draft within max_new_tokens.
    seq.params.max_new_tokens = 1
    assert spec.draft(seq) is None
    seq.params.max_new_tokens = 3
    assert len(spec.draft(seq).tokens) == 2  # two drafts and the token sampled after them


def test_acceptance_record_follows_what_was_accepted(tokenizer):
    seq = _sequence(tokenizer, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2], max_new_tokens=100)
    spec = Speculator(NgramProposer(NoPrefixCache(1), 1, 4), SpeculativeSettings(num_draft_tokens=4), 10_000)
    assert spec.acceptance(seq) == 0.5  # no record yet
    spec.verified(seq, 4, 4)
    high = spec.acceptance(seq)
    spec.verified(seq, 4, 1)  # one accepted, then a rejection: two trials
    assert 0.5 < spec.acceptance(seq) < high
    for _ in range(6):
        spec.verified(seq, 2, 0)
    assert spec.acceptance(seq) < 0.3
    spec.forget(seq)
    assert spec.acceptance(seq) == 0.5


CPU_COSTS = {1: 1.0, 2: 1.27, 4: 1.61, 8: 2.72, 16: 4.36, 32: 9.0}


def test_choose_rows_verifies_what_pays_for_its_rows():
    costs = StepCosts(CPU_COSTS)
    # One request, a likely draft: 4 rows (1.61x a step) for up to 1 + .9 + .81 + .73 expected tokens.
    assert choose_rows(1, 1, [4], [0.9], costs, 64) == [3]
    assert choose_rows(1, 1, [4], [0.1], costs, 64) == [0]  # unlikely: not worth any row
    # Four requests: likely drafts pay for 16 rows, even chances for none.
    assert choose_rows(4, 4, [3] * 4, [0.9] * 4, costs, 64) == [3] * 4  # 16 rows: 13.8 tokens for 2.7x
    assert choose_rows(4, 4, [3] * 4, [0.5] * 4, costs, 64) == [0] * 4
    # Sixteen: 32 rows cost 2.1x 16 rows on this profile, more than even near-certain drafts bring.
    assert choose_rows(16, 16, [3] * 16, [0.97] * 16, costs, 64) == [0] * 16
    # A memory-bound profile (none: every row count costs the same): every draft token, up to max_rows.
    assert choose_rows(3, 3, [4, 4, 4], [0.3] * 3, StepCosts(None), 64) == [4, 4, 4]
    assert sum(choose_rows(3, 3, [4, 4, 4], [0.3] * 3, StepCosts(None), 8)) == 5
    # The most likely tokens first: a prefix of each draft, the likelier request's further.
    keep = choose_rows(2, 2, [4, 4], [0.9, 0.6], costs, 64)
    assert keep[0] >= keep[1] and sum(keep) + 2 in (2, 4, 8)


def test_step_costs_learn_this_machine():
    costs = StepCosts(CPU_COSTS)
    for _ in range(3):
        costs.observe(1, 0.010)
    assert costs.cost(1) == pytest.approx(0.010)
    assert costs.cost(8) == pytest.approx(0.0272)  # the profile, scaled to what was seen
    for _ in range(3):
        costs.observe(8, 0.010)  # a machine where 8 rows cost what 1 does (a memory-bound step)
    assert costs.cost(8) == pytest.approx(0.010) and costs.cost(4) == pytest.approx(0.010)
    assert choose_rows(1, 1, [4], [0.6], costs, 64) == [4]  # free rows: the whole draft (5 rows -> 8)


@pytest.mark.parametrize("backend", ["jsgl", "llguidance"])
def test_grammar_cut_keeps_what_the_regex_allows(tokenizer, backend):
    manager = ConstraintManager(tokenizer, tokenizer.vocab_size, {tokenizer.eos_token_id}, jump_forward=False,
                                grammar_backend=backend)
    seq = _sequence(tokenizer, tokenizer.encode("Age:"), max_new_tokens=16, regex=r"[0-9]{1,3} years")
    manager.prepare(seq)
    manager.activate(seq, 10_000)
    digits = tokenizer.encode("42", add_special_tokens=False)
    words = tokenizer.encode(" years old", add_special_tokens=False)
    draft = grammar_cut(seq, digits + words)
    allowed = tokenizer.decode(draft.tokens)
    assert allowed.startswith("42 years") and "old" not in allowed
    assert len(draft.masks) == len(draft.tokens) + 1
    for token, mask in zip(draft.tokens, draft.masks):
        assert (int(mask[token >> 5]) >> (token & 31)) & 1
    # The request's own state did not move: the whole draft is still allowed from it.
    assert grammar_cut(seq, digits + words).tokens == draft.tokens
    assert grammar_cut(seq, tokenizer.encode("abc", add_special_tokens=False)) is None


@pytest.mark.parametrize("backend", ["jsgl", "llguidance"])
def test_grammar_cut_masks_are_the_states_after_each_prefix(tokenizer, backend):
    """``masks[i]`` is a fresh copy of the constraint advanced by ``tokens[:i]``, the bonus row's (after the last
    token) too: a mask one token behind would let a row sample what the grammar forbids there."""
    manager = ConstraintManager(tokenizer, tokenizer.vocab_size, {tokenizer.eos_token_id}, jump_forward=False,
                                grammar_backend=backend)
    seq = _sequence(tokenizer, tokenizer.encode("Age:"), max_new_tokens=16, regex=r"[0-9]{1,3} years")
    manager.prepare(seq)
    manager.activate(seq, 10_000)
    draft = grammar_cut(seq, tokenizer.encode("42 years", add_special_tokens=False))
    assert tokenizer.decode(draft.tokens) == "42 years" and len(draft.masks) == len(draft.tokens) + 1
    for i, mask in enumerate(draft.masks):
        state = seq.constraint.copy()
        for token in draft.tokens[:i]:
            state.advance(token)
        assert np.array_equal(mask, state.allowed_token_bitmask()), f"mask {i} of {len(draft.masks)}"
    # The states differ (digits only first, then " years" too): equal masks above are not a coincidence.
    assert not np.array_equal(draft.masks[0], draft.masks[1])


def _sequence(tokenizer, prompt_ids, *, max_new_tokens, regex=None, stop=None, min_new_tokens=0):
    params = SamplingParams(max_new_tokens=max_new_tokens, regex=regex, stop=stop, min_new_tokens=min_new_tokens)
    detok = IncrementalDetokenizer(tokenizer, params.stop_strings)
    detok.check_stops = min_new_tokens == 0  # as Engine.submit
    return Sequence(rid="r", prompt_ids=list(prompt_ids), params=params, detok=detok, seed=1,
                    stop_ids={tokenizer.eos_token_id})


def _verify(processor, kv, seq, draft, sampled):
    """Grow ``seq`` for ``draft``, fold ``sampled`` (the rows' tokens, from its last token's) in, shrink."""
    kv.grow(seq, seq.num_tokens + len(draft))
    tokens = np.array(sampled, np.int32)
    accepted = processor.absorb_verified(seq, draft, StepOutput(tokens, None, None), 0)
    if not seq.finished:
        kv.shrink(seq, seq.num_tokens)
    return accepted


@pytest.mark.parametrize("page", [1, 4])
def test_verify_accepts_the_agreeing_prefix_and_gives_back_the_rest(tokenizer, page):
    allocator = SlotAllocator(64, page)
    kv = SequenceKV(allocator, NoPrefixCache(page))
    processor = OutputProcessor(ConstraintManager(tokenizer, tokenizer.vocab_size, set(), False),
                                tokenizer.vocab_size, 10_000)
    words = tokenizer.encode(" one two three four five six seven eight nine ten", add_special_tokens=False)
    seq = _sequence(tokenizer, words[:3], max_new_tokens=100)
    kv.grow(seq, seq.num_tokens)
    seq.num_computed = 2  # the last prompt token is the one a decode step computes
    free = allocator.num_free()
    # Draft w3 w4 w5; the model samples w3 w4 then x: two accepted, and its own x as the third token.
    assert _verify(processor, kv, seq, words[3:6], [words[3], words[4], 7, 8]) == 2
    assert seq.output_ids == [words[3], words[4], 7]
    assert seq.num_computed == 5 and seq.num_tokens == 6 and len(seq.slots) == -(-6 // page) * page
    assert allocator.num_free() == free - (len(seq.slots) - -(-3 // page) * page)
    # A draft wholly rejected keeps only the first sample; one wholly accepted adds the bonus token.
    assert _verify(processor, kv, seq, [11, 12], [13, 14, 15]) == 0
    assert seq.output_ids[-1] == 13 and seq.num_computed == 6
    assert _verify(processor, kv, seq, [21, 22], [21, 22, 23]) == 2
    assert seq.output_ids[-3:] == [21, 22, 23] and seq.num_computed == 9 and seq.num_tokens == 10


def test_verify_stops_inside_a_draft(tokenizer):
    kv = SequenceKV(SlotAllocator(64), NoPrefixCache(1))
    processor = OutputProcessor(ConstraintManager(tokenizer, tokenizer.vocab_size, set(), False),
                                tokenizer.vocab_size, 10_000)
    eos = tokenizer.eos_token_id
    words = tokenizer.encode(" red green blue", add_special_tokens=False)
    # EOS accepted inside the draft: the request stops there, the tokens after it are not taken.
    seq = _sequence(tokenizer, [1, 2], max_new_tokens=100)
    kv.grow(seq, 2)
    seq.num_computed = 1
    assert _verify(processor, kv, seq, [words[0], eos, words[1]], [words[0], eos, words[1], words[2]]) == 2
    assert seq.finish_reason == FinishReason.STOP and seq.output_ids == [words[0], eos]
    # ... but not before min_new_tokens (the bias row of that position masks EOS, so the model never samples it).
    # max_new_tokens inside a draft: the request ends at its budget.
    seq = _sequence(tokenizer, [1, 2], max_new_tokens=2)
    kv.grow(seq, 2)
    seq.num_computed = 1
    assert _verify(processor, kv, seq, words, [*words, 9]) == 2  # both agreed; the second ends the request
    assert seq.finish_reason == FinishReason.LENGTH and seq.output_ids == words[:2]
    # A stop string completed inside the draft.
    seq = _sequence(tokenizer, [1, 2], max_new_tokens=100, stop=[" green"])
    kv.grow(seq, 2)
    seq.num_computed = 1
    _verify(processor, kv, seq, words, [*words, 9])
    assert seq.finish_reason == FinishReason.STOP and seq.detok.text == " red"


def test_verify_rows_sample_as_the_request_would_at_each_position(tokenizer):
    processor = OutputProcessor(ConstraintManager(tokenizer, tokenizer.vocab_size, set(), False),
                                tokenizer.vocab_size, 10_000)
    kv = SequenceKV(SlotAllocator(64), NoPrefixCache(1))
    seq = _sequence(tokenizer, [1, 2, 3], max_new_tokens=100, min_new_tokens=2)
    seq.params.frequency_penalty = 0.5
    seq.output_ids = [7]
    kv.grow(seq, seq.num_tokens + 2)
    seq.num_computed = 3
    from jsgl.engine.speculative import Draft

    rows = processor.verify_items(seq, Draft([8, 8]))
    assert [int(r.token_ids[0]) for r in rows] == [7, 8, 8] and [r.start_pos for r in rows] == [3, 4, 5]
    assert [r.step for r in rows] == [1, 2, 3]  # the seeded noise of output positions 1, 2, 3
    eos = tokenizer.eos_token_id
    assert rows[0].logit_bias[eos] == -np.inf and rows[1].logit_bias[eos] == 0.0  # min_new_tokens = 2
    # Row i samples after the output and the draft's first i tokens: the frequency penalty counts them.
    assert [float(r.logit_bias[8]) for r in rows] == [0.0, -0.5, -1.0]
    assert [float(r.logit_bias[7]) for r in rows] == [-0.5, -0.5, -0.5]


# ------------------------------------------------------------------ verify steps through EngineLoop (host model)
# Quick counterparts of test_speculative.py's engine tests (slow: the real model): EngineLoop with the host model
# (tests/host_model.py) and drafts from an oracle of it, right up to a chosen token, against the loop without drafts.
GREEDY, SEEDED, PENALIZED = dict(temperature=0.0), dict(temperature=0.9), dict(temperature=0.8, frequency_penalty=0.3)


def _host_requests(tokenizer, params, max_new_tokens=12, prompts=None):
    """Fresh requests (one per params dict, each its own id and seed) over prompts that share nothing."""
    seqs = []
    for i, extra in enumerate(params):
        sampling = SamplingParams(**{"max_new_tokens": max_new_tokens, "ignore_eos": True, **extra})
        prompt = prompts[i] if prompts is not None else [100 + 10 * i + k for k in range(6)]
        seqs.append(Sequence(rid=f"r{i}", prompt_ids=list(prompt), params=sampling,
                             detok=IncrementalDetokenizer(tokenizer, sampling.stop_strings), seed=7 + i,
                             stop_ids=set(sampling.stop_token_ids or [])))
    return seqs


def _speculating(engine, wrong_from, num_draft_tokens=3):
    engine.loop.speculator = Speculator(OracleProposer(engine.runner, wrong_from),
                                        SpeculativeSettings(num_draft_tokens=num_draft_tokens),
                                        engine.scheduler.token_limit)
    return engine.loop.speculator


def _outputs(seqs):
    return [(s.output_ids, s.finish_reason, s.detok.text) for s in seqs]


def _plain_and_speculative(tokenizer, params, wrong_from, *, page_size=1, between=None, **request_options):
    """The same requests through the loop without drafts and with the oracle's: (plain, speculative) engines
    and requests."""
    runs = []
    for speculative in (False, True):
        engine = host_engine(tokenizer, page_size=page_size)
        if speculative:
            _speculating(engine, wrong_from)
        seqs = _host_requests(tokenizer, params, **request_options)
        engine.run(seqs, between=between(seqs, engine) if between is not None else None)
        assert engine.pool_is_whole()
        runs.append((engine, seqs))
    return runs


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("wrong_from", [0, 1, 3])
def test_after_each_verify_step_a_request_holds_the_slots_of_its_tokens_only(tokenizer, page, wrong_from):
    """EngineLoop's verify steps, drafts wholly rejected (0), partly (1) or wholly accepted (3 of 3): right after
    each step a running request holds at most the pages of its tokens (a rejected draft's slots are not kept until
    the request ends), and the pool accounts for every slot."""
    engine = host_engine(tokenizer, page_size=page)
    spec = _speculating(engine, wrong_from)
    seqs = _host_requests(tokenizer, [GREEDY, GREEDY, SEEDED], max_new_tokens=16)
    for seq in seqs:
        engine.scheduler.add(seq)
    checked = 0
    while not engine.loop.idle():
        verified = spec.stats.verify_steps
        engine.loop.step()
        if spec.stats.verify_steps == verified:
            continue
        checked += 1
        running = engine.scheduler.running
        for seq in running:
            # (one without a draft in the step holds no slot yet for its newest token)
            assert seq.num_computed <= len(seq.slots) <= -(-seq.num_tokens // page) * page, \
                (seq.rid, len(seq.slots), seq.num_tokens)
        assert engine.allocator.num_free() + sum(len(s.slots) for s in running) == engine.allocator.capacity
    assert checked >= 3 and (spec.stats.accepted > 0) == (wrong_from > 0)
    assert engine.allocator.num_free() == engine.allocator.capacity


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("wrong_from", [0, 2])
def test_verify_steps_give_the_plain_loops_tokens_greedy_seeded_and_penalized(tokenizer, wrong_from, page):
    """Drafts accepted in part (or never) change no token of a greedy, a seeded and a penalized request
    (test_speculative's greedy, seeded and page-of-sixteen tests), and nothing leaks; fewer forward passes when drafts
    are accepted."""
    (plain, plain_seqs), (engine, seqs) = _plain_and_speculative(tokenizer, [GREEDY, SEEDED, PENALIZED, GREEDY],
                                                                 wrong_from, page_size=page)
    assert _outputs(seqs) == _outputs(plain_seqs)
    assert all(s.finish_reason == FinishReason.LENGTH for s in seqs)
    spec = engine.loop.speculator
    assert spec.stats.verify_steps > 0 and (spec.stats.accepted > 0) == (wrong_from > 0)
    assert (engine.loop.forward_passes < plain.loop.forward_passes) == (wrong_from > 0)


def test_verified_tokens_logprobs_are_their_rows(tokenizer):
    """A verified token's logprob and top logprobs are those of the row that sampled it: the plain loop's."""
    wanted = dict(temperature=0.0, return_logprob=True, top_logprobs_num=3)
    (_, plain_seqs), (engine, seqs) = _plain_and_speculative(tokenizer, [wanted, wanted], 2)
    assert engine.loop.speculator.stats.accepted > 0
    for got, want in zip(seqs, plain_seqs):
        assert got.output_ids == want.output_ids and len(got.output_logprobs) == len(got.output_ids)
        assert got.output_logprobs == want.output_logprobs
        assert got.output_top_logprobs == want.output_top_logprobs


def test_constrained_tokens_are_the_same_and_jumps_ride_decode_steps(tokenizer):
    """Under a regex with a forced run (", because "): the same tokens as without drafts, the same forced tokens, and
    the forced run rides a decode step's rows instead of an extend step of its own."""
    constrained = dict(temperature=0.0, regex=r"(yes|no), because [a-z]{1,12} [a-z]{1,12}\.")
    (plain, plain_seqs), (engine, seqs) = _plain_and_speculative(tokenizer, [constrained, GREEDY], 2,
                                                                 max_new_tokens=40)
    assert _outputs(seqs) == _outputs(plain_seqs)
    assert ", because " in seqs[0].detok.text and seqs[0].finish_reason == FinishReason.STOP
    jumped = [s.jump_forward_tokens for s in seqs]
    assert jumped == [s.jump_forward_tokens for s in plain_seqs] and jumped[0] > 0
    assert engine.scheduler.stats.extend_steps < plain.scheduler.stats.extend_steps
    assert engine.loop.speculator.stats.accepted > 0


def test_limits_stops_and_aborts_inside_drafts_leak_nothing(tokenizer):
    """A budget, a stop token and a stop string reached inside an accepted draft, min_new_tokens past a stop token
    there, and a request aborted between verify steps: each ends as without drafts, and the pool comes back whole."""
    plain, plain_seqs = host_engine(tokenizer), _host_requests(tokenizer, [GREEDY], max_new_tokens=20)
    plain.run(plain_seqs)
    text, ids = plain_seqs[0].detok.text, plain_seqs[0].output_ids
    stop_token, stop_string = ids[5], tokenizer.decode(ids[7:9])
    assert stop_string and stop_string in text and ids.index(stop_token) == 5
    cases = [dict(max_new_tokens=7), dict(stop_token_ids=[stop_token]), dict(stop=[stop_string]),
             dict(stop_token_ids=[stop_token], min_new_tokens=8), dict()]
    prompt = plain_seqs[0].prompt_ids

    def abort_the_last(seqs, engine):
        def between(step):
            if step == 4 and not seqs[-1].finished:
                engine.loop.finish(seqs[-1], FinishReason.ABORT)
        return between

    (_, plain_seqs), (engine, seqs) = _plain_and_speculative(
        tokenizer, [{**GREEDY, **case} for case in cases], 2, max_new_tokens=20, prompts=[prompt] * len(cases),
        between=abort_the_last)
    assert _outputs(seqs[:-1]) == _outputs(plain_seqs[:-1])
    assert [s.finish_reason for s in seqs] == [FinishReason.LENGTH, FinishReason.STOP, FinishReason.STOP,
                                               FinishReason.LENGTH, FinishReason.ABORT]
    assert len(seqs[0].output_ids) == 7 and seqs[1].output_ids[-1] == stop_token
    assert engine.loop.speculator.stats.accepted > 0


def test_a_failed_verify_step_falls_back_to_plain_steps(tokenizer):
    """A verify step whose dispatch fails (the pools intact) gives its drafts' slots back and steps its requests
    without drafts: the same tokens as the plain loop, nothing leaked."""
    failures = []

    def fail_the_first_verify_step(seqs, engine):
        def fails(items):
            if not failures and len(items) > len(seqs):  # rows beyond one per request: drafts
                failures.append(len(items))
                return True
            return False
        engine.runner.fail = fails
        return None

    (_, plain_seqs), (engine, seqs) = _plain_and_speculative(tokenizer, [GREEDY, SEEDED], 2,
                                                             between=fail_the_first_verify_step)
    assert failures and _outputs(seqs) == _outputs(plain_seqs)
    assert all(s.finish_reason == FinishReason.LENGTH for s in seqs)


def test_an_answer_asked_again_is_drafted_from_the_prefix_cache_and_accepted_whole(tokenizer):
    """NgramProposer on the loop's radix cache: asked the same greedy prompt again, the cached answer is the draft,
    and the model accepts all of it."""
    engine = host_engine(tokenizer, prefix_cache="radix")
    spec = engine.loop.speculator = Speculator(NgramProposer(engine.loop.prefix_cache, 1, 4),
                                               SpeculativeSettings(num_draft_tokens=4), engine.scheduler.token_limit)
    first = _host_requests(tokenizer, [GREEDY], max_new_tokens=16)
    engine.run(first)
    proposed, accepted = spec.stats.proposed, spec.stats.accepted
    again = _host_requests(tokenizer, [GREEDY], max_new_tokens=16)
    engine.run(again)
    assert again[0].output_ids == first[0].output_ids
    assert spec.stats.proposed - proposed >= 8 and spec.stats.accepted - accepted == spec.stats.proposed - proposed
    assert engine.pool_is_whole()
