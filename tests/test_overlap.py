"""Overlap scheduling on the real model: a decode step dispatched before the previous one is read back (its
tokens taken on device) gives exactly the outputs of the synchronous engine, and leaks nothing."""

from __future__ import annotations

import contextlib

from conftest import ENGINE_PROMPTS as PROMPTS
from conftest import assert_no_leak

# Lengths that end requests at different steps (1 and 2: on the step an overlapped step follows), EOS
# allowed, a stop string, seeded sampling with filters, and logprobs.
PARAMS = [
    {"temperature": 0, "max_new_tokens": 1},
    {"temperature": 0, "max_new_tokens": 2},
    {"temperature": 0, "max_new_tokens": 40, "stop": [","]},
    {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 11, "max_new_tokens": 33, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 24, "return_logprob": True, "top_logprobs_num": 3},
]


@contextlib.contextmanager
def overlap(engine, on: bool):
    was = engine.config.overlap_schedule
    engine.config.overlap_schedule = on
    try:
        yield
    finally:
        engine.config.overlap_schedule = was


def _run(engine, on: bool, prompts, params):
    with overlap(engine, on):
        before = engine.stats()["overlapped_steps"]
        outs = engine.generate(prompts, params)
        return outs, engine.stats()["overlapped_steps"] - before


def test_overlapped_decode_gives_the_synchronous_outputs(engine):
    _run(engine, False, PROMPTS, PARAMS)  # caches the prompts: each run below starts with a one-token extend
    sync, sync_overlapped = _run(engine, False, PROMPTS, PARAMS)  # (a whole prompt's prefill rounds differently)
    assert sync_overlapped == 0
    for _ in range(2):
        outs, overlapped = _run(engine, True, PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == [o.token_ids for o in sync]
        assert [o.text for o in outs] == [o.text for o in sync]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in sync]
        assert outs[4].output_logprobs == sync[4].output_logprobs
        assert outs[4].output_top_logprobs == sync[4].output_top_logprobs
        assert overlapped >= 20  # the longest request's decode steps, but the first
        assert_no_leak(engine)


def test_one_request_overlaps_every_decode_step_but_the_first(engine):
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    sync, _ = _run(engine, False, PROMPTS[2], params)
    out, overlapped = _run(engine, True, PROMPTS[2], params)
    assert out.token_ids == sync.token_ids
    # The extend samples the first token, 31 decode steps the rest: the first is scheduled, the other 30 are each
    # dispatched behind the one before (and none behind the last: the request ends there by length).
    assert overlapped == 30
    assert_no_leak(engine)


def test_a_request_arriving_mid_decode_ends_the_overlap_and_joins(engine):
    long_params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    short = {"temperature": 0, "max_new_tokens": 12}
    with overlap(engine, False):
        expected = [engine.generate(PROMPTS[0], long_params).token_ids, engine.generate(PROMPTS[1], short).token_ids]
    with overlap(engine, True):
        early = engine.submit(PROMPTS[0], long_params)
        stream = early.stream()
        while len(next(stream).token_ids) < 8:
            pass
        late = engine.submit(PROMPTS[1], short)
        assert [early.result(timeout=120).token_ids, late.result(timeout=120).token_ids] == expected
    assert_no_leak(engine)


def test_an_overlapped_step_that_cannot_be_dispatched_changes_nothing(engine, monkeypatch):
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    expected, _ = _run(engine, False, PROMPTS[3], params)
    original = engine.runner.dispatch

    def dispatch(items, **kw):
        if kw.get("after") is not None:
            raise ValueError("cannot trace")  # before anything runs: the pools are intact
        return original(items, **kw)

    monkeypatch.setattr(engine.runner, "dispatch", dispatch)
    out, overlapped = _run(engine, True, PROMPTS[3], params)
    assert out.token_ids == expected.token_ids and overlapped == 0
    assert_no_leak(engine)


def test_an_overlapped_step_that_loses_the_pools_fails_its_requests_and_the_engine_recovers(engine, monkeypatch):
    import jax

    from jsgl.engine.request import AbortReason

    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    expected, _ = _run(engine, False, PROMPTS[3], params)
    original = engine.runner.dispatch
    state = {"fail": True}

    def dispatch(items, **kw):
        if state["fail"] and kw.get("after") is not None:
            state["fail"] = False
            for leaf in jax.tree.leaves(engine.runner.kv):
                leaf.delete()  # what a failure while the donated step executes leaves behind
            raise ValueError("broken device")
        return original(items, **kw)

    monkeypatch.setattr(engine.runner, "dispatch", dispatch)
    with overlap(engine, True):
        out = engine.generate(PROMPTS[3], params)
        assert out.abort_reason == AbortReason.STEP_FAILED and "broken device" not in out.error
        assert engine.runner.kv_intact()
        assert engine.generate(PROMPTS[3], params).token_ids == expected.token_ids
    assert_no_leak(engine)


def test_overlapped_steps_sample_with_each_output_positions_seeded_noise(tokenizer):
    """Quick, on the host model (tests/host_model.py): seeded requests whose decode steps are overlapped sample each
    row with the noise step of the output position it samples (as the plain loop does), so their tokens are the
    plain loop's. A step index one off would sample every overlapped token with its predecessor's noise."""
    from jsgl.engine.detokenizer import IncrementalDetokenizer
    from jsgl.engine.request import SamplingParams
    from jsgl.engine.sequence import Sequence
    from tests.host_model import host_engine

    def requests():
        return [Sequence(rid=f"r{i}", prompt_ids=[200 + 10 * i + k for k in range(5 + i)],
                         params=SamplingParams(max_new_tokens=n, temperature=0.9, ignore_eos=True),
                         detok=IncrementalDetokenizer(tokenizer, []), seed=3 + i, stop_ids=set())
                for i, n in enumerate([12, 2, 9])]

    outputs = {}
    for on in (False, True):
        engine = host_engine(tokenizer, overlap_schedule=on)
        seqs = requests()
        engine.run(seqs)
        prompt_len = {seq.seed: len(seq.prompt_ids) for seq in seqs}
        for step in engine.runner.steps:
            for item in step:
                if item.seed in prompt_len:  # (not an overlapped step's padding row)
                    position = item.start_pos + len(item.token_ids) - 1  # its row samples the token after this
                    assert item.step == position + 1 - prompt_len[item.seed], (on, item.seed, position, item.step)
        outputs[on] = ([s.output_ids for s in seqs], engine.loop.overlap.steps)
    assert outputs[False][1] == 0 and outputs[True][1] >= 8  # the longest request's decode steps but its first
    assert outputs[True][0] == outputs[False][0]
