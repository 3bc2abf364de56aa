"""Tensor parallelism through ``jax.sharding``: a 1-D ``tp`` mesh, padded head layout, param/pool shardings.

The model code (:mod:`jsgl.model.llama`) stays single-device: the params and the KV pool carry
``NamedSharding``s, the jitted step is partitioned by XLA's SPMD partitioner (which inserts the
all-reduces after the row-parallel matmuls and whatever the vocab-parallel embedding/logits need),
and only attention runs per shard, through ``jax.shard_map``, so a Pallas kernel sees local heads.

Megatron-style scheme over ``tp`` devices:

* column-parallel ``wq, wk, wv, w_gate, w_up`` (+ biases): output dim sharded, so every shard computes
  its own heads / MLP columns from the replicated residual stream;
* row-parallel ``wo, w_down``: input dim sharded; the partial sums are all-reduced by XLA;
* vocab-parallel ``embed [V, D]`` (tied: it is also the lm head) and ``lm_head [D, V]``; norms replicated;
* KV pools (per layer ``[Hkv, N, hd]``) sharded over their KV-head axis: a shard stores only its heads' K/V.

**Head layout.** Attention needs every shard to hold whole GQA groups (a KV head together with the
query heads reading it) and the same number of heads. When ``tp`` does not divide the heads (SmolLM2:
9 query, 3 KV heads, group 3), :func:`head_layout` pads:

* ``tp <= Hkv``: each shard gets ``ceil(Hkv / tp)`` KV heads; missing ones are *zero heads* (zero
  ``wk``/``wv`` columns, so their pool slice stays zero) whose query heads are zero heads too.
  SmolLM2 tp=2: KV ``[0 1 | 2 pad]``, Q ``[0..5 | 6..8 pad pad pad]``.
* ``tp > Hkv``: each shard gets one KV head, *replicated*: shard ``s`` holds KV head ``s * Hkv // tp``;
  a head held by ``r`` shards splits its query group into ``r`` chunks, and every shard pads its
  chunk with zero query heads up to the largest chunk. SmolLM2 tp=4: KV ``[0 | 0 | 1 | 2]``,
  Q ``[0 1 pad | 2 pad pad | 3 4 5 | 6 7 8]``.

A zero query head has ``q = 0`` (uniform attention over finite V) and its ``wo`` rows are zero, so it
adds exactly 0 to the output: the padded model computes the same function. The MLP's intermediate
dim is zero-padded to a multiple of ``tp`` the same way (``silu(0) * 0 = 0``). The vocab is never padded
(padded logits would be sampled): when ``tp`` does not divide it, the embedding is sharded on ``D``
instead (local gather, all-reduced logits), or replicated.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jsgl.errors import ConfigError
from jsgl.kernels.attention import AttentionBackend, AttentionFn, AttentionMetadata
from jsgl.model.config import ModelConfig
from jsgl.model.placement import to_sharded

Params = dict[str, Any]
AXIS = "tp"

_COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")  # [in, out]: shard out
_ROW = ("wo", "w_down")  # [in, out]: shard in
_BIAS = ("bq", "bk", "bv")  # [out]: shard out, like their matrices


def make_mesh(tp: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh named ``tp`` over the first ``tp`` local devices, or in a multi-process engine over every
    process's devices (``jax.devices()``: it must use them all, each process holding its shards).

    Axis type Auto, on purpose: jax 0.10.2's ``jax.make_mesh`` defaults to Explicit axes, under which
    shardings become part of array types and every op whose result sharding is ambiguous (the
    row-parallel matmuls contract a sharded dim; the embedding gathers from a vocab-sharded table)
    needs an ``out_sharding`` annotation, i.e. the model would have to become mesh-aware. With Auto,
    the unannotated single-device model is partitioned by XLA from the argument shardings alone.
    """
    multiprocess = jax.process_count() > 1
    devices = list(devices if devices is not None else jax.devices() if multiprocess else jax.local_devices())
    if tp < 1:
        raise ConfigError(f"tp must be >= 1, not {tp}")
    if multiprocess and tp != len(devices):
        raise ConfigError(f"tp={tp}: an engine over {jax.process_count()} processes spans all their devices, "
                          f"{len(devices)} (tp = devices per node x nnodes)")
    if tp > len(devices):
        raise ConfigError(
            f"tp={tp} needs {tp} local devices but only {len(devices)} {devices[0].platform} device(s) exist; "
            "on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts")
    return Mesh(np.array(devices[:tp]), (AXIS,), axis_types=(AxisType.Auto,))


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Which original head each padded head is (-1: a zero head). Shard ``s`` owns the ``s``-th
    contiguous ``1/tp`` of both tuples; padded query head ``i`` reads padded KV head ``i // group``."""

    tp: int
    q_heads: tuple[int, ...]
    kv_heads: tuple[int, ...]

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def is_identity(self) -> bool:
        return self.q_heads == tuple(range(self.num_heads)) and self.kv_heads == tuple(range(self.num_kv_heads))


