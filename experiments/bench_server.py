"""Serving benchmark: concurrent streaming clients against a jsgl server's /generate and /v1/completions.

Reports requests/s, output tokens/s, and the medians (and p90) of time to first token (TTFT) and
inter-token latency (ITL, the gap between consecutive streamed chunks; one chunk is one token unless a
multi-byte character or a possible stop string holds text back).

    python experiments/bench_server.py                         # launches `jsgl serve` in a subprocess
    python experiments/bench_server.py --url http://127.0.0.1:30000 --num-requests 256 --concurrency 64
    jsgl bench server --endpoint completions
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx

WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or "
         "had by word but what some we can out other were all there when up use your how said an each she which "
         "do their time if will way about many then them write would like so these her long make thing see him "
         "two has look more day could go come did number sound no most people my over know water than call first "
         "who may down side been now find any new work part take get place made live where after back little only "
         "round man year came show every good me give our under name very through just form sentence great think "
         "say help low line differ turn cause much mean before move right boy old too same tell does set three").split()


def make_prompts(n: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))).capitalize()
            for _ in range(n)]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_request(client: httpx.AsyncClient, endpoint: str, prompt: str, max_tokens: int,
                      model: str) -> dict[str, Any]:
    """Stream one request; returns its TTFT, chunk gaps, token count and latency."""
    if endpoint == "generate":
        path, body = "/generate", {"text": prompt, "stream": True, "sampling_params": {
            "max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
    else:
        path, body = "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                         "temperature": 0, "ignore_eos": True, "stream": True,
                                         "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, last, gaps, tokens = None, None, [], 0
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            if endpoint == "generate":
                has_text = bool(event.get("text")) and event["meta_info"].get("finish_reason") is None
                if event["meta_info"].get("finish_reason") is not None:
                    tokens = event["meta_info"]["completion_tokens"]
            else:
                has_text = bool(event["choices"] and event["choices"][0]["text"])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            if has_text:
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    end = time.perf_counter()
    return {"ttft": (first or end) - t0, "gaps": gaps, "tokens": tokens, "latency": end - t0}


async def run_load(url: str, endpoint: str, prompts: list[str], concurrency: int, max_tokens: int,
                   model: str, api_key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:
        queue: asyncio.Queue[str] = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        results: list[dict[str, Any]] = []

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                results.append(await one_request(client, endpoint, prompt, max_tokens, model))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    gaps = [g for r in results for g in r["gaps"]]
    ttft = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {
        "endpoint": endpoint, "requests": len(results), "concurrency": concurrency, "max_tokens": max_tokens,
        "wall_s": round(wall, 3), "requests_per_s": round(len(results) / wall, 3),
        "output_tokens_per_s": round(tokens / wall, 2),
        "ttft_median_ms": round(1000 * statistics.median(ttft), 1),
        "ttft_p90_ms": round(1000 * _percentile(ttft, 0.9), 1),
        "itl_median_ms": round(1000 * statistics.median(gaps), 1) if gaps else None,
        "itl_p90_ms": round(1000 * _percentile(gaps, 0.9), 1) if gaps else None,
        "latency_median_s": round(statistics.median(r["latency"] for r in results), 3),
    }


def _server_info(url: str, api_key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return httpx.get(url + "/get_server_info", headers=headers, timeout=30).json()
    except (httpx.HTTPError, ValueError):  # not a jsgl server: the figures just lack these fields
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="an already running server (default: launch one)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--endpoint", choices=["generate", "completions", "both"], default="both")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"))
    parser.add_argument("--warmup", type=int, default=None,
                        help="requests run first, untimed, so that compiles stay out of the figures "
                             "(default: two waves at full concurrency)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.5, help="for a launched server")
    parser.add_argument("--precompile", choices=["off", "common", "all"], default="common",
                        help="a launched server's step shapes compiled at start (as `jsgl serve` does by default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    server = None
    url = args.url
    if url is None:
        from jsgl.server.launch import launch_server_process

        server = launch_server_process(model=args.model, api_key=args.api_key, kv_cache_gb=args.kv_cache_gb,
                                       max_running_requests=max(args.concurrency, 8), precompile=args.precompile)
        url = server.url
    try:
        endpoints = ["generate", "completions"] if args.endpoint == "both" else [args.endpoint]
        results = []
        warmup = 2 * args.concurrency if args.warmup is None else args.warmup
        for i, endpoint in enumerate(endpoints):
            if warmup:  # every batch size and prompt-length bucket the run will see gets compiled here
                warm = make_prompts(warmup, *args.prompt_words, seed=args.seed + 1000 + i)
                asyncio.run(run_load(url, endpoint, warm, min(warmup, args.concurrency), args.max_tokens,
                                     args.model, args.api_key))
            prompts = make_prompts(args.num_requests, *args.prompt_words, seed=args.seed + i)
            before = _server_info(url, args.api_key)
            res = asyncio.run(run_load(url, endpoint, prompts, args.concurrency, args.max_tokens, args.model,
                                       args.api_key))
            after = _server_info(url, args.api_key)
            # Compiles during the timed run mean the figures include compile time (warm up longer).
            res["compiles_during_run"] = after.get("compiles", 0) - before.get("compiles", 0)
            res["engine_steps"] = after.get("steps", 0) - before.get("steps", 0)
            results.append(res)
            print(json.dumps(res))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
    finally:
        if server is not None:
            server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
