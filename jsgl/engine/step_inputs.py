"""One step's host inputs, packed: every int32 input in one array and every float32 one in another.

Each argument of a jitted call is its own host-to-device transfer (~10-30 us on CPU): at batch 1, the
seventeen small arrays of a decode step (tokens, slots, positions, metadata, block table, sampling
parameters, stage flags) cost ~1 ms of a ~8 ms step. Packed, they are two; the step unpacks them with
static slices (the layout is part of the step's signature anyway).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jsgl.engine.sampler import FLAG_NAMES, SamplingInputs
from jsgl.kernels.attention import AttentionMetadata

# Per-token int32 rows, per-request int32 rows (the block table follows them), per-request float32 rows.
# `previous_row`: -1, or the row of the previous step's sampled tokens (still on device) that is this token: an
# overlapped decode step is dispatched before its inputs' last tokens are read back.
TOKEN_ROWS = ("token_ids", "previous_row", "write_slots", "positions", "target_ids")
REQUEST_ROWS = ("q_start", "q_len", "kv_lens", "sample_index", "top_k", "seeds", "steps")
FLOAT_ROWS = ("temperature", "top_p", "min_p")


class StepLayout(NamedTuple):
    """The padded shape of a step: tokens T, requests B, new tokens per request S, attended length L; and the
    KV pool's page size, which makes the block table ``[B, ceil(L / page_size)]`` pages (fixed per engine)."""

    num_t: int
    num_b: int
    max_q: int
    max_l: int
    page_size: int = 1

    @property
    def table_width(self) -> int:
        return -(-self.max_l // self.page_size)

    @property
    def num_ints(self) -> int:
        return (len(TOKEN_ROWS) * self.num_t + len(REQUEST_ROWS) * self.num_b + self.num_b * self.table_width
                + len(FLAG_NAMES))

    @property
    def num_floats(self) -> int:
        return len(FLOAT_ROWS) * self.num_b


class PackedStep(NamedTuple):
    ints: np.ndarray  # [layout.num_ints] int32
    floats: np.ndarray  # [layout.num_floats] float32

    def views(self, layout: StepLayout) -> dict[str, np.ndarray]:
        """Writable views of each named part (rows of the two buffers)."""
        t, b = layout.num_t, layout.num_b
        out: dict[str, np.ndarray] = {}
        offset = 0
        for name in TOKEN_ROWS:
            out[name], offset = self.ints[offset: offset + t], offset + t
        for name in REQUEST_ROWS:
            out[name], offset = self.ints[offset: offset + b], offset + b
        width = layout.table_width
        out["block_table"] = self.ints[offset: offset + b * width].reshape(b, width)
        out["flags"] = self.ints[offset + b * width:]
        for i, name in enumerate(FLOAT_ROWS):
            out[name] = self.floats[i * b: (i + 1) * b]
        return out


def new_packed(layout: StepLayout, vocab_size: int) -> PackedStep:
    """Zeroed buffers with the neutral sampling values (top_k = vocab, top_p = 1, no previous row)."""
    packed = PackedStep(np.zeros(layout.num_ints, np.int32), np.zeros(layout.num_floats, np.float32))
    views = packed.views(layout)
    views["previous_row"][:] = -1
    views["top_k"][:] = vocab_size
    views["top_p"][:] = 1.0
    return packed


def unpack(ints: jax.Array, floats: jax.Array, bitmask: Any, logit_bias: Any, repetition_scale: Any,
           previous_tokens: jax.Array, layout: StepLayout,
           top_logprobs: int) -> tuple[jax.Array, jax.Array, AttentionMetadata, jax.Array, jax.Array, SamplingInputs]:
    """Inside the jitted step: (token_ids, write_slots, meta, sample_index, target_ids, sampling)."""
    t, b = layout.num_t, layout.num_b
    parts: dict[str, jax.Array] = {}
    offset = 0
    for name in TOKEN_ROWS:
        parts[name], offset = ints[offset: offset + t], offset + t
    for name in REQUEST_ROWS:
        parts[name], offset = ints[offset: offset + b], offset + b
    width = layout.table_width
    block_table = ints[offset: offset + b * width].reshape(b, width)
    flags = ints[offset + b * width:] != 0
    temperature, top_p, min_p = (floats[i * b: (i + 1) * b] for i in range(len(FLOAT_ROWS)))
    meta = AttentionMetadata(parts["positions"], parts["q_start"], parts["q_len"], block_table, parts["kv_lens"],
                             layout.max_q, page_size=layout.page_size)
    sampling = SamplingInputs(temperature, top_p, parts["top_k"], min_p,
                              jax.lax.bitcast_convert_type(parts["seeds"], jnp.uint32), parts["steps"],
                              bitmask, logit_bias, repetition_scale, flags, top_logprobs=top_logprobs)
    previous_row = parts["previous_row"]
    token_ids = jnp.where(previous_row >= 0, previous_tokens[jnp.clip(previous_row, 0, b - 1)], parts["token_ids"])
    return token_ids, parts["write_slots"], meta, parts["sample_index"], parts["target_ids"], sampling
