"""One request's failure stays its own: the engine's step isolates it, limits reject hostile parameters,
and ids cannot collide. In-process, on the real model (greedy, so victims' answers are known)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import assert_no_leak

from jsgl.engine.request import AbortReason, FinishReason, InvalidRequestError, new_request_id

VICTIM = ("One, two, three, four,", {"temperature": 0, "max_new_tokens": 12})


@pytest.fixture(scope="module")
def solo(engine):
    return engine.generate(*VICTIM)


def assert_victim_ok(out, solo) -> None:
    assert out.finish_reason == solo.finish_reason and out.text == solo.text, (out, solo)


@pytest.mark.parametrize("bad", [
    {"temperature": math.inf}, {"temperature": math.nan}, {"top_p": math.nan},
    {"frequency_penalty": math.inf}, {"min_p": -math.inf},
])
def test_non_finite_sampling_params_are_rejected(engine, bad):
    with pytest.raises(InvalidRequestError, match="finite"):
        engine.submit("hello", {"max_new_tokens": 4, **bad})


def test_request_limits(engine):
    limit = engine.config.max_top_logprobs
    with pytest.raises(InvalidRequestError, match="top_logprobs_num"):
        engine.submit("hello", {"return_logprob": True, "top_logprobs_num": limit + 1})
    engine.generate("hello", {"max_new_tokens": 1, "return_logprob": True, "top_logprobs_num": limit})
    with pytest.raises(InvalidRequestError, match="stop strings"):
        engine.submit("hello", {"stop": [f"s{i}" for i in range(engine.config.max_stop_sequences + 1)]})
    with pytest.raises(InvalidRequestError, match="stop string is longer"):
        engine.submit("hello", {"stop": "x" * (engine.config.max_stop_chars + 1)})
    # Longer than any text of max_context tokens could be: rejected before tokenizing.
    with pytest.raises(InvalidRequestError, match="characters"):
        engine.submit("a" * (engine.admission.max_prompt_chars + 1), {"max_new_tokens": 1})
    for text in ("bad \ud800 prompt", "\udfff"):
        with pytest.raises(InvalidRequestError, match="Unicode"):
            engine.submit(text, {"max_new_tokens": 1})
    with pytest.raises(InvalidRequestError, match="Unicode"):
        engine.submit("hello", {"max_new_tokens": 1}, request_id="id-\ud800")
    assert_no_leak(engine)


def test_n_samples_that_can_never_fit_the_kv_pool_together_are_refused(engine):
    """n x (prompt + max_new_tokens) over the pool (the prompt once: the radix cache shares it) is refused before
    any sample is queued; samples without a max_new_tokens are not refused (they end at EOS or the pool's size)."""
    pool = engine.allocator.capacity
    with pytest.raises(InvalidRequestError, match=f"n = 64 samples .* the KV pool holds {pool}"):
        engine.generate("hello", {"n": 64, "max_new_tokens": 1000})
    per_sample = (pool - 8) // 2  # two samples of a short prompt that just fit
    alone = {"max_new_tokens": pool}  # one request alone stops at the pool's size, as before
    for handle in [*engine.submit_batch(["hello"] * 2, [{"max_new_tokens": per_sample}] * 2, samples=[2]),
                   *engine.submit_batch(["hello"], [alone], samples=[1]),
                   *engine.submit_batch(["hello"] * 2, [{"max_new_tokens": None}] * 2, samples=[2])]:
        handle.abort()
    assert_no_leak(engine)


def test_request_ids_are_random_and_never_shared(engine):
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == len("req-") + 32 for i in ids)
    first = engine.submit("Count: 1, 2,", {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True},
                          request_id="mine")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.submit("other", {"max_new_tokens": 2}, request_id="mine")
    others = engine.submit_batch(["a", "b"], [{"max_new_tokens": 1}] * 2)  # fresh ids: accepted meanwhile
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.submit("b", {"max_new_tokens": 1}, request_id="mine")
    assert all(h.result(timeout=60).finish_reason == FinishReason.LENGTH for h in others)
    out = first.result(timeout=120)
    assert out.finish_reason == FinishReason.LENGTH  # the rejected duplicates did not abort it
    # Once finished, the id is free again.
    assert engine.submit("x", {"max_new_tokens": 1}, request_id="mine").result(timeout=60).finish_reason
    assert_no_leak(engine)


