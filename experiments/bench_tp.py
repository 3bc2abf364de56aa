"""Per-step decode time at tp=1 vs tp=2 (or any ``--tps``) through ``ModelRunner``, on forced CPU devices.

    python experiments/bench_tp.py                       # tp 1,2; batch 8; 64-token prompts; 20 steps
    python experiments/bench_tp.py --tps 1,2,4 --batch 16 --context 256

A sanity check, not a speed-up claim: the "devices" are ``--xla_force_host_platform_device_count``
slices of one CPU, so tp > 1 adds the all-reduces (two per layer, one per vocab reduction) without
adding compute; on a real multi-GPU host the same code splits weights and KV reads across devices.
For each tp it builds a runner (params padded + sharded), prefills ``--batch`` random prompts of
``--context`` tokens in one extend step, runs ``--warmup`` decode steps (compilation) and times
``--steps`` more; it prints the median and mean ms per step and decode tokens/s, and checks that every
tp chose the same greedy tokens as the first one (exit status 1 if not). The device count is forced
only when jax has not started yet (run this as its own process); otherwise too few devices is an error.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tps", default="1,2", help="comma-separated tp degrees")
    p.add_argument("--batch", type=int, default=8, help="decode batch (requests)")
    p.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps (the first compiles)")
    p.add_argument("--attention-backend", default="native")
    p.add_argument("--devices", type=int, default=None, help="CPU devices to force (default: max tp)")
    return p.parse_args(argv)


def _force_cpu_devices(count: int) -> None:
    """Only effective before jax initialises its backends (XLA reads the flag once)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def bench_one(config: Any, np_params: Any, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jsgl.engine.model_runner import ModelRunner
    from jsgl.engine.step_inputs import ForwardItem

    span = args.context + args.warmup + args.steps + 1
    num_slots = 1 + args.batch * span
    start = time.perf_counter()
    params = jax.tree.map(jnp.asarray, np_params) if tp == 1 else np_params
    runner = ModelRunner(config, params, num_slots, attention_backend=args.attention_backend, tp=tp)
    setup_s = time.perf_counter() - start

    rng = np.random.default_rng(0)
    slots = [np.arange(1 + b * span, 1 + (b + 1) * span, dtype=np.int32) for b in range(args.batch)]
    prompts = [rng.integers(100, config.vocab_size, args.context).astype(np.int32) for _ in range(args.batch)]
    start = time.perf_counter()
    last = runner.run([ForwardItem(p, 0, s) for p, s in zip(prompts, slots)]).tokens
    prefill_s = time.perf_counter() - start  # includes the extend step's compilation

    tokens, times = [last.copy()], []
    for step in range(args.warmup + args.steps):
        items = [ForwardItem(last[b: b + 1].astype(np.int32), args.context + step, slots[b])
                 for b in range(args.batch)]
        start = time.perf_counter()
        last = runner.run(items).tokens  # run() fetches the tokens: the step is complete when it returns
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        tokens.append(last.copy())
    return {
        "tp": tp, "setup_s": setup_s, "prefill_s": prefill_s,
        "median_ms": 1e3 * statistics.median(times), "mean_ms": 1e3 * statistics.fmean(times),
        "tokens_per_s": args.batch / statistics.median(times),
        "heads": (runner.forward_config.num_heads, runner.forward_config.num_kv_heads),
        "tokens": np.stack(tokens).tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    """Exit status (what ``jsgl bench tp`` returns): 1 when some tp chose different greedy tokens."""
    args = parse_args(argv)
    tps = [int(t) for t in args.tps.split(",")]
    _force_cpu_devices(args.devices or max(tps))

    import jax

    from jsgl.model.loader import load_model

    devices = jax.local_devices()
    if len(devices) < max(tps):
        raise SystemExit(f"need {max(tps)} devices, jax has {len(devices)} (it started before this script "
                         "could force the CPU device count: run bench_tp as its own process)")
    config, np_params = load_model(args.model)
    print(f"{args.model}: {config.num_heads} q / {config.num_kv_heads} kv heads; {len(devices)} "
          f"{devices[0].platform} devices; batch {args.batch}, context {args.context}, {args.steps} steps")
    results = []
    for tp in tps:
        r = bench_one(config, np_params, tp, args)
        results.append(r)
        print(f"tp={tp}  padded heads {r['heads'][0]}/{r['heads'][1]}  setup {r['setup_s']:.1f}s  "
              f"prefill+compile {r['prefill_s']:.1f}s  decode step median {r['median_ms']:.1f} ms "
              f"(mean {r['mean_ms']:.1f})  {r['tokens_per_s']:.0f} tok/s", flush=True)
    status = 0
    for r in results[1:]:
        same = r["tokens"] == results[0]["tokens"]
        status |= not same
        print(f"tp={r['tp']} vs tp={results[0]['tp']}: step time x{r['median_ms'] / results[0]['median_ms']:.2f}, "
              f"greedy tokens {'identical' if same else 'DIFFER'}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
