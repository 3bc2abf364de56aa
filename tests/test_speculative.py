"""Speculative decoding on the real model: the same greedy and seeded tokens as without it (plain, regex, JSON, at
several batch sizes), the same sampled distribution (chi-square), jump-forward folded into decode steps, and no KV
slot leaked after stops and limits inside accepted drafts and aborts."""

from __future__ import annotations

import collections
import time

import pytest
from scipy.stats import chi2_contingency

from jsgl.engine.engine import Engine
from jsgl.engine.request import SamplingParams
from tests.conftest import assert_no_leak

# Every test here loads the model and runs engines (94-139 s): the full suite's. Their quick counterparts, on the
# host model through EngineLoop, are in test_speculative_unit.py.
pytestmark = pytest.mark.slow

OPTIONS = dict(kv_cache_gb=0.25, max_running_requests=32, chunked_prefill_size=256, precompile="off")
# Chat-formatted (tokenizer's template) in the fixtures: answers that copy the question, and free ones.
COPYING = ["Fix the spelling: The wether was beutiful and the childern played in the park all afternon.",
           "Extract the names from: Anna, Ben and Carla went to see Daniel and Eva at the station.",
           "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank."]
CHAT = ["What is the capital of France?", "Write a haiku about autumn.", "Name three primary colours."]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}


@pytest.fixture(scope="module")
def plain():
    eng = Engine(**OPTIONS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def spec():
    eng = Engine(**OPTIONS, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    yield eng
    eng.shutdown()


def chat(engine, questions):
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True) for q in questions]


def tokens(engine, questions, **params):
    """Greedy unless ``params`` say otherwise (SamplingParams' default temperature is SGLang's 1.0)."""
    params = {"temperature": 0.0, **params}
    return [o.token_ids for o in engine.generate(chat(engine, questions), SamplingParams(**params), progress=False)]


@pytest.mark.parametrize("batch", [1, 6])
def test_greedy_tokens_are_the_same(plain, spec, batch):
    prompts = (COPYING + CHAT)[:batch]
    before = spec.stats()["speculative"]["accepted"]
    for engine in (plain, spec):
        engine.flush_cache()
    assert tokens(spec, prompts, max_new_tokens=40) == tokens(plain, prompts, max_new_tokens=40)
    assert spec.stats()["speculative"]["accepted"] > before  # the copying prompts' drafts were accepted
    # Asked again, the prefix cache holds the answers: their continuation is the draft, accepted whole.
    s0 = spec.stats()["speculative"]
    assert tokens(spec, prompts, max_new_tokens=40) == tokens(plain, prompts, max_new_tokens=40)
    s1 = spec.stats()["speculative"]
    assert (s1["accepted"] - s0["accepted"]) / (s1["proposed"] - s0["proposed"]) > 0.9
    assert_no_leak(spec)


def test_constrained_greedy_tokens_are_the_same_and_jumps_ride_decode_steps(plain, spec):
    questions = ["Give a person as JSON.", "A JSON record of a customer.", "JSON for an author."]
    for engine in (plain, spec):
        engine.flush_cache()
    steps = {}
    for name, engine in (("plain", plain), ("spec", spec)):
        before = engine.stats()
        prompts = chat(engine, questions)
        outs = [engine.generate(prompts, SamplingParams(max_new_tokens=64, temperature=0, json_schema=PERSON),
                                progress=False),
                engine.generate(prompts[:1], SamplingParams(max_new_tokens=24, temperature=0,
                                                            regex=r"(yes|no), because [a-z ]+\."), progress=False)]
        after = engine.stats()
        steps[name] = (after["extend_steps"] - before["extend_steps"], after["jump_forward_tokens"]
                       - before["jump_forward_tokens"], [[o.token_ids for o in group] for group in outs])
    assert steps["spec"][2] == steps["plain"][2]
    assert steps["spec"][1] == steps["plain"][1] > 0  # the same forced tokens
    # Without speculation each jump-forward is an extend step; with it, the forced run is rows of a decode step.
    assert steps["spec"][0] < steps["plain"][0]
    assert_no_leak(spec)


def test_logprobs_of_verified_tokens_are_their_rows(plain, spec):
    params = SamplingParams(max_new_tokens=24, temperature=0, return_logprob=True, top_logprobs_num=3)
    prompts = chat(plain, COPYING)
    for engine in (plain, spec):
        engine.flush_cache()
    before = spec.stats()["speculative"]["accepted"]
    got, want = spec.generate(prompts, params, progress=False), plain.generate(prompts, params, progress=False)
    assert spec.stats()["speculative"]["accepted"] > before
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-4)
        assert [[t for _, t in top] for top in a.output_top_logprobs] == \
            [[t for _, t in top] for top in b.output_top_logprobs]


def test_seeded_sampling_gives_the_same_tokens(plain, spec):
    params = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, frequency_penalty=0.3, sampling_seed=11)
    prompts = COPYING + CHAT
    assert tokens(spec, prompts, **params) == tokens(plain, prompts, **params)


