"""The TPU part of `jsgl bench device`: attention at Llama-3-8B's shapes through jsgl's Mosaic kernel, the pure-JAX
path and jax's own ragged paged attention, against a float32 reference and the HBM floor.

For each KV format (bfloat16; the 8-bit format of jsgl.kernels.kv_quant under bfloat16 queries) a pool of shuffled,
non-contiguous pages (``--page-size``, 16 by default; page 0 reserved) and the batch's metadata are built, for

* decode: ``--batch`` (64) and ``--splitk-batch`` (1) requests, one new token each, ``--context`` tokens in all;
* extend: ``--extend-batch`` requests of ``--extend-new`` new tokens after a cached prefix, ``--context`` in all;

and run through

* ``tpu``: jsgl's kernel through the engine's attention contract (``tpu_paged_attention``: pools ``[Hkv, N, D]``,
  ``AttentionMetadata``), block sizes the chip's defaults unless ``--tpu-block-q``/``--tpu-pages-per-block``;
* ``native``: the pure-JAX path (``native_paged_attention``), what an engine on a TPU runs by default;
* ``jax-rpa``: ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``, bfloat16 only (it has no per-token
  scales), on the same K/V laid out its way once, before the clock: one ``[pages, page_size, 2 * Hkv, D]`` array
  with K head ``h`` at ``2h`` and V head ``h`` at ``2h + 1`` (as its ``ref_ragged_paged_attention`` reads them),
  and the metadata's block table as its ``[num_seqs, pages_per_seq]`` page table.

Each row: max |out - reference| (float32 attention over the same inputs, upcast; the 8-bit pools dequantized),
the median ms of ``--iters`` calls after ``--warmup`` (``block_until_ready``), and for decode the time against the
HBM floor: the K/V bytes (each read once; int8 rows and their scales) over ``--peak-bw``. Extend: TFLOP/s against
``--peak-flops``. An error over tolerance (or an implementation that fails) makes the exit status 1.
Interpreted (``--cpu-smoke``) the times are the interpreter's, and jax's kernel is skipped (it crashes in the
Pallas interpreter): its layout is checked through jax's reference instead.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jsgl.experiments.bench_device import TOLERANCE, kernel_cases, make_batch, median_time

from jsgl.kernels import kv_quant
from jsgl.kernels.attention import AttentionMetadata, native_paged_attention
from jsgl.kernels.tpu_attention import tpu_paged_attention

# Per chip, by JAX's device_kind: (generation, peak HBM bandwidth B/s, dense bfloat16 FLOP/s), from Google Cloud's
# spec pages (cloud.google.com/tpu/docs/v5e: 819 GBps, 197 TFLOPs; /v6e: 1638 GBps, 918 TFLOPs; /v5p: 2765 GBps,
# 459 TFLOPs).
TPU_PEAKS = {"TPU v5 lite": ("v5e", 819e9, 197e12), "TPU v6 lite": ("v6e", 1638e9, 918e12),
             "TPU v5": ("v5p", 2765e9, 459e12)}
FALLBACK_KIND = "TPU v5 lite"


def tpu_peaks(device_kind: str) -> tuple[float, float, str]:
    """``(peak HBM B/s, peak bfloat16 FLOP/s, where they come from)`` for a chip; v5e's for one not in the table."""
    if device_kind in TPU_PEAKS:
        generation, bandwidth, flops = TPU_PEAKS[device_kind]
        return bandwidth, flops, f"TPU {generation}'s, Google Cloud's spec page"
    _, bandwidth, flops = TPU_PEAKS[FALLBACK_KIND]
    return bandwidth, flops, f"{device_kind!r} is not in the table: TPU v5e's; --peak-bw, --peak-flops set them"


