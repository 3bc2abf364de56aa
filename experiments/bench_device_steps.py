"""Whole engine steps on an accelerator, against what the hardware allows (part of `jsgl bench device`).

A Llama-3-8B-shaped model with random bfloat16 weights (the numbers are the machine's, not the model's) runs
through jsgl's `ModelRunner`, the same jitted step the engine calls (host inputs packed, the platform's attention
kernel — Pallas on a GPU, the Mosaic kernel on a TPU —, sampling, the sampled tokens read back):

* decode at batch 1 and 64 over ``--context`` cached tokens: ms per step, and the step's bytes (every weight
  the step multiplies, once, plus the K/V it reads) over the time, as a fraction of ``--peak-bw``;
* prefill of ``--prefill-tokens`` new tokens: tokens/s and MFU (2 x matmul parameters x tokens, plus the
  attention's FLOPs, over the time, as a fraction of ``--peak-flops``);
* a mixed step (the accelerators' default while a prompt prefills beside running requests): the largest decode
  batch and the prefill its chunk's budget leaves (``--prefill-tokens`` less the batch, at least half), against
  the same decode and prefill run as two steps;
* each step's first call minus its median: the compile seconds of that bucket.

All 32 layers where they fit the device's allocator (weights and the pool for 64 x ``--context`` tokens), else
as many as do (a 16 GiB TPU v5e holds neither the 16 GB of weights nor the 32 GiB of bfloat16 KV): each layer
is the same work, so the fractions of the peaks stay comparable. With ``--cpu-smoke`` a tiny model runs the same
code on any machine (Pallas interpreted).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jsgl.engine.backends import resolve_backends
from jsgl.engine.model_runner import ModelRunner
from jsgl.engine.platform import TPU_SLOT_BLOCK, mixed_step_prefill
from jsgl.engine.step_inputs import ForwardItem
from jsgl.kernels import kv_quant
from jsgl.model.config import LLAMA3_8B, ModelConfig
from jsgl.model.llama import param_shapes

TINY = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2}


@dataclasses.dataclass
class StepResult:
    name: str
    tokens: int  # new tokens of the step
    median_s: float
    first_s: float  # the first call: compile + run
    bytes_read: int  # weights multiplied + K/V attended
    flops: float

    def row(self, peak_bw: float, peak_flops: float) -> str:
        ms = 1e3 * self.median_s
        floor = self.bytes_read / peak_bw
        return (f"{self.name:18s} {ms:9.3f} ms  {self.tokens / self.median_s:11.0f} tok/s  "
                f"HBM floor {1e3 * floor:7.3f} ms = {floor / self.median_s:6.1%} of peak bw  "
                f"MFU {self.flops / self.median_s / peak_flops:6.1%}  compile {self.first_s - self.median_s:6.1f} s")


def random_params(config: ModelConfig, dtype: Any, seed: int = 0) -> Any:
    """Weights of ``config``'s shapes: norms 1, matrices N(0, 0.02), made on the device leaf by leaf."""
    shapes = param_shapes(config, dtype)
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    made = [jnp.ones(s.shape, s.dtype) if len(s.shape) == 1
            else (0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype) for k, s in zip(keys, leaves)]
    return jax.tree.unflatten(tree, made)


def matmul_params(config: ModelConfig) -> int:
    """Parameters one new token multiplies: every matrix of ``param_shapes`` but the embedding, which serves a
    row lookup (a tied model's head multiplies the embedding: counted once)."""
    matrices = sum(x.size for x in jax.tree.leaves(param_shapes(config)) if len(x.shape) == 2)
    return matrices - (0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)