def head_layout(num_heads: int, num_kv_heads: int, tp: int) -> HeadLayout:
    """Padded/replicated head assignment giving every shard the same number of whole GQA groups."""
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        per_shard = -(-num_kv_heads // tp)
        kv = [h if h < num_kv_heads else -1 for h in range(tp * per_shard)]
        q = [h * group + g if h >= 0 else -1 for h in kv for g in range(group)]
        return HeadLayout(tp, tuple(q), tuple(kv))
    # More shards than KV heads: replicate. s * Hkv // tp hits every head, each 1 or ceil(tp/Hkv) times.
    kv = [s * num_kv_heads // tp for s in range(tp)]
    replicas = Counter(kv)
    local = max(-(-group // r) for r in replicas.values())
    q: list[int] = []
    for s, h in enumerate(kv):
        chunk = -(-group // replicas[h])
        r = s - kv.index(h)  # which replica of head h this shard is
        mine = [h * group + g for g in range(r * chunk, min(group, (r + 1) * chunk))]
        q += mine + [-1] * (local - len(mine))
    return HeadLayout(tp, tuple(q), tuple(kv))


def _take_heads(w: np.ndarray, index: tuple[int, ...], axis: int, head_dim: int) -> np.ndarray:
    """Reorder the head blocks of ``w`` along ``axis`` (size H * head_dim); index -1 gives zeros."""
    shape = w.shape
    heads = w.reshape(*shape[:axis], shape[axis] // head_dim, head_dim, *shape[axis + 1:])
    idx = np.asarray(index)
    out = np.take(heads, np.maximum(idx, 0), axis=axis)
    mask_shape = [1] * out.ndim
    mask_shape[axis] = len(idx)
    out = np.where((idx >= 0).reshape(mask_shape), out, np.zeros((), w.dtype))
    return out.reshape(*shape[:axis], len(idx) * head_dim, *shape[axis + 1:])


def _pad_axis(w: np.ndarray, axis: int, size: int) -> np.ndarray:
    pad = [(0, 0)] * w.ndim
    pad[axis] = (0, size - w.shape[axis])
    return np.pad(w, pad) if size != w.shape[axis] else w


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Everything the runner needs for one tp degree: mesh, head layout and the padded model config."""

    mesh: Mesh
    layout: HeadLayout
    config: ModelConfig  # the padded config the forward runs with (vocab unchanged)

    @classmethod
    def create(cls, config: ModelConfig, tp: int, devices: list[jax.Device] | None = None) -> TensorParallel:
        mesh = make_mesh(tp, devices)
        layout = head_layout(config.num_heads, config.num_kv_heads, tp)
        padded = dataclasses.replace(
            config, num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads,
            intermediate_size=-(-config.intermediate_size // tp) * tp)
        return cls(mesh, layout, padded)

    @property
    def tp(self) -> int:
        return self.layout.tp

    # ------------------------------------------------------------------------------------- params
    def pad_tensor(self, name: str, w: np.ndarray) -> np.ndarray:
        """One params leaf in the padded layout, on the host (``name``: its key; a layer's without the
        ``layers.i.`` prefix): heads reordered/zero-padded, the MLP width zero-padded."""
        lay, hd, inter = self.layout, self.config.head_dim, self.config.intermediate_size
        heads = {"wq": (lay.q_heads, 1), "wk": (lay.kv_heads, 1), "wv": (lay.kv_heads, 1), "wo": (lay.q_heads, 0),
                 "bq": (lay.q_heads, 0), "bk": (lay.kv_heads, 0), "bv": (lay.kv_heads, 0)}
        if name in heads and not lay.is_identity:
            return _take_heads(np.asarray(w), *heads[name], hd)
        if name in ("w_gate", "w_up", "w_down"):
            return _pad_axis(np.asarray(w), 0 if name == "w_down" else 1, inter)
        return w

    def spec(self, name: str, shape: tuple[int, ...]) -> P:
        """PartitionSpec of the (padded) leaf ``name`` of this shape."""
        tp = self.tp
        if name == "embed":
            vocab, hidden = shape
            # Vocab-parallel; else split D (a local gather, all-reduced logits); else replicated.
            return P(AXIS, None) if vocab % tp == 0 else P(None, AXIS) if hidden % tp == 0 else P()
        if name == "lm_head":
            return P(None, AXIS) if shape[1] % tp == 0 else P()
        if name in _COLUMN:
            return P(None, AXIS)
        if name in _ROW:
            return P(AXIS, None)
        return P(AXIS) if name in _BIAS else P()  # norms (and o's bias) replicated

    def param_specs(self, params: Params) -> Params:
        """PartitionSpec of every leaf of a (padded) params pytree, per-layer or stacked (``stack_layers``)."""
        layers = params["layers"]
        if isinstance(layers, dict):  # stacked: the layer axis first, unsplit
            layer_specs: Any = {k: P(None, *self.spec(k, v.shape[1:])) for k, v in layers.items()}
        else:
            layer_specs = [{k: self.spec(k, v.shape) for k, v in layer.items()} for layer in layers]
        return {**{k: self.spec(k, v.shape) for k, v in params.items() if k != "layers"}, "layers": layer_specs}

    def place(self, name: str, w: np.ndarray) -> jax.Array:
        """Pad one host leaf (a padded copy where the layout pads it) and give each device its slice of it: no
        device ever holds the whole tensor, and the host one tensor at a time (the loader calls this per tensor)."""
        leaf = name.rsplit(".", 1)[-1]  # "layers.3.wq" -> "wq"
        w = self.pad_tensor(leaf, w)
        return to_sharded(w, self.sharding(leaf, w.shape))

    def sharding(self, name: str, shape: tuple[int, ...]) -> NamedSharding:
        """Where the (padded) leaf ``name`` of this shape lives: what ``place`` gives it, and where a restored
        checkpoint puts it."""
        return NamedSharding(self.mesh, self.spec(name, shape))

    def stack_leaf(self, name: str, leaves: list[jax.Array]) -> jax.Array:
        """One leaf of every layer (placed) stacked over a leading layer axis, each device keeping its slices."""
        spec = P(None, *self.spec(name, leaves[0].shape))
        return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=NamedSharding(self.mesh, spec))(*leaves)

    def shard_params(self, params: Params) -> Params:
        """Pad on the host and place each leaf with its NamedSharding (each device gets only its slice)."""
        return {**{k: self.place(k, v) for k, v in params.items() if k != "layers"},
                "layers": [{k: self.place(k, v) for k, v in layer.items()} for layer in params["layers"]]}

    # ------------------------------------------------------------------------------------ KV pool
    @property
    def kv_sharding(self) -> NamedSharding:
        """Per-layer pools [Hkv', N, hd] split over KV heads: each device stores its own heads' K/V."""
        return NamedSharding(self.mesh, P(AXIS, None, None))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def replicate(self, tree: Any) -> Any:
        """Every leaf whole on every device (inside a jit): what the host reads of a step."""
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self.replicated), tree)

    def constrain_kv(self, kv: Any) -> Any:
        """Every pool leaf split over its heads (axis 0): the values [Hkv', N, hd] and, in the 8-bit format,
        the scales [Hkv', N]."""
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, _head_spec(x))),
                            kv)

    # ---------------------------------------------------------------------------------- attention
    def shard_attention(self, attention: AttentionBackend) -> AttentionBackend:
        """Run ``attention`` per shard on its local heads: q [T, Hq'/tp, hd], pools [Hkv'/tp, N, hd].

        Heads are independent in attention and each shard holds whole GQA groups, so no collective is
        needed inside; metadata is replicated. A Pallas kernel thus launches per device on local data. A backend's
        K/V ``write`` (the TPU kernel) runs per shard the same way, on its heads' rows of the new K/V.
        """
        write = None if attention.write is None else functools.partial(_sharded_write, attention.write, self.mesh)
        return AttentionBackend(f"{attention.name}-sharded",
                                functools.partial(_sharded_attention, attention.attend, self.mesh), write=write)


def _head_spec(x: Any) -> P:
    """A pool leaf split over its leading (KV head) axis (a scanned model's layer index, a scalar, is replicated)."""
    return P(AXIS, *(None,) * (x.ndim - 1)) if x.ndim else P()


def _pool_specs(pool: Any) -> Any:
    return jax.tree.map(_head_spec, pool)  # an Int8Pool: values and scales; a LayerPool's layer replicated


def _shard_map_mesh(mesh: Mesh) -> Any:
    """``mesh``, or where the step is lowered for a device this process lacks, the context's same axes over an
    abstract device (kernels/lowering.py): shard_map must be given that mesh."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.shape_tuple == mesh.abstract_mesh.shape_tuple:
        return context
    return mesh


def _sharded_attention(attention: AttentionFn, mesh: Mesh, q: jax.Array, k_pool: Any,
                       v_pool: Any, meta: AttentionMetadata, scale: float) -> jax.Array:
    # check_vma=False: a pallas_call's out_shape does not say how it varies over the manual axis, which
    # the check would require; the body has no collectives, so the check would verify nothing anyway.
    local = jax.shard_map(
        lambda q, k, v, m: attention(q, k, v, m, scale), mesh=_shard_map_mesh(mesh),
        in_specs=(P(None, AXIS, None), _pool_specs(k_pool), _pool_specs(v_pool), P()),
        out_specs=P(None, AXIS, None), check_vma=False)
    return local(q, k_pool, v_pool, meta)


def _sharded_write(write: Any, mesh: Mesh, pool: Any, slots: jax.Array, x: jax.Array) -> Any:
    """``write(pool, slots, x)`` per shard: its heads' pool and rows ``x [T, Hkv'/tp, hd]``, the slots replicated."""
    local = jax.shard_map(write, mesh=_shard_map_mesh(mesh), in_specs=(_pool_specs(pool), P(), P(None, AXIS, None)),
                          out_specs=_pool_specs(pool), check_vma=False)
    return local(pool, slots, x)
