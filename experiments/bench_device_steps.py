"""Whole engine steps on an accelerator, against what the hardware allows (part of `jsgl bench device`).

A Llama-3-8B-shaped model with random bfloat16 weights (the numbers are the machine's, not the model's) runs
through jsgl's `ModelRunner`, the same jitted step the engine calls (host inputs packed, Pallas attention,
sampling, the sampled tokens read back):

* decode at batch 1 and 64 over ``--context`` cached tokens: ms per step, and the step's bytes (every weight
  the step multiplies, once, plus the K/V it reads) over the time, as a fraction of ``--peak-bw``;
* prefill of ``--prefill-tokens`` new tokens: tokens/s and MFU (2 x matmul parameters x tokens, plus the
  attention's FLOPs, over the time, as a fraction of ``--peak-flops``);
* each step's first call minus its median: the compile seconds of that bucket.

With ``--cpu-smoke`` a tiny model runs the same code on any machine (Pallas interpreted).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jsgl.engine.model_runner import ModelRunner
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


def run_steps(*, smoke: bool, context: int, prefill_tokens: int, decode_batches: list[int], kv_dtype: str,
              iters: int, attention: str, layers: str = "auto") -> list[StepResult]:
    config = ModelConfig.from_hf(TINY if smoke else LLAMA3_8B)
    dtype = jnp.dtype(jnp.bfloat16)
    kv = jnp.dtype(kv_dtype)
    params = random_params(config, dtype)
    num_slots = max(decode_batches) * context + prefill_tokens + 1
    runner = ModelRunner(config, params, num_slots, attention_backend=attention, matmul_backend="xla",
                         kv_dtype=kv, max_context=max(context, prefill_tokens), layers=layers)
    weight_bytes = matmul_params(config) * dtype.itemsize
    kv_token_bytes = 2 * config.num_layers * config.num_kv_heads * kv_quant.bytes_per_head_token(kv, config.head_dim)
    attn_flops = lambda queries, keys: 4 * queries * keys * config.num_heads * config.head_dim  # noqa: E731
    results = []
    for batch in decode_batches:
        items = [ForwardItem(token_ids=np.ones(1, np.int32), start_pos=context - 1,
                             slots=np.arange(1 + b * context, 1 + (b + 1) * context, dtype=np.int32))
                 for b in range(batch)]
        first, median = time_step(runner, items, iters)
        results.append(StepResult(f"decode b{batch} ctx{context}", batch, median, first,
                                  weight_bytes + batch * context * kv_token_bytes,
                                  2 * matmul_params(config) * batch + batch * attn_flops(1, context)))
    start = max(decode_batches) * context + 1
    item = ForwardItem(token_ids=np.ones(prefill_tokens, np.int32), start_pos=0,
                       slots=np.arange(start, start + prefill_tokens, dtype=np.int32))
    first, median = time_step(runner, [item], iters)
    results.append(StepResult(f"prefill {prefill_tokens}", prefill_tokens, median, first,
                              weight_bytes + prefill_tokens * kv_token_bytes,
                              2 * matmul_params(config) * prefill_tokens
                              + attn_flops(prefill_tokens, (prefill_tokens + 1) / 2)))
    return results
