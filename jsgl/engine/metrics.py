"""Prometheus metrics of one engine, under SGLang's names and labels where SGLang has the metric
(`sglang:prompt_tokens_total`, `sglang:time_to_first_token_seconds`, ...) and `jsgl:` where it has none.

Two kinds: what the engine already counts (queue lengths, KV use, hit rates, jump-forward, compiles) is read from
``Engine.stats()`` when Prometheus scrapes, costing the engine nothing; per-request counts and latencies (tokens,
time to first token, between tokens, end to end, finishes) are observed by the engine thread as tokens come out,
about a microsecond per request and step, and agree with what the responses report (``usage``, ``meta_info``).
Off until ``Engine.enable_metrics()`` (the server turns it on); counted from then on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jsgl.engine.sequence import Sequence

# SGLang's buckets (docs/references/production_metrics.md), so its Grafana dashboard reads ours.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0,
                20.0, 25.0, 30.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5)


class EngineMetrics:
    """The registry `/metrics` exposes for one engine (``exposition()``), and the engine thread's hooks."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(**label)

        self.ttft = histogram("sglang:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds",
                             "Time between a request's consecutive steps that gave it tokens, in seconds.",
                             TOKEN_BUCKETS)
        self.tpot = histogram("sglang:time_per_output_token_seconds",
                              "Per finished request: (end to end - first token) / (output tokens - 1), in seconds.",
                              TOKEN_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             E2E_BUCKETS)
        self.generation_tokens = Counter("sglang:generation_tokens", "Output tokens generated (sampled or forced).",
                                         ["model_name"], registry=self.registry).labels(**label)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens of requests whose prefill completed.",
                                     ["model_name"], registry=self.registry).labels(**label)
        self.cached_tokens = Counter("sglang:cached_tokens", "Of those, the ones taken from the prefix cache.",
                                     ["model_name"], registry=self.registry).labels(**label)
        self.requests = Counter("sglang:num_requests", "Finished requests, by how they finished.",
                                ["model_name", "finish_reason"], registry=self.registry)
        self.aborts = Counter("jsgl:aborted_requests", "Aborted requests, by reason.", ["model_name", "reason"],
                              registry=self.registry)
        self.model_name = model_name
        self.generated = 0  # the counter's value, for gen_throughput
        self.registry.register(_StatsCollector(stats, lambda: self.generated, model_name))

    # ------------------------------------------------------------------ engine thread (keep these cheap)
    def tokens(self, seq: Sequence, now: float, sampled: bool) -> None:
        """``seq`` was in the step that ended at ``now`` (time.monotonic), which ``sampled`` its next token (or
        ended its prefill, for a prefill-only request): count the output tokens it has gained (sampled, forced by
        jump-forward, and a grammar's forced start, appended before its prefill)."""
        first = seq.first_token_time is None
        if first:  # counted from the step that ends its prefill on
            if not sampled:
                return
            seq.first_token_time = now
            self.ttft.observe(now - seq.arrival_time)
            self.prompt_tokens.inc(len(seq.prompt_ids))
            self.cached_tokens.inc(seq.cached_tokens_reported)
        new = len(seq.output_ids) - seq.metrics_tokens
        if new <= 0:  # prefill only, or a jump-forward that retokenized to fewer tokens
            return
        seq.metrics_tokens += new
        self.generation_tokens.inc(new)
        self.generated += new
        if not first:
            self.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now

    def finished(self, seq: Sequence, now: float) -> None:
        """``seq`` finished (any reason) at ``now`` (EngineLoop.retire: once a request)."""
        reason = seq.finish_reason.value if seq.finish_reason is not None else "unknown"
        self.requests.labels(self.model_name, reason).inc()
        if seq.abort_reason is not None:
            self.aborts.labels(self.model_name, seq.abort_reason.value).inc()
        self.e2e.observe(now - seq.arrival_time)
        outputs = len(seq.output_ids)
        if seq.first_token_time is not None and outputs > 1:
            self.tpot.observe((now - seq.first_token_time) / (outputs - 1))

    # ------------------------------------------------------------------------------------ scrape side
    def exposition(self) -> bytes:
        """The text `/metrics` answers (Prometheus' text format)."""
        return generate_latest(self.registry)


class _StatsCollector(Collector):
    """Counters and gauges read off ``Engine.stats()`` at scrape time; ``gen_throughput`` is output tokens per
    second since the previous scrape (since start at the first)."""

    def __init__(self, stats: Callable[[], dict[str, Any]], generated: Callable[[], int], model_name: str) -> None:
        self.stats, self.generated, self.model_name = stats, generated, model_name
        self._lock = threading.Lock()
        self._last = (time.monotonic(), 0)

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        labels = ["model_name"]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric([self.model_name], value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric([self.model_name], value)
            return family

        with self._lock:
            now, generated = time.monotonic(), self.generated()
            then, before = self._last
            self._last = (now, generated)
        used = s["total_slots"] - s["free_slots"]
        yield counter("jsgl:computed_prefill_tokens", "Prompt tokens computed by extend steps.",
                      s["computed_prefill_tokens"])
        yield gauge("sglang:num_running_reqs", "Requests being prefilled or decoded.", s["running_requests"])
        yield gauge("sglang:num_queue_reqs", "Requests waiting for admission (or for their constraint's index).",
                    s["queued_requests"])
        yield gauge("sglang:num_used_tokens", "KV slots in use (requests and the prefix cache).", used)
        yield gauge("sglang:max_total_num_tokens", "KV slots in the pool.", s["total_slots"])
        yield gauge("sglang:token_usage", "Share of the KV pool in use.", used / max(s["total_slots"], 1))
        yield gauge("sglang:cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens.",
                    s["cache_hit_rate"])
        yield gauge("sglang:gen_throughput", "Output tokens per second since the previous scrape.",
                    (generated - before) / max(now - then, 1e-9))
        yield gauge("jsgl:optimal_hit_rate", "The best hit rate any cache policy could reach on the same prompts.",
                    s["optimal_hit_rate"])
        yield counter("jsgl:jump_forward_tokens", "Output tokens appended by jump-forward (not sampled).",
                      s["jump_forward_tokens"])
        yield counter("jsgl:retractions", "Requests retracted (recomputed later), for memory or a higher priority.",
                      s["retractions"])
        yield counter("jsgl:preemptions", "Of those, retracted for a waiting request of a higher priority.",
                      s["preemptions"])
        yield counter("jsgl:evicted_tokens", "Tokens evicted from the prefix cache.", s["evicted_tokens"])
        compiles = CounterMetricFamily("jsgl:compiles", "Step shapes compiled, by when.", labels=["model_name", "when"])
        for when, key in (("start", "compiled_at_start"), ("background", "compiled_in_background"),
                          ("request_path", "compiled_on_request_path")):
            compiles.add_metric([self.model_name, when], s[key])
        yield compiles
