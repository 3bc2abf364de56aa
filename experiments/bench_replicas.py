"""Replicas behind sglang-router (`jsgl serve --dp N`): hit rate and throughput of dp=1, dp=2 cache_aware and dp=2
round_robin on a shared-prefix workload, and the router's added latency per request.

The workload: several distinct long system prompts × questions, interleaved (question 0 of every system prompt,
then question 1 of each, ...), sent by concurrent clients from empty caches. dp=1 is one `jsgl serve` with all
the cores; dp=2 are two Ray-actor replicas with half the cores each (`Replicas`), measured through their
cache_aware router and then through a round_robin router over the same replicas. The router's added latency:
the median over pairs of the same cached one-token request sent to a replica directly and through the router.

    jsgl bench replicas                          # 8 system prompts x 8 questions, 8 clients, 16 new tokens
    jsgl bench replicas --quick                  # 3 x 2, 2 clients, 2 tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

WORDS = ("river stone light quiet market paper garden window silver engine harbor winter lantern orchard signal "
         "meadow copper bridge candle forest").split()


def shared_prefix_prompts(systems: int, questions: int, words: int, seed: int = 0) -> list[str]:
    """`systems` long system prompts × `questions` questions, interleaved by question."""
    prompts = []
    for q in range(questions):
        for s in range(systems):
            body = " ".join(WORDS[(s * 7 + i * 3 + seed) % len(WORDS)] for i in range(words))
            prompts.append(f"You are assistant {s + 100 * seed}. Background notes: {body}.\nQuestion {q}: what is "
                           f"the {q + 1}th most important fact here?\nAnswer:")
    return prompts


def run_workload(url: str, prompts: list[str], clients: int, new_tokens: int) -> dict[str, float]:
    def one(prompt: str) -> int:
        resp = httpx.post(f"{url}/generate", timeout=600, json={"text": prompt, "sampling_params": {
            "temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}})
        resp.raise_for_status()
        return resp.json()["meta_info"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(one, prompts))
    wall = time.perf_counter() - start
    return {"requests": len(prompts), "wall_s": wall, "req_per_s": len(prompts) / wall, "tok_per_s": tokens / wall}


def measure(url: str, workers: list[str], prompts: list[str], clients: int, new_tokens: int) -> dict[str, float]:
    """The workload from empty caches: throughput and the hit rate summed over `workers`."""
    for worker in workers:
        httpx.post(f"{worker}/flush_cache", timeout=60).raise_for_status()
    before = [httpx.get(f"{w}/get_server_info", timeout=60).json() for w in workers]
    result = run_workload(url, prompts, clients, new_tokens)
    after = [httpx.get(f"{w}/get_server_info", timeout=60).json() for w in workers]
    cached = sum(a["cached_tokens"] - b["cached_tokens"] for a, b in zip(after, before))
    prompt = sum(a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before))
    return {**result, "hit_rate": cached / prompt if prompt else 0.0}


def router_latency_ms(router: str, workers: list[str], pairs: int) -> float:
    """Median over pairs of (through the router - directly) for one cached one-token request."""
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    before = [httpx.get(f"{w}/get_server_info", timeout=60).json()["prompt_tokens"] for w in workers]
    with httpx.Client(timeout=60) as client:
        client.post(f"{router}/generate", json=body).raise_for_status()
        after = [httpx.get(f"{w}/get_server_info", timeout=60).json()["prompt_tokens"] for w in workers]
        worker = next(w for w, b, a in zip(workers, before, after) if a > b)  # where cache_aware sends it again
        diffs = []
        for _ in range(pairs):
            times = []
            for url in (worker, router):
                start = time.perf_counter()
                client.post(f"{url}/generate", json=body).raise_for_status()
                times.append(time.perf_counter() - start)
            diffs.append(times[1] - times[0])
    return 1000 * statistics.median(diffs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="the model (default: %(default)s)")
    parser.add_argument("--systems", type=int, default=8, help="distinct system prompts (default: %(default)s)")
    parser.add_argument("--questions", type=int, default=8, help="questions per system prompt (default: %(default)s)")
    parser.add_argument("--system-words", type=int, default=160,
                        help="words of each system prompt (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens per answer (default: %(default)s)")
    parser.add_argument("--latency-pairs", type=int, default=40,
                        help="direct/routed request pairs for the router's latency (default: %(default)s)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache per engine (default: %(default)s)")
    parser.add_argument("--precompile", default="common", help="engines' --precompile (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="3 x 2 prompts, 2 clients, 2 tokens (default: off)")
    parser.add_argument("--json", default=None, help="also write the results to this file (default: none)")
    args = parser.parse_args(argv)
    if args.quick:
        args.systems, args.questions, args.clients, args.new_tokens, args.latency_pairs = 3, 2, 2, 2, 5

    from jsgl.engine.config import EngineConfig
    from jsgl.server.launch import launch_server_process
    from jsgl.server.replicas import Replicas
    from jsgl.server.router_process import RouterProcess

    prompts = shared_prefix_prompts(args.systems, args.questions, args.system_words)
    warmup = shared_prefix_prompts(args.systems, 2, args.system_words, seed=1)  # other prefixes, same shapes
    engine = dict(kv_cache_gb=args.kv_cache_gb, precompile=args.precompile)
    rows: dict[str, dict[str, Any]] = {}
    with launch_server_process(model=args.model, **engine) as single:
        run_workload(single.url, warmup, args.clients, args.new_tokens)
        rows["dp1"] = measure(single.url, [single.url], prompts, args.clients, args.new_tokens)
    with Replicas(EngineConfig(model=args.model, **engine), dp=2, policy="cache_aware") as replicas:
        run_workload(replicas.url, warmup, args.clients, args.new_tokens)
        rows["dp2 cache_aware"] = measure(replicas.url, replicas.urls, prompts, args.clients, args.new_tokens)
        rows["dp2 cache_aware"]["router_ms"] = router_latency_ms(replicas.url, replicas.urls, args.latency_pairs)
        robin = RouterProcess(replicas.urls, policy="round_robin")
        try:
            robin.wait_for_workers(2)
            rows["dp2 round_robin"] = measure(robin.url, replicas.urls, prompts, args.clients, args.new_tokens)
        finally:
            robin.stop()
    print(f"{args.systems} system prompts x {args.questions} questions (interleaved), {args.clients} clients, "
          f"{args.new_tokens} new tokens, {args.model}")
    print(f"{'config':<18}{'hit rate':>10}{'req/s':>9}{'tok/s':>9}{'wall s':>9}")
    for name, row in rows.items():
        print(f"{name:<18}{row['hit_rate']:>10.3f}{row['req_per_s']:>9.2f}{row['tok_per_s']:>9.1f}"
              f"{row['wall_s']:>9.1f}")
    print(f"router's added latency per request (median of {args.latency_pairs} pairs, direct vs routed): "
          f"{rows['dp2 cache_aware']['router_ms']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
