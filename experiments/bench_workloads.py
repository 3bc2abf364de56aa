"""The paper's end-to-end workloads (§6, Figs. 5/6) on jsgl: throughput, latency and cache hit rates.

    jsgl bench workloads                       # every workload, default sizes (see experiments/workloads/)
    jsgl bench workloads --quick               # a few programs each
    jsgl bench workloads --only mmlu,json --prefix-cache none

Per workload, on one engine shared by all (its compiled steps carry over):
- warm-up: two programs, then the prefix cache is flushed;
- **throughput**: `run_batch` of the workload's batch (one thread per program, so the engine sees them
  all at once), programs/s over the wall time;
- **hit rate**: cached / prompt tokens of that batch, beside the optimum (Theorem 3.1) for it;
- **latency**: further programs of the same workload run one at a time, mean seconds each, on the cache
  the batch left (a server that has been serving this workload, not a cold one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from jsgl.experiments.workloads import Workload, get_workload, workload_names


def _missing_outputs(state: Any, outputs: tuple[str, ...]) -> list[str]:
    missing = []
    for name in outputs:
        try:
            state[name]
        except Exception:  # KeyError, or the program's error re-raised
            missing.append(name)
    return missing


def run_workload(w: Workload, rt: Any, programs: int, latency_programs: int) -> dict[str, Any]:
    inputs = w.inputs(programs + latency_programs)
    batch, alone = inputs[:programs], inputs[programs:]
    w.program.run_batch(batch[:2], backend=rt, num_threads=2, **w.sampling)  # compile this workload's shapes
    rt.endpoint.flush_cache()
    before = rt.stats()
    t0 = time.perf_counter()
    states = w.program.run_batch(batch, backend=rt, num_threads=len(batch), **w.sampling)
    for s in states:
        s.sync()
    wall = time.perf_counter() - t0
    after = rt.stats()
    errors = [repr(s.error()) for s in states if s.error() is not None]
    missing = sorted({m for s in states if s.error() is None for m in _missing_outputs(s, w.outputs)})
    latencies = []
    for kwargs in alone:
        t1 = time.perf_counter()
        w.program.run(backend=rt, **kwargs, **w.sampling).sync()
        latencies.append(time.perf_counter() - t1)
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    steps = after["steps"] - before["steps"]
    batched = after["mean_batch_size"] * after["steps"] - before["mean_batch_size"] * before["steps"]
    return {
        "workload": w.name, "title": w.title, "programs": programs, "wall_s": round(wall, 3),
        "throughput": programs / wall, "latency_s": statistics.mean(latencies) if latencies else None,
        "latency_programs": len(latencies), "prompt_tokens": prompt, "cached_tokens": cached,
        "computed_prefill_tokens": after["computed_prefill_tokens"] - before["computed_prefill_tokens"],
        # The engine's achieved and optimal rates cover the same window (the flush above started it; a run past
        # HIT_RATE_WINDOW_TOKENS distinct tokens is measured over its last window).
        "hit_rate": after["cache_hit_rate"], "optimal_hit_rate": after["optimal_hit_rate"],
        "mean_batch_size": batched / steps if steps else 0.0,
        "compiles": after["compiles"] - before["compiles"], "errors": errors, "missing_outputs": missing,
    }


@contextlib.contextmanager
def frontend_switches(parallelism: bool = True, prefix_hint: bool = True):
    """Fig. 8(c)'s frontend ablations for the programs run inside; both back on afterwards."""
    from jsgl.lang import global_config

    global_config.enable_parallelism, global_config.enable_prefix_hint = parallelism, prefix_hint
    try:
        yield
    finally:
        global_config.enable_parallelism = global_config.enable_prefix_hint = True


def print_table(results: list[dict[str, Any]]) -> None:
    print("| workload | programs | throughput (programs/s) | latency (s) | hit rate | optimal | batch | compiles "
          "| errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        lat = f"{r['latency_s']:.2f}" if r["latency_s"] is not None else "-"
        print(f"| {r['title']} | {r['programs']} | {r['throughput']:.3f} | {lat} | {r['hit_rate']:.3f} | "
              f"{r['optimal_hit_rate']:.3f} | {r['mean_batch_size']:.1f} | {r['compiles']} | "
              f"{len(r['errors']) + len(r['missing_outputs'])} |")


def describe_machine() -> dict[str, str]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = ""
    import os

    return {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(), "commit": commit or "unknown"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help=f"comma list of workloads (default: all: {', '.join(workload_names())})")
    ap.add_argument("--programs", type=int, default=0, help="throughput batch per workload (default: its own)")
    ap.add_argument("--latency-programs", type=int, default=-1, help="programs timed alone (default: its own)")
    ap.add_argument("--quick", action="store_true", help="each workload's small batch, one latency program")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix-cache", default="radix", choices=["radix", "flat", "none"])
    ap.add_argument("--schedule-policy", default="lpm")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--no-frontend-parallelism", action="store_true", help="run forks one after another")
    ap.add_argument("--no-frontend-hint", action="store_true", help="no prefix hints from the frontend")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or workload_names()
    workloads = [get_workload(n) for n in names]

    import jsgl.lang as sgl

    rt = sgl.Runtime(model=args.model, prefix_cache=args.prefix_cache, schedule_policy=args.schedule_policy,
                     kv_cache_gb=args.kv_cache_gb, max_running_requests=args.max_running_requests)
    results = []
    try:
        with frontend_switches(not args.no_frontend_parallelism, not args.no_frontend_hint):
            for w in workloads:
                programs = args.programs or (w.quick_programs if args.quick else w.programs)
                latency = (args.latency_programs if args.latency_programs >= 0
                           else (1 if args.quick else w.latency_programs))
                print(f"{w.title}: {programs} programs, {latency} alone ({w.source})", flush=True)
                res = run_workload(w, rt, programs, latency)
                results.append(res)
                print("  " + json.dumps({k: v for k, v in res.items() if k not in ("title",)}), flush=True)
    finally:
        rt.shutdown()

    print(f"\nmodel {args.model}, prefix cache {args.prefix_cache}, policy {args.schedule_policy}")
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **describe_machine(), "results": results},
                                              indent=2))
    failed = [r for r in results if r["errors"] or r["missing_outputs"]]
    for r in failed:
        print(f"{r['workload']}: {len(r['errors'])} failed programs {r['errors'][:1]}, missing {r['missing_outputs']}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
