"""The TPU K/V write kernel (jsgl.kernels.tpu_kv_write) against kv_quant.write, bit for bit, in the Pallas TPU
interpreter; its Mosaic lowering for TPU v5e from this machine (one kernel, the pool aliased, tile-shaped DMAs); and
the whole engine step lowered for TPU, which writes every layer's K/V through it instead of XLA's scatter.

Small pools (2 KV heads, head_dim 32, 512 slots: whole blocks of every format) filled with random rows, so a block's
untouched rows must survive its read-merge-write; float32, bfloat16 and the 8-bit format; plain pools and stacks.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from step_lowering import NUM_SLOTS, donated, lowered_step, pool_scatters
from test_tpu_attention import STEP_LAYOUTS

from jsgl.kernels import kv_quant, lowering
from jsgl.kernels.attention import get_attention_backend
from jsgl.kernels.kv_quant import Int8Pool, LayerPool
from jsgl.kernels.tpu_kv_write import BUFFERS, fits, row_span, write_rows

HEADS, SLOTS, HEAD_DIM = 2, 512, 32
DTYPES = [jnp.float32, jnp.bfloat16, "int8"]
CASES = {
    # Scattered single tokens in more blocks than the kernel has buffers (its buffers are reused), unsorted, two of
    # them in one block of every format but apart in the batch (merged into one run).
    "decode": [37, 500, 69, 130, 38, 203, 255, 256, 301, 333, 410, 449, 17],
    # Two requests' prefills: runs of consecutive slots across pages of 16 and blocks of 8, 16 and 32 slots.
    "prefill": list(range(13, 58)) + list(range(200, 231)),
    # A decode batch padded to a bucket: padding tokens write the reserved slot 0 (the last of them, as a scatter).
    "padding": [70, 71, 300, 0, 0, 0],
}


def make_pool(rng, dtype, layers: int | None = None, heads: int = HEADS):
    """Random rows in every slot: ``[heads, (layers,) SLOTS, HEAD_DIM]`` (an Int8Pool for ``"int8"``)."""
    shape = (heads, *(() if layers is None else (layers,)), SLOTS, HEAD_DIM)
    rows = rng.standard_normal(shape).astype(np.float32)
    return Int8Pool(*kv_quant.quantize(jnp.asarray(rows))) if dtype == "int8" else jnp.asarray(rows, dtype)


def new_rows(rng, dtype, num_tokens, heads: int = HEADS):
    """The new tokens' K rows, in the dtype the model computes them in for such a pool."""
    x = rng.standard_normal((num_tokens, heads, HEAD_DIM)).astype(np.float32)
    return jnp.asarray(x, jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32)


def assert_bitwise_equal(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), np.argwhere(a != b)[:5].tolist()