def time_step(runner: ModelRunner, items: list[ForwardItem], iters: int) -> tuple[float, float]:
    """(first call, median of ``iters`` later calls) in seconds, each with its tokens read back."""
    t0 = time.perf_counter()
    runner.run(items, logprobs=False)
    first = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.run(items, logprobs=False)
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def decode_items(batch: int, context: int, page_size: int) -> list[ForwardItem]:
    """``batch`` requests decoding their last token at ``context``: request b's pages are whole pages after page 0
    (the reserved slot 0's), one request after another."""
    pages_each = -(-context // page_size)
    return [ForwardItem(token_ids=np.ones(1, np.int32), start_pos=context - 1,
                        slots=np.arange(context, dtype=np.int32) + page_size * (1 + b * pages_each))
            for b in range(batch)]


def prefill_item(tokens: int, batch: int, context: int, page_size: int) -> ForwardItem:
    """A ``tokens``-token prefill from position 0, on the pages after ``decode_items(batch, ...)``'s."""
    start = page_size * (1 + batch * -(-context // page_size))
    return ForwardItem(token_ids=np.ones(tokens, np.int32), start_pos=0,
                       slots=np.arange(start, start + tokens, dtype=np.int32))


def slots_needed(context: int, prefill_tokens: int, decode_batches: list[int], page_size: int) -> int:
    """Pool slots for the steps: page 0 (the reserved slot 0's), whole pages per decode request, the prefill's."""
    pages_each = -(-context // page_size)
    return page_size * (1 + max(decode_batches) * pages_each + -(-prefill_tokens // page_size))


def layers_that_fit(allocator_bytes: int, num_slots: int, kv_dtypes: list[str]) -> int:
    """How many of Llama-3-8B's layers fit three quarters of an allocator (the rest: the step's own buffers and XLA's
    temporaries), with bfloat16 weights (embedding and head included) and ``num_slots`` of the widest KV dtype."""
    weights = lambda n: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(  # noqa: E731
        param_shapes(ModelConfig.from_hf({**LLAMA3_8B, "num_hidden_layers": n}), jnp.bfloat16)))
    per_layer = weights(2) - weights(1)
    config = ModelConfig.from_hf(LLAMA3_8B)
    per_layer += num_slots * 2 * config.num_kv_heads * max(
        kv_quant.bytes_per_head_token(jnp.dtype(kv), config.head_dim) for kv in kv_dtypes)
    return int((0.75 * allocator_bytes - (2 * weights(1) - weights(2))) // per_layer)


def step_config(*, smoke: bool, num_layers: int | None, num_slots: int,
                kv_dtypes: list[str]) -> tuple[ModelConfig, str]:
    """The model the steps run, and why it has fewer layers than Llama-3-8B ("" when it has them all): tiny under
    ``smoke``; else ``num_layers``, or all 32 where they fit the device's allocator, else as many as do."""
    if smoke:
        return ModelConfig.from_hf(TINY), ""
    full = LLAMA3_8B["num_hidden_layers"]
    if num_layers is not None:
        return ModelConfig.from_hf({**LLAMA3_8B, "num_hidden_layers": num_layers}), \
            ("--step-num-layers" if num_layers != full else "")
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0)
    fit = layers_that_fit(limit, num_slots, kv_dtypes) if limit else full
    if fit >= full:
        return ModelConfig.from_hf(LLAMA3_8B), ""
    if fit < 1:
        raise ValueError(f"not one Llama-3-8B layer fits {limit / 2**30:.1f} GiB beside its embedding and head "
                         f"with {num_slots} KV slots: lower --context or --decode-batches")
    return ModelConfig.from_hf({**LLAMA3_8B, "num_hidden_layers": fit}), \
        f"what fits 3/4 of the allocator's {limit / 2**30:.1f} GiB"


def run_steps(*, config: ModelConfig, context: int, prefill_tokens: int, decode_batches: list[int], kv_dtype: str,
              iters: int, attention: str, layers: str = "auto", page_size: int = 1,
              platform: str | None = None) -> list[StepResult]:
    """``platform``: resolve the backends for it rather than this process's (``"tpu"`` under ``--cpu-smoke``: the
    Mosaic kernel's backend, which then runs interpreted here)."""
    dtype = jnp.dtype(jnp.bfloat16)
    kv = jnp.dtype(kv_dtype)
    params = random_params(config, dtype)
    # Whole 128-slot blocks, as an engine sizes a TPU's pool, so a TPU's K/V write kernel applies (pool_slots).
    granule = math.lcm(page_size, TPU_SLOT_BLOCK)
    num_slots = -(-slots_needed(context, prefill_tokens, decode_batches, page_size) // granule) * granule
    backends = resolve_backends(attention, "xla", dtype=dtype, kv_dtype=kv, page_size=page_size, platform=platform,
                                layers=layers)
    runner = ModelRunner(config, params, num_slots, kv_dtype=kv, max_context=max(context, prefill_tokens),
                         page_size=page_size, backends=backends)
    weight_bytes = matmul_params(config) * dtype.itemsize
    kv_token_bytes = 2 * config.num_layers * config.num_kv_heads * kv_quant.bytes_per_head_token(kv, config.head_dim)
    attn_flops = lambda queries, keys: 4 * queries * keys * config.num_heads * config.head_dim  # noqa: E731
    results = []
    for batch in decode_batches:
        first, median = time_step(runner, decode_items(batch, context, page_size), iters)
        results.append(StepResult(f"decode b{batch} ctx{context}", batch, median, first,
                                  weight_bytes + batch * context * kv_token_bytes,
                                  2 * matmul_params(config) * batch + batch * attn_flops(1, context)))
    first, median = time_step(runner, [prefill_item(prefill_tokens, max(decode_batches), context, page_size)], iters)
    results.append(StepResult(f"prefill {prefill_tokens}", prefill_tokens, median, first,
                              weight_bytes + prefill_tokens * kv_token_bytes,
                              2 * matmul_params(config) * prefill_tokens
                              + attn_flops(prefill_tokens, (prefill_tokens + 1) / 2)))
    # A mixed step, as the engine's accelerator default makes one: the largest decode batch and the prefill its
    # chunk's budget leaves, in one step; and that prefill alone, to set the mixed step against the two apart.
    batch, mixed = max(decode_batches), mixed_step_prefill(prefill_tokens, max(decode_batches))
    chunk = prefill_item(mixed, batch, context, page_size)
    prefill_flops = 2 * matmul_params(config) * mixed + attn_flops(mixed, (mixed + 1) / 2)
    first, median = time_step(runner, [chunk], iters)
    results.append(StepResult(f"prefill {mixed}", mixed, median, first, weight_bytes + mixed * kv_token_bytes,
                              prefill_flops))
    first, median = time_step(runner, [*decode_items(batch, context, page_size), chunk], iters)
    results.append(StepResult(f"mixed b{batch}+{mixed}", batch + mixed, median, first,
                              weight_bytes + (batch * context + mixed) * kv_token_bytes,
                              2 * matmul_params(config) * batch + batch * attn_flops(1, context) + prefill_flops))
    return results


def mixed_summary(results: list[StepResult]) -> str:
    """The mixed step against its decode and prefill steps run apart (run_steps' last three rows and its largest
    decode): what a running request waits for a token while a prompt prefills, mixed or alternating."""
    prefill, mixed = results[-2], results[-1]
    decode = next(r for r in results if r.name.startswith("decode") and r.tokens == mixed.tokens - prefill.tokens)
    apart = decode.median_s + prefill.median_s
    return (f"mixed step {1e3 * mixed.median_s:.3f} ms vs {decode.name} + {prefill.name} apart "
            f"{1e3 * apart:.3f} ms: {mixed.median_s / apart:.2f} of the time")
