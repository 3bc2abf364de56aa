"""The soak test's short version: `jsgl serve` in a subprocess under 8 concurrent clients sending valid,
streaming, constrained, select, chat, aborted, disconnecting, oversize and hostile requests
(experiments/soak.py runs the long one)."""

from __future__ import annotations

import pytest
from jsgl.experiments.soak import run_soak

from jsgl.server.launch import launch_server_process


@pytest.mark.slow
def test_short_soak_loses_nothing_and_leaks_nothing():
    with launch_server_process(kv_cache_gb=0.25, max_running_requests=16) as server:
        report = run_soak(server.url, duration_s=25, clients=8, hostile_share=0.2, seed=1,
                          server_pid=server.proc.pid, warmup_s=20)
    print(report.summary())
    assert not report.failures, report.summary()
    assert not report.leaks(), report.summary()
    kinds = {o.kind for o in report.outcomes}
    assert {"hostile", "disconnect", "abort", "regex", "json", "stream"} <= kinds, kinds
    # After warm-up, memory may grow only by what new step compilations cost (bounded by the buckets): each
    # compiled step is ~8-31 MB of host memory here, so the allowance scales with the signatures compiled after
    # warm-up, plus slack for the radix tree filling the 0.25 GB pool, which this 25 s run never sees end. The
    # growth spread from 41 to 171 MB over nine runs (~1,100-1,900 requests). Is it a per-request leak? No: a
    # long soak of the same mix (eight 30 s phases on one server, 9,859 requests) measured RSS 2078, 2090, 2096,
    # 2100, 2101, 2102, 2102 MB at the phase ends while the tree grew from 999 to 5,803 cached tokens (the pool
    # full at phase 6), then +31 MB with one new step signature in phase 8: after the pool filled, 2,570
    # requests grew it < 1 MB (2026-12-02). A leak of 150 KB per request (~290 MB here) would still fail this.
    grown = report.rss_end_mb - report.rss_warm_mb
    new_signatures = report.server_info.get("compiles", 0) - report.compiles_warm
    assert grown < 200 + 20 * new_signatures, report.summary()
