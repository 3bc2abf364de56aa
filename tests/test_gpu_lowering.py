"""The whole jitted engine step, lowered for CUDA on this GPU-less machine at Llama-3-8B's shapes.

No weights exist: the params and pools are abstract (`param_shapes`), so the 16 GB model costs nothing. The
step must use the compiled Pallas (Triton) kernels, one per layer, even though the host tracing it is a CPU
(interpret or compile follows the platform lowered for), and must update the donated KV pools in place.
Running the Triton kernels needs a GPU: `jsgl bench device` on the day one is lent.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from step_lowering import donated, lowered_step, partitions

from jsgl.engine.model_runner import _sample_step
from jsgl.engine.step_inputs import StepLayout, sampling_size
from jsgl.kernels.lowering import lower_for
from jsgl.model.config import LLAMA3_8B, ModelConfig
from jsgl.model.llama import param_shapes


def summary(text: str) -> dict:
    """Triton kernel calls, CPU FFI calls, donated arguments of main, and partitions of a lowered step."""
    return {"triton": len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\(", text)),
            "cpu_ffi": len(re.findall(r"custom_call @jsgl_", text)),
            "donated": donated(text), "partitions": partitions(text)}


LAYOUTS = {"decode": StepLayout(8, 8, 1, 512), "extend": StepLayout(256, 8, 64, 512)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_step_lowers_for_cuda_with_triton_kernels_and_pools_in_place(name):
    text = lowered_step(LAYOUTS[name], "cuda")
    # One kernel a layer, none of the CPU kernels' FFI calls, and every one of the 64 pools (K and V of 32
    # layers) donated: the step writes them in place.
    assert summary(text) == {"triton": 32, "cpu_ffi": 0, "donated": 64, "partitions": 1}
    if name == "extend":  # each program: 16 tokens x the 4 query heads of one KV head, one K/V read for them
        assert text.count("jsgl_paged_extend_bq16_g4_bk64") >= 32


@pytest.mark.parametrize("name", LAYOUTS)
def test_page_table_step_lowers_for_cuda_with_the_paged_kernels(name):
    """Pages of 16 slots (`--page-size 16`): the step's block table is 32 pages a request, not 512 slots, and
    each layer's kernel gathers its K/V block's 4 pages from it."""
    layout = LAYOUTS[name]._replace(page_size=16)
    assert layout.table_width == 32
    text = lowered_step(layout, "cuda")
    assert summary(text) == {"triton": 32, "cpu_ffi": 0, "donated": 64, "partitions": 1}
    assert text.count("_bk64_pg16") >= 32 if name == "extend" else text.count("_pg16") >= 32


def test_int8_kv_step_lowers_for_cuda_with_its_pools_in_place():
    """kv_dtype int8 on a bfloat16 model: still one Triton kernel a layer, and all 128 pool buffers (int8 rows
    and scales of K and V, 32 layers) donated."""
    got = summary(lowered_step(LAYOUTS["decode"], "cuda", dtype=jnp.bfloat16, kv_dtype=jnp.int8))
    assert got == {"triton": 32, "cpu_ffi": 0, "donated": 128, "partitions": 1}


def test_tp4_step_lowers_for_cuda_with_a_kernel_per_shard():
    """At tp=4 (forced CPU devices, in a child: the device count is fixed when jax starts) the step is 4
    partitions, attention a Triton kernel per layer inside the shard_map (each device on its heads), the
    sharded pools still donated."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in LAYOUTS:
        assert got[name] == {"triton": 32, "cpu_ffi": 0, "donated": 64, "partitions": 4}, got
    assert got["int8 decode"] == {"triton": 32, "cpu_ffi": 0, "donated": 128, "partitions": 4}, got
    assert got["scanned extend"] == {"triton": 1, "cpu_ffi": 0, "donated": 2, "partitions": 4}, got


