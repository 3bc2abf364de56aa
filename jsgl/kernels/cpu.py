"""x86 CPU kernels (``cpu_matmul.cc``, ``cpu_attention.cc``) as JAX ops through XLA's FFI, for AVX-512 or AVX2.

* :func:`packed_matmul`: ``x @ W`` with ``W`` packed once into panels of 48 output columns, in float32
  (:class:`PackedWeight`) or in the GGUF file's own Q4_1/Q8_0 blocks (:class:`QuantWeight`, dequantized
  exactly in registers from the file's 5-8.5 bits per weight; from 5 rows on the float32 kernel's sums bit for
  bit, at 1-4 rows with the block scales folded out of the inner sum). XLA's CPU dot repacks
  its weight operand on every call, which at the 1-16 rows of a decode step costs about as much as the
  multiply (a chain of [16, 576] x [576, 1536] products: XLA ~185 GFLOP/s, packed float32 ~330).
* :func:`cpu_paged_attention`: the ``"cpu"`` attention backend, for every step: each request's K/V rows are read
  in place from the pool instead of gathered into a padded copy (decode and short extends one token at a time;
  prefill chunks as flash attention over blocks of 16 tokens and 16 keys), so its cost follows the batch's real
  lengths, not its padded [requests, new tokens, attended length] shape. A layer with a sliding window (the
  kernel does not mask one) uses the native path.
  Its fused form :func:`cpu_rope_write_attention` also applies RoPE and writes the new K/V (the model's path).

The sources are compiled on first use with the machine's C++ compiler (``-march=native``; ``CXX`` overrides ``g++``)
into the jsgl cache, keyed by source, flags, jax version and CPU, sealed with an HMAC (a library there without a
valid one is removed, never loaded; jsgl/cache_security.py); a read-only cache builds them aside. They are written
against 16-float vectors (``cpu_simd.h``): one AVX-512 register, or two AVX2 registers on CPUs without AVX-512 (AMD
before Zen 4, Intel client cores since Alder Lake), with tile shapes chosen per ISA (:func:`vector_isa` says which
was built). Without a compiler or at least AVX2 + FMA + F16C, :func:`available` is False and the engine keeps XLA's
dot and the native attention (on a 2-core AVX2 machine ~12x slower at batch-1 decode).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jsgl.cache_security import load_library, seal, unseal
from jsgl.errors import ConfigError, RefusedError
from jsgl.kernels.attention import (
    AttentionBackend,
    AttentionMetadata,
    native_paged_attention,
    register_attention_backend,
)
from jsgl.kernels.quant import QuantBlocks
from jsgl.paths import cache_subdir

log = logging.getLogger("jsgl.kernels.cpu")

PANEL = 48  # output columns per packed panel (kPanel in the C++ source)
_SOURCES = [Path(__file__).with_name(name)
            for name in ("cpu_matmul.cc", "cpu_attention.cc", "cpu_parallel.h", "cpu_math.h", "cpu_amx.h",
                         "cpu_simd.h")]
_TARGETS = ("jsgl_packed_matmul", "jsgl_q4_1_matmul", "jsgl_q8_0_matmul", "jsgl_paged_attention",
            "jsgl_rope_write_attention")
MATMUL_BACKENDS = ("xla", "packed", "gguf")
_lock = threading.Lock()
_status: dict[str, object] = {}


def cpu_signature() -> str:
    """The host CPU (model name and flags): what code built for this CPU depends on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def hardware_supported() -> bool:
    """Whether this CPU has what the kernels need (AVX-512F, or AVX2 + FMA + F16C), from /proc/cpuinfo's flags;
    for tests that must fail, not skip, where the kernels should build."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = set(" ".join(ln for ln in cpu_signature().splitlines() if ln.startswith("flags")).split())
    return "avx512f" in flags or {"avx2", "fma", "f16c"} <= flags


def _build_command() -> tuple[list[str], str]:
    """The compiler's command (less sources and output) and the library's cache key."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    command = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
               f"-I{jax.ffi.include_dir()}"]
    key = hashlib.sha256(b"\0".join([*(src.read_bytes() for src in _SOURCES), " ".join(command).encode(),
                                     cpu_signature().encode(), jax.__version__.encode()])).hexdigest()[:16]
    return command, key