def jax_rpa_pages(k_pool: jax.Array, v_pool: jax.Array, page_size: int) -> jax.Array:
    """Pools ``[Hkv, N, D]`` as jax's kernel reads them: ``[N / page_size, page_size, 2 * Hkv, D]``, K head ``h`` at
    ``2h`` and V head ``h`` at ``2h + 1``."""
    heads, slots, dim = k_pool.shape
    both = jnp.stack([k_pool, v_pool], axis=1)  # [Hkv, 2, N, D]: row 2h + 0 is K of head h, 2h + 1 its V
    return both.reshape(2 * heads, slots // page_size, page_size, dim).transpose(1, 2, 0, 3)


def jax_rpa_inputs(meta: AttentionMetadata) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(kv_lens, page_indices, cu_q_lens, num_seqs)`` of jax's kernel from jsgl's metadata (requests in order)."""
    cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(meta.q_len).astype(jnp.int32)])
    return (meta.kv_lens.astype(jnp.int32), meta.block_table.astype(jnp.int32), cu_q_lens,
            jnp.array([meta.kv_lens.shape[0]], jnp.int32))


def max_error(out: jax.Array, exact: jax.Array) -> float:
    out = out.astype(jnp.float32)
    return float(jnp.max(jnp.abs(out - exact))) if bool(jnp.all(jnp.isfinite(out))) else float("inf")


def implementations(args: argparse.Namespace, q: jax.Array, k_pool: Any, v_pool: Any, meta: AttentionMetadata,
                    scale: float, interpret: bool) -> dict[str, tuple[Callable, tuple] | str]:
    """name -> (jitted function, its inputs), or why it does not run here."""
    tpu = functools.partial(tpu_paged_attention, scale=scale, block_q=args.tpu_block_q,
                            pages_per_block=args.tpu_pages_per_block, interpret=interpret)
    impls: dict[str, tuple[Callable, tuple] | str] = {
        "tpu": (jax.jit(tpu), (q, k_pool, v_pool, meta)),
        "native": (jax.jit(functools.partial(native_paged_attention, scale=scale)), (q, k_pool, v_pool, meta)),
    }
    if isinstance(k_pool, kv_quant.Int8Pool) or q.dtype != jnp.bfloat16:
        impls["jax-rpa"] = "n/a: compared in bfloat16 only (it has no per-token KV scales)"
    elif interpret:
        impls["jax-rpa"] = "skipped: jax's kernel crashes in the Pallas interpreter (a TPU runs it)"
    else:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

        kv_pages = jax.block_until_ready(jax_rpa_pages(k_pool, v_pool, meta.page_size))  # once, before the clock
        kv_lens, page_indices, cu_q_lens, num_seqs = jax_rpa_inputs(meta)
        rpa = lambda q, kv_pages: ragged_paged_attention(  # noqa: E731
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=scale)
        impls["jax-rpa"] = (rpa, (q, kv_pages))
    return impls


def layout_check(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, meta: AttentionMetadata, scale: float,
                 exact: jax.Array) -> float:
    """Max error of jax's reference (``ref_ragged_paged_attention``) on the layout built for its kernel: where the
    kernel itself cannot run, this shows the interleaving and page table are what it reads."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    kv_lens, page_indices, cu_q_lens, num_seqs = jax_rpa_inputs(meta)
    out = ref_ragged_paged_attention(q, jax_rpa_pages(k_pool, v_pool, meta.page_size), kv_lens, page_indices,
                                     cu_q_lens, num_seqs, sm_scale=scale)
    return max_error(out, exact)


def check_case(kind: str, batch: int, kv_heads: int, dtype_name: str, args: argparse.Namespace,
               interpret: bool) -> bool:
    quantized = dtype_name == "int8"
    dtype = jnp.dtype("bfloat16" if quantized else dtype_name)  # the queries' (and a plain pool's) dtype
    decode = kind == "decode"
    new = 1 if decode else args.extend_new
    q, k_pool, v_pool, meta = make_batch(
        jax.random.key(args.seed), batch=batch, context=args.context, new=new, q_heads=args.q_heads,
        kv_heads=kv_heads, head_dim=args.head_dim, dtype=jnp.float32 if quantized else dtype,
        page_size=args.page_size)
    if quantized:
        q = q.astype(dtype)
        k_pool, v_pool = (kv_quant.Int8Pool(*kv_quant.quantize(x)) for x in (k_pool, v_pool))
    scale = args.head_dim**-0.5
    as_f32 = lambda x: kv_quant.dequantize(x.values, x.scales) if quantized else x.astype(jnp.float32)  # noqa: E731
    exact = jax.jit(native_paged_attention, static_argnums=4)(
        q.astype(jnp.float32), as_f32(k_pool), as_f32(v_pool), meta, scale)
    tolerance = TOLERANCE[dtype_name]
    kv_bytes = 2 * batch * args.context * kv_heads * kv_quant.bytes_per_head_token(
        jnp.int8 if quantized else dtype, args.head_dim)
    floor = kv_bytes / args.peak_bw
    if decode:
        detail = f"K/V {kv_bytes / 1e6:,.2f} MB read once: HBM floor {floor * 1e3:.4g} ms"
    else:
        prefix = args.context - new  # visible keys per query: the prefix and the causal part of the new tokens
        flops = 4 * batch * (new * prefix + new * (new + 1) // 2) * args.q_heads * args.head_dim
        detail = f"{flops / 1e9:.4g} GFLOP"
    print(f"{kind} {dtype_name} Hq={args.q_heads} Hkv={kv_heads} D={args.head_dim} B={batch} ctx={args.context} "
          f"new={new} ({detail}; tolerance {tolerance:.0e})", flush=True)
    ok = True
    for name, impl in implementations(args, q, k_pool, v_pool, meta, scale, interpret).items():
        if isinstance(impl, str):
            if name == "jax-rpa" and impl.startswith("skipped"):  # not run here: check what it would have read
                err = layout_check(q, k_pool, v_pool, meta, scale, exact)
                ok &= err <= tolerance
                verdict = "ok" if err <= tolerance else "FAIL"
                impl += f"; its layout through jax's reference: max|err| {err:.2e} [{verdict}]"
            print(f"  {name:8s} {impl}", flush=True)
            continue
        fn, inputs = impl
        try:
            err = max_error(jax.block_until_ready(fn(*inputs)), exact)
            untimed = name == "native" and args.skip_native_timing
            seconds = float("nan") if untimed else median_time(fn, inputs, args.iters, args.warmup)
        except Exception as exc:  # one implementation failing to compile or run must not hide the others' rows
            ok = False
            first_line = (str(exc).strip().splitlines() or [""])[0][:300]
            print(f"  {name:8s} ERROR {type(exc).__name__}: {first_line}", flush=True)
            continue
        ok &= err <= tolerance
        if decode:
            speed = f"{kv_bytes / seconds / 1e9:8.1f} GB/s = {floor / seconds:6.1%} of peak bw"
        else:
            speed = f"{flops / seconds / 1e12:8.2f} TFLOP/s = {flops / seconds / args.peak_flops:6.1%} of peak"
        print(f"  {name:8s} max|err| {err:.2e} [{'ok' if err <= tolerance else 'FAIL'}] {seconds * 1e3:10.3f} ms  "
              f"{speed}", flush=True)
    return ok


def run_kernel_checks(args: argparse.Namespace, interpret: bool) -> bool:
    """Every (KV heads, dtype, case) of the TPU part; True when every error is within tolerance."""
    print(f"\nattention on the TPU kernels (pages of {args.page_size}, shuffled; median of {args.iters} after "
          f"{args.warmup}; peak {args.peak_bw / 1e12:.3f} TB/s, {args.peak_flops / 1e12:.0f} TFLOP/s)", flush=True)
    ok = True
    for kind, batch, kv_heads, dtype_name in kernel_cases(args):
        ok &= check_case(kind, batch, kv_heads, dtype_name, args, interpret)
    return ok
