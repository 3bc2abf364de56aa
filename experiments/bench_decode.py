"""Decode throughput: jsgl vs transformers `generate`, and jsgl's ms/step vs the memory-bandwidth floor.

    python experiments/bench_decode.py            # or: jsgl bench decode
    python experiments/bench_decode.py --batch-sizes 1 16 --new-tokens 64 --kernels cpu xla

Everything is measured in one run on the same machine, prompts and model, and printed as ratios.
jsgl runs with each set of kernels: ``gguf`` (the default on CPU: matmuls over the GGUF file's own Q4_1/Q8_0
blocks, dequantized exactly in cache, and in-place paged decode attention), ``packed`` (the same kernels over
float32 weight panels) and ``xla`` (XLA's dot and the native attention: the ablation).
The floor of one decode step is (bytes of weights read + bytes of KV attended) / measured read bandwidth.

What each time includes: ``ms/step`` is the engine's decode step (schedule, build inputs, the jitted step,
read back, fold in the tokens); ``e2e ms`` is a whole generate of the batch with its prompts cached, divided by
its steps (also submission, detokenizing, the caller's wake-ups); ``bare ms`` is the jitted decode step alone,
called back to back with one step's inputs already built and its tokens read back, wall time over the calls
(a mean, like e2e), measured just before and just after the e2e run (their mean). ``e2e/bare`` is the engine's overhead.
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


class ReadBandwidth:
    """Best bytes/s of a jitted full read (sum) of a large float32 array, like a weight read. The best of a
    few, not the median: a floor needs the fastest reads. Measured again in every round, since this machine's
    bandwidth drifts over minutes."""

    def __init__(self, size_mb: int = 512):
        # Random values, like weights (no page of equal bytes the host could share).
        self.x = jax.random.uniform(jax.random.key(0), (size_mb * (1 << 20) // 4,), jnp.float32)
        self.read = jax.jit(lambda a: jnp.sum(a))
        self.read(self.x).block_until_ready()

    def gbs(self, repeats: int = 5) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.read(self.x).block_until_ready()
            times.append(time.perf_counter() - t0)
        return self.x.nbytes / min(times) / 1e9


KERNELS = {"gguf": {"matmul_backend": "gguf", "attention_backend": "cpu"},  # the default on CPU
           "packed": {"matmul_backend": "packed", "attention_backend": "cpu"},
           "xla": {"matmul_backend": "xla", "attention_backend": "native"},
           # The default without overlap scheduling: each step read back before the next is dispatched.
           "gguf-sync": {"matmul_backend": "gguf", "attention_backend": "cpu", "overlap_schedule": False},
           # Other dtypes (not run by default): the KV pool in the 8-bit format (the CPU attention kernel reads
           # float32 pools, so these attend through the native path), and the bfloat16 model (XLA's dot).
           "gguf-kv8": {"matmul_backend": "gguf", "kv_dtype": "int8"},
           "bf16": {"dtype": "bfloat16"},
           "bf16-kv8": {"dtype": "bfloat16", "kv_dtype": "int8"}}
DEFAULT_KERNELS = ["gguf", "packed", "xla"]


def step_weight_bytes(params) -> int:
    """Bytes of weights one decode step reads: all of them, except an embedding table that only serves
    row lookups because the LM head has its own (packed) copy."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return total - params["embed"].nbytes if "lm_head" in params else total