class _Exploding:
    """A token constraint that fails when the engine asks for its mask (a broken per-request input)."""

    def __init__(self, secret: str) -> None:
        self.secret = secret

    def allowed_token_bitmask(self) -> np.ndarray:
        raise RuntimeError(self.secret)

    def advance(self, token_id: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False


def test_a_failing_request_fails_alone_without_leaking_its_text(engine, solo, monkeypatch):
    """Host-side failure of one request's step inputs: that request ends with STEP_FAILED and an error id;
    the victim in the same batch finishes exactly as alone."""
    secret = "SECRET-REGEX-(a|b)*"
    original = engine.scheduler.add

    def add(seq):
        if seq.params.stop == ["<bomb>"]:
            seq.constraint = _Exploding(secret)
        original(seq)

    monkeypatch.setattr(engine.scheduler, "add", add)
    victim = engine.submit(*VICTIM)
    bomb = engine.submit("Hello there", {"max_new_tokens": 8, "temperature": 0, "stop": ["<bomb>"]})
    bad, good = bomb.result(timeout=120), victim.result(timeout=120)
    assert bad.finish_reason == FinishReason.ABORT and bad.abort_reason == AbortReason.STEP_FAILED
    assert "error id" in bad.error and secret not in bad.error
    assert_victim_ok(good, solo)
    assert_no_leak(engine)


def test_a_failing_model_step_is_rerun_per_request(engine, solo, monkeypatch):
    """The batched forward fails because of one request: each is rerun alone, only the culprit fails."""
    original = engine.runner.dispatch

    def dispatch(items, **kw):
        if any(it.top_p == 0.5 for it in items):  # the culprit's marker: fails any step it is in
            raise ValueError("device step failed")
        return original(items, **kw)

    monkeypatch.setattr(engine.runner, "dispatch", dispatch)
    victim = engine.submit(*VICTIM)
    culprit = engine.submit("Hello there", {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.5})
    bad, good = culprit.result(timeout=120), victim.result(timeout=120)
    assert bad.abort_reason == AbortReason.STEP_FAILED and "device step failed" not in bad.error
    assert_victim_ok(good, solo)
    assert engine.runner.kv_intact()
    assert_no_leak(engine)


def test_a_failure_that_loses_the_kv_pools_fails_the_batch_and_the_engine_recovers(engine, solo, monkeypatch):
    """A step that fails after consuming its donated pools cannot be pinned on one request: every running
    request fails, the pools are reallocated and the (now meaningless) prefix cache emptied."""
    import jax

    original = engine.runner.dispatch
    state = {"fail": True}

    def dispatch(items, **kw):
        if state["fail"] and len(items) > 1:
            for leaf in jax.tree.leaves(engine.runner.kv):
                leaf.delete()  # what a failure while the donated step executes leaves behind
            raise ValueError("broken device")
        return original(items, **kw)

    monkeypatch.setattr(engine.runner, "dispatch", dispatch)
    handles = engine.submit_batch([VICTIM[0], "Hi there"], [VICTIM[1], {"max_new_tokens": 4}])
    outs = [h.result(timeout=120) for h in handles]
    assert all(o.abort_reason == AbortReason.STEP_FAILED and "broken device" not in o.error for o in outs)
    state["fail"] = False
    assert engine.runner.kv_intact()
    assert_victim_ok(engine.generate(*VICTIM), solo)
    assert_no_leak(engine)


def test_a_schedule_that_fails_midway_through_moving_a_request_still_answers_it(engine, solo, monkeypatch):
    """A failure between two queues (a retraction whose release raised, found by the hit-rate sweep) left the
    request in none of them: it never finished and its caller waited forever. Now every live request in no
    queue is failed with the step, and the engine keeps serving."""
    original = engine.scheduler.schedule
    state = {"fail": True}

    def schedule():
        if state["fail"] and engine.scheduler.waiting:
            state["fail"] = False
            engine.scheduler.waiting.pop(0)  # in flight between queues when the error hits
            raise RuntimeError("broken retraction")
        return original()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    out = engine.submit("Hi there", {"max_new_tokens": 4}).result(timeout=60)
    assert out.finish_reason == FinishReason.ABORT and out.abort_reason == AbortReason.STEP_FAILED
    assert "broken retraction" not in out.error
    assert_victim_ok(engine.generate(*VICTIM), solo)
    assert_no_leak(engine)


def test_client_abort_is_typed(engine):
    handle = engine.submit("Count: 1, 2,", {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True})
    handle.abort()
    out = handle.result(timeout=60)
    assert out.finish_reason == FinishReason.ABORT and out.abort_reason == AbortReason.CLIENT
    assert_no_leak(engine)


def test_stream_holds_back_only_a_possible_stop_prefix(tokenizer):
    from jsgl.engine.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, ["abcab", "zz", "b!"])
    for piece, shown in [("xxab", "xx"), ("c", ""), ("a", ""), ("q", "abcaq"), ("z", ""), ("b", "z")]:
        detok._append(piece)
        assert detok.stream_delta(False) == shown, (piece, shown)
    assert detok.stream_delta(True) == "b"


def test_engine_config_rejects_bad_limits():
    from jsgl.engine.config import EngineConfig

    with pytest.raises(ValueError):
        EngineConfig(max_stop_sequences=-1)
    with pytest.raises(ValueError):
        EngineConfig(constraint_timeout_s=0)


def test_a_constraint_not_built_in_time_fails_its_request_and_stops_its_build(engine, solo, monkeypatch):
    import time

    from jsgl.fsm import build_stats

    monkeypatch.setattr(engine.config, "constraint_timeout_s", 0.5)
    victim = engine.submit(*VICTIM)
    slow = engine.submit("Numbers:", {"max_new_tokens": 4, "regex": rf"(\d{{1,100}}\.){{1,98}}{time.time_ns()}"})
    out = slow.result(timeout=60)
    assert out.abort_reason == AbortReason.INVALID_REQUEST and "--constraint-timeout-s" in out.error
    assert_victim_ok(victim.result(timeout=60), solo)
    deadline = time.monotonic() + 5
    while build_stats() != {"queued": 0, "running": 0}:  # nobody holds the build any more: it stops
        assert time.monotonic() < deadline, build_stats()
        time.sleep(0.01)
    assert_no_leak(engine)


def test_language_backends_raise_typed_errors(engine):
    """A gen whose constraint cannot be satisfied fails its program state with a GenerationError that says
    why (the engine's AbortReason), not a bare RuntimeError carrying text."""
    import jsgl.lang as sgl
    from jsgl.errors import GenerationError
    from jsgl.lang.runtime_backend import Runtime

    @sgl.function
    def prog(s):
        s += "Answer: " + sgl.gen("a", max_tokens=4, regex=r"\x04+")  # no token can produce byte 0x04

    state = prog.run(backend=Runtime(engine=engine))
    error = state.error()
    assert isinstance(error, GenerationError) and error.reason == AbortReason.INVALID_REQUEST, error
    assert error.request_id
