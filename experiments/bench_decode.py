"""Decode throughput: jsgl vs transformers `generate`, and jsgl's ms/step vs the memory-bandwidth floor.

    python experiments/bench_decode.py            # or: jsgl bench decode
    python experiments/bench_decode.py --batch-sizes 1 16 --new-tokens 64 --kernels cpu xla

Everything is measured in one run on the same machine, prompts and model, and printed as ratios.
jsgl runs with each set of kernels: ``gguf`` (the default on CPU: matmuls over the GGUF file's own Q4_1/Q8_0
blocks, dequantized exactly in cache, and in-place paged decode attention), ``packed`` (the same kernels over
float32 weight panels) and ``xla`` (XLA's dot and the native attention: the ablation).
The floor of one decode step is (bytes of weights read + bytes of KV attended) / measured read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

PROMPTS = [
    "The history of the printing press begins",
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper who",
    "The three most important ideas in economics are",
    "def quicksort(arr):",
    "Once upon a time in a faraway kingdom,",
    "The mitochondria is the powerhouse of the cell because",
    "Here is a recipe for a simple tomato soup:",
    "In the year 2050, cities will",
    "Photosynthesis converts sunlight into",
    "A good night's sleep matters because",
    "The rules of chess are simple:",
    "Dear hiring manager, I am applying for",
    "The Pacific Ocean is the largest",
    "To learn a new language quickly, you should",
    "The first computer programmers were",
]


def read_bandwidth_gbs(size_mb: int = 512, repeats: int = 7) -> float:
    """Median bytes/s of a jitted full read (sum) of a large float32 array, like a weight read."""
    x = jnp.ones((size_mb * (1 << 20) // 4,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return x.nbytes / statistics.median(times) / 1e9


KERNELS = {"gguf": {"matmul_backend": "gguf", "attention_backend": "cpu"},  # the default on CPU
           "packed": {"matmul_backend": "packed", "attention_backend": "cpu"},
           "xla": {"matmul_backend": "xla", "attention_backend": "native"}}


def step_weight_bytes(params) -> int:
    """Bytes of weights one decode step reads: all of them, except an embedding table that only serves
    row lookups because the LM head has its own (packed) copy."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return total - params["embed"].nbytes if "lm_head" in params else total


def bench_jsgl(engine, batch: int, new_tokens: int, repeats: int) -> dict:
    prompts = (PROMPTS * (batch // len(PROMPTS) + 1))[:batch]
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.generate(prompts, params, progress=False)  # warm-up: compile every bucket this run uses
    rates, step_ms = [], []
    for _ in range(repeats):
        engine.flush_cache()
        before = engine.stats()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params, progress=False)
        wall = time.perf_counter() - t0
        after = engine.stats()
        rates.append(sum(o.completion_tokens for o in outs) / wall)
        steps = after["decode_steps"] - before["decode_steps"]
        step_ms.append(1e3 * (after["decode_time_s"] - before["decode_time_s"]) / max(steps, 1))
    mean_prompt = float(np.mean([len(engine.tokenizer(p).input_ids) for p in prompts]))
    return {"tokens_per_s": statistics.median(rates), "decode_ms_per_step": statistics.median(step_ms),
            "mean_prompt_tokens": mean_prompt}


def bench_transformers(batch: int, new_tokens: int, repeats: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jsgl.model.registry import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompts = (PROMPTS * (batch // len(PROMPTS) + 1))[:batch]
    enc = tok(prompts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=tok.pad_token_id or 0)
    with torch.no_grad():
        model.generate(**enc, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model.generate(**enc, **kwargs)
            rates.append((out.shape[1] - enc.input_ids.shape[1]) * batch / (time.perf_counter() - t0))
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kernels", nargs="+", choices=sorted(KERNELS), default=list(KERNELS))
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    from jsgl.engine.engine import Engine
    from jsgl.kernels import cpu as cpu_kernels

    kernels = [k for k in args.kernels if k == "xla" or cpu_kernels.available()]
    if kernels != args.kernels:
        print(f"CPU kernels unavailable ({cpu_kernels.unavailable_reason()}): measuring {kernels} only")
    bandwidth = read_bandwidth_gbs()  # before any engine: the kernels' helper threads must not compete
    results: dict[str, dict[int, dict]] = {}
    for name in kernels:
        engine = Engine(kv_cache_gb=0.5, max_running_requests=max(args.batch_sizes), **KERNELS[name])
        cfg, weight_bytes = engine.model_config, step_weight_bytes(engine.runner.params)
        print(f"jsgl[{name}]: {cfg.num_layers} layers, {weight_bytes / 1e6:.0f} MB of weights read per step; "
              f"measured read bandwidth {bandwidth:.1f} GB/s")
        results[name] = {}
        for batch in args.batch_sizes:
            ours = bench_jsgl(engine, batch, args.new_tokens, args.repeats)
            mean_ctx = ours["mean_prompt_tokens"] + args.new_tokens / 2
            ours["floor_ms"] = 1e3 * (weight_bytes + batch * mean_ctx * cfg.kv_bytes_per_token) / (bandwidth * 1e9)
            results[name][batch] = ours
        engine.shutdown()
    rows = []
    for batch in args.batch_sizes:
        theirs = None if args.skip_transformers else bench_transformers(batch, args.new_tokens, args.repeats)
        rows.append({"batch": batch, "transformers_tokens_per_s": theirs,
                     **{name: results[name][batch] for name in kernels}})

    print(f"\n{'batch':>5} {'jsgl':>5} {'tok/s':>8} {'hf tok/s':>9} {'jsgl/hf':>8} {'ms/step':>8} {'floor ms':>9} "
          f"{'step/floor':>10}")
    for r in rows:
        hf = r["transformers_tokens_per_s"]
        for name in kernels:
            ours = r[name]
            ratio = f"{ours['tokens_per_s'] / hf:8.2f}" if hf else f"{'-':>8}"
            hf_s = f"{hf:9.1f}" if hf else f"{'-':>9}"
            print(f"{r['batch']:>5} {name:>5} {ours['tokens_per_s']:8.1f} {hf_s} {ratio} "
                  f"{ours['decode_ms_per_step']:8.1f} {ours['floor_ms']:9.1f} "
                  f"{ours['decode_ms_per_step'] / ours['floor_ms']:10.2f}")
        if "xla" in kernels and len(kernels) > 1:
            speedups = [f"{name} {r[name]['tokens_per_s'] / r['xla']['tokens_per_s']:.2f}x"
                        for name in kernels if name != "xla"]
            print(f"{'':>5} tokens/s vs xla: " + ", ".join(speedups))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_gbs": bandwidth, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
