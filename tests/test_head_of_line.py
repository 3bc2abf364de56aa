"""One request cannot stall another: a short request sent just after an 8000-token prompt finishes within twice its
solo time plus a second (the promise of the README, measured as the probe that found it did). Before the time
share the long prompt's 16 extend steps of 512 tokens ran first and the 32-token request took 13-15 s here.

Its own engine, precompiled, so that no compile lands inside the timed window.
"""

from __future__ import annotations

import statistics
import time

import pytest
from conftest import assert_no_leak

from jsgl.engine.engine import Engine

VICTIM = "Write a short poem about the sea and the sky."
GREEDY_32 = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    eng = Engine("smollm2-135m", precompile="common")
    yield eng
    eng.shutdown()


def _timed(engine: Engine, prompt: str) -> tuple[float, str]:
    start = time.perf_counter()
    out = engine.generate(prompt, GREEDY_32)
    return time.perf_counter() - start, out.text


@pytest.mark.slow
@pytest.mark.parametrize("long_prompts", [[8000], [4000] * 4], ids=["one-8000", "four-4000"])
def test_a_short_request_beside_long_prompts_keeps_its_pace(engine, long_prompts):
    """Sent after them, it is neither stalled by the prefill under way nor queued behind the other long prompts."""
    _timed(engine, VICTIM)
    solo_times, solo_texts = zip(*(_timed(engine, VICTIM) for _ in range(3)))
    solo = statistics.median(solo_times)
    longs = [engine.submit([28 + i] * n, {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True})
             for i, n in enumerate(long_prompts)]
    time.sleep(0.3)  # the first long prompt's prefill is under way
    seconds, text = _timed(engine, VICTIM)
    assert not longs[-1].done  # they were beside it (their prefill takes several seconds here)
    for long in longs:
        long.abort()
    assert text == solo_texts[0]  # the same greedy text, whatever shared its steps
    assert seconds < 2 * solo + 1.0, f"{seconds:.2f} s beside the long prompts, {solo:.2f} s alone"
    assert_no_leak(engine)
