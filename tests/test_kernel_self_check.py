"""An accelerator's attention kernel (and K/V write kernel) is checked on its device before an engine's first step
(jsgl.kernels.self_check, jsgl.engine.backends.checked_on_device): here the kernels run interpreted, and a
TPU is simulated by telling JAX's default backend is "tpu", so the real kernel meets a compiler that refuses it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jsgl.engine import backends as backends_module
from jsgl.engine.backends import checked_on_device, resolve_backends
from jsgl.kernels import attention, kv_quant
from jsgl.kernels.self_check import TOLERANCE, KernelCheckFailed, check_attention_kernel
from jsgl.model.config import ModelConfig

CONFIG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=256, intermediate_size=64, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize("name", ["tpu", "pallas"])
def test_kernels_pass_their_check_interpreted(name, kv_dtype):
    error = check_attention_kernel(name, num_heads=8, num_kv_heads=2, head_dim=64, kv_dtype=kv_dtype, page_size=16)
    assert error < TOLERANCE / 2  # bfloat16 rounding: an output ulp or two


def _register(name, attend):
    attention.register_attention_backend(attention.AttentionBackend(name, attend))


def test_a_wrong_or_failing_kernel_is_found(monkeypatch):
    monkeypatch.setattr(attention, "_BACKENDS", dict(attention._BACKENDS))
    _register("off_by_ten_percent", lambda *args: attention.native_paged_attention(*args) * 1.1)
    with pytest.raises(KernelCheckFailed, match="differs from the native path"):
        check_attention_kernel("off_by_ten_percent", num_heads=4, num_kv_heads=1, head_dim=64,
                               kv_dtype=jnp.bfloat16, page_size=16)

    def refuses(*args):
        raise NotImplementedError("no lowering for this op")

    _register("refused", refuses)
    with pytest.raises(KernelCheckFailed, match="refused attention failed on .*NotImplementedError"):
        check_attention_kernel("refused", num_heads=4, num_kv_heads=1, head_dim=64, kv_dtype=jnp.bfloat16,
                               page_size=16)


def test_a_wrong_kv_write_is_found(monkeypatch):
    # A backend writing K/V through its own kernel (the TPU's) writes the check's pools through it too: they must be
    # kv_quant.write's, bit for bit (attention over wrong pools would agree with native over the same pools).
    monkeypatch.setattr(attention, "_BACKENDS", dict(attention._BACKENDS))
    doubled = lambda pool, slots, x: kv_quant.write(pool, slots, x * 2)  # noqa: E731
    attention.register_attention_backend(attention.AttentionBackend("doubles", attention.native_paged_attention,
                                                                    write=doubled))
    with pytest.raises(KernelCheckFailed, match="doubles K/V write on .* differs from kv_quant.write"):
        check_attention_kernel("doubles", num_heads=4, num_kv_heads=1, head_dim=64, kv_dtype=jnp.bfloat16,
                               page_size=16)


def test_a_kernel_the_device_refuses_falls_back_under_auto_and_is_an_error_by_name(monkeypatch, caplog):
    # JAX told it runs on a TPU: the kernel goes to Mosaic, which cannot compile for this CPU, a real refusal.
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    picked = resolve_backends(platform="tpu", dtype="bfloat16", kv_dtype="bfloat16", page_size=16)
    assert picked.attention == "tpu"
    with caplog.at_level("WARNING"):
        checked = checked_on_device(picked, "auto", CONFIG, jnp.bfloat16, 16, "tpu")
    assert checked.attention == "native" and checked.scanned == picked.scanned
    assert "tpu attention failed on" in checked.attention_fallback
    assert "native path instead" in caplog.text
    with pytest.raises(ValueError, match="attention_backend='tpu': tpu attention failed on .*native runs on tpu"):
        checked_on_device(picked, "tpu", CONFIG, jnp.bfloat16, 16, "tpu")


def test_only_this_process_accelerator_is_checked(monkeypatch):
    calls = []
    monkeypatch.setattr(backends_module, "check_attention_kernel", lambda name, **shape: calls.append(shape) or 0.0)
    picked = resolve_backends(platform="tpu", dtype="bfloat16", kv_dtype="bfloat16", page_size=16, tp=2)
    assert checked_on_device(picked, "auto", CONFIG, jnp.bfloat16, 16, "tpu") is picked  # a plan for a TPU, on CPU
    assert calls == []
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert checked_on_device(picked, "auto", CONFIG, jnp.bfloat16, 16, "tpu") is picked
    # Per tensor-parallel shard: half the heads each.
    assert calls == [dict(num_heads=2, num_kv_heads=1, head_dim=64, kv_dtype=jnp.bfloat16, page_size=16)]
    native = dataclasses.replace(picked, attention="native")
    assert checked_on_device(native, "native", CONFIG, jnp.bfloat16, 16, "tpu") is native and len(calls) == 1
