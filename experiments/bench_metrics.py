"""What Prometheus metrics cost: decode with the engine's latency metrics on and off, alternating rounds on one
engine, and one `/metrics` scrape.

    python experiments/bench_metrics.py            # or: jsgl bench metrics
    python experiments/bench_metrics.py --quick

Each round: `--batch` greedy requests of `--new-tokens` tokens (ignore_eos) on the default model, submitted
together, on an engine precompiled for them, prefix cache flushed before each round (so every round prefills the
same). Per round the engine's decode-step seconds (`stats()["decode_time_s"]`, prefill excluded) over its decode
steps: ms/step, with metrics on (the engine thread observes each request's token gaps) and off. Rounds alternate
on/off so the machine's drift hits both; medians over rounds, and their ratio. Then the hooks alone: the
engine-thread calls a decode step of `--batch` requests makes (µs), and one scrape (`exposition()`, ms).
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

from jsgl.engine.engine import Engine
from jsgl.engine.metrics import EngineMetrics


def decode_ms_per_step(engine: Engine, batch: int, new_tokens: int) -> float:
    engine.flush_cache()
    before = engine.stats()
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    engine.generate([f"Story {i}: once upon a time" for i in range(batch)], params, progress=False)
    after = engine.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    return 1000 * (after["decode_time_s"] - before["decode_time_s"]) / max(steps, 1)


def hook_cost_us(metrics: EngineMetrics, batch: int, steps: int = 2000) -> float:
    """Engine-thread time of one decode step's metric calls at ``batch`` requests (past their first token)."""
    seqs = [SimpleNamespace(arrival_time=time.monotonic(), first_token_time=0.0, last_token_time=0.0,
                            output_ids=[], metrics_tokens=0) for _ in range(batch)]
    start = time.perf_counter()
    for _ in range(steps):
        now = time.monotonic()
        for seq in seqs:
            seq.output_ids.append(0)  # (the list append is the engine's own work; it stays in the timing)
            metrics.tokens(seq, now, True)
    return 1e6 * (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="requests per round (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64, help="output tokens each (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds with metrics on, and as many off")
    ap.add_argument("--quick", action="store_true", help="batch 4, 8 tokens, 1 round each")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.new_tokens, args.rounds = 4, 8, 1
    engine = Engine(max_running_requests=max(args.batch, 1), precompile="common")
    metrics = engine.enable_metrics()
    decode_ms_per_step(engine, args.batch, args.new_tokens)  # warm-up: first runs pay one-time costs
    on, off = [], []
    for _ in range(args.rounds):
        for enabled, times in ((True, on), (False, off)):
            engine.loop.metrics = metrics if enabled else None  # read by the engine thread each step
            times.append(decode_ms_per_step(engine, args.batch, args.new_tokens))
    engine.loop.metrics = metrics
    scrape_ms = statistics.median(_timed(metrics.exposition) for _ in range(20))
    hooks = hook_cost_us(metrics, args.batch)
    engine.shutdown()
    on_ms, off_ms = statistics.median(on), statistics.median(off)
    print(f"decode, batch {args.batch} x {args.new_tokens} tokens, medians of {args.rounds} alternating rounds")
    print(f"{'metrics':<10}{'ms/step':>10}")
    print(f"{'on':<10}{on_ms:>10.3f}\n{'off':<10}{off_ms:>10.3f}")
    print(f"on/off: {on_ms / off_ms:.3f}")
    print(f"the hooks alone: {hooks:.1f} us per decode step of {args.batch} ({100 * hooks / 1000 / off_ms:.2f}% "
          f"of the step); one /metrics scrape: {scrape_ms:.2f} ms")
    return 0


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


if __name__ == "__main__":
    raise SystemExit(main())
