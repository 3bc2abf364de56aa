"""`/metrics`: Prometheus' text format, parsed by prometheus_client's own parser, after a mixed workload on the
real model (plain, stopped, JSON-constrained with jump-forward, prefill-only, chat, streamed, aborted, and a 400 that
never reaches the engine). Every counter moves by what the responses themselves report; the latency histograms count one
observation per request (TTFT, end to end) and per further step that gave it tokens; the gauges come back to idle.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import assert_server_no_leak
from prometheus_client.parser import text_string_to_metric_families

from jsgl.server.launch import ServerThread

MODEL = "smollm2-135m"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def scrape(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            assert sample.labels.get("model_name") == MODEL or sample.name.startswith(("python_", "process_"))
            samples[(sample.name, labels)] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.slow
def test_metrics_count_what_the_responses_report(engine):
    with ServerThread(engine) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        _run_and_check(engine, http)


def _run_and_check(engine, http: httpx.Client) -> None:
    before = scrape(http)
    metas = []
    for body in ({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
                 {"text": "One, two, three,", "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                  "stop": ","}},
                 {"text": "A person as JSON:", "sampling_params": {"max_new_tokens": 40, "temperature": 0,
                                                                   "json_schema": json.dumps(SCHEMA)}},
                 {"text": "Scored, not continued", "sampling_params": {"max_new_tokens": 0}}):  # prefill only
        resp = http.post("/generate", json=body)
        assert resp.status_code == 200, resp.text
        metas.append(resp.json()["meta_info"])
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 5, "temperature": 0,
                                                   "messages": [{"role": "user", "content": "Say hi."}]}).json()
    with http.stream("POST", "/generate", json={"text": "Count: 1, 2,", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 7, "temperature": 0}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    metas.append(events[-1]["meta_info"])
    assert http.post("/generate", json={"text": "x", "sampling_params": {"temperature": -1}}).status_code == 400

    # One aborted mid-decode: its tokens so far count too.
    aborted: dict = {}
    thread = threading.Thread(target=lambda: aborted.update(http.post("/generate", json={
        "text": "Once upon a time", "rid": "metrics-abort", "sampling_params": {"max_new_tokens": 2000,
                                                                               "ignore_eos": True}}).json()))
    thread.start()
    deadline = time.monotonic() + 60
    while value(scrape(http), "sglang:num_running_reqs") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    http.post("/abort_request", json={"rid": "metrics-abort"})
    thread.join(60)
    metas.append(aborted["meta_info"])
    assert_server_no_leak(http)

    after = scrape(http)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    completions = [m["completion_tokens"] for m in metas] + [chat["usage"]["completion_tokens"]]
    prompts = [m["prompt_tokens"] for m in metas] + [chat["usage"]["prompt_tokens"]]
    cached = [m["cached_tokens"] for m in metas] + [chat["usage"]["prompt_tokens_details"]["cached_tokens"]]
    assert delta("sglang:generation_tokens_total") == sum(completions)
    assert delta("sglang:prompt_tokens_total") == sum(prompts)
    assert delta("sglang:cached_tokens_total") == sum(cached)
    assert delta("sglang:num_requests_total", finish_reason="abort") == 1
    assert delta("jsgl:aborted_requests_total", reason="client") == 1
    assert delta("sglang:num_requests_total", finish_reason="stop") + delta(
        "sglang:num_requests_total", finish_reason="length") == len(completions) - 1
    assert 0 < delta("jsgl:jump_forward_tokens_total") < completions[2]  # the JSON request's forced tokens
    assert delta("sglang:time_to_first_token_seconds_count") == len(completions)
    assert delta("sglang:e2e_request_latency_seconds_count") == len(completions)
    # One inter-token gap per step after the first that gave a request tokens: at most one per further token
    # (a jump-forward appends several in one step), exactly one per token for the unconstrained ones.
    plain = sum(max(c - 1, 0) for i, c in enumerate(completions) if i != 2)
    assert plain < delta("sglang:inter_token_latency_seconds_count") <= sum(max(c - 1, 0) for c in completions)
    assert delta("sglang:time_per_output_token_seconds_count") == sum(c > 1 for c in completions)
    assert delta("sglang:e2e_request_latency_seconds_sum") > delta("sglang:time_to_first_token_seconds_sum") > 0
    assert value(after, "sglang:num_running_reqs") == value(after, "sglang:num_queue_reqs") == 0
    stats = engine.stats()
    assert value(after, "sglang:max_total_num_tokens") == stats["total_slots"]
    assert value(after, "sglang:token_usage") == pytest.approx(1 - stats["free_slots"] / stats["total_slots"])
    assert value(after, "sglang:cache_hit_rate") == pytest.approx(stats["cache_hit_rate"])
    assert value(after, "jsgl:compiles_total", when="start") == stats["compiled_at_start"]


def test_metrics_can_be_turned_off_and_an_engine_has_one_registry(engine):
    from jsgl.server.app import create_app

    first = engine.enable_metrics()
    assert engine.enable_metrics() is first and b"sglang:prompt_tokens_total" in first.exposition()
    with ServerThread(engine) as server:
        assert httpx.get(server.url + "/metrics").status_code == 200
    app = create_app(engine, metrics=False)
    from fastapi.testclient import TestClient

    resp = TestClient(app).get("/metrics")
    assert resp.status_code == 404 and "--disable-metrics" in resp.json()["error"]["message"]


def test_token_counters_count_prompts_and_outputs_through_the_engine_loop(tokenizer):
    """Quick, on the host model (tests/host_model.py): the engine loop's metrics hooks count each request's prompt
    once, at its length (not its tokens so far, which include the first sampled one), and every output token; one
    time-to-first-token and one finish per request, an inter-token gap per further step."""
    import collections

    from jsgl.engine.detokenizer import IncrementalDetokenizer
    from jsgl.engine.metrics import EngineMetrics
    from jsgl.engine.request import SamplingParams
    from jsgl.engine.sequence import Sequence
    from tests.host_model import host_engine

    engine = host_engine(tokenizer, overlap_schedule=False)
    metrics = engine.loop.metrics = EngineMetrics(lambda: collections.defaultdict(float), MODEL)  # (no stats here)
    seqs = [Sequence(rid=f"r{i}", prompt_ids=list(range(300 + 20 * i, 307 + 23 * i)),
                     params=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True),
                     detok=IncrementalDetokenizer(tokenizer, []), seed=i, stop_ids=set())
            for i, n in enumerate([5, 1, 0])]  # the last is prefill only
    engine.run(seqs)

    def sample(name, **labels):
        return metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels}) or 0.0

    assert sample("sglang:prompt_tokens_total") == sum(len(s.prompt_ids) for s in seqs) == 7 + 10 + 13
    assert sample("sglang:generation_tokens_total") == sum(len(s.output_ids) for s in seqs) == 5 + 1
    assert sample("sglang:cached_tokens_total") == 0
    assert sample("sglang:time_to_first_token_seconds_count") == 3
    assert sample("sglang:num_requests_total", finish_reason="length") == 3
    assert sample("sglang:inter_token_latency_seconds_count") == 4  # the 5-token request's steps after its first
