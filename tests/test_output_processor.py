"""OutputProcessor on hand-worked steps: the inputs it builds for a request's share of a step (tokens, sampling
parameters, prompt-logprob targets, penalties as logit bias / repetition scale, the grammar's bitmask) and how
it folds a step's sampled tokens back (logprob bookkeeping, stop tokens / strings / regexes, min_new_tokens,
length and context limits, grammar termination, jump-forward, and a request error that ends only its request).

Real Sequence, SamplingParams, IncrementalDetokenizer (over a one-character-per-token tokenizer) and
ConstraintManager; the grammar is a small literal grammar written here (a GrammarBackend with jump-forward), and
the step outputs are StepOutput arrays written by hand.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import regex

from jsgl.engine.constrained import ConstraintManager
from jsgl.engine.detokenizer import STOP_REGEX_TIMEOUT_S, IncrementalDetokenizer
from jsgl.engine.model_runner import StepOutput
from jsgl.engine.output_processor import OutputProcessor
from jsgl.engine.request import AbortReason, FinishReason, InvalidRequestError, SamplingParams
from jsgl.engine.sequence import Sequence
from jsgl.fsm.grammar_backend import ForcedTail, GrammarBackend

V = 32  # vocabulary
EOS = 30


class CharTokenizer:
    """Token i is the letter chr(97 + i % 26)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def text(ids):
    return CharTokenizer().decode(ids)


