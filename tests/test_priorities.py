"""Request priorities on the real model (SGLang's `priority`): a high-priority request sent into a saturated
engine finishes before the low-priority ones queued ahead of it, preempting a running one; the preempted request
is recomputed and gives the same greedy text as alone; nothing is lost or leaked. Through the DSL (`gen(priority=)`),
/generate (top-level `priority`, as SGLang's) and the OpenAI routes it reaches the engine the same way.
"""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import assert_no_leak

import jsgl as sgl
from jsgl.engine.engine import Engine
from jsgl.engine.request import FinishReason
from jsgl.server.launch import ServerThread

LOW = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    eng = Engine("smollm2-135m", max_running_requests=2, kv_cache_gb=0.05, precompile="off",
                 enable_priority_scheduling=True)  # off by default, as SGLang's
    yield eng
    eng.shutdown()


def test_a_high_priority_request_overtakes_the_queue_and_the_preempted_one_is_unchanged(engine):
    prompts = [f"Tell me about the number {i}." for i in range(6)]
    alone = [engine.generate(p, LOW).text for p in prompts]
    engine.flush_cache()
    order: list[str] = []
    lows = [engine.submit(p, LOW, request_id=f"low{i}") for i, p in enumerate(prompts)]
    for handle in lows:
        handle.subscribe(lambda chunk, rid=handle.request_id: chunk.finished and order.append(rid))
    deadline = time.monotonic() + 120
    while engine.stats()["running_requests"] < 2 and time.monotonic() < deadline:  # saturated: two decode, four wait
        time.sleep(0.01)
    high = engine.submit("Quick: name a colour.", {**LOW, "priority": 10}, request_id="high")
    high.subscribe(lambda chunk: chunk.finished and order.append("high"))
    outs = [h.result(timeout=300) for h in lows]
    assert high.result(timeout=300).finish_reason == FinishReason.LENGTH
    assert order.index("high") < min(order.index(f"low{i}") for i in range(2, 6)), order  # the queued ones
    assert engine.stats()["preemptions"] >= 1  # one of the two running lows gave way
    assert [o.text for o in outs] == alone  # recomputed after preemption: the same greedy text
    assert all(o.completion_tokens == 24 for o in outs)
    assert_no_leak(engine)


def test_priority_reaches_the_engine_from_the_dsl_and_from_generate(engine):
    seen: list[int] = []
    enqueue = engine._enqueue

    def spy(seqs):
        seen.extend(seq.params.priority for seq in seqs)
        return enqueue(seqs)

    engine._enqueue = spy
    try:
        @sgl.function
        def prog(s):
            s += "Say yes:" + sgl.gen("a", max_tokens=2, temperature=0, priority=3)

        prog.run(backend=sgl.Runtime(engine=engine))
        with ServerThread(engine) as server:
            ok = httpx.post(server.url + "/generate", json={"text": "Hi", "priority": 7,
                                                            "sampling_params": {"max_new_tokens": 2}}, timeout=120)
            bad = httpx.post(server.url + "/generate", json={"text": "Hi", "priority": "high"}, timeout=120)
            huge = httpx.post(server.url + "/generate", json={"text": "Hi", "priority": 2**40}, timeout=120)
            chat = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
                "model": "smollm2-135m", "max_tokens": 2, "priority": 5,
                "messages": [{"role": "user", "content": "Hi"}]})
    finally:
        del engine._enqueue
    assert seen == [3, 7, 5] and chat.status_code == 200
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
    assert bad.status_code == 400 and "priority" in bad.text
    assert huge.status_code == 400 and "priority must be a 32-bit integer" in huge.text
    assert_no_leak(engine)
