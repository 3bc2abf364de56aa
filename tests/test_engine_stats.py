"""Engine statistics that a long-running server reports: hit rates over one window, bounded memory."""

from __future__ import annotations

from conftest import wait_idle

import jsgl.engine.engine_loop as engine_loop

SHARED = "You are a helpful assistant. Answer the question briefly and precisely. Question: "
PROMPTS = [SHARED + q for q in ("What is the capital of France?", "What is two plus two?", "Name a red fruit.")]
GREEDY = {"temperature": 0, "max_new_tokens": 2}


def run_window(engine) -> dict:
    for prompt in PROMPTS:  # one at a time: each later prompt finds the shared prefix in the tree
        engine.generate(prompt, GREEDY)
    wait_idle(engine)
    return engine.stats()


def test_achieved_and_optimal_hit_rates_cover_the_same_window(engine):
    wait_idle(engine)
    assert engine.flush_cache()
    first = run_window(engine)
    assert 0 < first["cache_hit_rate"] <= first["optimal_hit_rate"] + 1e-9
    assert engine.flush_cache()
    again = run_window(engine)  # the same prompts: after a flush, both rates restart together
    assert again["cache_hit_rate"] == first["cache_hit_rate"]
    assert again["optimal_hit_rate"] == first["optimal_hit_rate"]
    assert again["prompt_tokens"] > first["prompt_tokens"]  # lifetime counters keep counting


def test_the_optimal_hit_rate_trie_is_bounded(engine, monkeypatch):
    monkeypatch.setattr(engine_loop, "HIT_RATE_WINDOW_TOKENS", 40)
    for i in range(6):
        engine.generate(f"A different prompt number {i} about something else entirely", GREEDY)
    wait_idle(engine)
    assert engine.loop.distinct.nodes < 40 + 20  # reset before it grew past the bound (+ one prompt)
    assert engine.scheduler.stats.batched_requests >= engine.scheduler.stats.steps  # running totals, no list


def test_the_optimum_counts_a_continuation_of_an_earlier_output_as_a_hit():
    """A program's second call extends its first call's prompt + output: the cache holds both, so the
    optimum (Theorem 3.1) must not count the output's tokens as distinct prompt tokens."""
    from jsgl.radix.metrics import DistinctPrefixCounter

    counter = DistinctPrefixCounter()
    counter.add([1, 2, 3])  # first call: 3 prompt tokens, all distinct
    counter.add_generated([1, 2, 3, 7, 8])  # ... which generated 7 8
    counter.add([1, 2, 3, 7, 8, 9])  # second call: only 9 is new
    assert (counter.prompt_tokens, counter.distinct_tokens, counter.nodes) == (9, 4, 6)
    assert counter.optimal_hit_rate == 1 - 4 / 9
    counter.add([1, 2, 4])  # a branch off the first prompt
    assert (counter.prompt_tokens, counter.distinct_tokens, counter.nodes) == (12, 5, 7)


def test_stats_say_what_the_engine_runs_on(engine):
    """The platform, the device, the dtypes and the backends actually chosen (auto resolved), and the config
    filled with the CPU's defaults (what /get_server_info shows)."""
    from jsgl.kernels import cpu as cpu_kernels

    stats = engine.stats()
    assert (stats["platform"], stats["device_kind"], stats["device_count"]) == ("cpu", "cpu", 1)
    assert (stats["dtype"], stats["kv_dtype"], stats["page_size"]) == ("float32", "float32", 1)
    kernels = cpu_kernels.available()
    assert stats["attention_backend"] == ("cpu" if kernels else "native")
    assert stats["matmul_backend"] == ("gguf" if kernels else "xla")
    assert (engine.config.page_size, engine.config.kv_cache_gb, engine.config.mem_fraction) == (1, 0.25, None)
