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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jsgl.experiments.baselines import Target
from jsgl.experiments.workloads import Workload, get_workload, workload_names


def _missing_outputs(state: Any, outputs: tuple[str, ...]) -> list[str]:
    missing = []
    for name in outputs:
        try:
            state[name]
        except Exception:  # KeyError, or the program's error re-raised
            missing.append(name)
    return missing


def run_workload(w: Workload, target: Target | Any, programs: int, latency_programs: int) -> dict[str, Any]:
    """`target`: a baselines.Target, or a jsgl Runtime. Hit rates and batch sizes come from the engine's
    statistics where the system has them (jsgl), else they are None."""
    if not isinstance(target, Target):
        target = Target.of_runtime(target)
    backend = target.backend
    inputs = w.inputs(programs + latency_programs)
    batch, alone = inputs[:programs], inputs[programs:]
    w.program.run_batch(batch[:2], backend=backend, num_threads=2, **w.sampling)  # compile this workload's shapes
    target.flush()
    before = target.stats() if target.stats else None
    t0 = time.perf_counter()
    states = w.program.run_batch(batch, backend=backend, num_threads=len(batch), **w.sampling)
    for s in states:
        s.sync()
    wall = time.perf_counter() - t0
    after = target.stats() if target.stats else None
    errors = [repr(s.error()) for s in states if s.error() is not None]
    missing = sorted({m for s in states if s.error() is None for m in _missing_outputs(s, w.outputs)})
    latencies = []
    for kwargs in alone:
        t1 = time.perf_counter()
        w.program.run(backend=backend, **kwargs, **w.sampling).sync()
        latencies.append(time.perf_counter() - t1)
    result = {
        "workload": w.name, "title": w.title, "programs": programs, "wall_s": round(wall, 3),
        "throughput": programs / wall, "latency_s": statistics.mean(latencies) if latencies else None,
        "latency_programs": len(latencies), "errors": errors, "missing_outputs": missing,
        "prompt_tokens": None, "cached_tokens": None, "computed_prefill_tokens": None, "hit_rate": None,
        "optimal_hit_rate": None, "mean_batch_size": None, "compiles": None,
    }
    if before is None or after is None:
        return result
    steps = after["steps"] - before["steps"]
    batched = after["mean_batch_size"] * after["steps"] - before["mean_batch_size"] * before["steps"]
    result.update({
        "prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"],
        "cached_tokens": after["cached_tokens"] - before["cached_tokens"],
        "computed_prefill_tokens": after["computed_prefill_tokens"] - before["computed_prefill_tokens"],
        # The engine's achieved and optimal rates cover the same window (the flush above started it; a run past
        # HIT_RATE_WINDOW_TOKENS distinct tokens is measured over its last window).
        "hit_rate": after["cache_hit_rate"], "optimal_hit_rate": after["optimal_hit_rate"],
        "mean_batch_size": batched / steps if steps else 0.0, "compiles": after["compiles"] - before["compiles"],
    })
    return result


@contextlib.contextmanager
def frontend_switches(parallelism: bool = True, prefix_hint: bool = True):
    """Fig. 8(c)'s frontend ablations for the programs run inside; both back on afterwards."""
    from jsgl.lang import global_config

    global_config.enable_parallelism, global_config.enable_prefix_hint = parallelism, prefix_hint
    try:
        yield
    finally:
        global_config.enable_parallelism = global_config.enable_prefix_hint = True


@contextlib.contextmanager
def _runtime(**options: Any) -> Iterator[Any]:
    import jsgl.lang as sgl

    rt = sgl.Runtime(**options)
    try:
        yield rt
    finally:
        rt.shutdown()


def print_table(results: list[dict[str, Any]]) -> None:
    def cell(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print("| workload | programs | throughput (programs/s) | latency (s) | hit rate | optimal | batch | compiles "
          "| errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['title']} | {r['programs']} | {r['throughput']:.3f} | {cell(r['latency_s'], '.2f')} | "
              f"{cell(r['hit_rate'], '.3f')} | {cell(r['optimal_hit_rate'], '.3f')} | "
              f"{cell(r['mean_batch_size'], '.1f')} | {cell(r['compiles'], 'd')} | "
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
    ap.add_argument("--system", default="jsgl", help="jsgl, or a peer system: vllm, llamacpp, transformers "
                    "(experiments/baselines/; skipped with a message when not installed)")
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

    if args.system != "jsgl":
        from jsgl.experiments.baselines import get_system

        system = get_system(args.system)
        reason = system.unavailable() or system.refuses(args.model)
        if reason:
            print(f"{system.title}: skipped: {reason}")
            return 0
        context = system.start(args.model)
    else:
        context = _runtime(model=args.model, prefix_cache=args.prefix_cache, schedule_policy=args.schedule_policy,
                           kv_cache_gb=args.kv_cache_gb, max_running_requests=args.max_running_requests)
    results = []
    with context as target, frontend_switches(not args.no_frontend_parallelism, not args.no_frontend_hint):
        for w in workloads:
            programs = args.programs or (w.quick_programs if args.quick else w.programs)
            latency = (args.latency_programs if args.latency_programs >= 0
                       else (1 if args.quick else w.latency_programs))
            print(f"{w.title}: {programs} programs, {latency} alone ({w.source})", flush=True)
            res = run_workload(w, target, programs, latency)
            results.append(res)
            print("  " + json.dumps({k: v for k, v in res.items() if k not in ("title",)}), flush=True)

    print(f"\nmodel {args.model}, system {args.system}" + (
        f", prefix cache {args.prefix_cache}, policy {args.schedule_policy}" if args.system == "jsgl" else ""))
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
