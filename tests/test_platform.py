"""Platform defaults (jsgl.engine.platform): what an engine on a GPU/TPU or on the CPU gets when a flag is left
unset, the memory plan they give a Llama-3-8B on an 80 GB card, the allocator's share of a GPU, the backends
resolved per platform, and a device asked for that is not there."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsgl.engine import memory
from jsgl.engine.memory import DeviceMemory, plan_memory, resolve_dtypes
from jsgl.engine.platform import (
    ACCELERATOR_MEM_FRACTION,
    Platform,
    current_platform,
    gpu_preallocation,
    max_step_tokens,
    resolve_defaults,
)
from jsgl.kernels.attention import resolve_attention_backend
from jsgl.kernels.cpu import resolve_matmul_backend
from jsgl.model.config import LLAMA3_8B, ModelConfig

GIB = 1 << 30
H100 = Platform("gpu", "NVIDIA H100 80GB HBM3", 1)
CPU = Platform("cpu", "cpu", 1)
UNSET = dict(page_size=None, kv_cache_gb=None, num_kv_slots=None, mem_fraction=None)


def test_this_machine_is_a_cpu_and_other_devices_are_refused_by_name():
    assert current_platform() == current_platform("cpu") == Platform("cpu", jax.devices()[0].device_kind,
                                                                     len(jax.devices()))
    with pytest.raises(ValueError, match=r"jsgl\[cuda12\]"):
        current_platform("gpu")
    with pytest.raises(ValueError, match=r"jsgl\[tpu\]"):
        current_platform("tpu")
    with pytest.raises(ValueError, match="device must be one of"):
        current_platform("cuda")


def test_unset_fields_take_the_platforms_defaults_and_explicit_ones_win():
    gpu = resolve_defaults(H100, **UNSET)
    assert (gpu.page_size, gpu.kv_cache_gb, gpu.mem_fraction) == (16, None, ACCELERATOR_MEM_FRACTION)
    cpu = resolve_defaults(CPU, **UNSET)
    assert (cpu.page_size, cpu.kv_cache_gb, cpu.mem_fraction) == (1, 1.0, None)
    pinned = resolve_defaults(H100, **{**UNSET, "page_size": 1, "kv_cache_gb": 2.0})
    assert (pinned.page_size, pinned.kv_cache_gb, pinned.mem_fraction) == (1, 2.0, None)
    slots = resolve_defaults(H100, **{**UNSET, "num_kv_slots": 4096})
    assert (slots.kv_cache_gb, slots.mem_fraction) == (None, None)
    assert resolve_defaults(CPU, **{**UNSET, "mem_fraction": 0.5}).mem_fraction == 0.5


def test_mixed_steps_are_an_accelerators_default_within_the_chunks_budget():
    # A GPU/TPU mixes a prompt's prefill into the decode steps, the step no larger than a prefill chunk; a CPU does
    # not (it saves nothing there); an explicit value, 0 included, wins on either.
    assert resolve_defaults(H100, **UNSET).mixed_prefill_tokens == 512 - 64
    assert resolve_defaults(CPU, **UNSET).mixed_prefill_tokens == 0
    assert resolve_defaults(H100, **UNSET, chunked_prefill_size=256, max_running_requests=200).mixed_prefill_tokens \
        == 128  # at least half the chunk, beside many decodes
    assert resolve_defaults(H100, **UNSET, mixed_prefill_tokens=0).mixed_prefill_tokens == 0
    assert resolve_defaults(CPU, **UNSET, mixed_prefill_tokens=64).mixed_prefill_tokens == 64
    # The memory plan's largest step: a chunk, or a mixed step's prefill beside every running request.
    assert max_step_tokens(512, 448, 64) == max_step_tokens(512, 0, 64) == 512
    assert max_step_tokens(256, 128, 200) == 328


def test_dry_run_says_padded_attention_mixes_no_steps(tmp_path, capsys):
    from jsgl.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    args = ["serve", "--dry-run", "--model", str(tmp_path), "--device-gb", "80", "--device", "gpu"]
    assert main(args) == 0
    assert "gpu defaults: page size 16, mixed steps of up to 448 prefill tokens" in capsys.readouterr().out
    assert main([*args, "--attention-backend", "native"]) == 0
    assert "gpu defaults: page size 16, mixed steps off" in capsys.readouterr().out


def test_an_80gb_gpu_without_flags_gives_an_8b_model_tens_of_gb_of_kv():
    config = ModelConfig.from_hf(LLAMA3_8B)
    defaults = resolve_defaults(H100, **UNSET)
    dtype, kv_dtype = resolve_dtypes("auto", "auto", H100.name)
    assert dtype == kv_dtype == np.dtype("bfloat16")
    plan = plan_memory(config, mem_fraction=defaults.mem_fraction, kv_cache_gb=defaults.kv_cache_gb,
                       device_bytes=(80 * GIB, "80 GB"), weight_itemsize=dtype.itemsize, kv_dtype=kv_dtype)
    assert 14 * GIB < plan.weight_bytes < 16 * GIB
    assert 45 * GIB < plan.kv_bytes < 55 * GIB, plan.render()  # 0.85 x 80 less weights and activations
    assert plan.num_slots > 350_000  # 128 KiB a token: ~45x the 8k context the old 1 GiB default held


def test_the_fraction_is_of_the_whole_gpu_and_never_past_the_allocators_limit(monkeypatch):
    for variable in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(variable, raising=False)
    assert gpu_preallocation() == 0.75  # JAX's own default
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert gpu_preallocation() == 0.95
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    assert gpu_preallocation() is None

    config = ModelConfig.from_hf(LLAMA3_8B)
    card = 140 * GIB
    for share, fraction, capped in ((0.95, 0.85, False), (0.75, 0.85, True)):
        monkeypatch.setattr(memory, "device_memory", lambda s=share: DeviceMemory(card, int(s * card), "H200"))
        plan = plan_memory(config, mem_fraction=fraction, weight_itemsize=2, kv_dtype=np.dtype("bfloat16"))
        taken = plan.weight_bytes + plan.activation_bytes + plan.kv_bytes
        assert plan.device_bytes == card and ("capped" in plan.device) == capped
        assert taken <= min(fraction * card, memory.ALLOCATOR_SHARE * share * card) + config.num_layers * 4096
        assert taken > 0.95 * min(fraction * card, memory.ALLOCATOR_SHARE * share * card)


def test_backends_resolve_per_platform():
    assert resolve_attention_backend("auto", "gpu") == "pallas"
    assert resolve_matmul_backend("auto", platform="gpu") == "xla"
    assert resolve_attention_backend("native", "gpu") == "native"
    assert resolve_attention_backend("auto", "tpu") == "tpu"  # checked on the device before use (self_check)
    assert resolve_attention_backend("tpu", "tpu") == "tpu"


def test_layers_are_scanned_on_tpu_and_unrolled_on_gpu_and_cpu():
    from jsgl.engine.backends import resolve_backends

    assert resolve_backends(platform="gpu", dtype="bfloat16").layers == "unrolled"  # until measured on a GPU
    assert resolve_backends(platform="gpu", dtype="bfloat16", layers="scanned").layers == "scanned"
    assert resolve_backends(platform="tpu", dtype="bfloat16").layers == "scanned"
    assert resolve_backends(platform="cpu").layers == "unrolled"
    assert resolve_backends("native", "xla", platform="cpu", layers="scanned").layers == "scanned"
    assert resolve_backends(platform="gpu", layers="unrolled").layers == "unrolled"
    if resolve_backends(platform="cpu").attention == "cpu":  # the C++ kernels take per-layer pools
        with pytest.raises(ValueError, match="attention_backend=native and matmul_backend=xla"):
            resolve_backends(platform="cpu", layers="scanned")
    with pytest.raises(ValueError, match="layers must be auto, scanned or unrolled"):
        resolve_backends(platform="cpu", layers="rolled")


def test_pallas_extends_are_not_held_back_by_the_score_budget():
    """The scheduler's padded-score budget counts the native path's score array; the kernels build none."""
    from jsgl.experiments.bench_device_steps import TINY, random_params

    from jsgl.engine.model_runner import ModelRunner

    config = ModelConfig.from_hf(TINY)
    params = random_params(config, np.dtype("float32"))
    sizes = {}
    for backend in ("pallas", "native"):
        runner = ModelRunner(config, params, 256, attention_backend=backend, matmul_backend="xla",
                             max_context=8192, page_size=16)
        sizes[backend] = runner.attention_bytes(8, 128, 8192)
    assert sizes["pallas"] == 0 and sizes["native"] >= 8 * 128 * 8192 * config.num_heads * 4


@pytest.mark.parametrize("attention,platform", [("pallas", "gpu"), ("tpu", "tpu")])
def test_the_accelerator_plans_are_length_free_and_list_extends(attention, platform):
    """The Pallas (GPU) and Mosaic (TPU) kernels read lengths at run time: a step's signature is (tokens,
    requests), decode at one length (not one per length bucket: 8 at 8k, 12 at 128k) and the extends planned too,
    as on the CPU."""
    from jsgl.experiments.bench_device_steps import TINY, random_params

    from jsgl.engine.backends import resolve_backends
    from jsgl.engine.model_runner import ModelRunner

    config = ModelConfig.from_hf({**TINY, "max_position_embeddings": 131072})
    params = random_params(config, np.dtype("float32"))
    # Resolved for the accelerator (on this CPU a runner resolves for the CPU, which refuses the TPU kernel).
    backends = resolve_backends(attention, "xla", platform=platform, page_size=16, layers="unrolled")
    counts = {}
    for context in (8192, 131072):
        runner = ModelRunner(config, params, context + 64, backends=backends, max_context=context, page_size=16)
        assert runner.length_free and runner.table_width == context
        plan = runner.planned_signatures("common", 64, 512)
        decode = [s for s in plan if s[2] == 1 and s[0] == s[1]]
        extends = [s for s in plan if s not in decode]
        assert {s[3] for s in plan} == {context} and len(decode) == 7  # batch buckets 1..64, one length
        assert extends and all(s[2] == s[0] for s in extends)  # S = T: each extend is (tokens, requests)
        assert runner.step_shape(3, 3, 1, 700, True) == (4, 4, 1, context)
        counts[context] = len(plan)
    native = ModelRunner(config, params, 8192 + 64, attention_backend="native", matmul_backend="xla",
                         max_context=8192, page_size=16)
    assert len(native.planned_signatures("common", 64, 512)) == 7 * 8  # decode at every length bucket
    assert counts[8192] == counts[131072]  # the plan no longer grows with the context


def test_dry_run_prints_a_tpu_plan_for_an_8b_model(tmp_path, capsys):
    from jsgl.cli import main

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    args = ["serve", "--dry-run", "--model", str(tmp_path), "--device-gb", "16", "--device", "tpu"]
    assert main([*args, "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "tpu defaults: page size 16, mixed steps of up to 448 prefill tokens" in out
    assert "backends: attention tpu, matmul xla, layers scanned" in out
    assert re.search(r"weights +3\.74 GiB +per device", out) and re.search(r"KV pool +9\.\d\d GiB", out)
    # bfloat16 weights of an 8B model do not fit one 16 GB chip: said, with what to change.
    assert main(args) == 2
    assert "leaves no room for a KV pool beside 14.96 GiB of weights" in capsys.readouterr().err


def test_a_tpu_pool_is_whole_blocks_of_the_kv_write_kernel():
    from jsgl.engine.platform import pool_slots
    from jsgl.kernels import kv_quant
    from jsgl.kernels.tpu_kv_write import fits

    assert pool_slots(1000, 16, "gpu") == 992 and pool_slots(1000, 1, "cpu") == 1000
    assert pool_slots(1000, 16, "tpu") == 896 and pool_slots(100, 16, "tpu") == 256
    # Sized so, a TPU pool is written by the kernel in every KV format (else the model falls back to the scatter).
    for dtype in (jnp.bfloat16, jnp.float32, jnp.int8):
        assert fits(kv_quant.allocate((2, pool_slots(1000, 16, "tpu"), 64), dtype))
    assert not fits(kv_quant.allocate((2, pool_slots(1000, 16, "gpu"), 64), jnp.int8))
