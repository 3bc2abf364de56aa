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
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jsgl.kernels.attention import AttentionBackend, AttentionFn, AttentionMetadata
from jsgl.model.config import ModelConfig

Params = dict[str, Any]
AXIS = "tp"

_COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")  # [in, out]: shard out
_ROW = ("wo", "w_down")  # [in, out]: shard in
_BIAS = ("bq", "bk", "bv")  # [out]: shard out, like their matrices


def make_mesh(tp: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh named ``tp`` over the first ``tp`` local devices.

    Axis type Auto, on purpose: jax 0.10.2's ``jax.make_mesh`` defaults to Explicit axes, under which
    shardings become part of array types and every op whose result sharding is ambiguous (the
    row-parallel matmuls contract a sharded dim; the embedding gathers from a vocab-sharded table)
    needs an ``out_sharding`` annotation, i.e. the model would have to become mesh-aware. With Auto,
    the unannotated single-device model is partitioned by XLA from the argument shardings alone.
    """
    devices = list(devices if devices is not None else jax.local_devices())
    if tp < 1:
        raise ValueError(f"tp must be >= 1, not {tp}")
    if tp > len(devices):
        raise ValueError(
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
    def pad_params(self, params: Params, original: ModelConfig) -> Params:
        """Host-side: reorder/zero-pad heads and the MLP width to the layout (numpy in, numpy out)."""
        hd, inter = original.head_dim, self.config.intermediate_size
        lay = self.layout

        def pad_layer(layer: Params) -> Params:
            layer = {name: np.asarray(w) for name, w in layer.items()}
            if not lay.is_identity:
                for name, heads in (("wq", lay.q_heads), ("wk", lay.kv_heads), ("wv", lay.kv_heads)):
                    layer[name] = _take_heads(layer[name], heads, 1, hd)
                for name, heads in (("bq", lay.q_heads), ("bk", lay.kv_heads), ("bv", lay.kv_heads)):
                    if name in layer:
                        layer[name] = _take_heads(layer[name], heads, 0, hd)
                layer["wo"] = _take_heads(layer["wo"], lay.q_heads, 0, hd)
            layer["w_gate"] = _pad_axis(layer["w_gate"], 1, inter)
            layer["w_up"] = _pad_axis(layer["w_up"], 1, inter)
            layer["w_down"] = _pad_axis(layer["w_down"], 0, inter)
            return layer

        return {**{k: v for k, v in params.items() if k != "layers"},
                "layers": [pad_layer(layer) for layer in params["layers"]]}

    def param_specs(self, params: Params) -> Params:
        """PartitionSpec of every leaf of a (padded) params pytree."""
        tp = self.tp
        vocab, hidden = params["embed"].shape
        if vocab % tp == 0:
            embed = P(AXIS, None)  # vocab-parallel
        elif hidden % tp == 0:
            embed = P(None, AXIS)
        else:
            embed = P()
        specs: Params = {"embed": embed, "final_norm": P()}
        if "lm_head" in params:
            specs["lm_head"] = P(None, AXIS) if vocab % tp == 0 else P()
        layer_specs = {}
        for name in params["layers"][0]:
            if name in _COLUMN:
                layer_specs[name] = P(None, AXIS)
            elif name in _ROW:
                layer_specs[name] = P(AXIS, None)
            elif name in _BIAS:
                layer_specs[name] = P(AXIS)
            else:  # norms
                layer_specs[name] = P()
        specs["layers"] = [layer_specs] * len(params["layers"])
        return specs

    def shard_params(self, params: Params, original: ModelConfig) -> Params:
        """Pad on the host and place each leaf with its NamedSharding (each device gets only its slice)."""
        padded = self.pad_params(params, original)
        specs = self.param_specs(padded)
        return jax.tree.map(lambda w, spec: jax.device_put(np.asarray(w), NamedSharding(self.mesh, spec)),
                            padded, specs)

    # ------------------------------------------------------------------------------------ KV pool
    @property
    def kv_sharding(self) -> NamedSharding:
        """Per-layer pools [Hkv', N, hd] split over KV heads: each device stores its own heads' K/V."""
        return NamedSharding(self.mesh, P(AXIS, None, None))

    # ---------------------------------------------------------------------------------- attention
    def shard_attention(self, attention: AttentionBackend) -> AttentionBackend:
        """Run ``attention`` per shard on its local heads: q [T, Hq'/tp, hd], pools [Hkv'/tp, N, hd].

        Heads are independent in attention and each shard holds whole GQA groups, so no collective is
        needed inside; metadata is replicated. A Pallas kernel thus launches per device on local data.
        """
        return AttentionBackend(f"{attention.name}-sharded",
                                functools.partial(_sharded_attention, attention.attend, self.mesh))


def _sharded_attention(attention: AttentionFn, mesh: Mesh, q: jax.Array, k_pool: jax.Array,
                       v_pool: jax.Array, meta: AttentionMetadata, scale: float) -> jax.Array:
    # check_vma=False: a pallas_call's out_shape does not say how it varies over the manual axis, which
    # the check would require; the body has no collectives, so the check would verify nothing anyway.
    local = jax.shard_map(
        lambda q, k, v, m: attention(q, k, v, m, scale), mesh=mesh,
        in_specs=(P(None, AXIS, None), P(AXIS, None, None), P(AXIS, None, None), P()),
        out_specs=P(None, AXIS, None), check_vma=False)
    return local(q, k_pool, v_pool, meta)
