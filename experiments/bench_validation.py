"""What request validation costs on /generate, next to what a request costs.

Two parts, measured in one run:
  1. In process, no HTTP: the derived pydantic model + SamplingParams.from_any + validate() on the body
     sglang 0.5's RuntimeEndpoint sends for a plain gen (every sampling field, nulls, empty lists) and on
     a minimal body. Median per request over repeated batches.
  2. Over HTTP against an in-process server on the default model (localhost, one client, sequential):
     GET /health (the HTTP floor), POST /generate refused by validation (400: pydantic and the engine's
     checks, no tokenizing, no model step), and POST /generate of one new token (a real request: tokenize,
     prefill, one sample). Medians; the last column is the share of a one-token request.

    python -m experiments.bench_validation        # or: jsgl bench validation
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

SGLANG_BODY: dict[str, Any] = {
    "text": "Answer in one word. What is the capital of France?",
    "sampling_params": {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 1,
        "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 0.0,
        "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "ignore_eos": False, "regex": None, "json_schema": None},
}
MINIMAL_BODY: dict[str, Any] = {"text": SGLANG_BODY["text"], "sampling_params": {"max_new_tokens": 1}}
# Passes the pydantic model, fails the engine's check (min > max): the whole validation path, then a 400.
REFUSED_BODY: dict[str, Any] = {**SGLANG_BODY,
                                "sampling_params": {**SGLANG_BODY["sampling_params"], "min_new_tokens": 5}}


def validate_in_process(body: dict[str, Any], vocab_size: int = 49152) -> None:
    from jsgl.engine.sampling_params import SamplingParams
    from jsgl.server.protocol import GenerateRequest

    req = GenerateRequest.model_validate(body)
    SamplingParams.from_any(req.sampling_params.model_dump(exclude_unset=True)).validate(vocab_size)


def per_call_us(fn: Any, repeats: int, batch: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - t0) / batch * 1e6)
    return statistics.median(samples)


def http_medians(url: str, n: int) -> dict[str, float]:
    import httpx

    calls = {
        "GET /health": lambda c: c.get("/health"),
        "POST /generate, refused (400)": lambda c: c.post("/generate", json=REFUSED_BODY),
        "POST /generate, 1 new token": lambda c: c.post("/generate", json=SGLANG_BODY),
    }
    out = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        for name, call in calls.items():
            call(client)  # warm: compiles, the prefix cache, connection
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                call(client)
                times.append((time.perf_counter() - t0) * 1e3)
            out[name] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batch", type=int, default=2000)
    p.add_argument("--http-requests", type=int, default=100)
    p.add_argument("--no-http", action="store_true", help="only the in-process part (no model)")
    args = p.parse_args(argv)

    print("in process (pydantic model + SamplingParams checks), median per request:")
    for name, body in (("sglang client body", SGLANG_BODY), ("minimal body", MINIMAL_BODY)):
        us = per_call_us(lambda b=body: validate_in_process(b), args.repeats, args.batch)
        print(f"  {name:<22} {us:8.1f} us")
    if args.no_http:
        return

    from jsgl.engine.engine import Engine
    from jsgl.server.launch import ServerThread

    engine = Engine(model="smollm2-135m", kv_cache_gb=0.25)
    try:
        with ServerThread(engine) as server:
            medians = http_medians(server.url, args.http_requests)
    finally:
        engine.shutdown()
    one_token = medians["POST /generate, 1 new token"]
    print(f"over HTTP (localhost, sequential, {args.http_requests} requests each; prefix cached after warm-up):")
    for name, ms in medians.items():
        print(f"  {name:<32} {ms:8.2f} ms   {ms / one_token:6.1%} of a one-token request")


if __name__ == "__main__":
    main()
