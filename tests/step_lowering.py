"""The whole jitted engine step of a Llama-3-8B-shaped model, lowered for a platform this machine lacks (shared by
test_gpu_lowering, test_tpu_attention and test_tpu_kv_write).

No weights exist: params and pools are abstract (`param_shapes`), so the 16 GB model costs nothing; under tensor
parallelism each carries the NamedSharding the runner would place it with.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp

from jsgl.engine.model_runner import _step
from jsgl.engine.step_inputs import StepLayout
from jsgl.kernels.lowering import lower_for
from jsgl.model.config import LLAMA3_8B, ModelConfig
from jsgl.model.llama import param_shapes

# Not a dimension of the model (hidden 4096, MLP 14336, head 128), so an op on a whole pool is recognisable by it.
NUM_SLOTS = 6144


def lowered_step(layout: StepLayout, platform: str, tp: int = 1, dtype=jnp.float32, kv_dtype=None,
                 scanned: bool = False, attention: str = "pallas") -> str:
    from jax.sharding import NamedSharding, PartitionSpec

    from jsgl.model.sharding import TensorParallel

    cfg = ModelConfig.from_hf(LLAMA3_8B)
    parallel = TensorParallel.create(cfg, tp) if tp > 1 else None
    forward = parallel.config if parallel else cfg  # heads and MLP padded to whole groups per shard
    params = param_shapes(forward, dtype, scanned)
    sharding = lambda *spec: NamedSharding(parallel.mesh, PartitionSpec(*spec)) if parallel else None  # noqa: E731
    # A layer's pool [Hkv, N, D], or a scanned model's stack of every layer's [Hkv, L, N, D]
    layers = (cfg.num_layers,) if scanned else ()
    pool = jax.ShapeDtypeStruct((forward.num_kv_heads, *layers, NUM_SLOTS, cfg.head_dim), kv_dtype or dtype,
                                sharding=sharding("tp", *(None,) * (2 + len(layers))))
    if kv_dtype == jnp.int8:  # the 8-bit format: int8 rows and a float32 scale per token and head
        from jsgl.kernels.kv_quant import Int8Pool

        pool = Int8Pool(pool, jax.ShapeDtypeStruct(pool.shape[:-1], jnp.float32,
                                                   sharding=sharding("tp", *(None,) * (1 + len(layers)))))
    if parallel:  # each weight carries the NamedSharding the runner would place it with
        params = jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                   sharding=NamedSharding(parallel.mesh, spec)),
                              params, parallel.param_specs(params), is_leaf=lambda x: isinstance(x, PartitionSpec))
    kv = (pool, pool) if scanned else ([pool] * cfg.num_layers, [pool] * cfg.num_layers)
    b = layout.num_b
    step = jax.jit(functools.partial(_step, layout=layout, config=forward, attention_backend=attention,
                                     prompt_top_k=-1, tp=parallel), donate_argnums=(1,))
    args = (params, kv, jax.ShapeDtypeStruct((layout.num_ints,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32))
    return lower_for(step, *args, platform=platform, mesh=parallel.mesh if parallel else None).as_text()


def donated(text: str) -> int:
    """Arguments of the lowered step's main that its outputs alias (or that XLA may reuse): the pools in place."""
    main = text[text.index("func.func public @main"):].split("\n", 1)[0]
    return len(re.findall(r"tf\.aliasing_output|jax\.buffer_donor", main))


def partitions(text: str) -> int:
    return int(re.search(r"mhlo\.num_partitions = (\d+)", text)[1])


def pool_gathers(text: str) -> int:
    """Gathers out of a whole pool (values [Hkv, (L,) N, D] or scales [Hkv, (L,) N]): the native path's padded K/V."""
    return len(re.findall(rf"stablehlo\.gather[^\n]*: \(tensor<(?:\d+x)*{NUM_SLOTS}x", text))


def pool_scatters(text: str) -> int:
    """Scatters into a whole pool (values [Hkv, (L,) N, D] or scales [Hkv, (L,) N]): XLA's K/V write. A scatter's
    types follow its update region, on the line closing it."""
    count = 0
    for op in re.finditer(r'"stablehlo\.scatter"\(', text):
        closing = text[text.index("}) : (", op.end()):].split("\n", 1)[0]
        count += bool(re.match(rf"\}}\) : \(tensor<(?:\d+x)*{NUM_SLOTS}x", closing))
    return count