class JsglRun:
    """One engine per kernel set; ``once`` times one generate of the batch."""

    def __init__(self, name: str, batch_sizes: list[int]):
        from jsgl.engine.engine import Engine

        # Compiles as it goes (its warm-up run below), as before the background precompile: nothing compiles beside
        # the timed runs.
        self.engine = Engine(kv_cache_gb=0.5, max_running_requests=max(batch_sizes), precompile="off",
                             **KERNELS[name])
        self.weight_bytes = step_weight_bytes(self.engine.runner.params)

    def warm(self, prompts: list[str], params: dict) -> None:
        self.engine.generate(prompts, params, progress=False)  # compiles every bucket this batch uses
        self._capture_decode_step(prompts, params)

    def _capture_decode_step(self, prompts: list[str], params: dict) -> None:
        """Keep the arguments of one decode step of this batch, for `bare_ms`."""
        runner, captured = self.engine.runner, []

        def spy(*args, **kwargs):
            if kwargs["layout"].max_q == 1 and not captured:
                captured.append((list(args), kwargs))
            return step(*args, **kwargs)

        step, runner._step = runner._step, spy
        try:
            self.engine.generate(prompts, {**params, "max_new_tokens": 3}, progress=False)
        finally:
            runner._step = step
        self.decode_call = captured[0]

    def bare_ms(self, steps: int) -> float:
        """The bare decode step: the jitted step called with one decode step's inputs already built (host
        arrays, as the engine passes them) and the sampled tokens read back, ``steps`` calls back to back: their
        wall time over ``steps``. A mean, as e2e is: the median of the calls left out this VM's slow calls and
        came out 2-10% under the mean, which e2e's whole-generate mean counts (e2e over it read 1.07-1.27 where
        e2e over the mean read 1.01-1.21). Its K/V writes land in slots a later flush_cache frees: call it just
        before one."""
        runner = self.engine.runner
        args, kwargs = self.decode_call
        t0 = time.perf_counter()
        for _ in range(steps):
            args[1] = runner.kv
            runner.kv, out = runner._step(*args, **kwargs)
            jax.device_get(out["tokens"])
        return 1e3 * (time.perf_counter() - t0) / steps

    def once(self, prompts: list[str], params: dict) -> dict:
        engine = self.engine
        bare = self.bare_ms(params["max_new_tokens"])
        engine.flush_cache()
        before = engine.stats()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params, progress=False)
        wall = time.perf_counter() - t0
        after = engine.stats()
        steps = max(after["decode_steps"] - before["decode_steps"], 1)
        # Again with the prompts cached: end to end per step, as a user's request meets it (the one extend
        # step computes each prompt's last token).
        t0 = time.perf_counter()
        engine.generate(prompts, params, progress=False)
        e2e = 1e3 * (time.perf_counter() - t0) / (engine.stats()["steps"] - after["steps"])
        # The bare step again, right after (the next round's flush frees the slots it writes): the machine's
        # speed drifts by tens of percent within seconds, so e2e is compared with the mean of the two.
        bare = (bare + self.bare_ms(params["max_new_tokens"])) / 2
        return {"tokens_per_s": sum(o.completion_tokens for o in outs) / wall,
                "decode_ms_per_step": 1e3 * (after["decode_time_s"] - before["decode_time_s"]) / steps,
                "e2e_ms_per_step": e2e, "bare_ms_per_step": bare}


