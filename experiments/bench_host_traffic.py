"""Bytes a decode step sends from the host to the device, read off the lowered step's arguments.

    jsgl bench host_traffic                                 # Llama-3-8B, batch 64 x 8k context, pages 1 and 16
    jsgl bench host_traffic --batch 64 --context 131072 --page-sizes 1 16 --platforms cuda tpu

The engine's jitted step (``model_runner._step``) is lowered from abstract shapes (no weights, no device:
``jsgl.kernels.lowering``) at the decode shape the engine pads such a batch to, for CUDA with the Pallas kernels and
unrolled layers, and for TPU (an abstract v5e) as a TPU engine runs it: the Mosaic kernel, the layers scanned over
stacked weights and pools. It counts the attention kernel calls in the lowered step (one per layer unrolled, one in
the scanned layer's body). Each argument is either resident
on the device across steps (the weights; the KV pools, donated and updated in place; the previous step's sampled
tokens) or uploaded by the host every step (the packed int32 inputs, and the sampler's when a batch samples).
The packed inputs are broken down by their rows (``engine.step_inputs``): a table of what each input costs and why.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys

import jax
import jax.numpy as jnp

from jsgl.engine.model_runner import _step, bucket
from jsgl.engine.step_inputs import REQUEST_ROWS, TOKEN_ROWS, StepLayout, sampling_size
from jsgl.kernels.lowering import lower_for
from jsgl.model.config import LLAMA3_8B, ModelConfig
from jsgl.model.llama import param_shapes

WHY = {
    "token_ids": "the new token of each row",
    "previous_row": "which row of the last step's tokens (still on device) is this one (overlap)",
    "write_slots": "the KV slot each new token is written to",
    "positions": "RoPE and the causal mask",
    "target_ids": "the next prompt token (prompt logprobs; unused in decode)",
    "q_start": "where each request's new tokens start",
    "q_len": "how many new tokens each request has",
    "kv_lens": "each request's attended length",
    "sample_index": "which token of each request is sampled",
    "block_table": "each request's pages: one int32 per page of its padded length",
    "argmax": "whether the forward takes the greedy tokens itself",
}


# Per platform: the attention backend, whether the layers are scanned (the engine's defaults there), and what marks
# its kernel's custom call in the lowered text (on TPU its name: the K/V write is a Mosaic custom call too).
PLATFORMS = {"cuda": ("pallas", False, "__gpu$xla.gpu.triton"),
             "tpu": ("tpu", True, 'kernel_name = "jsgl_ragged_paged_attention')}


def lowered_decode(config: ModelConfig, layout: StepLayout, num_slots: int, dtype,
                   platform: str = "cuda") -> jax.stages.Lowered:
    """The engine's decode step at ``layout``, lowered for ``platform`` with its kernels, from shapes alone."""
    attention, scanned, _ = PLATFORMS[platform]
    params = param_shapes(config, dtype, scanned)
    if scanned:  # every layer's pool stacked, [Hkv, L, N, D], one for K and one for V
        pool = jax.ShapeDtypeStruct((config.num_kv_heads, config.num_layers, num_slots, config.head_dim), dtype)
        kv = (pool, pool)
    else:
        pool = jax.ShapeDtypeStruct((config.num_kv_heads, num_slots, config.head_dim), dtype)
        kv = ([pool] * config.num_layers, [pool] * config.num_layers)
    step = jax.jit(functools.partial(_step, layout=layout, config=config, attention_backend=attention,
                                     prompt_top_k=-1), donate_argnums=(1,))
    args = (params, kv, jax.ShapeDtypeStruct((layout.num_ints,), jnp.int32),
            jax.ShapeDtypeStruct((layout.num_b,), jnp.int32))
    return lower_for(step, *args, platform=platform)


def _nbytes(tree) -> int:
    """Bytes of the arguments in ``tree`` (``ArgInfo`` leaves of a lowered call: shape and dtype)."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def traffic_table(batch: int, context: int, page_size: int, dtype=jnp.bfloat16,
                  platform: str = "cuda") -> tuple[list[tuple], int, int]:
    """Rows (input, shape, bytes, per step?, why) of one decode step, the bytes uploaded per step, and the attention
    kernel calls in the lowered step."""
    config = ModelConfig.from_hf(LLAMA3_8B)
    # The engine's decode bucket: requests and tokens padded to a bucket, the attended length to 64.
    b = bucket(batch)
    layout = StepLayout(b, b, 1, bucket(context, 64), page_size)
    num_slots = (batch * -(-context // page_size) + 1) * page_size
    lowered = lowered_decode(config, layout, num_slots, dtype, platform)
    kernels = lowered.as_text().count(PLATFORMS[platform][2])
    params_info, kv_info, ints_info, previous_info = lowered.args_info[0]
    assert all(x.donated for x in jax.tree.leaves(kv_info))  # the pools are updated in place, never copied
    pools = jax.tree.leaves(kv_info)
    rows = [("weights", f"{config.num_layers} layers", _nbytes(params_info), "resident", "loaded once"),
            ("KV pools", f"{len(pools)} x {pools[0].shape}", _nbytes(kv_info), "resident",
             "donated: updated in place"),
            ("previous tokens", str(previous_info.shape), _nbytes(previous_info), "resident",
             "the last step's sampled tokens, never read back before this step")]
    for name in TOKEN_ROWS:
        rows.append((name, f"[{layout.num_t}]", 4 * layout.num_t, "uploaded", WHY[name]))
    for name in REQUEST_ROWS:
        rows.append((name, f"[{layout.num_b}]", 4 * layout.num_b, "uploaded", WHY[name]))
    rows.append(("block_table", f"[{layout.num_b}, {layout.table_width}]", 4 * layout.num_b * layout.table_width,
                 "uploaded", WHY["block_table"]))
    rows.append(("argmax", "[1]", 4, "uploaded", WHY["argmax"]))
    assert sum(r[2] for r in rows if r[3] == "uploaded") == _nbytes(ints_info)  # the packed array, row by row
    rows.append(("sampler inputs", f"[{sampling_size(layout.num_b)}]", 4 * sampling_size(layout.num_b),
                 "if sampling", "temperature, top-k/p, min-p, seeds, steps, stage flags (a plain greedy batch: none)"))
    return rows, _nbytes(ints_info), kernels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--platforms", nargs="+", default=["cuda", "tpu"], choices=list(PLATFORMS))
    args = p.parse_args(argv)
    fmt = lambda n: f"{n / 2**20:10.3f} MiB" if n >= 2**20 else f"{n / 2**10:10.2f} KiB"  # noqa: E731
    for platform, page_size in itertools.product(args.platforms, args.page_sizes):
        rows, uploaded, kernels = traffic_table(args.batch, args.context, page_size, platform=platform)
        attention, scanned, _ = PLATFORMS[platform]
        print(f"\nLlama-3-8B decode on {platform}, batch {args.batch} x {args.context}-token contexts, page size "
              f"{page_size}: {fmt(uploaded).strip()} uploaded per greedy step; {kernels} {attention} attention "
              f"kernel call(s) in the lowered step ({'one scanned layer' if scanned else 'layers unrolled'})")
        for name, shape, nbytes, when, why in rows:
            print(f"  {name:16s} {shape:22s} {fmt(nbytes)}  {when:11s} {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
