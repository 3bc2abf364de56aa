"""Grammar backends side by side on bench_json's workload: jsgl's compressed FSM vs llguidance.

    python -m experiments.bench_grammar            # or: jsgl bench grammar
    python -m experiments.bench_grammar --quick    # 8 cities, fewer repeats (~1.5 min on 2 cores)

The workload is bench_json's: one fixed JSON schema, a paragraph about each of the N most populous cities,
greedy decoding. What each figure includes:
  setup             backend construction for a tokenizer, once per process (jsgl: starting its build
                    worker processes, the vocabulary's bytes; llguidance: converting the HF tokenizer).
  build, cold       compile(schema) until the Future resolves, no cache of any kind (jsgl: schema -> regex
                    -> FSM -> token index in a worker process, memory and disk cache off; llguidance: schema
                    -> grammar -> matcher). What the first request of a new schema waits for.
  build, cached     what every later request of the same schema pays: compile(schema) (jsgl: memory hit;
                    llguidance: template hit) plus new_constraint (llguidance: a deep copy of the matcher).
  mask+advance      per output token, replaying the run's own outputs: allowed_token_bitmask() + advance()
                    (jsgl: a table lookup; llguidance: an Earley/lexer step computing the mask).
  tok/s             completion tokens / wall time of the whole batch (submit to last result), grammar
                    already cached: prefill, masks, sampling, detokenization, jump-forward extends.
                    Jumped tokens count as completion tokens (the caller receives them).
  jumped, passes    completion tokens appended by jump-forward (jsgl: forced text, retokenized; llguidance:
                    its fast-forward tokens), and the forward passes the batch needed.
  valid             outputs that parse as JSON and validate against the schema.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from jsgl.experiments.bench_json import SCHEMA, city_prompts, timed_json_batch

BACKENDS = ("jsgl", "llguidance")


def build_times(name: str, tokenizer: Any, vocab_size: int, reps: int) -> dict[str, float]:
    """Seconds: backend setup, cold builds (median of `reps`), cached compile + new constraint (median)."""
    from jsgl.errors import InvalidRequestError
    from jsgl.fsm import GrammarSpec, clear_memory_cache, make_grammar_backend, vocab_bytes

    t0 = time.perf_counter()
    backend = make_grammar_backend(name, tokenizer, vocab_size)
    if name == "jsgl":
        vocab_bytes(tokenizer)  # its once-per-tokenizer work (llguidance's is in the constructor)
    setup = time.perf_counter() - t0
    spec = GrammarSpec("json_schema", SCHEMA)
    cold = []
    disk = os.environ.get("JSGL_FSM_DISK_CACHE")
    os.environ["JSGL_FSM_DISK_CACHE"] = "0"  # jsgl: every cold build really builds
    try:
        for _ in range(reps):
            clear_memory_cache()
            if hasattr(backend, "clear_cache"):
                backend.clear_cache()
            t0 = time.perf_counter()
            try:
                backend.compile(spec).result()
            except InvalidRequestError as exc:  # e.g. jsgl's build deadline, on a machine busy with others
                print(f"{name}: a cold build failed: {exc}", flush=True)
                continue
            cold.append(time.perf_counter() - t0)
    finally:
        if disk is None:
            del os.environ["JSGL_FSM_DISK_CACHE"]
        else:
            os.environ["JSGL_FSM_DISK_CACHE"] = disk
    cached = []
    for _ in range(max(reps, 5)):
        t0 = time.perf_counter()
        backend.new_constraint(backend.compile(spec).result(), {0})
        cached.append(time.perf_counter() - t0)
    return {"setup_s": setup, "cold_s": statistics.median(cold) if cold else float("nan"),
            "cached_s": statistics.median(cached)}


def mask_cost(engine: Any, outputs: list[Any]) -> float:
    """Median seconds per token of allowed_token_bitmask() + advance(), replaying `outputs` (their own
    tokens: each backend replays what it produced)."""
    from jsgl.fsm import GrammarSpec

    backend = engine.constraints.backend
    compiled = backend.compile(GrammarSpec("json_schema", SCHEMA)).result()
    per_token = []
    for out in outputs:
        tokens = [t for t in out.token_ids if t not in engine.stop_ids]
        constraint = backend.new_constraint(compiled, engine.stop_ids)
        t0 = time.perf_counter()
        for t in tokens:
            constraint.allowed_token_bitmask()
            constraint.advance(t)
        per_token.append((time.perf_counter() - t0) / max(len(tokens), 1))
    return statistics.median(per_token)


def decode_run(engine: Any, prompts: list[str], jump: bool) -> tuple[dict[str, Any], list[Any]]:
    before = engine.stats()["forward_passes"]
    outs, latencies, wall, valid = timed_json_batch(engine, prompts, jump)
    tokens = sum(o.completion_tokens for o in outs)
    return {"tok_per_s": tokens / wall, "wall_s": wall, "p50_latency_s": statistics.median(latencies),
            "completion_tokens": tokens, "jumped_tokens": sum(o.jump_forward_tokens for o in outs),
            "forward_passes": engine.stats()["forward_passes"] - before, "valid": valid, "n": len(outs)}, outs


def run_engines(prompts: list[str], max_running: int, reps: int) -> dict[str, dict[str, Any]]:
    """Both engines live at once and their runs alternate, so a machine whose load drifts (shared CPUs)
    weighs on both alike; tok/s and latency are medians over `reps`, counts come from the last rep."""
    from jsgl.engine.engine import Engine

    engines = {name: Engine(kv_cache_gb=0.5, max_running_requests=max_running, grammar_backend=name)
               for name in BACKENDS}
    try:
        for engine in engines.values():
            for jump in (True, False):  # warm-up: compiles the step's shapes for both modes
                decode_run(engine, prompts, jump)
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        last: dict[str, list[Any]] = {}
        for _ in range(reps):
            for jump in (True, False):
                for name, engine in engines.items():
                    figures, outs = decode_run(engine, prompts, jump)
                    runs.setdefault((name, "jump" if jump else "plain"), []).append(figures)
                    if not jump:
                        last[name] = outs
        results: dict[str, dict[str, Any]] = {name: {} for name in engines}
        for (name, mode), figures in runs.items():
            summary = dict(figures[-1])
            for key in ("tok_per_s", "p50_latency_s", "wall_s"):
                summary[key] = statistics.median(f[key] for f in figures)
            results[name][mode] = summary
        for name, engine in engines.items():
            results[name]["mask_s_per_token"] = mask_cost(engine, last[name])
        return results
    finally:
        for engine in engines.values():
            engine.shutdown()


def ratio(a: float, b: float) -> str:
    if not b or a != a or b != b:  # zero or NaN
        return "       -"
    return f"{a / b:8.2f}x" if a / b >= 0.1 else f"{'1/' + format(b / a, '.0f'):>8}x"


def print_table(results: dict[str, dict[str, Any]]) -> None:
    j, g = results["jsgl"], results["llguidance"]
    rows = [
        ("setup per tokenizer (ms)", 1e3 * j["setup_s"], 1e3 * g["setup_s"], "{:10.1f}"),
        ("grammar build, cold (ms)", 1e3 * j["cold_s"], 1e3 * g["cold_s"], "{:10.1f}"),
        ("grammar build, cached (ms)", 1e3 * j["cached_s"], 1e3 * g["cached_s"], "{:10.3f}"),
        ("mask+advance per token (us)", 1e6 * j["mask_s_per_token"], 1e6 * g["mask_s_per_token"], "{:10.1f}"),
    ]
    for mode in ("jump", "plain"):
        label = "jump-forward on" if mode == "jump" else "jump-forward off"
        rows += [
            (f"decode tok/s, {label}", j[mode]["tok_per_s"], g[mode]["tok_per_s"], "{:10.1f}"),
            (f"p50 latency s, {label}", j[mode]["p50_latency_s"], g[mode]["p50_latency_s"], "{:10.2f}"),
            (f"forward passes, {label}", j[mode]["forward_passes"], g[mode]["forward_passes"], "{:10d}"),
            (f"completion tokens, {label}", j[mode]["completion_tokens"], g[mode]["completion_tokens"], "{:10d}"),
            (f"valid outputs, {label}", j[mode]["valid"], g[mode]["valid"], "{:10d}"),
        ]
    rows.append(("tokens jumped, jump-forward on", j["jump"]["jumped_tokens"], g["jump"]["jumped_tokens"],
                 "{:10d}"))
    print(f"\n{'figure (medians where repeated)':<36} {'jsgl':>10} {'llguidance':>10} {'llg/jsgl':>9}")
    for label, a, b, fmt in rows:
        print(f"{label:<36} {fmt.format(a)} {fmt.format(b)} {ratio(b, a)}")
    for name, r in results.items():
        saved = r["plain"]["forward_passes"] / max(r["jump"]["forward_passes"], 1)
        print(f"{name}: jump-forward saves {r['jump']['jumped_tokens']} of {r['jump']['completion_tokens']} "
              f"tokens' decode steps; {saved:.2f}x fewer forward passes, "
              f"{r['jump']['tok_per_s'] / r['plain']['tok_per_s']:.2f}x tok/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cities", type=int, default=16)
    ap.add_argument("--build-reps", type=int, default=3, help="cold builds per backend (median)")
    ap.add_argument("--reps", type=int, default=2, help="measured decode runs per backend and mode (median)")
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="8 cities, 2 cold builds, 1 measured run")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.cities, args.build_reps, args.reps = 8, 2, 1

    from jsgl.fsm.llguidance_backend import llguidance_module
    from jsgl.model.tokenizer import load_tokenizer

    llguidance_module()  # a clear "pip install llguidance" before minutes of work
    tokenizer = load_tokenizer("smollm2-135m")
    vocab_size = len(tokenizer)  # = SmolLM2-135M's model vocabulary (49152)
    results: dict[str, dict[str, Any]] = {}
    for name in BACKENDS:
        t0 = time.perf_counter()
        results[name] = build_times(name, tokenizer, vocab_size, args.build_reps)
        print(f"{name}: build times measured in {time.perf_counter() - t0:.1f}s", flush=True)
    prompts = city_prompts(args.cities, tokenizer)
    t0 = time.perf_counter()
    for name, figures in run_engines(prompts, args.max_running, args.reps).items():
        results[name].update(figures)
    print(f"decode: {len(prompts)} requests x {2 * (args.reps + 1)} runs per backend in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
