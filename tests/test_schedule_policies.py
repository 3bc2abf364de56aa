"""Every schedule policy through a real engine with a KV pool too small for the workload.

Six prompts over two shared prefixes, interleaved, all queued at once with at most 4 running: the policy
decides the admission order, the 60-slot pool forces evictions (and, for some orders, retractions). Whatever
the order, greedy outputs must equal those of an engine without a prefix cache, the achieved hit rate can
not beat the optimum (every distinct prefix token computed once), and the engine's optimum must equal the
one counted here from the prompts' token ids.
"""

from __future__ import annotations

import pytest
from conftest import assert_no_leak

from jsgl.engine.engine import Engine
from jsgl.radix.schedule_policy import POLICIES

PREFIXES = ["The following are questions about the geography of Europe, answered briefly and correctly by an "
            "expert.\n\n",
            "Here is a short list of facts about the animals that live in the oceans, written for children.\n\n"]
SUFFIXES = [["Q: What is the capital of France?\nA:", "Q: Which river flows through Vienna?\nA:",
             "Q: What is the highest mountain?\nA:"],
            ["Fact 1: The blue whale", "Fact 2: Octopuses have", "Fact 3: Sharks are"]]
MAX_NEW = [4, 9, 6, 5, 8, 7]  # distinct, so that `lof` has an order to impose
SMALL_POOL = {"num_kv_slots": 60, "max_running_requests": 4, "chunked_prefill_size": 64}
# A tiny workload whose optimum is easy by hand: distinct prefixes (10) (10 11) (10 11 12) (10 11 12 13)
# (10 11 12 14) (10 11 15) = 6 of 11 prompt tokens, so at best 5 of 11 are cache hits.
TINY = [[10, 11, 12, 13], [10, 11, 12, 14], [10, 11, 15]]
TINY_OPTIMUM = 5 / 11


def optimal_hit_rate(prompts: list[list[int]]) -> float:
    distinct = {tuple(p[:k]) for p in prompts for k in range(1, len(p) + 1)}
    return 1 - len(distinct) / sum(len(p) for p in prompts)


@pytest.fixture(scope="module")
def workload(tokenizer):
    prompts = [tokenizer(PREFIXES[j]).input_ids + tokenizer(SUFFIXES[j][i]).input_ids
               for i in range(3) for j in range(2)]  # interleaved: arrival order alternates the prefixes
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in MAX_NEW]
    return prompts, params


@pytest.fixture(scope="module")
def reference(workload):
    prompts, params = workload
    with Engine(num_kv_slots=4096, max_running_requests=4, chunked_prefill_size=64, prefix_cache="none") as eng:
        outs = eng.generate(prompts, params, progress=False)
        assert eng.stats()["cached_tokens"] == 0
    return [o.token_ids for o in outs]


def test_optimum_by_hand():
    assert optimal_hit_rate(TINY) == pytest.approx(TINY_OPTIMUM)


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_on_a_small_pool_matches_the_no_cache_reference(policy, workload, reference):
    prompts, params = workload
    with Engine(prefix_cache="radix", schedule_policy=policy, **SMALL_POOL) as eng:
        outs = eng.generate(prompts, params, progress=False)
        assert [o.token_ids for o in outs] == reference
        stats = eng.stats()
        print(f"{policy}: hit rate {stats['cache_hit_rate']:.3f} of {stats['optimal_hit_rate']:.3f}, "
              f"evicted {stats['evicted_tokens']}, retractions {stats['retractions']}")
        assert stats["evicted_tokens"] > 0  # the pool was too small to keep everything
        assert stats["optimal_hit_rate"] == pytest.approx(optimal_hit_rate(prompts))
        assert 0 <= stats["cache_hit_rate"] <= stats["optimal_hit_rate"] + 1e-12
        assert stats["cache_hit_rate"] == pytest.approx(stats["cached_tokens"] / stats["prompt_tokens"])
        assert_no_leak(eng)
        # A flush starts a new window. One request at a time, the tiny workload reaches its hand-computed
        # optimum exactly (each request reuses all of its prefix that an earlier one computed).
        assert eng.flush_cache()
        for prompt in TINY:
            eng.generate(prompt, {"temperature": 0, "max_new_tokens": 1}, progress=False)
        stats = eng.stats()
        assert stats["optimal_hit_rate"] == pytest.approx(TINY_OPTIMUM)
        assert stats["cache_hit_rate"] == pytest.approx(TINY_OPTIMUM)
        assert_no_leak(eng)


def test_a_partial_match_lowers_the_hit_rate_and_changes_no_output(workload, reference):
    """Fig. 8(a)(b)'s sweep: with half of each match used, the hit rate is lower than the full cache's,
    greedy outputs are the no-cache reference's, and the recomputed duplicates leak no slot."""
    prompts, params = workload
    rates = {}
    for fraction in (1.0, 0.5):
        # SMALL_POOL's schedule, as the policy tests: on this workload its steps give the reference's greedy
        # tokens (a 4096-slot pool batches differently, and one near-tied float32 choice flips).
        with Engine(prefix_cache="radix", cache_match_fraction=fraction, **SMALL_POOL) as eng:
            outs = eng.generate(prompts, params, progress=False)
            assert [o.token_ids for o in outs] == reference
            rates[fraction] = eng.stats()["cache_hit_rate"]
            assert_no_leak(eng)
    # Each later request of a prefix group matches at least its shared prefix (~20 tokens), then half of it.
    assert 0 < rates[0.5] < rates[1.0]
    assert rates[0.5] == pytest.approx(rates[1.0] / 2, rel=0.3)
