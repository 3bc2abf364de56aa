"""Step shapes compiled at engine start: the planned set covers every batch the scheduler can form, and a
precompiled engine serves a mixed workload without compiling, with the same outputs as one that compiles
as it goes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from jsgl.experiments.bench_serve import XlaCompiles

from jsgl.engine.engine import Engine

MAX_RUNNING, CHUNK = 8, 64
_SHOTS = "Q: What is 2 + 2?\nA: 4\nQ: What is the capital of Italy?\nA: Rome\n" * 3
# Decode at batch 1 and 8, few-shot prompts sharing a prefix, a regex, sampling with a logit bias and a repetition
# penalty, token and prompt logprobs (the last: only precompile "all" plans its extends).
MIXED = [("The capital of France is", {"max_new_tokens": 12}),
         *[(_SHOTS + f"Q: What is {i} + {i}?\nA:", {"max_new_tokens": 2}) for i in range(6)],
         ("A person as JSON:", {"max_new_tokens": 40, "regex": r'\{"name": "[A-Z][a-z]{1,8}", "age": [1-9][0-9]\}'}),
         ("List three colors:", {"max_new_tokens": 10, "repetition_penalty": 1.3, "logit_bias": {"11": 2.0}}),
         ("Count: one, two,", {"max_new_tokens": 6, "return_logprob": True, "top_logprobs_num": 3,
                               "logprob_start_len": 0})]


@pytest.fixture(scope="module")
def precompiled():
    # Jit's in-memory caches are per process and the sampler's is shared by every engine: earlier tests' engines
    # must not have filled what this engine's precompile is meant to (run alone, this test caught a sampler
    # re-lowered while serving that the full suite hid).
    jax.clear_caches()
    engine = Engine(precompile="all", max_running_requests=MAX_RUNNING, chunked_prefill_size=CHUNK,
                    kv_cache_gb=0.25)
    yield engine
    engine.shutdown()


def test_planned_signatures_cover_every_batch(precompiled):
    """Any decode batch of up to max_running requests, and any extend batch of up to a chunk of new tokens
    (prompt logprobs or not), maps to a planned signature (hypothesis over request counts and lengths)."""
    runner = precompiled.runner
    assert runner.ragged  # the CPU kernels attend on every layer of the default model
    plan = set(runner.planned_signatures("all", MAX_RUNNING, CHUNK))
    common = set(runner.planned_signatures("common", MAX_RUNNING, CHUNK))
    assert common < plan and not runner.planned_signatures("off", MAX_RUNNING, CHUNK)

    @settings(max_examples=examples(200), deadline=None)
    @given(st.data())
    def check(data):
        n = data.draw(st.integers(1, MAX_RUNNING))
        decode = data.draw(st.booleans())
        new = [1] * n if decode else data.draw(
            st.lists(st.integers(1, CHUNK), min_size=n, max_size=n).filter(lambda xs: sum(xs) <= CHUNK))
        lengths = [data.draw(st.integers(q, runner.table_width)) for q in new]
        shape = runner.step_shape(n, sum(new), max(new), max(lengths), decode)
        assert (*shape, -1) in (common if decode else common & plan)
        if not decode:
            assert (*shape, runner.max_top_logprobs) in plan

    check()


def test_a_default_sized_chunk_is_planned_with_its_three_quarter_bucket(precompiled):
    """At the default chunk of 512 tokens an extend of 257-384 tokens pads to 384, not 512, and that shape is
    planned too (the plan is a pure function of the configuration: nothing is compiled here)."""
    runner, chunk = precompiled.runner, 512
    plan = set(runner.planned_signatures("common", MAX_RUNNING, chunk))
    assert runner.step_shape(3, 353, 300, 900, False)[0] == 384
    assert runner.step_shape(3, 385, 300, 900, False)[0] == 512
    assert runner.step_shape(3, 200, 100, 900, False)[0] == 256  # below 256 the buckets stay powers of two

    @settings(max_examples=examples(200), deadline=None)
    @given(st.integers(1, MAX_RUNNING), st.data())
    def check(n, data):
        new = data.draw(st.lists(st.integers(1, chunk), min_size=n, max_size=n).filter(lambda xs: sum(xs) <= chunk))
        assert (*runner.step_shape(n, sum(new), max(new), runner.table_width, False), -1) in plan

    check()


def test_mixed_steps_are_planned(precompiled):
    """With mixed steps, a step carries every running request's decode token and up to ``mixed_prefill_tokens``
    of prefill: those shapes are planned too, beyond the chunk size."""
    runner, mixed = precompiled.runner, 96
    plan = set(runner.planned_signatures("common", MAX_RUNNING, CHUNK, mixed_prefill_tokens=mixed))
    assert plan > set(runner.planned_signatures("common", MAX_RUNNING, CHUNK))

    @settings(max_examples=examples(200), deadline=None)
    @given(st.integers(1, MAX_RUNNING - 1), st.data())
    def check(decodes, data):
        prefill = data.draw(st.lists(st.integers(1, mixed), min_size=1, max_size=MAX_RUNNING - decodes)
                            .filter(lambda xs: sum(xs) <= mixed))
        new = [1] * decodes + prefill
        shape = runner.step_shape(len(new), sum(new), max(new), runner.table_width, False)
        assert (*shape, -1) in plan

    check()


def test_precompiled_engine_serves_a_mixed_workload_without_compiling(precompiled):
    """Decode at batch 1 and 8, few-shot prompts sharing a prefix, a regex, sampling with top-p, a logit
    bias, a repetition penalty, token and prompt logprobs: nothing compiles while serving, and the greedy
    outputs equal those of an engine that compiles each shape on first use (precompile off)."""
    engine = precompiled
    planned = engine.stats()["compiles"]
    assert planned == len(engine.runner.planned_signatures("all", MAX_RUNNING, CHUNK))
    assert engine.stats()["precompile_s"] > 0
    prompts, params = [p for p, _ in MIXED], [q for _, q in MIXED]
    with XlaCompiles() as compiled:
        outs = engine.generate(prompts, params, progress=False)
        engine.generate([f"Story {i}:" for i in range(8)], {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.9},
                        progress=False)  # sampled, filtered, batch 8
    stats = engine.stats()
    assert stats["unplanned_compiles"] == 0 and stats["compiles"] == planned
    # Nothing compiled while serving: no step, no sampler (compiled per batch bucket apart from the steps), no
    # other jitted function.
    assert not compiled.names, compiled.names

    reference = Engine(max_running_requests=MAX_RUNNING, chunked_prefill_size=CHUNK, kv_cache_gb=0.25,
                       precompile="off")
    try:
        want = reference.generate(prompts, params, progress=False)
        assert reference.stats()["compiled_on_request_path"] == reference.stats()["compiles"] > 0
    finally:
        reference.shutdown()
    assert [o.text for o in outs] == [o.text for o in want]
    got, ref = outs[-1], want[-1]
    np.testing.assert_allclose(got.output_logprobs, ref.output_logprobs, atol=1e-4)
    np.testing.assert_allclose(got.input_logprobs[1:], ref.input_logprobs[1:], atol=1e-4)
    assert [[t for _, t in top] for top in got.output_top_logprobs] == \
        [[t for _, t in top] for top in ref.output_top_logprobs]


def test_a_default_engine_compiles_its_plan_in_the_background(precompiled):
    """The default engine answers at once (nothing compiled at start); a first request compiles on the request path
    only the shapes it meets before the background does, the background compiles the rest of the plan while the
    engine is idle, and then the mixed workload (less its prompt logprobs) compiles nothing, with the outputs of
    the engine precompiled at start."""
    jax.clear_caches()
    engine = Engine(max_running_requests=MAX_RUNNING, chunked_prefill_size=CHUNK, kv_cache_gb=0.25)
    greedy = {"max_new_tokens": 12, "temperature": 0}
    seeded = [(prompt, {**params, "sampling_seed": i}) for i, (prompt, params) in enumerate(MIXED[:-1])]
    prompts, params = [p for p, _ in seeded], [q for _, q in seeded]
    try:
        assert engine.config.precompile == "background" and engine.stats()["precompile_s"] == 0
        first = engine.generate("The capital of France is", greedy, progress=False)
        assert engine.wait_compiled(timeout=600)
        stats = engine.stats()
        plan = engine.runner.planned_signatures("common", MAX_RUNNING, CHUNK)
        assert stats["compiles"] == len(plan) == stats["compiled_in_background"] + stats["compiled_on_request_path"]
        assert stats["compiled_at_start"] == 0 and stats["unplanned_compiles"] == 0
        assert stats["background_compile_s"] > 0 and stats["compiled_in_background"] > 0
        with XlaCompiles() as compiled:
            outs = engine.generate(prompts, params, progress=False)
        assert not compiled.names, compiled.names
        assert engine.stats()["compiled_on_request_path"] == stats["compiled_on_request_path"]
    finally:
        engine.shutdown()
    assert first.text == precompiled.generate("The capital of France is", greedy, progress=False).text
    assert [o.text for o in outs] == [o.text for o in precompiled.generate(prompts, params, progress=False)]


def test_padded_attention_precompiles_the_sampler_for_the_extends_it_leaves_to_first_use():
    """With padded attention (native) only decodes are planned; a first extend (batch bucket 8) compiles its
    step shape as it comes, but the sampler for that bucket was compiled at start, on logits placed as a step
    places them."""
    jax.clear_caches()
    engine = Engine(precompile="common", attention_backend="native", max_running_requests=2, chunked_prefill_size=64,
                    context_length=128, kv_cache_gb=0.1, mixed_prefill_tokens=32)
    try:
        assert not engine.runner.ragged
        assert engine.config.mixed_prefill_tokens == 0  # padded steps are never mixed: the config says so
        with XlaCompiles() as compiled:
            engine.generate(["Story:", "Hello"], {"max_new_tokens": 4, "temperature": 0.8}, progress=False)
    finally:
        engine.shutdown()
    assert "jit(_step)" in compiled.names and "jit(_sample_step)" not in compiled.names, compiled.names
