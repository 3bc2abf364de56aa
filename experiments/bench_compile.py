"""Start-up compile time on an accelerator, measured from this CPU: the layers unrolled vs scanned, and how many
step shapes a default GPU plan precompiles.

    jsgl bench compile                       # Llama-3-8B-shaped decode and extend steps, bf16, native attention
    jsgl bench compile --layers 8 --rounds 1 # a shallower model, one round (a quick look)

Each step is the engine's jitted forward (``model_runner._step``) over abstract params and pools (no weights are
allocated), traced, lowered and compiled by XLA for this CPU with the pure-JAX attention: what compiling costs as
the model gets deeper, which is what a GPU start-up pays per shape too (its kernels differ, the layer count's
effect does not). Unrolled, XLA compiles ``num_layers`` copies of a layer; scanned (``--layers scanned``, the
default on a GPU/TPU) one, inside a while loop. The compile of every round is a fresh one: JAX's persistent cache
is off in this process and each round builds a new ``jax.jit``.

Then the plan: the shapes ``jsgl serve`` precompiles on a GPU by default (Pallas attention, page size 16, 64
running requests, 512-token chunks) at 8k and 128k context: decode per batch bucket and the extends, the same count
at every context as the kernels read lengths at run time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jsgl.experiments.bench_device_steps import TINY, random_params

from jsgl.engine.model_runner import ModelRunner, _step
from jsgl.engine.step_inputs import StepLayout
from jsgl.model.config import LLAMA3_8B, ModelConfig
from jsgl.model.llama import param_shapes

NUM_SLOTS = 16384
LAYOUTS = {"decode b8": StepLayout(8, 8, 1, 512), "extend 512": StepLayout(512, 8, 64, 512)}


def abstract_step(config: ModelConfig, layout: StepLayout, scanned: bool, dtype=jnp.bfloat16) -> tuple:
    """A fresh jitted step and its abstract arguments (params and pools as shapes)."""
    layers = (config.num_layers,) if scanned else ()
    pool = jax.ShapeDtypeStruct((config.num_kv_heads, *layers, NUM_SLOTS, config.head_dim), dtype)
    kv = (pool, pool) if scanned else ([pool] * config.num_layers, [pool] * config.num_layers)
    step = jax.jit(functools.partial(_step, layout=layout, config=config, attention_backend="native",
                                     prompt_top_k=-1), donate_argnums=(1,))
    args = (param_shapes(config, dtype, scanned), kv, jax.ShapeDtypeStruct((layout.num_ints,), jnp.int32),
            jax.ShapeDtypeStruct((layout.num_b,), jnp.int32))
    return step, args


def compile_seconds(config: ModelConfig, layout: StepLayout, scanned: bool) -> tuple[float, float]:
    """(trace + lower, XLA compile) seconds of one fresh compile."""
    step, args = abstract_step(config, layout, scanned)
    t0 = time.perf_counter()
    lowered = step.trace(*args).lower()
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def planned_shapes(context: int) -> int:
    """How many step shapes a default GPU engine precompiles at ``context`` (a tiny model: the count depends only
    on the backend, the batch and chunk limits and the context)."""
    tiny = ModelConfig.from_hf({**TINY, "max_position_embeddings": context})
    params = random_params(tiny, jnp.float32)
    runner = ModelRunner(tiny, params, context + 64, attention_backend="pallas", matmul_backend="xla",
                         max_context=context, page_size=16, layers="scanned")
    return len(runner.planned_signatures("common", 64, 512))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=None, help="layers of the model (default: Llama-3-8B's 32)")
    p.add_argument("--rounds", type=int, default=3, help="fresh compiles per case, alternating (median reported)")
    args = p.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)
    config = ModelConfig.from_hf(LLAMA3_8B)
    if args.layers:
        config = dataclasses.replace(config, num_layers=args.layers)
    print(f"Llama-3-8B shapes, {config.num_layers} layers, bfloat16, native attention, compiled by XLA for this "
          f"CPU ({jax.devices()[0].device_kind}); median of {args.rounds} fresh compiles, seconds")
    print(f"  {'step':12s} {'unrolled trace+lower':>21s} {'compile':>8s} {'scanned trace+lower':>20s} "
          f"{'compile':>8s} {'unrolled/scanned':>17s}")
    for name, layout in LAYOUTS.items():
        times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for scanned in (False, True):
                times[scanned].append(compile_seconds(config, layout, scanned))
        med = {s: (statistics.median(t[0] for t in times[s]), statistics.median(t[1] for t in times[s]))
               for s in times}
        total = {s: sum(med[s]) for s in med}
        print(f"  {name:12s} {med[False][0]:21.2f} {med[False][1]:8.2f} {med[True][0]:20.2f} {med[True][1]:8.2f} "
              f"{total[False] / total[True]:16.1f}x")
    for context in (8192, 131072):
        print(f"step shapes a default GPU engine precompiles at {context // 1024}k context: {planned_shapes(context)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