class TransformersRun:
    """transformers ``generate`` on the same GGUF (dequantized to float32 by transformers), greedy."""

    def __init__(self):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from jsgl.model.registry import resolve_model_path

        path = resolve_model_path("smollm2-135m")
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                          dtype=torch.float32).eval()

    def _generate(self, prompts: list[str], new_tokens: int) -> tuple[int, float]:
        enc = self.tok(prompts, return_tensors="pt", padding=True)
        with self.torch.no_grad():
            t0 = time.perf_counter()
            out = self.model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=self.tok.pad_token_id or 0)
            return (out.shape[1] - enc.input_ids.shape[1]) * len(prompts), time.perf_counter() - t0

    def warm(self, prompts: list[str], params: dict) -> None:
        self._generate(prompts, 4)

    def once(self, prompts: list[str], params: dict) -> dict:
        tokens, wall = self._generate(prompts, params["max_new_tokens"])
        return {"tokens_per_s": tokens / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds (every system once per round)")
    ap.add_argument("--kernels", nargs="+", choices=sorted(KERNELS), default=DEFAULT_KERNELS,
                    help="engine variants; also gguf-sync (no overlap scheduling), gguf-kv8, bf16, bf16-kv8 (other "
                    "weight and KV dtypes)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    from jsgl.kernels import cpu as cpu_kernels

    kernels = [k for k in args.kernels if KERNELS[k].get("matmul_backend", "xla") == "xla" or cpu_kernels.available()]
    if kernels != args.kernels:
        print(f"CPU kernels unavailable ({cpu_kernels.unavailable_reason()}): measuring {kernels} only")
    bandwidth = ReadBandwidth()
    runs: dict[str, JsglRun | TransformersRun] = {name: JsglRun(name, args.batch_sizes) for name in kernels}
    if not args.skip_transformers:
        runs["hf"] = TransformersRun()
    for name in kernels:
        print(f"jsgl[{name}]: {runs[name].weight_bytes / 1e6:.0f} MB of weights read per step")

    rows = []
    for batch in args.batch_sizes:
        prompts = (PROMPTS * (batch // len(PROMPTS) + 1))[:batch]
        params = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        for run in runs.values():
            run.warm(prompts, params)
        # Interleaved rounds: the machine's slow and fast phases hit every system alike, and each round
        # gives one ratio. Its memory bandwidth swings between ~40 and ~80 GB/s within seconds, so each jsgl
        # run's floor uses the read bandwidth measured just before and just after it (their mean).
        samples: dict[str, list[dict]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                time.sleep(0.01)  # the kernels' helper threads stop spinning 1 ms after their last job
                before = bandwidth.gbs() if name != "hf" else 0.0
                sample = run.once(prompts, params)
                if name != "hf":
                    time.sleep(0.01)
                    sample["bandwidth_gbs"] = (before + bandwidth.gbs()) / 2
                samples[name].append(sample)
        mean_ctx = float(np.mean([len(runs[kernels[0]].engine.tokenizer(p).input_ids) for p in prompts]))
        mean_ctx += args.new_tokens / 2
        row = {"batch": batch, "bandwidth_gbs": [x["bandwidth_gbs"] for name in kernels for x in samples[name]]}
        for name in kernels:
            rates = [x["tokens_per_s"] for x in samples[name]]
            kv_bytes = runs[name].engine.memory_plan.kv_bytes_per_token  # the engine's KV format
            step_bytes = runs[name].weight_bytes + batch * mean_ctx * kv_bytes
            floors = [1e3 * step_bytes / (x["bandwidth_gbs"] * 1e9) for x in samples[name]]
            steps = [x["decode_ms_per_step"] for x in samples[name]]
            row[name] = {"tokens_per_s": statistics.median(rates), "floor_ms": statistics.median(floors),
                         "decode_ms_per_step": statistics.median(steps), "rounds_ms_per_step": steps,
                         "rounds_bandwidth_gbs": [x["bandwidth_gbs"] for x in samples[name]],
                         "step_over_floor": statistics.median(a / b for a, b in zip(steps, floors)),
                         "e2e_ms_per_step": statistics.median(x["e2e_ms_per_step"] for x in samples[name]),
                         "bare_ms_per_step": statistics.median(x["bare_ms_per_step"] for x in samples[name]),
                         "e2e_over_bare": statistics.median(x["e2e_ms_per_step"] / x["bare_ms_per_step"]
                                                            for x in samples[name])}
            if "hf" in runs:
                row[name]["vs_hf"] = statistics.median(
                    a / b["tokens_per_s"] for a, b in zip(rates, samples["hf"]))
            if "xla" in kernels:
                row[name]["vs_xla"] = statistics.median(
                    a / b["tokens_per_s"] for a, b in zip(rates, samples["xla"]))
        if "hf" in runs:
            row["hf"] = {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in samples["hf"]),
                         "all": [x["tokens_per_s"] for x in samples["hf"]]}
        rows.append(row)
    for name in kernels:
        runs[name].engine.shutdown()

    print(f"\nmedians of {args.repeats} interleaved rounds; ratios are medians of per-round ratios "
          "(each run's floor from the read bandwidth around it)")
    for r in rows:
        print(f"batch {r['batch']:>2}: read bandwidth {min(r['bandwidth_gbs']):.1f}-{max(r['bandwidth_gbs']):.1f} GB/s")
    print(f"{'batch':>5} {'jsgl':>9} {'tok/s':>8} {'hf tok/s':>9} {'jsgl/hf':>8} {'vs xla':>7} {'ms/step':>8} "
          f"{'floor ms':>9} {'step/floor':>10} {'e2e ms':>7} {'bare ms':>7} {'e2e/bare':>8}")
    for r in rows:
        for name in kernels:
            ours = r[name]
            hf_s = f"{r['hf']['tokens_per_s']:9.1f}" if "hf" in r else f"{'-':>9}"
            vs_hf = f"{ours['vs_hf']:8.2f}" if "vs_hf" in ours else f"{'-':>8}"
            vs_xla = f"{ours['vs_xla']:7.2f}" if "vs_xla" in ours else f"{'-':>7}"
            print(f"{r['batch']:>5} {name:>9} {ours['tokens_per_s']:8.1f} {hf_s} {vs_hf} {vs_xla} "
                  f"{ours['decode_ms_per_step']:8.1f} {ours['floor_ms']:9.1f} "
                  f"{ours['step_over_floor']:10.2f} {ours['e2e_ms_per_step']:7.2f} {ours['bare_ms_per_step']:7.2f} "
                  f"{ours['e2e_over_bare']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
