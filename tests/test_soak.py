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
    # compiled step is ~8-17 MB of host memory here (the long soak: +47 MB for 6; one short run +152 MB for 9),
    # so the allowance scales with the signatures compiled after warm-up, plus slack: 200 MB. The growth of this
    # 25 s run spread from 41 to 171 MB over nine runs (55/0, 86/2, 41/2, 51/1 new signatures alone, ~1,100-1,300
    # requests; 124/2, 106/1, 84/1, and 139/1 and 171/1 with ~1,900 requests inside the full suite). That it
    # rises with the request count is not explained yet: it may be a leak of up to ~90 KB per request (open
    # question, 2026-12-02). One of 200 KB per request would still show.
    grown = report.rss_end_mb - report.rss_warm_mb
    new_signatures = report.server_info.get("compiles", 0) - report.compiles_warm
    assert grown < 200 + 20 * new_signatures, report.summary()
