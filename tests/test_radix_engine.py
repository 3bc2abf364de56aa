"""RadixAttention in the engine on the real model: reuse is exact, counted, and safe under memory pressure."""

from __future__ import annotations

import threading

import pytest
from conftest import wait_idle

from jsgl.engine.engine import Engine

FEW_SHOT = "".join(f"Q: What is {a} plus {b}?\nA: {a + b}\n\n" for a, b in [(2, 3), (10, 7), (6, 6), (21, 4)])
SHARED = [FEW_SHOT + f"Q: What is {a} plus {b}?\nA:" for a, b in [(1, 1), (8, 5), (30, 12)]]
CHAT = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a fruit.<|im_end|>\n"
MULTI_TURN = [CHAT + "<|im_start|>assistant\n", CHAT + "<|im_start|>assistant\nApple.<|im_end|>\n"
              "<|im_start|>user\nAnother one?<|im_end|>\n<|im_start|>assistant\n"]
FORK = ["The three primary colors are red, blue and yellow. Here is a poem about " + t for t in
        ("red:", "blue:", "yellow:", "all of them:")]
WORKLOAD = SHARED + MULTI_TURN + FORK
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def no_cache_outputs():
    eng = Engine(model="smollm2-135m", kv_cache_gb=0.25, prefix_cache="none")  # the session pool: shared compiles
    try:
        yield [o.token_ids for o in eng.generate(WORKLOAD, GREEDY)]
    finally:
        eng.shutdown()


def test_radix_outputs_equal_no_cache_and_second_run_computes_only_uncached(engine, no_cache_outputs):
    assert engine.flush_cache()
    first = [o.token_ids for o in engine.generate(WORKLOAD, GREEDY)]
    assert first == no_cache_outputs
    before = engine.stats()["computed_prefill_tokens"]
    second = engine.generate(WORKLOAD, GREEDY)
    assert [o.token_ids for o in second] == no_cache_outputs
    # Every prompt is cached now except its last token, which is recomputed for its logits.
    assert engine.stats()["computed_prefill_tokens"] - before == len(WORKLOAD)
    assert all(o.cached_tokens == o.prompt_tokens - 1 for o in second)
    wait_idle(engine)
    assert engine.allocator.num_free() + engine.prefix_cache.total_size() == engine.allocator.capacity


def test_later_requests_reuse_a_running_requests_prefix(engine, tokenizer, no_cache_outputs):
    assert engine.flush_cache()
    first = engine.submit(SHARED[0], {**GREEDY, "max_new_tokens": 40})
    next(iter(first.stream()))  # its prefill is done and inserted while it still decodes
    rest = engine.generate(SHARED[1:], GREEDY)
    shared_len = len(tokenizer(FEW_SHOT).input_ids)
    assert all(o.cached_tokens >= shared_len - 2 for o in rest)
    assert [o.token_ids for o in rest] == no_cache_outputs[1:len(SHARED)]
    first.result(timeout=60)


def test_flush_cache_frees_every_slot_and_is_refused_while_running(engine):
    handle = engine.submit("Count to fifty: 1, 2, 3,", {"max_new_tokens": 200, "ignore_eos": True})
    next(iter(handle.stream()))
    assert engine.flush_cache() is False
    handle.abort()
    handle.result(timeout=60)
    wait_idle(engine)
    assert engine.flush_cache() is True
    assert engine.prefix_cache.total_size() == 0
    assert engine.allocator.num_free() == engine.allocator.capacity


@pytest.mark.parametrize("mode", ["radix", "flat"])
def test_small_pool_evicts_and_retracts_yet_stays_exact(mode, no_cache_outputs):
    eng = Engine(model="smollm2-135m", num_kv_slots=192, prefix_cache=mode, max_running_requests=16)
    try:
        outs = eng.generate(WORKLOAD, GREEDY)
        assert [o.token_ids for o in outs] == no_cache_outputs
        stats = eng.stats()
        assert stats["evicted_tokens"] > 0 or stats["retractions"] > 0
        wait_idle(eng)
        assert eng.flush_cache()
        assert eng.allocator.num_free() == eng.allocator.capacity
    finally:
        eng.shutdown()


def test_concurrent_clients_share_prefix_without_leaks(engine):
    results: dict[int, list[int]] = {}

    def client(i: int) -> None:
        results[i] = engine.generate(FORK[i % len(FORK)], GREEDY).token_ids

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, ids in results.items():
        assert ids == results[i % len(FORK)]
    wait_idle(engine)
    assert engine.allocator.num_free() + engine.prefix_cache.total_size() == engine.allocator.capacity
