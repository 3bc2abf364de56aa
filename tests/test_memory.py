"""Memory planning (`--mem-fraction`, `jsgl serve --dry-run`): weights per device from the config alone, the KV
pool from what the fraction leaves, and an engine sized by it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jsgl.engine.memory import WEIGHT_BYTES, load_config, plan_memory, weight_bytes_per_device
from jsgl.model.config import LLAMA3_8B, ModelConfig

GIB = 1 << 30


def test_weight_bytes_are_the_loaded_models():
    """From the config alone, the bytes the loader's float32 params take (tied embedding counted once)."""
    from jsgl.model.loader import load_model

    config, params = load_model("smollm2-135m")
    assert load_config("smollm2-135m") == config  # the GGUF's metadata only
    assert weight_bytes_per_device(config, 1) == sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))


def test_llama3_8b_plan_at_tp1_and_tp4():
    config = ModelConfig.from_hf(LLAMA3_8B)
    params = (128256 * 4096 * 2 + 32 * (4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096) + 4096)
    assert weight_bytes_per_device(config, 1) == params * WEIGHT_BYTES  # 8.03 B parameters
    h100 = (80 * GIB, "test")
    one = plan_memory(config, tp=1, mem_fraction=0.9, device_bytes=h100)
    four = plan_memory(config, tp=4, mem_fraction=0.9, device_bytes=h100)
    # tp=4: every matrix is split four ways (8 KV heads, 14336 and the vocab divide); only the norms repeat.
    norms = (2 * 32 + 1) * 4096 * WEIGHT_BYTES
    assert four.weight_bytes == (one.weight_bytes - norms) // 4 + norms
    assert (one.kv_bytes_per_token, four.kv_bytes_per_token) == (2 * 32 * 8 * 128 * 4, 2 * 32 * 2 * 128 * 4)
    for plan in (one, four):
        room = int(0.9 * 80 * GIB) - plan.weight_bytes - plan.activation_bytes
        assert plan.num_slots == room // plan.kv_bytes_per_token
        assert 0 <= plan.free_bytes - int(0.1 * 80 * GIB) < plan.kv_bytes_per_token
    assert four.num_slots > 4 * one.num_slots  # the weights' share shrinks too
    with pytest.raises(ValueError, match="no room for a KV pool"):
        plan_memory(config, tp=1, mem_fraction=0.9, device_bytes=(24 * GIB, "test"))


def test_engine_sized_by_mem_fraction():
    """An engine given a fraction allocates the planned slots and reports weights, KV and what is left."""
    from jsgl.engine.engine import Engine

    engine = Engine(mem_fraction=0.06)
    try:
        stats, plan = engine.stats(), engine.memory_plan
        assert plan.mem_fraction == 0.06 and stats["total_slots"] == plan.num_slots - 1 > 1000  # slot 0 reserved
        assert stats["kv_bytes"] == plan.num_slots * engine.model_config.kv_bytes_per_token
        assert stats["weight_bytes"] + stats["kv_bytes"] + plan.activation_bytes <= 0.06 * stats["device_bytes"]
        assert engine.generate(["The capital of France is"], {"max_new_tokens": 4})[0].completion_tokens == 4
    finally:
        engine.shutdown()
