"""Engine behaviour on the real model: batching invariance, stops, lengths, streaming, errors, no leaks."""

from __future__ import annotations

import time

import pytest
from conftest import ENGINE_PROMPTS as PROMPTS
from conftest import assert_no_leak, wait_idle

from jsgl.engine.engine import Engine
from jsgl.engine.request import FinishReason, InvalidRequestError

GREEDY = {"temperature": 0, "max_new_tokens": 24}


def test_batch_equals_alone(engine):
    alone = [engine.generate(p, GREEDY).token_ids for p in PROMPTS]
    batched = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert batched == alone
    assert_no_leak(engine)


def test_request_joining_mid_decode(engine):
    long_params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    expected_late = engine.generate(PROMPTS[1], GREEDY).token_ids
    expected_early = engine.generate(PROMPTS[0], long_params).token_ids
    early = engine.submit(PROMPTS[0], long_params)
    seen = 0
    for chunk in early.stream():  # wait until the first request is decoding
        seen = len(chunk.token_ids)
        if seen >= 8:
            break
    late = engine.submit(PROMPTS[1], GREEDY)
    assert late.result(timeout=120).token_ids == expected_late
    assert early.result(timeout=120).token_ids == expected_early
    assert seen >= 8
    assert_no_leak(engine)


def test_long_prompt_chunks_interleave_with_decoding(engine):
    """Chunked prefill of a long prompt does not stall a request that is already decoding."""
    decoding = engine.submit(PROMPTS[0], {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True})
    stream = decoding.stream()
    while len(next(stream).token_ids) < 2:
        pass
    long_prompt = " ".join(PROMPTS * 20)  # ~1500 tokens: 6 chunks of the fixture's 256
    long = engine.submit(long_prompt, {"temperature": 0, "max_new_tokens": 1})
    before_steps = engine.stats()["decode_steps"]
    long.result(timeout=120)
    assert engine.stats()["decode_steps"] - before_steps >= 4
    decoding.result(timeout=120)
    assert_no_leak(engine)


def test_max_new_tokens_exact(engine):
    for n in (1, 7):
        out = engine.generate(PROMPTS[2], {"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
        assert out.completion_tokens == len(out.token_ids) == n
        assert out.finish_reason == FinishReason.LENGTH


def test_stop_string_cut_exactly_even_across_tokens(engine, tokenizer):
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    full = engine.generate(PROMPTS[4], params)
    # Pick a stop string that straddles a token boundary of the greedy output.
    pieces = [tokenizer.decode([t]) for t in full.token_ids]
    boundary = len(pieces[0]) + len(pieces[1]) + len(pieces[2])
    stop = full.text[boundary - 2: boundary + 2]
    assert len(stop) == 4 and stop in full.text
    out = engine.generate(PROMPTS[4], {**params, "stop": [stop, "never-appears-xyz"]})
    assert out.text == full.text[: full.text.index(stop)]
    assert out.finish_reason == FinishReason.STOP and out.matched_stop == stop
    # A stop token id ends generation too and is reported as the matched stop.
    tok = full.token_ids[5]
    out = engine.generate(PROMPTS[4], {**params, "stop_token_ids": [tok]})
    assert out.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]
    assert out.matched_stop == tok
    assert_no_leak(engine)


def test_streaming_concatenates_to_final_text(engine):
    handle = engine.submit(PROMPTS[3], {"temperature": 0, "max_new_tokens": 20, "stop": "13"})
    chunks = list(handle.stream())
    assert chunks[-1].finished
    final = handle.result()
    assert "".join(c.text_delta for c in chunks) == final.text
    assert "13" not in final.text


def test_sampling_is_seeded(engine):
    params = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "min_p": 0.01, "max_new_tokens": 16}
    a = engine.generate(PROMPTS[0], {**params, "seed": 7}).token_ids
    b = engine.generate(PROMPTS[0], {**params, "seed": 7}).token_ids
    others = {tuple(engine.generate(PROMPTS[0], {**params, "seed": s}).token_ids) for s in range(3)}
    assert a == b
    assert len(others | {tuple(a)}) > 1


def test_output_logprobs_consistent_with_prompt_logprobs(engine, tokenizer):
    out = engine.generate(PROMPTS[2], {"temperature": 0, "max_new_tokens": 6, "return_logprob": True,
                                       "top_logprobs_num": 2, "ignore_eos": True})
    assert len(out.output_logprobs) == 6
    # Greedy: the chosen token is the top-1 of its distribution.
    for lp, top in zip(out.output_logprobs, out.output_top_logprobs):
        assert abs(lp - top[0][0]) < 1e-5
    # Scoring prompt + output as a prompt gives the same logprobs for the output tokens.
    ids = tokenizer(PROMPTS[2]).input_ids
    scored = engine.generate(ids + out.token_ids, {"max_new_tokens": 0, "return_logprob": True,
                                                   "logprob_start_len": len(ids)})
    assert scored.input_logprobs == pytest.approx(out.output_logprobs, abs=1e-3)