def _kernels_dir() -> Path | None:
    """``cache_dir()/kernels`` (0700, ours), or None where the cache cannot hold it (read-only)."""
    try:
        return cache_subdir("kernels")
    except OSError as exc:
        log.warning("jsgl CPU kernels: the cache is not writable (%s); building them in a temporary directory", exc)
        return None


def _scratch(parent: Path | None) -> tempfile.TemporaryDirectory:
    """A private (0700) directory to build in: under the cache, else (read-only, full) the system's."""
    try:
        return tempfile.TemporaryDirectory(prefix="build-", dir=parent)
    except OSError as exc:
        log.warning("jsgl CPU kernels: building in a temporary directory (%s)", exc)
        return tempfile.TemporaryDirectory(prefix="jsgl-kernels-")


def _build(command: list[str], scratch_parent: Path | None) -> bytes:
    """The compiled library's bytes, built in a private scratch directory (processes may race)."""
    with _scratch(scratch_parent) as tmp:
        built = Path(tmp) / "jsgl_cpu.so"
        sources = [str(src) for src in _SOURCES if src.suffix == ".cc"]
        proc = subprocess.run([*command, *sources, "-o", str(built)], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"compiling the jsgl CPU kernels failed:\n{proc.stderr[-3000:]}")
        return built.read_bytes()


def _store(out: Path, library: bytes) -> None:
    try:
        seal(out, library)
    except OSError as exc:  # a full or read-only cache: built again next start
        log.warning("jsgl CPU kernels: not stored in %s (%s)", out.parent, exc)
        return
    for stale in out.parent.glob("jsgl_cpu_*.so"):  # builds of older sources (a loaded one stays mapped)
        if stale != out:
            with contextlib.suppress(OSError):
                stale.unlink()


def _load_library() -> ctypes.CDLL:
    """The kernels' library: the cached build if its HMAC is valid (jsgl/cache_security.py; any other file there is
    removed, never loaded), else compiled now and cached sealed."""
    command, key = _build_command()
    directory = _kernels_dir()
    if directory is not None:
        library = unseal(directory / f"jsgl_cpu_{key}.so", "jsgl CPU kernels: cached library")
        if library is not None:
            return load_library(library, directory)
    library = _build(command, directory)
    if directory is not None:
        _store(directory / f"jsgl_cpu_{key}.so", library)
    return load_library(library, directory)


def available() -> bool:
    """Whether the kernels are built and registered with XLA (compiles them on the first call)."""
    with _lock:
        if "ok" not in _status:
            try:
                lib = _load_library()
                for name in _TARGETS:
                    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
                _status.update(ok=True, lib=lib)
            except RefusedError:  # a cache another user could write into: refused, not worked around
                raise
            except Exception as exc:  # no compiler, no AVX2, ...: fall back, but say why
                log.warning("jsgl CPU kernels unavailable, using XLA's dot and native attention: %s", exc)
                _status.update(ok=False, error=str(exc))
        return bool(_status["ok"])


def unavailable_reason() -> str | None:
    return None if available() else str(_status.get("error"))


def vector_isa() -> str | None:
    """``"avx512"`` or ``"avx2"``: the vector width the kernels were built for here (None without them)."""
    if not available():
        return None
    return "avx512" if _status["lib"].jsgl_avx512() else "avx2"


def amx_enabled() -> bool:
    """Whether the matmuls of more than 16 rows (prefill) run on AMX tiles here: three bfloat16 products of split
    float32 values, ~2x the AVX-512 kernels' rate at ~5x float32's rounding error (``cpu_amx.h``). False without
    the kernels, without AMX or the OS's leave to use it, or with ``JSGL_NO_AMX=1``."""
    return available() and bool(_status["lib"].jsgl_amx_enabled())


def _require() -> None:
    """Builds and registers the kernels before a call site traces one (or says why it cannot)."""
    if not available():
        raise RuntimeError(f"the jsgl CPU kernels are unavailable: {unavailable_reason()}")


