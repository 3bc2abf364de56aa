"""frequency_penalty, presence_penalty and skip_special_tokens by their effect on the real model's output.

Greedy decoding with penalties must pick, at every step, the argmax of the model's log-probabilities minus
``frequency_penalty * count + presence_penalty * (count > 0)`` over the tokens generated so far. The
reference is computed here from the engine's own top-20 log-probabilities of the raw distribution (which
tests/test_model.py checks against transformers), so it does not reuse the engine's penalty code.
"""

from __future__ import annotations

import collections

import pytest

PROMPT = "One, one, one, one, one,"  # greedy repeats " one," so counts grow and a penalty soon bites
STEPS = 24
TOP = 20  # the engine's default max_top_logprobs
TIE = 1e-3  # scores closer than this are not decided by the reference (float32 rounding)


def greedy(engine, **params):
    return engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": STEPS, "ignore_eos": True,
                                    "return_logprob": True, "top_logprobs_num": TOP, **params})


def penalized_argmax(top: list[tuple[float, int]], history: list[int], frequency: float, presence: float):
    """The penalized argmax among the top-k of the raw distribution, or None when the reference cannot
    decide it (a near tie, or a winner that might lie outside the top-k)."""
    counts = collections.Counter(history)
    scores = sorted(((lp - frequency * counts[t] - presence * (counts[t] > 0), t) for lp, t in top), reverse=True)
    floor = min(lp for lp, _ in top)  # any token outside the top-k scores at most this (penalties >= 0)
    (best, token), (second, _) = scores[0], scores[1]
    if best - second < TIE or best - floor < TIE:
        return None
    return token


@pytest.mark.parametrize("frequency, presence", [(0.5, 0.0), (0.0, 2.0), (0.3, 0.6)])
def test_penalized_greedy_is_the_argmax_of_penalized_logprobs(engine, frequency, presence):
    out = greedy(engine, frequency_penalty=frequency, presence_penalty=presence)
    assert len(out.token_ids) == len(out.output_top_logprobs) == STEPS
    checked = changed = 0
    for t, (token, top) in enumerate(zip(out.token_ids, out.output_top_logprobs, strict=True)):
        assert len(top) == TOP
        expected = penalized_argmax(top, out.token_ids[:t], frequency, presence)
        if expected is None:
            continue
        checked += 1
        assert token == expected, (t, token, expected, top[:3])
        changed += expected != max(top)[1]  # the penalty overrode the model's own choice here
    assert checked >= STEPS - 3 and changed >= 1, (checked, changed)


@pytest.mark.parametrize("frequency, presence", [(0.5, 0.0), (0.0, 2.0)])
def test_penalty_first_changes_the_output_where_it_changes_the_argmax(engine, frequency, presence):
    """Replay the unpenalized greedy run with the penalty by hand: the first step whose penalized argmax
    differs is exactly where the penalized run departs from it, with that token."""
    plain = greedy(engine)
    penalized = greedy(engine, frequency_penalty=frequency, presence_penalty=presence)
    diverge = None
    for t, (token, top) in enumerate(zip(plain.token_ids, plain.output_top_logprobs, strict=True)):
        assert token == max(top)[1]  # greedy: the raw argmax
        expected = penalized_argmax(top, plain.token_ids[:t], frequency, presence)
        assert expected is not None, (t, top[:3])  # the reference must decide every step up to the change
        if expected != token:
            diverge = t
            break
    assert diverge is not None and diverge > 0, "the penalty never changes the argmax: pick a stronger one"
    assert penalized.token_ids[:diverge] == plain.token_ids[:diverge]
    assert penalized.token_ids[diverge] == expected != plain.token_ids[diverge]


def test_skip_special_tokens(engine):
    """A chat reply that ends with <|im_end|> and, with ignore_eos, goes on into the next turn: the special
    tokens appear in the text exactly when skip_special_tokens is False."""
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=False,
                                     add_generation_prompt=True)
    params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    kept = engine.generate(prompt, {**params, "skip_special_tokens": False})
    skipped = engine.generate(prompt, {**params, "skip_special_tokens": True})
    assert kept.token_ids == skipped.token_ids
    specials = {tok.convert_tokens_to_ids(s): s for s in ("<|im_end|>", "<|im_start|>")}
    emitted = [t for t in kept.token_ids if t in specials]
    assert emitted and tok.eos_token_id in emitted  # the model ends its turn and goes on past it
    assert kept.text.count("<|im_end|>") == kept.token_ids.count(tok.convert_tokens_to_ids("<|im_end|>"))
    assert kept.text.count("<|im_start|>") == kept.token_ids.count(tok.convert_tokens_to_ids("<|im_start|>"))
    assert "<|im_end|>" not in skipped.text and "<|im_start|>" not in skipped.text
    assert kept.text.replace("<|im_end|>", "").replace("<|im_start|>", "") == skipped.text
    assert kept.text == tok.decode(kept.token_ids, skip_special_tokens=False)