def test_abort_frees_kv(engine):
    handle = engine.submit(PROMPTS[0], {"max_new_tokens": 500, "ignore_eos": True, "temperature": 0})
    for chunk in handle.stream():
        if len(chunk.token_ids) >= 3:
            handle.abort()
            break
    out = handle.result(timeout=60)
    assert out.finish_reason == FinishReason.ABORT
    assert_no_leak(engine)


def test_steady_workload_compiles_nothing_new(engine):
    engine.generate(PROMPTS, GREEDY)
    before = engine.stats()["compiled_on_request_path"]  # the background may compile meanwhile, when idle
    engine.generate(PROMPTS, GREEDY)
    assert engine.stats()["compiled_on_request_path"] == before


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", {}, "empty"),
        ([], {}, "empty"),
        ("hi", {"max_new_tokens": -1}, "max_new_tokens"),
        ("hi", {"temperature": -0.5}, "temperature"),
        ("hi", {"top_p": 0}, "top_p"),
        ("hi", {"no_such_param": 1}, "unknown sampling parameters"),
        ([10**7], {}, "token ids"),
    ],
)
def test_bad_input_is_a_clear_error(engine, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit(prompt, params)


def test_prompt_longer_than_context_is_rejected_and_engine_keeps_serving(engine):
    too_long = list(range(100, 100 + engine.max_context + 5))
    with pytest.raises(InvalidRequestError, match="context length"):
        engine.submit(too_long, {})
    assert engine.generate("Hello", {"max_new_tokens": 2, "temperature": 0}).completion_tokens == 2


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="unknown model"):
        Engine(model="/no/such/model/dir")


@pytest.mark.parametrize("prefix_cache", ["radix", "none"])
def test_page_size_four_gives_the_same_outputs(engine, prefix_cache):
    expected = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    paged = Engine(model="smollm2-135m", num_kv_slots=192, page_size=4, prefix_cache=prefix_cache)
    try:
        for _ in range(2):  # the second round reuses whole cached pages
            assert [o.token_ids for o in paged.generate(PROMPTS, GREEDY)] == expected
        if prefix_cache == "radix":
            assert paged.stats()["cached_tokens"] > 0
        wait_idle(paged)
        assert paged.flush_cache()
        assert paged.allocator.num_free() == paged.allocator.capacity
    finally:
        paged.shutdown()


def test_mixed_steps_give_the_same_outputs(engine):
    """Decodes that share their steps with a long prompt's chunks (mixed steps) sample what they sample alone."""
    # ~1500 tokens; not test_long_prompt_chunks_interleave_with_decoding's, which must not find it cached
    long_prompt = " | ".join(PROMPTS * 20)
    long_params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    expected = [engine.generate(PROMPTS[0], long_params).token_ids, engine.generate(long_prompt, GREEDY).token_ids,
                *(o.token_ids for o in engine.generate(PROMPTS[1:], GREEDY))]
    mixed = Engine(model="smollm2-135m", num_kv_slots=4096, mixed_prefill_tokens=32)
    try:
        first = mixed.submit(PROMPTS[0], long_params)
        stream = first.stream()
        while len(next(stream).token_ids) < 2:
            pass
        rest = [mixed.submit(long_prompt, GREEDY), *(mixed.submit(p, GREEDY) for p in PROMPTS[1:])]
        assert [h.result(timeout=300).token_ids for h in (first, *rest)] == expected
        assert mixed.stats()["mixed_steps"] > 0
        assert_no_leak(mixed)
    finally:
        mixed.shutdown()


def test_submit_batch_takes_the_clients_ids_all_or_nothing(engine):
    handles = engine.submit_batch(PROMPTS[:2], [GREEDY] * 2, request_ids=["batch-a", "batch-b"])
    assert [h.request_id for h in handles] == ["batch-a", "batch-b"]
    assert [h.result(timeout=120).token_ids for h in handles] == [engine.generate(p, GREEDY).token_ids
                                                                   for p in PROMPTS[:2]]
    with pytest.raises(InvalidRequestError):  # the second prompt is too long: neither is queued
        engine.submit_batch(["ok", "word " * 100_000], [GREEDY] * 2, request_ids=["batch-c", "batch-d"])
    assert engine.submit("ok", GREEDY, request_id="batch-c").result(timeout=120).finish_reason is not None
    assert_no_leak(engine)


def test_pallas_page_size_must_be_a_power_of_two():
    """The Pallas kernels gather whole pages per K/V block: a page size they cannot read is refused at start,
    not failed on every request."""
    with pytest.raises(ValueError, match="power of two"):
        Engine(model="smollm2-135m", num_kv_slots=192, page_size=3, attention_backend="pallas")


def test_memory_pressure_retracts_and_completes():
    """A pool too small for every request at once still finishes all of them, correctly."""
    small = Engine(model="smollm2-135m", num_kv_slots=192, prefix_cache="none", max_running_requests=8)
    try:
        params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
        alone = [small.generate(p, params).token_ids for p in PROMPTS[:4]]
        t0 = time.monotonic()
        together = [o.token_ids for o in small.generate(PROMPTS[:4], params)]
        assert together == alone, f"after {time.monotonic() - t0:.1f}s"
        assert small.stats()["retractions"] > 0
        wait_idle(small)
        assert small.allocator.num_free() == small.allocator.capacity
    finally:
        small.shutdown()