def test_sampled_distribution_is_unchanged(plain, spec):
    """Chi-square over the tokens verification decides (the prefill samples the first: output tokens 1, then 1-3) of a
    prompt whose drafts are often right, 240 samples a side, each side with its own seeds."""
    prompt = chat(plain, [COPYING[2]])[0]
    counts = {}
    # Every draft verified, whatever its rows cost here (the policy is not what this test is about).
    costs = spec.loop.speculator.costs
    costs.cost, cost = (lambda rows: 1.0), costs.cost
    before = spec.stats()["speculative"]
    for name, engine, base in (("plain", plain, 0), ("spec", spec, 10_000)):
        seen = collections.Counter()
        for group in range(40):
            params = [SamplingParams(max_new_tokens=6, temperature=0.8, sampling_seed=base + 6 * group + i,
                                     ignore_eos=True) for i in range(6)]
            for out in engine.generate([prompt] * 6, params, progress=False):
                seen[tuple(out.token_ids)] += 1
        counts[name] = seen
    after = spec.stats()["speculative"]
    costs.cost = cost
    assert after["accepted"] - before["accepted"] > 200  # accepted drafts decided many of these tokens
    for first, last in ((1, 2), (1, 4)):
        table = collections.defaultdict(lambda: [0, 0])
        for col, name in enumerate(("plain", "spec")):
            for seq, n in counts[name].items():
                table[seq[first:last]][col] += n
        common = [row for row in table.values() if sum(row) >= 10]
        rest = [sum(row[c] for row in table.values() if sum(row) < 10) for c in (0, 1)]
        rows = common + ([rest] if sum(rest) else [])
        assert len(rows) >= 2
        assert chi2_contingency(rows).pvalue > 0.001


def test_limits_stops_and_aborts_inside_drafts_leak_nothing(plain, spec):
    prompt = chat(plain, [COPYING[1]])[0]
    for engine in (plain, spec):
        engine.flush_cache()
        tokens(engine, [COPYING[1]], max_new_tokens=40)  # the answer is cached: the next drafts are its continuation
    answer = plain.tokenizer.decode(tokens(plain, [COPYING[1]], max_new_tokens=40)[0])
    assert " Carla" in answer
    cases = [dict(max_new_tokens=7), dict(max_new_tokens=40, stop=[" Carla"]),
             dict(max_new_tokens=40, stop_token_ids=plain.tokenizer.encode(" Ben", add_special_tokens=False)),
             dict(max_new_tokens=40, min_new_tokens=30)]
    for params in cases:
        out_spec = spec.generate(prompt, SamplingParams(temperature=0, **params), progress=False)
        out_plain = plain.generate(prompt, SamplingParams(temperature=0, **params), progress=False)
        assert (out_spec.token_ids, out_spec.text, out_spec.finish_reason) == \
            (out_plain.token_ids, out_plain.text, out_plain.finish_reason), params
    handles = [spec.submit(p, SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True))
               for p in chat(spec, COPYING * 2)]
    time.sleep(1.0)
    for handle in handles[::2]:
        handle.abort()
    for handle in handles:
        handle.result(timeout=120)
    assert_no_leak(spec)


def test_pages_of_sixteen_as_on_an_accelerator():
    """The GPU/TPU default page size: rejected drafts give back whole pages only, a request's cached prefix is whole
    pages; the same greedy tokens (plain and JSON) and no page leaked."""
    outputs = {}
    for algorithm in ("none", "ngram"):
        engine = Engine(kv_cache_gb=0.05, page_size=16, precompile="off", speculative_algorithm=algorithm)
        try:
            got = tokens(engine, COPYING[:2], max_new_tokens=32) + tokens(engine, COPYING[:2], max_new_tokens=32)
            got += tokens(engine, ["A person as JSON."], max_new_tokens=48, json_schema=PERSON)
            outputs[algorithm] = got
            if algorithm == "ngram":
                assert engine.stats()["speculative"]["accepted"] > 0
            assert_no_leak(engine)
        finally:
            engine.shutdown()
    assert outputs["ngram"] == outputs["none"]


def test_a_failed_verify_step_falls_back_to_plain_steps(plain, spec, monkeypatch):
    """A verify step whose dispatch fails (the pools intact) gives back the drafts' slots and steps its requests
    without drafts: the same tokens as plain decoding, nothing leaked."""
    loop, failures = spec.loop, []
    dispatch = loop._dispatch

    def failing_once(seqs, items, is_decode, after=None):
        if not failures and len(items) > len(seqs):  # rows beyond one per request: drafts
            failures.append(len(items))
            raise RuntimeError("injected verify failure")
        return dispatch(seqs, items, is_decode, after)

    monkeypatch.setattr(loop, "_dispatch", failing_once)
    for engine in (plain, spec):
        engine.flush_cache()
    assert tokens(spec, COPYING, max_new_tokens=32) == tokens(plain, COPYING, max_new_tokens=32)
    assert failures
    assert_no_leak(spec)