def interpreted(pool, slots, x):
    return jax.jit(functools.partial(write_rows, interpret=True))(pool, jnp.asarray(slots, jnp.int32), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_kv_quant_write(case, dtype):
    rng = np.random.default_rng(len(case))
    pool, slots = make_pool(rng, dtype), CASES[case]
    assert fits(pool)
    if case == "decode":  # more blocks than buffers: each buffer is refilled after its write-back
        assert len({slot // row_span(jnp.int8 if dtype == "int8" else dtype) for slot in slots}) > BUFFERS
    x = new_rows(rng, dtype, len(slots))
    assert_bitwise_equal(interpreted(pool, slots, x), kv_quant.write(pool, jnp.asarray(slots), x))


# Stacks of 3 layers (the 8-bit format's scale blocks take every layer) and of 16 (the layer's tile of 8 layers).
# float32 in the full suite only: the plain pools cover it in the quick loop.
@pytest.mark.parametrize("dtype", [jnp.bfloat16, "int8", pytest.param(jnp.float32, marks=pytest.mark.slow)])
@pytest.mark.parametrize("layers,layer", [(3, 0), (3, 2), (16, 15)])
def test_layer_of_a_stack(layers, layer, dtype):
    rng = np.random.default_rng(layers + layer)
    stack, slots = make_pool(rng, dtype, layers), CASES["decode"]
    x = new_rows(rng, dtype, len(slots))
    pool = LayerPool(stack, jnp.int32(layer))
    got = interpreted(pool, slots, x)
    assert isinstance(got, LayerPool) and int(got.layer) == layer
    assert_bitwise_equal(got.stack, kv_quant.write(pool, jnp.asarray(slots), x).stack)
    others = [i for i in range(layers) if i != layer]  # implied by the equality; said plainly
    assert_bitwise_equal(jax.tree.map(lambda a: a[:, others], got.stack), jax.tree.map(lambda a: a[:, others], stack))


def test_pools_the_blocks_do_not_tile_are_scattered():
    # A bfloat16 pool of 8-slot pages (not whole 16-row blocks), an 8-bit one of 32-row blocks but not whole 128-slot
    # lanes of scales, and head_dim 256: kv_quant.write writes them, with no kernel.
    rng = np.random.default_rng(0)
    pools = [jnp.zeros((HEADS, 40, HEAD_DIM), jnp.bfloat16), Int8Pool(*kv_quant.quantize(jnp.ones((HEADS, 96, 8)))),
             jnp.zeros((HEADS, 64, 256), jnp.float32)]
    assert row_span(jnp.bfloat16) == 16 and row_span(jnp.int8) == 32 and row_span(jnp.float32) == 8
    for pool in pools:
        assert not fits(pool)
        x = jnp.asarray(rng.standard_normal((3, HEADS, pool.shape[-1])), jnp.float32)
        fn = jax.jit(lambda p, s, x: write_rows(p, s, x, interpret=True))
        slots = jnp.asarray([1, 17, 33], jnp.int32)
        assert "tpu_custom_call" not in fn.lower(pool, slots, x).as_text()
        assert_bitwise_equal(fn(pool, slots, x), kv_quant.write(pool, slots, x))


def test_the_tpu_backend_writes_through_the_kernel():
    backend = get_attention_backend("tpu")
    assert backend.write is write_rows
    assert get_attention_backend("native").write is None  # kv_quant.write (XLA's scatter)
    # Unset, `interpret` follows the target: the interpreter on this CPU, Mosaic when lowered for a TPU.
    rng = np.random.default_rng(1)
    pool, slots = make_pool(rng, jnp.bfloat16), jnp.asarray(CASES["padding"], jnp.int32)
    x = new_rows(rng, jnp.bfloat16, len(CASES["padding"]))
    fn = jax.jit(backend.write)
    assert_bitwise_equal(fn(pool, slots, x), kv_quant.write(pool, slots, x))
    assert lowering.lower_for(fn, pool, slots, x, platform="tpu").as_text().count("tpu_custom_call") == 1


def test_tp4_writes_each_shard_through_the_kernel():
    """At tp=4 (forced CPU devices, in a child: the device count is fixed when jax starts) the sharded TPU backend's
    write, lowered for TPU, runs the kernel inside the shard_map on each shard's KV head: a stack's values
    [1, 3, N, 32] of the whole [4, 3, N, 32], the 8-bit format's values and scales too; 4 partitions, no pool
    scattered into. (Run interpreted, the Pallas TPU interpreter's cross-device barrier never completes on this
    2-core host: the shards' numbers are checked one device at a time above, the wiring here.)"""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "bf16": {"kernels": [f"tensor<1x3x{NUM_SLOTS}x32xbf16>"], "partitions": 4, "pool_scatters": 0},
        "int8": {"kernels": [f"tensor<1x3x{NUM_SLOTS}x32xi8>", f"tensor<1x3x{NUM_SLOTS}xf32>"], "partitions": 4,
                 "pool_scatters": 0}}


def _tp4_child() -> dict[str, dict]:
    from jax.sharding import NamedSharding
    from step_lowering import partitions

    from jsgl.model.config import ModelConfig
    from jsgl.model.sharding import TensorParallel, _head_spec

    tp = TensorParallel.create(ModelConfig("llama", 128, 64, 128, 1, 12, 4, HEAD_DIM), 4)
    write = jax.jit(tp.shard_attention(get_attention_backend("tpu")).write, donate_argnums=0)
    placed = lambda shape, dtype: S(shape, dtype, sharding=NamedSharding(tp.mesh, _head_spec(S(shape, dtype))))  # noqa: E731
    shape, found = (4, 3, NUM_SLOTS, HEAD_DIM), {}
    for name, dtype in (("bf16", jnp.bfloat16), ("int8", jnp.int8)):
        stack = placed(shape, dtype)
        if dtype == jnp.int8:
            stack = Int8Pool(stack, placed(shape[:-1], jnp.float32))
        pool = LayerPool(stack, placed((), jnp.int32))
        args = (pool, S((16,), jnp.int32), S((16, 4, HEAD_DIM), jnp.bfloat16))
        text = lowering.lower_for(write, *args, platform="tpu", mesh=tp.mesh).as_text()
        kernels = re.findall(r"custom_call @tpu_custom_call\([^\n]*-> (tensor<[^>]*>)", text)
        found[name] = {"kernels": kernels, "partitions": partitions(text), "pool_scatters": pool_scatters(text)}
    return found


def mosaic_dmas(text: str) -> list[tuple[str, str]]:
    """``(source, target)`` memref types of every DMA in the Mosaic kernels of a lowered module."""
    from jax._src.interpreters import mlir
    from jaxlib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager
    from jaxlib.mosaic.python import tpu

    dmas = []
    for config in re.findall(r'backend_config = "(\{\\22custom_call_config.*?\})"', text):
        body = base64.b64decode(json.loads(config.replace("\\22", '"'))["custom_call_config"]["body"])
        context = mlir.make_ir_context()
        tpu.register_dialect(context)
        with context:
            context.allow_unregistered_dialects = True
            module = ir.Module.parse(body)
            PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
            dmas += re.findall(r"tpu\.enqueue_dma source\(%\w+ : (memref<[^)]*>)\) target\(%\w+ : (memref<[^)]*>)\)",
                               str(module))
    return dmas


S = jax.ShapeDtypeStruct
# A Llama-3-8B layer's pool (8 KV heads, head_dim 128) or the stack of its 32 layers; a 256-token prefill.
LLAMA_POOL = (8, 6144, 128)


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float32, jnp.int8])
def test_lowers_for_tpu_in_place_with_tile_shaped_copies(kv_dtype, stacked):
    """One Mosaic kernel (two in the 8-bit format: values, scales), its pool aliased to its output and donated. Its
    DMAs: whole tiles of the pool (8 heads x ``span`` rows x 128 lanes: 16 rows of bfloat16, 8 of float32, 32 of
    int8; 128 slots of scales, of 8 layers in a stack) and one float32 row per token, every head at once."""
    shape = (LLAMA_POOL[0], 32, *LLAMA_POOL[1:]) if stacked else LLAMA_POOL
    pool = S(shape, kv_dtype)
    if kv_dtype == jnp.int8:
        pool = Int8Pool(pool, S(shape[:-1], jnp.float32))

    def fn(pool, slots, x, layer):
        out = write_rows(LayerPool(pool, layer) if stacked else pool, slots, x)
        return out.stack if stacked else out

    args = (pool, S((256,), jnp.int32), S((256, 8, 128), jnp.bfloat16), S((), jnp.int32))
    text = lowering.lower_for(jax.jit(fn, donate_argnums=0), *args, platform="tpu").as_text()
    int8 = kv_dtype == jnp.int8
    assert text.count("tpu_custom_call") == 1 + int8
    assert text.count("output_operand_aliases") == 1 + int8 and donated(text) == 1 + int8
    span, name = row_span(kv_dtype), {jnp.bfloat16: "bf16", jnp.float32: "f32", jnp.int8: "i8"}[kv_dtype]
    block = f"memref<8x{span}x128x{name}, #tpu.memory_space<any>>"
    row = "memref<8x1x128xf32, #tpu.memory_space<any>>"
    dmas = set(mosaic_dmas(text))
    expected = {(block, block.replace("any", "vmem")), (block.replace("any", "vmem"), block),
                (row, row.replace("any", "vmem"))}
    if int8:
        scales = f"memref<8x{'8x' if stacked else ''}128xf32, #tpu.memory_space<any>>"
        expected |= {(scales, scales.replace("any", "vmem")), (scales.replace("any", "vmem"), scales)}
    assert dmas == expected