class Literal:
    """A grammar accepting exactly `target` (then EOS, if any EOS id is given)."""

    def __init__(self, target, eos_ids):
        self.target, self.eos, self.pos, self.advanced = list(target), set(eos_ids), 0, []

    def allowed_token_bitmask(self):
        allowed = [self.target[self.pos]] if self.pos < len(self.target) else sorted(self.eos)
        mask = np.zeros((V + 31) // 32, np.uint32)
        for t in allowed:
            mask[t >> 5] |= np.uint32(1 << (t & 31))
        return mask

    def advance(self, token):
        assert self.pos < len(self.target) and token == self.target[self.pos], (token, self.pos)
        self.pos += 1
        self.advanced.append(token)

    def is_terminated(self):
        return self.pos == len(self.target) and not self.eos


class LiteralBackend(GrammarBackend):
    """Jump-forward over the rest of the literal once two or more tokens of it are left (decoded like sampled
    tokens: ForcedTail.text None)."""

    name = "literal"
    kinds = frozenset({"regex"})
    jump_forward = True

    def compile(self, spec):
        raise NotImplementedError

    def new_constraint(self, compiled, eos_ids):
        return Literal(compiled, eos_ids)

    def forced_tail(self, constraint, output_ids):
        rest = constraint.target[constraint.pos:]
        return ForcedTail(rest, 0) if len(rest) >= 2 else None

    def commit_tail(self, constraint, tail):
        constraint.pos += len(tail.tokens)


def processor(max_context=64, jump_forward=True):
    constraints = ConstraintManager(None, V, {EOS}, jump_forward, grammar_backend=LiteralBackend(None, V))
    return OutputProcessor(constraints, V, max_context)


def seq(prompt, stop_ids=(), literal=None, **params):
    p = SamplingParams(**params)
    detok = IncrementalDetokenizer(CharTokenizer(), p.stop_strings, stop_regexes=p.stop_regexes,
                                   no_stop_trim=p.no_stop_trim)
    detok.check_stops = p.min_new_tokens == 0  # as Engine.submit
    s = Sequence(rid="r", prompt_ids=list(prompt), params=p, detok=detok, seed=11, stop_ids=set(stop_ids))
    if literal is not None:
        s.constraint = Literal(literal, s.stop_ids)
    return s


def out(tokens, logprobs=None, top=None, prompt=None, prompt_top=None):
    return StepOutput(np.asarray(tokens, np.int32), None if logprobs is None else np.asarray(logprobs, np.float32),
                      top, prompt, prompt_top)


def sample(proc, s, token, **kw):
    """A decode step of `s` that samples `token`; returns absorb's answer."""
    chunk = s.num_tokens - s.num_computed
    return proc.absorb(s, chunk, True, out([token], **kw), 0)


def prefill(proc, s, token=0):
    return proc.absorb(s, s.num_tokens - s.num_computed, True, out([token]), 0)


# -------------------------------------------------------------------------------------------- step inputs
def test_forward_item_is_the_next_chunk_with_the_requests_sampling_parameters():
    proc = processor()
    s = seq([3, 4, 5, 6, 7], temperature=0.7, top_p=0.9, top_k=5, min_p=0.1)
    s.num_computed, s.slots = 2, np.arange(10, 15, dtype=np.int32)
    item = proc.forward_item(s, 2, samples=False)
    assert item.token_ids.tolist() == [5, 6] and item.token_ids.dtype == np.int32
    assert item.start_pos == 2 and item.slots is s.slots
    assert (item.temperature, item.top_p, item.top_k, item.min_p) == (pytest.approx(0.7), 0.9, 5, 0.1)
    assert (item.seed, item.step) == (11, 0)
    assert item.logit_bias is None and item.repetition_scale is None and item.bitmask is None
    assert item.target_ids is None


def test_forward_item_of_a_decode_step_and_its_sampling_step_number():
    proc = processor()
    s = seq([3, 4], temperature=0.5)
    s.output_ids = [9, 8, 1]
    s.num_computed = 4
    item = proc.forward_item(s, 1, samples=True)
    assert item.token_ids.tolist() == [1] and item.start_pos == 4 and item.step == 3


@pytest.mark.parametrize(("params", "temperature"), [
    ({"temperature": 0.0}, 0.0), ({"temperature": 1e-6}, 0.0), ({"temperature": 0.8, "top_k": 1}, 0.0),
    ({"temperature": 0.8, "top_k": 2}, 0.8)])
def test_greedy_requests_sample_at_temperature_zero(params, temperature):
    item = processor().forward_item(seq([1, 2], **params), 2, samples=True)
    assert item.temperature == pytest.approx(temperature)


def test_prompt_logprob_targets_are_the_next_tokens_padded_at_the_end():
    proc = processor()
    s = seq([3, 4, 5, 6, 7], return_logprob=True, logprob_start_len=0)
    s.num_computed = 1
    assert proc.forward_item(s, 2, samples=False).target_ids.tolist() == [5, 6]
    s.num_computed = 3
    item = proc.forward_item(s, 2, samples=True)  # the last prompt position predicts no prompt token
    assert item.target_ids.tolist() == [7, 0] and item.target_ids.dtype == np.int32
    s.num_computed = 0
    assert proc.forward_item(s, 5, samples=True).target_ids.tolist() == [4, 5, 6, 7, 0]


def test_no_prompt_logprob_targets_unless_asked():
    proc = processor()
    assert proc.forward_item(seq([3, 4, 5], return_logprob=True), 3, True).target_ids is None
    assert proc.forward_item(seq([3, 4, 5], logprob_start_len=0), 3, True).target_ids is None


def test_grammar_bitmask_only_on_sampling_rows():
    proc = processor()
    s = seq([1, 2, 3], literal=[5, 6])
    assert proc.forward_item(s, 2, samples=False).bitmask is None
    mask = proc.forward_item(s, 3, samples=True).bitmask
    assert mask.tolist() == [1 << 5]


# ----------------------------------------------------------------------------------- penalties as logits
def bias_of(s):
    return processor().forward_item(s, 1, samples=True).logit_bias


def test_no_bias_without_penalties_bias_or_min_tokens():
    assert bias_of(seq([1])) is None
    s = seq([1], stop_ids=[EOS])
    s.output_ids = [2]
    assert bias_of(s) is None


def test_frequency_and_presence_penalties_count_the_output():
    s = seq([1, 3, 3], frequency_penalty=0.5, presence_penalty=0.25)
    s.output_ids = [3, 3, 5]
    expected = np.zeros(V, np.float32)
    expected[3] = -(0.5 * 2 + 0.25)  # the prompt's 3s do not count
    expected[5] = -(0.5 * 1 + 0.25)
    bias = bias_of(s)
    assert bias.dtype == np.float32 and bias.shape == (V,)
    np.testing.assert_allclose(bias, expected)


@pytest.mark.parametrize(("freq", "pres", "at3"), [(0.5, 0.0, -1.0), (0.0, 0.25, -0.25), (-0.5, 0.0, 1.0)])
def test_either_penalty_alone(freq, pres, at3):
    s = seq([1], frequency_penalty=freq, presence_penalty=pres)
    s.output_ids = [3, 3]
    expected = np.zeros(V, np.float32)
    expected[3] = at3
    np.testing.assert_allclose(bias_of(s), expected)


def test_penalties_wait_for_the_first_output_token():
    assert bias_of(seq([3, 3], frequency_penalty=0.5, presence_penalty=0.5)) is None


def test_logit_bias_adds_to_the_penalties():
    s = seq([1], frequency_penalty=1.0, logit_bias={"3": 2.5, "7": -1.0})
    s.output_ids = [3]
    expected = np.zeros(V, np.float32)
    expected[3], expected[7] = -1.0 + 2.5, -1.0
    np.testing.assert_allclose(bias_of(s), expected)
    alone = seq([1], logit_bias={"3": 2.5})
    expected = np.zeros(V, np.float32)
    expected[3] = 2.5
    np.testing.assert_allclose(bias_of(alone), expected)


def test_output_token_outside_the_vocabulary_is_not_penalized():
    s = seq([1], frequency_penalty=1.0)
    s.output_ids = [3, V + 2]
    expected = np.zeros(V, np.float32)
    expected[3] = -1.0
    np.testing.assert_allclose(bias_of(s), expected)


def test_min_new_tokens_bans_stop_tokens_until_reached():
    s = seq([1], stop_ids=[EOS, 4, V, V + 5], min_new_tokens=2, logit_bias={"6": 1.0})
    expected = np.zeros(V, np.float32)
    expected[[EOS, 4]] = -np.inf  # stop ids outside the (model's) vocabulary are skipped
    expected[6] = 1.0
    np.testing.assert_array_equal(bias_of(s), expected)
    s.output_ids = [1]
    np.testing.assert_array_equal(bias_of(s), expected)
    s.output_ids = [1, 2]
    expected[[EOS, 4]] = 0.0
    np.testing.assert_array_equal(bias_of(s), expected)


def test_min_new_tokens_without_stop_tokens_needs_no_bias():
    assert bias_of(seq([1], min_new_tokens=3)) is None


def test_repetition_scale_marks_generated_tokens():
    proc = processor()
    s = seq([2, 9], repetition_penalty=1.3)
    assert proc.forward_item(s, 2, True).repetition_scale is None  # nothing generated yet
    s.output_ids = [2, 2, 5]
    scale = proc.forward_item(s, 1, True).repetition_scale
    expected = np.ones(V, np.float32)
    expected[[2, 5]] = 1.3
    assert scale.dtype == np.float32
    np.testing.assert_array_equal(scale, expected)
    assert proc.forward_item(s, 1, False).repetition_scale is None
    plain = seq([2, 9])
    plain.output_ids = [2]
    assert proc.forward_item(plain, 1, True).repetition_scale is None


# ------------------------------------------------------------------------------------------ step outputs
def test_a_chunk_that_does_not_sample_only_advances():
    proc = processor()
    s = seq(range(10))
    assert proc.absorb(s, 4, False, out([5]), 0) is False
    assert s.num_computed == 4 and s.output_ids == [] and not s.finished


def test_a_finished_request_absorbs_its_chunk_but_no_token():
    proc = processor()
    s = seq(range(4))
    s.finish_reason = FinishReason.ABORT  # aborted while its step ran
    assert proc.absorb(s, 4, True, out([5]), 0) is False
    assert s.num_computed == 4 and s.output_ids == []


def test_prefill_only_request_ends_with_length_and_no_token():
    proc = processor()
    s = seq(range(4), max_new_tokens=0)
    assert prefill(proc, s, 5) is True
    assert s.finish_reason == FinishReason.LENGTH and s.output_ids == [] and s.num_computed == 4


def test_sampled_token_of_its_row_and_its_logprobs():
    proc = processor()
    s = seq([1, 2], return_logprob=True, top_logprobs_num=2)
    s.num_computed = 1
    step = out(np.array([4, 6]), logprobs=[-0.5, -0.25],
               top=(np.array([[-0.1, -0.2, -0.3], [-0.25, -1.5, -2.5]]), np.array([[9, 8, 7], [6, 3, 2]])))
    assert proc.absorb(s, 1, True, step, 1) is True
    assert s.output_ids == [6] and type(s.output_ids[0]) is int and s.num_computed == 2
    assert s.output_logprobs == [-0.25] and type(s.output_logprobs[0]) is float
    assert s.output_top_logprobs == [[(-0.25, 6), (-1.5, 3)]]
    assert type(s.output_top_logprobs[0][0][1]) is int and type(s.output_top_logprobs[0][0][0]) is float
    assert s.detok.text == "g" and not s.finished


def test_no_logprobs_unless_asked():
    proc = processor()
    s = seq([1, 2])
    top = (np.array([[-0.1, -0.2]]), np.array([[9, 8]]))
    sample(proc, s, 4, logprobs=[-0.5], top=top)
    assert s.output_ids == [4] and s.output_logprobs == [] and s.output_top_logprobs == []
    no_top = seq([1, 2], return_logprob=True)
    sample(proc, no_top, 4, logprobs=[-0.5], top=top)
    assert no_top.output_logprobs == [-0.5] and no_top.output_top_logprobs == []
    missing = seq([1, 2], return_logprob=True, top_logprobs_num=2)
    sample(proc, missing, 4, logprobs=[-0.5])
    assert missing.output_logprobs == [-0.5] and missing.output_top_logprobs == []


def test_stop_token_finishes_and_is_trimmed_from_the_text():
    proc = processor()
    s = seq([1], stop_ids=[EOS, 3])
    assert sample(proc, s, 2) is True and not s.finished
    assert sample(proc, s, 3) is True
    assert (s.finish_reason, s.matched_stop, s.output_ids, s.detok.text) == (FinishReason.STOP, 3, [2, 3], "c")


def test_stop_token_as_the_first_token_leaves_no_text():
    proc = processor()
    s = seq([1], stop_ids=[3])
    sample(proc, s, 3)
    assert (s.finish_reason, s.matched_stop, s.output_ids, s.detok.text) == (FinishReason.STOP, 3, [3], "")


def test_stop_token_kept_in_the_text_with_no_stop_trim():
    proc = processor()
    s = seq([1], stop_ids=[3], no_stop_trim=True)
    sample(proc, s, 3)
    assert (s.finish_reason, s.matched_stop, s.detok.text) == (FinishReason.STOP, 3, "d")


def test_stop_token_is_ignored_before_min_new_tokens():
    proc = processor()
    s = seq([1], stop_ids=[3], min_new_tokens=2, max_new_tokens=5)
    sample(proc, s, 3)
    assert not s.finished and s.detok.text == "d"
    sample(proc, s, 3)
    assert (s.finish_reason, s.matched_stop, s.output_ids, s.detok.text) == (FinishReason.STOP, 3, [3, 3], "d")


def test_stop_string_finishes_with_the_string_as_matched_stop():
    proc = processor()
    s = seq([1], stop="cd", max_new_tokens=10)
    for t in (0, 2):
        sample(proc, s, t)
    assert not s.finished
    sample(proc, s, 3)
    assert (s.finish_reason, s.matched_stop, s.detok.text) == (FinishReason.STOP, "cd", "a")


def test_stop_strings_wait_for_min_new_tokens():
    proc = processor()
    s = seq([1], stop="x", min_new_tokens=3, max_new_tokens=10)
    for t in (23, 0):  # "x" as the first token: before min_new_tokens
        sample(proc, s, t)
        assert not s.finished
    sample(proc, s, 1)  # min_new_tokens reached; the early "x" is behind the new text
    assert not s.finished and s.detok.text == "xab"
    sample(proc, s, 23)
    assert (s.finish_reason, s.matched_stop, s.detok.text) == (FinishReason.STOP, "x", "xab")


@pytest.mark.parametrize("max_new", [1, 3])
def test_length_finishes_at_max_new_tokens(max_new):
    proc = processor()
    s = seq([1], max_new_tokens=max_new)
    for _ in range(max_new - 1):
        sample(proc, s, 2)
        assert not s.finished
    sample(proc, s, 2)
    assert s.finish_reason == FinishReason.LENGTH and s.matched_stop is None and len(s.output_ids) == max_new


def test_length_finishes_at_the_context_limit():
    proc = processor(max_context=6)
    s = seq([1, 2, 3], max_new_tokens=None)
    sample(proc, s, 4)
    sample(proc, s, 4)
    assert not s.finished and s.num_tokens == 5
    sample(proc, s, 4)
    assert s.finish_reason == FinishReason.LENGTH and s.num_tokens == 6


def test_a_stop_token_wins_over_the_length_limit():
    proc = processor()
    s = seq([1], stop_ids=[3], max_new_tokens=1)
    sample(proc, s, 3)
    assert (s.finish_reason, s.matched_stop) == (FinishReason.STOP, 3)


def test_grammar_advances_on_sampled_tokens_and_ends_the_request_when_complete():
    proc = processor(jump_forward=False)
    s = seq([1], literal=[5, 6])
    sample(proc, s, 5)
    assert s.constraint.advanced == [5] and not s.finished
    sample(proc, s, 6)
    assert s.constraint.advanced == [5, 6]
    assert (s.finish_reason, s.matched_stop, s.detok.text) == (FinishReason.STOP, None, "fg")


def test_grammar_is_not_advanced_by_a_stop_token():
    proc = processor(jump_forward=False)
    s = seq([1], stop_ids=[EOS], literal=[5])
    sample(proc, s, 5)
    assert not s.finished  # the literal is complete; EOS ends it
    sample(proc, s, EOS)  # Literal.advance would reject EOS
    assert s.constraint.advanced == [5] and (s.finish_reason, s.matched_stop) == (FinishReason.STOP, EOS)


def test_jump_forward_appends_the_forced_tokens():
    proc = processor()
    s = seq([1], stop_ids=[EOS], literal=[5, 6, 7, 8])
    sample(proc, s, 5)
    assert s.output_ids == [5, 6, 7, 8] and s.jump_forward_tokens == 3 and s.detok.text == "fghi"
    assert not s.finished and s.num_computed == 1  # the forced tokens are computed next step
    assert proc.constraints.jumps == 1
    sample(proc, s, EOS)
    assert (s.finish_reason, s.output_ids) == (FinishReason.STOP, [5, 6, 7, 8, EOS])


@pytest.mark.parametrize(("params", "reason"), [({"max_new_tokens": 1}, FinishReason.LENGTH),
                                               ({"stop": "f"}, FinishReason.STOP)])
def test_no_jump_forward_once_finished(params, reason):
    proc = processor()
    s = seq([1], literal=[5, 6, 7, 8], **params)
    sample(proc, s, 5)
    assert (s.finish_reason, s.output_ids, s.jump_forward_tokens) == (reason, [5], 0)


def test_jump_forward_text_that_hits_a_stop_string_finishes_the_request():
    proc = processor()
    s = seq([1], stop="gh", literal=[5, 6, 7, 8], max_new_tokens=10)
    sample(proc, s, 5)
    assert (s.finish_reason, s.matched_stop, s.detok.text) == (FinishReason.STOP, "gh", "f")


SLOW_REGEX = "(.*a){20}c"  # backtracks polynomially (degree 20) over a run of "a": the search soon times out


def test_a_stop_regex_too_slow_to_search_fails_only_its_request():
    proc = processor(max_context=4096)
    s = seq([1], stop_regex=SLOW_REGEX, max_new_tokens=None)
    for _ in range(100):
        assert sample(proc, s, 0) is True  # "a"
        if s.finished:
            break
    assert (s.finish_reason, s.abort_reason) == (FinishReason.ABORT, AbortReason.INVALID_REQUEST)
    assert "stop_regex patterns took over" in s.error and repr(SLOW_REGEX) in s.error


def test_a_stop_regex_too_slow_in_jumped_text_fails_only_its_request():
    proc = processor(max_context=4096)
    s = seq([1], stop_regex=SLOW_REGEX, literal=[0] * 100, max_new_tokens=None)
    assert sample(proc, s, 0) is True  # one "a" is searched quickly; the 99 jumped ones are not
    assert s.output_ids == [0] * 100  # the jump happened; searching its text raised
    assert (s.finish_reason, s.abort_reason) == (FinishReason.ABORT, AbortReason.INVALID_REQUEST)
    assert "stop_regex patterns took over" in s.error and repr(SLOW_REGEX) in s.error


def test_many_stop_regexes_share_one_budget_per_step():
    """Eight patterns each well inside the budget alone (~2 ms a search over 17 "x"s) exceed it together: the
    request fails, where each pattern timing alone let it cost the engine thread ~8 budgets a token."""
    patterns = [f"(x|xx)+{end}" for end in "yzqwvjkb"]
    single = regex.compile(patterns[0])
    started = time.perf_counter()
    single.search("x" * 17, 0)
    assert time.perf_counter() - started < STOP_REGEX_TIMEOUT_S / 2, "this machine is too slow for the premise"
    detok = IncrementalDetokenizer(CharTokenizer(), [], stop_regexes=patterns)
    with pytest.raises(InvalidRequestError, match="stop_regex patterns took over 10 ms together"):
        for n in range(1, 18):
            detok.add([23] * n)  # the output so far: n "x"s


# ------------------------------------------------------------------------------------------ prompt logprobs
def prompt_step(values, top=None, row=0, rows=1):
    vals = [np.zeros(len(values), np.float32)] * rows
    vals[row] = np.asarray(values, np.float32)
    tops = None
    if top is not None:
        tops = [top] * rows
    return StepOutput(np.zeros(rows, np.int32), np.zeros(rows, np.float32), None, vals, tops)


def test_prompt_logprobs_from_the_start_over_two_chunks():
    proc = processor()
    s = seq([10, 11, 12, 13, 14, 15], return_logprob=True, logprob_start_len=0)
    # Position p predicts prompt token p + 1; token 0 has no logprob (None).
    proc.absorb(s, 3, False, prompt_step([-1.0, -2.0, -3.0]), 0)
    assert s.input_logprobs == [None, -1.0, -2.0, -3.0]
    proc.absorb(s, 3, True, prompt_step([-4.0, -5.0, -9.0]), 0)  # the last position predicts the output
    assert s.input_logprobs == [None, -1.0, -2.0, -3.0, -4.0, -5.0]
    assert s.input_top_logprobs == [None] * 6
    assert s.output_ids == [0] and s.output_logprobs == [0.0]
    assert len(s.input_logprobs) == len(s.build_output().input_token_ids)


@pytest.mark.parametrize("computed_from", [0, 1, 2])
def test_prompt_logprobs_from_a_later_token(computed_from):
    """logprob_start_len 3: prompt tokens 3, 4, 5, predicted by positions 2, 3, 4 (a cached prefix may cover
    positions before 2)."""
    proc = processor()
    prompt = [10, 11, 12, 13, 14, 15]
    s = seq(prompt, return_logprob=True, logprob_start_len=3)
    s.num_computed = computed_from
    values = [-float(p) for p in range(computed_from, 6)]  # position p's logprob: -p
    proc.absorb(s, 6 - computed_from, True, prompt_step(values), 0)
    assert s.input_logprobs == [-2.0, -3.0, -4.0]
    assert s.build_output().input_token_ids == [13, 14, 15]


def test_prompt_logprobs_are_not_repeated_when_a_retracted_request_is_recomputed():
    proc = processor()
    s = seq([10, 11, 12, 13], return_logprob=True, logprob_start_len=1)
    proc.absorb(s, 4, True, prompt_step([-1.0, -2.0, -3.0, -4.0]), 0)
    assert s.input_logprobs == [-1.0, -2.0, -3.0]
    s.num_computed = 0  # retracted: recomputed from scratch, output so far included
    proc.absorb(s, 5, True, prompt_step([-7.0, -7.0, -7.0, -7.0, -7.0]), 0)
    assert s.input_logprobs == [-1.0, -2.0, -3.0] and len(s.output_ids) == 2


def test_prompt_top_logprobs_are_truncated_to_the_requested_count():
    proc = processor()
    s = seq([10, 11, 12], return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    top = (np.array([[-0.5, -1.0, -2.0], [-0.25, -3.0, -4.0], [-0.1, -0.2, -0.3]]),
           np.array([[11, 4, 5], [12, 6, 7], [1, 2, 3]]))
    proc.absorb(s, 3, True, prompt_step([-0.5, -0.25, -9.0], top=top, row=1, rows=2), 1)
    assert s.input_logprobs == [None, -0.5, -0.25]
    assert s.input_top_logprobs == [None, [(-0.5, 11), (-1.0, 4)], [(-0.25, 12), (-3.0, 6)]]
    assert type(s.input_top_logprobs[1][0][1]) is int and type(s.input_top_logprobs[1][0][0]) is float


def test_prompt_top_logprobs_absent_from_the_step_leave_none():
    proc = processor()
    s = seq([10, 11, 12], return_logprob=True, logprob_start_len=1, top_logprobs_num=2)
    proc.absorb(s, 3, True, prompt_step([-0.5, -0.25, -9.0]), 0)
    assert s.input_logprobs == [-0.5, -0.25] and s.input_top_logprobs == [None, None]


def test_decode_rows_and_other_requests_collect_no_prompt_logprobs():
    proc = processor()
    s = seq([10, 11], return_logprob=True, logprob_start_len=0)
    proc.absorb(s, 2, True, prompt_step([-1.0, -2.0]), 0)
    assert s.input_logprobs == [None, -1.0]
    proc.absorb(s, 1, True, prompt_step([-5.0]), 0)  # a decode step in a batch where others want them
    assert s.input_logprobs == [None, -1.0]
    proc.absorb(s, 1, True, out([4], logprobs=[-0.5]), 0)  # decode steps carry no prompt logprobs at all
    assert s.input_logprobs == [None, -1.0] and s.output_ids == [0, 0, 4] and s.output_logprobs[-1] == -0.5
    other = seq([10, 11], return_logprob=True)
    proc.absorb(other, 2, True, prompt_step([-1.0, -2.0]), 0)
    assert other.input_logprobs == [] and other.input_top_logprobs == []