@pytest.mark.parametrize("name", LAYOUTS)
def test_scanned_step_lowers_for_cuda_with_one_layer_and_its_stacks_in_place(name):
    """layers=scanned (the TPU default): the 32 layers are one while loop over one layer's program, its
    one Triton kernel reading the layer from the stacked pools, and both stacks (K and V) donated."""
    text = lowered_step(LAYOUTS[name], "cuda", dtype=jnp.bfloat16, scanned=True)
    assert summary(text) == {"triton": 1, "cpu_ffi": 0, "donated": 2, "partitions": 1}
    assert text.count("stablehlo.while") == 1 and text.count("_stacked") >= 1
    int8 = summary(lowered_step(LAYOUTS[name], "cuda", dtype=jnp.bfloat16, kv_dtype=jnp.int8, scanned=True))
    assert int8 == {"triton": 1, "cpu_ffi": 0, "donated": 4, "partitions": 1}


def test_bfloat16_step_makes_no_float32_copy_of_a_weight():
    """dtype bfloat16: the matmuls take the bfloat16 weights as they are (float32 accumulation through the
    dots' result type), so no weight-shaped bfloat16 -> float32 convert appears; the Triton kernels are there."""
    text = lowered_step(LAYOUTS["decode"], "cuda", dtype=jnp.bfloat16)
    weights = {"4096x4096", "4096x1024", "4096x14336", "14336x4096", "128256x4096", "4096x128256"}
    converted = set(re.findall(r"stablehlo\.convert %\S+ : \(tensor<(\d+x\d+)xbf16>\) -> tensor<\1xf32>", text))
    assert not converted & weights, converted
    bf16_dots = re.findall(r"stablehlo\.dot_general %\S+, %\S+,[^\n]*: \(tensor<[^>]*xbf16>, tensor<[^>]*xbf16>\) -> "
                           r"tensor<[^>]*xf32>", text)
    assert len(bf16_dots) >= 7 * 32  # q, k, v, o, gate, up, down of every layer, bf16 in, f32 out
    assert summary(text)["triton"] == 32


def test_sampler_lowers_for_cuda_at_llama3_vocabulary():
    """The sampler, its own jitted call after the forward's, lowers for CUDA at Llama 3's 128k vocabulary with its
    stages as conditionals (one program serves greedy, filtered, masked and biased batches)."""
    vocab, b = ModelConfig.from_hf(LLAMA3_8B).vocab_size, 8
    args = (jax.ShapeDtypeStruct((b, vocab), jnp.float32), jax.ShapeDtypeStruct((sampling_size(b),), jnp.int32),
            jax.ShapeDtypeStruct((b, -(-vocab // 32)), jnp.uint32), jax.ShapeDtypeStruct((b, vocab), jnp.float32),
            jax.ShapeDtypeStruct((b, vocab), jnp.float32))
    text = lower_for(_sample_step, *args, top_logprobs=20, platform="cuda").as_text()
    assert summary(text)["cpu_ffi"] == 0
    assert text.count("stablehlo.case") + text.count("stablehlo.if") >= 6
    main = text[text.index("@main"):].split("\n", 1)[0]  # its signature: the tokens and the top-20 logprobs
    assert "tensor<8xi32> {jax.result_info = \"result['tokens']\"}" in main
    assert "tensor<8x20xf32> {jax.result_info = \"result['top_vals']\"}" in main


def test_same_step_interprets_when_lowered_for_cpu():
    """The same jitted step lowered for the CPU host takes the interpreted kernels: no Triton call."""
    text = lowered_step(StepLayout(8, 8, 1, 512), "cpu")
    assert "triton" not in text


def test_param_shapes_are_the_loaders():
    from jsgl.model.loader import load_model

    cfg, params = load_model("smollm2-135m")
    got = jax.tree.map(lambda x: (x.shape, str(x.dtype)), params)
    want = jax.tree.map(lambda x: (x.shape, str(x.dtype)), param_shapes(cfg))
    assert got == want


if __name__ == "__main__":  # the tp=4 child
    got = {name: summary(lowered_step(layout, "cuda", tp=4)) for name, layout in LAYOUTS.items()}
    got["int8 decode"] = summary(lowered_step(LAYOUTS["decode"], "cuda", tp=4, dtype=jnp.bfloat16, kv_dtype=jnp.int8))
    got["scanned extend"] = summary(lowered_step(LAYOUTS["extend"], "cuda", tp=4, dtype=jnp.bfloat16, scanned=True))
    print(json.dumps(got))