def step_summary(name: str, scanned: bool, kv_dtype, attention: str = "tpu") -> dict:
    text = lowered_step(STEP_LAYOUTS[name], "tpu", dtype=jnp.bfloat16, kv_dtype=kv_dtype, scanned=scanned,
                        attention=attention)
    calls = lambda fn: len(re.findall(rf"call @{fn}\(", text))  # noqa: E731
    return {"pool_scatters": pool_scatters(text), "value_writes": calls("_write_values"),
            "scale_writes": calls("_write_scales"), "mosaic": text.count("custom_call @tpu_custom_call"),
            "donated": donated(text)}


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize("scanned", [False, True])
@pytest.mark.parametrize("name", sorted(STEP_LAYOUTS))
def test_engine_step_for_tpu_writes_kv_through_the_kernel(name, scanned, kv_dtype):
    """The Llama-3-8B-shaped step lowered for TPU v5e: no scatter into a pool; the kernel once per layer for K and
    once for V (in the scanned loop's body: twice), the 8-bit format's scales too; the pools still donated."""
    int8 = kv_dtype == jnp.int8
    writes = 2 if scanned else 64
    pools = (2 if scanned else 64) * (2 if int8 else 1)
    assert step_summary(name, scanned, kv_dtype) == {
        "pool_scatters": 0, "value_writes": writes, "scale_writes": writes if int8 else 0,
        "mosaic": 2 + int8, "donated": pools}


def test_native_step_scatters_into_every_pool():
    # What the kernel replaces (and what pool_scatters sees): XLA's scatter of K and V into each layer's pool.
    assert step_summary("decode", False, jnp.bfloat16, attention="native")["pool_scatters"] == 64
    assert step_summary("decode", True, jnp.int8, attention="native")["pool_scatters"] == 4  # values and scales


if __name__ == "__main__":  # the tp=4 child
    print(json.dumps(_tp4_child()))