def resolve_matmul_backend(name: str, tp: int = 1, platform: str | None = None) -> str:
    """``xla``: XLA's dot. ``packed``: the kernel over float32 panels. ``gguf``: the kernel over the GGUF
    file's own Q4_1/Q8_0 blocks where it has them (else float32 panels). ``auto``: ``gguf`` on a CPU that
    builds the kernels, without tensor parallelism; else ``xla``. ``platform``: JAX's backend name to resolve
    for (default: this process's)."""
    if name == "auto":
        on_cpu = (platform or jax.default_backend()) == "cpu"
        return "gguf" if tp == 1 and on_cpu and available() else "xla"
    if name not in MATMUL_BACKENDS:
        raise ConfigError(f"unknown matmul backend {name!r}; known: auto, {', '.join(MATMUL_BACKENDS)}")
    if name != "xla" and tp > 1:
        raise ConfigError(f"matmul_backend={name!r} does not shard: use 'xla' (or 'auto') with tp > 1")
    if name != "xla" and not available():
        raise ConfigError(f"matmul_backend={name!r} needs the CPU kernels: {unavailable_reason()}")
    return name


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """``[K, N]`` weights side by side (``splits`` = their N), as panels ``[ceil(N / 48), K, 48]`` of 48 output
    columns, the last zero-padded."""

    panels: jax.Array
    splits: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def out_features(self) -> int:
        return sum(self.splits)


