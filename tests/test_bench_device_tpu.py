"""The TPU part of `jsgl bench device` (experiments/bench_device_tpu.py), which no TPU has run yet: the K/V layout
it builds for jax's ragged paged attention, read by jax's own reference; the peaks it picks per chip; and the whole
part at smoke size (`--cpu-smoke --platform tpu`: every kernel in the Pallas interpreter), whose printed errors must
be within tolerance and whose jax kernel must say it was skipped, never show a number.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jsgl.experiments import bench_device
from jsgl.experiments.bench_device_steps import layers_that_fit, slots_needed
from jsgl.experiments.bench_device_tpu import TPU_PEAKS, jax_rpa_inputs, jax_rpa_pages, tpu_peaks

from jsgl.kernels.attention import native_paged_attention


def test_jax_rpa_layout_is_what_jax_reference_reads():
    """K and V interleaved per head and the block table as the page table: jax's reference on them is the
    pure-JAX path on jsgl's pools (GQA 2, shuffled pages of 4, 5 new tokens after a cached prefix)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    q, k, v, meta = bench_device.make_batch(jax.random.key(1), batch=3, context=13, new=5, q_heads=4, kv_heads=2,
                                            head_dim=8, dtype=jnp.float32, page_size=4)
    want = native_paged_attention(q, k, v, meta, 0.3)
    got = ref_ragged_paged_attention(q, jax_rpa_pages(k, v, 4), *jax_rpa_inputs(meta), sm_scale=0.3)
    assert float(jnp.max(jnp.abs(got - want))) < 1e-5


def test_peaks_by_device_kind():
    assert tpu_peaks("TPU v5 lite")[:2] == (819e9, 197e12)
    assert tpu_peaks("TPU v6 lite")[:2] == (1638e9, 918e12)
    bandwidth, flops, source = tpu_peaks("cpu")  # not a TPU: v5e's, said so
    assert (bandwidth, flops) == TPU_PEAKS["TPU v5 lite"][1:] and "not in the table" in source


def test_steps_keep_the_layers_that_fit():
    """64 requests of 4,096 tokens in pages of 16: on a 16 GiB v5e neither the 16 GB of bf16 weights nor the 32 GiB
    of bf16 KV fit, so the steps run fewer of the model's layers; an H200 (at the CLI's 95%) holds all 32."""
    slots = slots_needed(4096, 512, [1, 64], 16)
    assert slots == 16 * (1 + 64 * 256 + 32)
    v5e, v6e = (layers_that_fit(int(gib * 2**30), slots, ["bfloat16", "int8"]) for gib in (15.75, 31.25))
    assert 1 <= v5e < v6e < 32
    assert layers_that_fit(int(0.95 * 139.8 * 2**30), slots, ["bfloat16", "int8"]) >= 32
    assert layers_that_fit(int(15.75 * 2**30), slots, ["int8"]) > v5e  # half the KV bytes


@pytest.mark.slow  # ~40 s on 2 cores: the interpreter runs each kernel program in Python
def test_tpu_part_at_smoke_size(capsys):
    # bfloat16 kernel cases only, for the suite's time: the int8 format's kernel is checked in test_tpu_attention,
    # and its engine steps here.
    rc = bench_device.main(["--cpu-smoke", "--platform", "tpu", "--skip-engine", "--dtypes", "bfloat16",
                            "--step-kv-dtypes", "int8", "--step-layers", "scanned"])
    out = capsys.readouterr().out
    assert rc == 0 and out.rstrip().endswith("all ok"), out
    cases = re.findall(r"^(decode|extend) (bfloat16|int8) .*B=(\d+) .*tolerance ([\d.e+-]+)\)$", out, re.M)
    assert [(kind, dtype, int(batch)) for kind, dtype, batch, _ in cases] == [
        (kind, "bfloat16", batch) for kind, batch in (("decode", 3), ("decode", 1), ("extend", 2))], out
    errors = re.findall(r"^  (tpu|native)\s+max\|err\| (\S+) \[ok\]\s+[\d.]+ ms", out, re.M)
    assert len(errors) == 2 * len(cases), out  # every case measured both, within tolerance
    assert all(float(err) <= bench_device.TOLERANCE["bfloat16"] for _, err in errors), errors
    skipped = re.findall(r"^  jax-rpa\s+skipped: .*interpreter.*max\|err\| (\S+) \[ok\]$", out, re.M)
    assert len(skipped) == 3 and all(float(err) <= bench_device.TOLERANCE["bfloat16"] for err in skipped), out
    assert re.search(r"^engine steps, tiny model, .*KV int8, layers scanned, tpu attention, pages of 4", out, re.M)
    steps = re.findall(r"^(decode b\d+ ctx40|prefill 16)\s+[\d.]+ ms", out, re.M)
    assert steps == ["decode b1 ctx40", "decode b2 ctx40", "prefill 16"], out
    assert re.search(r"^mixed b2\+14\s+[\d.]+ ms", out, re.M) and re.search(r"^mixed step .* apart .* of the time$",
                                                                          out, re.M), out
