"""Check the paged-attention kernels against the reference on an accelerator, and time them.

    jsgl bench device                                     # Llama-7B-like shapes on a GPU; on a TPU, its part
    python experiments/bench_device.py --kv-heads 8 --dtypes bfloat16 --iters 50
    python experiments/bench_device.py --cpu-smoke          # tiny shapes, Pallas interpret mode, any machine
    python experiments/bench_device.py --cpu-smoke --platform tpu   # the TPU part, interpreted, any machine

``--platform`` (default: the TPU part where JAX's backend is a TPU, else the GPU part) picks the kernels. On a
TPU, ``bench_device_tpu.py`` checks and times jsgl's Mosaic kernel, the pure-JAX path and jax's own ragged paged
attention (read its docstring); the engine and step parts (the last paragraph) run there too, through the "tpu"
backend. What follows is the GPU part.

For every (kv heads, dtype) it builds a pool with shuffled (non-contiguous) slots and runs

* decode: ``--batch`` requests, one new token each, ``--context`` cached tokens;
* extend: ``--extend-batch`` requests with ``--extend-new`` new tokens after a cached prefix, total
  ``--context`` tokens each;

in each ``--dtypes``: float32, bfloat16, and int8 (the 8-bit KV format under bfloat16 queries);

through ``pallas_paged_attention`` and ``native_paged_attention`` (both jitted), prints the max abs error
of each against a float32 reference on the same (upcast) inputs, the median time over ``--iters`` runs
after ``--warmup`` runs (``block_until_ready``), and for decode the K/V bytes read divided by the time as
a fraction of ``--peak-bw`` (default 4.8e12 B/s, H200 HBM3e). For extend it also prints TFLOP/s. The exit
status is 1 when any error is over tolerance. Then the engine end to end on tiny checkpoints of each family
against transformers (``bench_device_engine.py``), and whole engine steps of a Llama-3-8B-shaped model (decode at
``--decode-batches``, a prefill, compile seconds; ``bench_device_steps.py``) against the HBM and FLOP peaks.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jsgl.engine.platform import INSTALL_HINT
from jsgl.kernels import kv_quant
from jsgl.kernels.attention import AttentionMetadata, native_paged_attention
from jsgl.kernels.pallas_attention import default_num_splits, pallas_paged_attention

# int8: the 8-bit KV format (int8 rows + a float32 scale per token and head) under bfloat16 queries, checked
# against float32 attention over the dequantized pool (what the format stores).
TOLERANCE = {"float32": 2e-3, "bfloat16": 3e-2, "int8": 3e-2}


# What the GPU and TPU parts default to where they differ (a flag given wins): the GPU part checks both GQA shapes in
# float32 too, with a small split-K decode batch and token-granular pages; the TPU part Llama-3-8B's attention
# (8 KV heads) in its serving dtypes, at batch 1 beside the large one, over pages of 16 (the engine's there).
PLATFORM_DEFAULTS = {
    "gpu": dict(kv_heads=[32, 8], dtypes=["bfloat16", "float32", "int8"], splitk_batch=4, page_size=1,
                peak_bw=4.8e12, peak_flops=989e12),  # H200: HBM3e, dense bfloat16
    "tpu": dict(kv_heads=[8], dtypes=["bfloat16", "int8"], splitk_batch=1, page_size=16),  # peaks: by chip
}


def kernel_cases(args: argparse.Namespace) -> list[tuple[str, int, int, str]]:
    """(kind, batch, KV heads, dtype) of every kernel check: decode at --batch (and --splitk-batch), an extend."""
    runs = [("decode", args.batch)] + ([("decode", args.splitk_batch)] if args.splitk_batch else [])
    runs += [] if args.skip_extend else [("extend", args.extend_batch)]
    return [(kind, batch, kv_heads, dtype_name) for kv_heads in args.kv_heads for dtype_name in args.dtypes
            for kind, batch in runs]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", choices=["auto", "gpu", "tpu"], default="auto",
                   help="whose kernels: auto is the TPU part on a TPU, else the GPU part (with --cpu-smoke either "
                        "runs interpreted here)")
    p.add_argument("--batch", type=int, default=64, help="decode batch")
    p.add_argument("--context", type=int, default=4096, help="tokens per request after this step")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, nargs="+", default=None, help="default: GPU 32 8, TPU 8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtypes", nargs="+", default=None, choices=list(TOLERANCE),
                   help="int8: the 8-bit KV pools (jsgl.kernels.kv_quant) with bfloat16 queries (default: GPU "
                        "bfloat16 float32 int8, TPU bfloat16 int8)")
    p.add_argument("--splitk-batch", type=int, default=None,
                   help="a small decode batch (on a GPU it exercises split-K; default GPU 4, TPU 1); 0: skip")
    p.add_argument("--extend-batch", type=int, default=8)
    p.add_argument("--extend-new", type=int, default=512, help="new tokens per extend request")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-bw", type=float, default=None,
                   help="peak HBM bandwidth, B/s (default: GPU 4.8e12, an H200; TPU by its generation)")
    p.add_argument("--decode-block-k", type=int, default=64)
    p.add_argument("--num-splits", type=int, default=None, help="decode split-K (default: heuristic)")
    p.add_argument("--extend-block-q", type=int, default=None,
                   help="tokens per extend program, all query heads of a KV head (default: 64 query rows)")
    p.add_argument("--extend-block-k", type=int, default=64)
    p.add_argument("--tpu-block-q", type=int, default=None, help="TPU kernel: tokens per program (default: by chip)")
    p.add_argument("--tpu-pages-per-block", type=int, default=None,
                   help="TPU kernel: pages per KV block (default: by chip)")
    p.add_argument("--skip-kernels", action="store_true", help="skip the kernel checks (the engine parts only)")
    p.add_argument("--skip-extend", action="store_true")
    p.add_argument("--skip-native-timing", action="store_true", help="don't time the reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=None,
                   help="KV pages of this many slots: the kernels read page tables (default: GPU 1, TPU 16)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in Pallas interpret mode (any backend)")
    steps = p.add_argument_group("whole engine steps on a Llama-3-8B-shaped model (bench_device_steps.py)")
    steps.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64])
    steps.add_argument("--prefill-tokens", type=int, default=512)
    steps.add_argument("--step-kv-dtypes", nargs="+", default=["bfloat16", "int8"], choices=["bfloat16", "int8"])
    steps.add_argument("--step-layers", nargs="+", default=["scanned", "unrolled"], choices=["scanned", "unrolled"],
                       help="the layers as one lax.scan (the GPU default) and/or unrolled, side by side (the first "
                            "KV dtype only; the others run the first of these)")
    steps.add_argument("--step-num-layers", type=int, default=None,
                       help="layers of the model (default: its 32, or as many as fit the device's memory)")
    steps.add_argument("--peak-flops", type=float, default=None,
                       help="dense bfloat16 peak, FLOP/s (default: GPU 989e12, an H200; TPU by its generation)")
    steps.add_argument("--skip-steps", action="store_true")
    p.add_argument("--skip-engine", action="store_true",
                   help="skip the engine end to end on tiny checkpoints vs transformers (bench_device_engine.py)")
    args = p.parse_args(argv)
    if args.platform == "auto":
        args.platform = "tpu" if jax.default_backend() == "tpu" else "gpu"
    defaults = dict(PLATFORM_DEFAULTS[args.platform])
    if args.platform == "tpu":
        from jsgl.experiments.bench_device_tpu import tpu_peaks

        bandwidth, flops, args.peak_source = tpu_peaks(jax.devices()[0].device_kind)
        defaults.update(peak_bw=bandwidth, peak_flops=flops)
    else:
        args.peak_source = "an H200's"
    given = [flag for flag, name in (("--peak-bw", "peak_bw"), ("--peak-flops", "peak_flops"))
             if getattr(args, name) is not None]
    if given:
        args.peak_source += f"; {' and '.join(given)} as given"
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.cpu_smoke:
        args.batch, args.context, args.q_heads, args.kv_heads, args.head_dim = 3, 40, 4, [2], 16
        args.splitk_batch, args.extend_batch, args.extend_new, args.iters, args.warmup = 1, 2, 9, 2, 1
        args.decode_block_k, args.extend_block_q, args.extend_block_k, args.num_splits = 8, 4, 8, 2
        args.decode_batches, args.prefill_tokens = [1, 2], 16
        if args.platform == "tpu":  # several pages per KV block and several KV blocks per request, straddled q blocks
            args.page_size, args.tpu_block_q, args.tpu_pages_per_block = 4, 4, 2
    return args


def make_batch(key, *, batch, context, new, q_heads, kv_heads, head_dim, dtype, page_size=1):
    """Pool with ``batch * context`` used slots in shuffled order (+ the dummy slot 0), and metadata; with
    ``page_size > 1``, shuffled pages of that many slots (+ page 0, the dummy's) and a page table."""
    pages_each = -(-context // page_size)
    num_slots = (batch * pages_each + 1) * page_size
    kq, kk, kv, kp = jax.random.split(key, 4)
    pages = 1 + jax.random.permutation(kp, batch * pages_each).astype(jnp.int32)
    block_table = pages.reshape(batch, pages_each)
    k_pool = jax.random.normal(kk, (kv_heads, num_slots, head_dim), jnp.float32).astype(dtype)
    v_pool = jax.random.normal(kv, (kv_heads, num_slots, head_dim), jnp.float32).astype(dtype)
    tokens = batch * new
    q = jax.random.normal(kq, (tokens, q_heads, head_dim), jnp.float32).astype(dtype)
    kv_lens = jnp.full((batch,), context, jnp.int32)
    positions = (context - new + jnp.arange(tokens, dtype=jnp.int32) % new).astype(jnp.int32)
    meta = AttentionMetadata(
        positions=positions,
        q_start=jnp.arange(batch, dtype=jnp.int32) * new,
        q_len=jnp.full((batch,), new, jnp.int32),
        block_table=block_table,
        kv_lens=kv_lens,
        max_q_len=new,
        page_size=page_size,
    )
    return q, k_pool, v_pool, meta


def median_time(fn, args, iters, warmup):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check(kind, batch, args, kv_heads, dtype_name, interpret):
    quantized = dtype_name == "int8"
    dtype = jnp.dtype("bfloat16" if quantized else dtype_name)  # the queries' (and a plain pool's) dtype
    decode = kind == "decode"
    new = 1 if decode else args.extend_new
    key = jax.random.key(args.seed)
    q, k_pool, v_pool, meta = make_batch(
        key,
        batch=batch,
        context=args.context,
        new=new,
        q_heads=args.q_heads,
        kv_heads=kv_heads,
        head_dim=args.head_dim,
        dtype=jnp.float32 if quantized else dtype,
        page_size=args.page_size,
    )
    if quantized:
        q = q.astype(dtype)
        k_pool, v_pool = (kv_quant.Int8Pool(*kv_quant.quantize(x)) for x in (k_pool, v_pool))
    scale = args.head_dim**-0.5
    kernel = jax.jit(
        functools.partial(
            pallas_paged_attention,
            scale=scale,
            decode_block_k=args.decode_block_k,
            num_splits=args.num_splits,
            extend_block_q=args.extend_block_q,
            extend_block_k=args.extend_block_k,
            interpret=interpret,
        )
    )
    native = jax.jit(native_paged_attention, static_argnums=4)

    out = jax.block_until_ready(kernel(q, k_pool, v_pool, meta))
    as_f32 = lambda x: kv_quant.dequantize(x.values, x.scales) if quantized else x.astype(jnp.float32)  # noqa: E731
    exact = native(q.astype(jnp.float32), as_f32(k_pool), as_f32(v_pool), meta, scale)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - exact)))
    ref_err = "n/a"  # float32: the reference *is* the exact computation
    if dtype_name != "float32":
        native_out = native(q, k_pool, v_pool, meta, scale).astype(jnp.float32)
        ref_err = f"{float(jnp.max(jnp.abs(native_out - exact))):.2e}"
        del native_out
    del exact
    ok = err <= TOLERANCE[dtype_name] and bool(jnp.all(jnp.isfinite(out)))

    t_kernel = median_time(kernel, (q, k_pool, v_pool, meta), args.iters, args.warmup)
    t_native = float("nan")
    if not args.skip_native_timing:
        t_native = median_time(lambda *a: native(*a, scale), (q, k_pool, v_pool, meta), args.iters, args.warmup)

    # K and V, once each (the 8-bit format: its int8 rows and their scales)
    kv_bytes = 2 * batch * args.context * kv_heads * kv_quant.bytes_per_head_token(
        jnp.int8 if quantized else dtype, args.head_dim)
    if decode:
        splits = args.num_splits or default_num_splits(batch, kv_heads, args.context, args.decode_block_k)
        extra = f"splits={splits}  K/V {kv_bytes / 1e9:.2f} GB -> {kv_bytes / t_kernel / 1e9:.0f} GB/s = "
        extra += f"{kv_bytes / t_kernel / args.peak_bw:.1%} of peak {args.peak_bw / 1e12:.2f} TB/s"
    else:
        # Visible keys per query: the prefix plus the causal part of the new tokens.
        prefix = args.context - new
        pairs = batch * (new * prefix + new * (new + 1) // 2)
        flops = 4 * pairs * args.q_heads * args.head_dim
        extra = f"{flops / t_kernel / 1e12:.1f} TFLOP/s; K/V read once would be "
        extra += f"{kv_bytes / t_kernel / args.peak_bw:.1%} of peak bandwidth"
    print(
        f"{kind:6s} {dtype_name:8s} Hq={args.q_heads} Hkv={kv_heads} D={args.head_dim} B={batch} "
        f"ctx={args.context} new={new}: max|err| pallas={err:.2e} native={ref_err} "
        f"[{'ok' if ok else 'FAIL'}]  pallas {t_kernel * 1e3:.3f} ms  native {t_native * 1e3:.3f} ms  {extra}",
        flush=True,
    )
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = jax.default_backend()
    on_tpu = args.platform == "tpu"
    if args.cpu_smoke:
        interpret = True
    elif backend != args.platform:
        compiled = "Mosaic kernels need a TPU" if on_tpu else "compiled (Triton) kernels need a CUDA GPU"
        print(
            f"bench device: the default JAX backend is {backend!r} ({jax.devices()[0].device_kind}), not a "
            f"{args.platform.upper()}; the {compiled} ({INSTALL_HINT[args.platform]}). Run with --cpu-smoke for a "
            "tiny interpret-mode check.",
            file=sys.stderr,
        )
        return 2
    else:
        interpret = False
    device = jax.devices()[0]
    memory = (device.memory_stats() or {}) if hasattr(device, "memory_stats") else {}
    limit = f", allocator limit {memory['bytes_limit'] / 2**30:.1f} GiB" if "bytes_limit" in memory else ""
    print(f"jax {jax.__version__} on {len(jax.devices())} x {device.device_kind}{limit} (interpret={interpret}); "
          f"{args.platform} part, peaks {args.peak_bw / 1e12:.2f} TB/s and {args.peak_flops / 1e12:.0f} TFLOP/s "
          f"({args.peak_source})", flush=True)
    ok = True
    if on_tpu and not args.skip_kernels:
        from jsgl.experiments.bench_device_tpu import run_kernel_checks

        ok &= run_kernel_checks(args, interpret)
    elif not args.skip_kernels:
        for kind, batch, kv_heads, dtype_name in kernel_cases(args):
            ok &= check(kind, batch, args, kv_heads, dtype_name, interpret)
    attention = "tpu" if on_tpu else "pallas"
    if not args.skip_engine:
        from jsgl.experiments.bench_device_engine import engine_defaults_report, run_engine_checks

        print("\nan engine left at its defaults here:", engine_defaults_report(), sep="\n", flush=True)
        if on_tpu and interpret:
            print("\nthe engine through the 'tpu' backend vs transformers: skipped off a TPU (an engine refuses the "
                  "Mosaic kernel on another platform; tests/test_tpu_attention.py serves a model through the "
                  "interpreted kernel)", flush=True)
        else:
            print(f"\nthe engine end to end ({attention} attention) on tiny random checkpoints vs transformers "
                  "(float32, CPU):", flush=True)
            if args.cpu_smoke:
                options = dict(page_sizes=(16,), dtypes=("float32",), family_names=("qwen3",))
            else:  # the TPU kernel reads whole pages by DMA: the engine's page of 16 there, not single slots too
                options = dict(page_sizes=(16,)) if on_tpu else {}
            for result in run_engine_checks(attention=attention, **options):
                print(result.row(), flush=True)
                ok &= result.ok
    if not args.skip_steps:
        from jsgl.experiments.bench_device_steps import mixed_summary, run_steps, slots_needed, step_config

        page = args.page_size if on_tpu else 1  # the GPU's steps keep single-slot pages (docs/gpu.md's figures)
        slots = slots_needed(args.context, args.prefill_tokens, args.decode_batches, page)
        config, shrunk = step_config(smoke=args.cpu_smoke, num_layers=args.step_num_layers, num_slots=slots,
                                     kv_dtypes=args.step_kv_dtypes)
        model = "tiny" if args.cpu_smoke else "Llama-3-8B-shaped"
        if shrunk:
            model += f" ({config.num_layers} of 32 layers: {shrunk})"
        for kv_dtype in args.step_kv_dtypes:
            for layers in args.step_layers if kv_dtype == args.step_kv_dtypes[0] else args.step_layers[:1]:
                print(f"\nengine steps, {model} model, bfloat16 weights, KV {kv_dtype}, layers {layers}, "
                      f"{attention} attention, pages of {page}: peak {args.peak_bw / 1e12:.2f} TB/s, "
                      f"{args.peak_flops / 1e12:.0f} TFLOP/s", flush=True)
                results = run_steps(config=config, context=args.context, prefill_tokens=args.prefill_tokens,
                                    decode_batches=args.decode_batches, kv_dtype=kv_dtype, iters=args.iters,
                                    attention=attention, layers=layers, page_size=page,
                                    platform="tpu" if on_tpu else None)
                for result in results:
                    print(result.row(args.peak_bw, args.peak_flops), flush=True)
                print(mixed_summary(results), flush=True)
    print("all ok" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