def pack_weight(weights: list[jax.Array]) -> PackedWeight:
    """Packs ``[K, N_i]`` weights that multiply the same input into one PackedWeight."""
    w = jnp.concatenate([jnp.asarray(w, jnp.float32) for w in weights], axis=1)
    k, n = w.shape
    num_panels = -(-n // PANEL)
    w = jnp.pad(w, ((0, 0), (0, num_panels * PANEL - n)))
    return PackedWeight(w.reshape(k, num_panels, PANEL).transpose(1, 0, 2), tuple(x.shape[1] for x in weights))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """Like :class:`PackedWeight`, in the GGUF file's blocks of 32 along K (kind ``q4_1`` or ``q8_0``), at the
    file's size: ``blocks [P, K/32, B]`` uint8, each block of a panel the float16 scales ``[S, 48]`` (d, and m
    for Q4_1) then the codes ``[16, 48]`` (Q4_1: rows 2t, 2t+1 of the block in the low, high nibble of byte
    row t) or ``[32, 48]`` (Q8_0, int8 bits): B = 960 or 1632."""

    blocks: jax.Array
    kind: str = dataclasses.field(metadata=dict(static=True))
    splits: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def out_features(self) -> int:
        return sum(self.splits)


PACKED_TYPES = (PackedWeight, QuantWeight)


def pack_quant(blocks: list[QuantBlocks]) -> QuantWeight:
    """Packs GGUF matrices of one kind that multiply the same input (see :class:`QuantWeight`)."""
    kind = blocks[0].kind
    if any(b.kind != kind for b in blocks):
        raise ValueError("pack_quant: matrices of one quantization kind only")
    q = np.concatenate([b.q for b in blocks]).view(np.uint8)  # [N, K]
    n, k = q.shape
    num_panels = -(-n // PANEL)
    # [N, ...] -> [P, K/32, rows, 48]: panel, block, row within the block, column
    blocked = lambda a: np.pad(a, ((0, num_panels * PANEL - n), (0, 0))).reshape(
        num_panels, PANEL, k // 32, -1).transpose(0, 2, 3, 1)
    codes = blocked(q)
    if kind == "q4_1":
        codes = codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)
    scales = [np.concatenate([b.d for b in blocks])]
    if kind == "q4_1":
        scales.append(np.concatenate([b.m for b in blocks]))
    # Back to float16, exactly: the file's scales are float16.
    scales = [np.ascontiguousarray(blocked(s.astype(np.float16))).view(np.uint8) for s in scales]
    packed = np.concatenate([a.reshape(num_panels, k // 32, -1) for a in [*scales, codes]], axis=-1)
    return QuantWeight(jnp.asarray(packed), kind, tuple(b.q.shape[0] for b in blocks))


def packed_matmul(x: jax.Array, w: PackedWeight | QuantWeight, *, norm: jax.Array | None = None, eps: float = 0.0,
                  swiglu: bool = False, residual: jax.Array | None = None) -> jax.Array:
    """``x [..., K] @ W [K, N]`` in float32 by the packed-panel kernels, with the layer's elementwise work
    around it fused in (each XLA op between two kernels cost ~10 us):

    ``norm`` (weight [K]): multiply ``rms_norm(x, eps) * norm``; ``swiglu``: x is [..., 2K] (gate | up),
    multiply ``silu(gate) * up``; ``residual`` [..., N]: return ``residual + x @ W``.
    """
    _require()
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    n = w.out_features
    out = jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32)
    fused = (jnp.zeros((0,), jnp.float32) if norm is None else norm.astype(jnp.float32),
             jnp.zeros((0, 0), jnp.float32) if residual is None else residual.reshape(-1, n).astype(jnp.float32))
    attrs = {"eps": np.float32(eps), "swiglu": bool(swiglu)}
    if isinstance(w, QuantWeight):
        y = jax.ffi.ffi_call(f"jsgl_{w.kind}_matmul", out)(rows, w.blocks, *fused, **attrs)
    else:
        y = jax.ffi.ffi_call("jsgl_packed_matmul", out)(rows, w.panels, *fused, **attrs)
    return y.reshape(*x.shape[:-1], n)


def attention_supported(q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Shapes the C++ attention kernel handles (head_dim a multiple of 16 up to 256, GQA group <= 16)."""
    return head_dim % 16 == 0 and head_dim <= 256 and q_heads % kv_heads == 0 and q_heads // kv_heads <= 16


def _kernel_serves(q: jax.Array, k_pool: jax.Array, meta: AttentionMetadata) -> bool:
    # The C++ kernels have no sliding window and read float32 pools only: windowed layers and other KV formats
    # (bfloat16, the 8-bit Int8Pool) take the native path.
    return (meta.sliding_window is None and k_pool.dtype == jnp.float32
            and attention_supported(q.shape[1], k_pool.shape[0], q.shape[2]))


def _metadata_args(meta: AttentionMetadata) -> tuple[jax.Array, ...]:
    return meta.positions, meta.slot_table(), meta.kv_lens, meta.q_start, meta.q_len


def cpu_paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, meta: AttentionMetadata,
                        scale: float) -> jax.Array:
    """Same contract as :func:`native_paged_attention`; decode and short extends run in the C++ kernel."""
    if not _kernel_serves(q, k_pool, meta):
        return native_paged_attention(q, k_pool, v_pool, meta, scale)
    _require()
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call("jsgl_paged_attention", out)(
        q.astype(jnp.float32), k_pool, v_pool, *_metadata_args(meta), scale=np.float32(scale))


def cpu_rope_write_attention(qkv: jax.Array, k_pool: jax.Array, v_pool: jax.Array, write_slots: jax.Array,
                             cos: jax.Array, signed_sin: jax.Array, meta: AttentionMetadata,
                             scale: float) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """RoPE on the new tokens' q and k, taken with v straight from the q|k|v matmul's output
    ``qkv [T, (Hq + 2 Hkv) D]``; their k and v written into the pools at ``write_slots``; and attention: one
    call that updates the (donated) pools in place. ``cos``, ``signed_sin`` [T, 1, D] as from
    ``jsgl.model.llama.rope_tables``. Returns (out [T, Hq, D], k_pool, v_pool), or None where the kernel does
    not serve (prefill): the model then does the three steps itself."""
    kv_heads, _, head_dim = k_pool.shape
    t, q_heads = qkv.shape[0], qkv.shape[1] // head_dim - 2 * kv_heads
    q_shape = jax.ShapeDtypeStruct((t, q_heads, head_dim), jnp.float32)
    if not _kernel_serves(q_shape, k_pool, meta):
        return None
    _require()
    outs = (q_shape, jax.ShapeDtypeStruct(k_pool.shape, jnp.float32), jax.ShapeDtypeStruct(v_pool.shape, jnp.float32))
    call = jax.ffi.ffi_call("jsgl_rope_write_attention", outs, input_output_aliases={4: 1, 5: 2})
    tables = [jnp.broadcast_to(x, (t, 1, head_dim)).reshape(t, head_dim) for x in (cos, signed_sin)]
    return call(qkv.astype(jnp.float32), *tables, write_slots.astype(jnp.int32), k_pool, v_pool,
                *_metadata_args(meta), scale=np.float32(scale))


register_attention_backend(AttentionBackend("cpu", cpu_paged_attention, rope_write_attend=cpu_rope_write_attention))
