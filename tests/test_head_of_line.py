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
def test_a_short_request_beside_an_8000_token_prompt_keeps_its_pace(engine):
    _timed(engine, VICTIM)
    solo_times, solo_texts = zip(*(_timed(engine, VICTIM) for _ in range(3)))
    solo = statistics.median(solo_times)
    long = engine.submit([28] * 8000, {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True})
    time.sleep(0.3)  # the long prompt's prefill is under way
    seconds, text = _timed(engine, VICTIM)
    assert not long.done  # it was beside the prefill (8000 tokens take several seconds here)
    long.abort()
    assert text == solo_texts[0]  # the same greedy text, whatever shared its steps
    assert seconds < 2 * solo + 1.0, f"{seconds:.2f} s beside the long prompt, {solo:.2f} s alone"
    assert_no_leak(engine)
