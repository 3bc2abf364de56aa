"""What one step computes (``ForwardItem`` per request, ``Step`` for the batch), packed in one place
(``pack_step``): the forward's int32 inputs in one array, the sampler's in another.

Each argument of a jitted call is its own host-to-device transfer, so a step's seventeen small arrays travel as
two: the forward's (unpacked with static slices: the layout is part of the step's signature anyway) and the
sampler's, whose float rows travel as their bits (``view``). A plain greedy step uploads only the first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jsgl.engine.kv_pool import slot_pages
from jsgl.engine.sampler import FLAG_NAMES, SamplingInputs, stage_flags
from jsgl.engine.sampling_params import GREEDY_TEMPERATURE
from jsgl.kernels.attention import AttentionMetadata

# Per-token int32 rows, per-request int32 rows (the block table follows them, then `argmax`: whether the
# forward takes the greedy tokens itself, the sampler not being run). `previous_row`: -1, or the row of the
# previous step's sampled tokens (still on device) that is this token: an overlapped decode step is dispatched
# before its inputs' last tokens are read back.
TOKEN_ROWS = ("token_ids", "previous_row", "write_slots", "positions", "target_ids")
REQUEST_ROWS = ("q_start", "q_len", "kv_lens", "sample_index")
# The sampler's per-request rows: int32, then float32 (as bits); the stage flags follow them.
SAMPLING_INT_ROWS = ("top_k", "seeds", "steps")
SAMPLING_FLOAT_ROWS = ("temperature", "top_p", "min_p")
SAMPLING_ROWS = SAMPLING_INT_ROWS + SAMPLING_FLOAT_ROWS


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
        return len(TOKEN_ROWS) * self.num_t + len(REQUEST_ROWS) * self.num_b + self.num_b * self.table_width + 1

    @property
    def num_sampling(self) -> int:
        return sampling_size(self.num_b)


def sampling_size(num_b: int) -> int:
    return len(SAMPLING_ROWS) * num_b + len(FLAG_NAMES)


class PackedStep(NamedTuple):
    ints: np.ndarray  # [layout.num_ints] int32: the forward's inputs
    sampling: np.ndarray  # [layout.num_sampling] int32: the sampler's

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
        out["argmax"] = self.ints[offset + b * width:]
        for i, name in enumerate(SAMPLING_ROWS):
            row = self.sampling[i * b: (i + 1) * b]
            out[name] = row.view(np.float32) if name in SAMPLING_FLOAT_ROWS else row
        out["flags"] = self.sampling[len(SAMPLING_ROWS) * b:]
        return out


def new_packed(layout: StepLayout, vocab_size: int) -> PackedStep:
    """Zeroed buffers with the neutral sampling values (top_k = vocab, top_p = 1, no previous row)."""
    packed = PackedStep(np.zeros(layout.num_ints, np.int32), np.zeros(layout.num_sampling, np.int32))
    views = packed.views(layout)
    views["previous_row"][:] = -1
    views["top_k"][:] = vocab_size
    views["top_p"][:] = 1.0
    return packed


@dataclasses.dataclass
class ForwardItem:
    """One request's share of a step: its new tokens, where they go, and how to sample after them."""

    token_ids: np.ndarray  # new tokens
    start_pos: int  # position of the first new token
    slots: np.ndarray  # pool slot of every position [0, start_pos + len(token_ids))
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int = 0
    step: int = 0
    bitmask: np.ndarray | None = None
    logit_bias: np.ndarray | None = None
    repetition_scale: np.ndarray | None = None  # [V]: divide positive logits by it, multiply negative ones
    target_ids: np.ndarray | None = None  # next token of each new token, for prompt logprobs


class Step(NamedTuple):
    """What one step computes, packed for the device: the requests' tokens, positions, KV slots and block tables
    (``packed.ints``), their sampling rows and stage flags (``packed.sampling``), the per-vocabulary rows
    (``vocab_rows``: FSM bitmask, logit bias, repetition scale: host arrays, or neutral device arrays where no
    request has one), and whether the forward's argmax is the step's tokens (``plain_greedy``: no sampler)."""

    layout: StepLayout
    packed: PackedStep
    vocab_rows: tuple[Any, Any, Any]
    plain_greedy: bool
    q_lens: list[int]


def pack_step(items: list[ForwardItem], layout: StepLayout, vocab_size: int,
              neutral: Callable[[str, int], Any], *, logprobs: bool, top_logprobs: int,
              after_previous: bool) -> Step:
    """Pack ``items`` into ``layout`` (padding rows keep the neutral values; their writes go to reserved slot 0).
    ``neutral(kind, num_b)``: the device array of a per-vocabulary row that changes nothing. ``after_previous``:
    each request's token is the previous step's sampled token in its row (an overlapped decode step)."""
    packed = new_packed(layout, vocab_size)
    rows = packed.views(layout)
    q_lens = [len(it.token_ids) for it in items]
    offset = 0
    for b, (it, m) in enumerate(zip(items, q_lens)):
        kv_len = it.start_pos + m
        sl = slice(offset, offset + m)
        rows["token_ids"][sl] = it.token_ids
        rows["positions"][sl] = np.arange(it.start_pos, kv_len)
        rows["write_slots"][sl] = it.slots[it.start_pos: kv_len]
        if it.target_ids is not None:
            rows["target_ids"][sl] = it.target_ids
        rows["q_start"][b], rows["q_len"][b], rows["kv_lens"][b] = offset, m, kv_len
        pages = slot_pages(it.slots, kv_len, layout.page_size)
        rows["block_table"][b, :len(pages)] = pages
        rows["sample_index"][b] = offset + m - 1
        offset += m
    if after_previous:
        rows["previous_row"][:len(items)] = np.arange(len(items))
    for b, it in enumerate(items):
        rows["temperature"][b], rows["top_p"][b], rows["min_p"][b] = it.temperature, it.top_p, it.min_p
        rows["top_k"][b] = vocab_size if it.top_k < 0 else min(it.top_k, vocab_size)
        rows["seeds"][b] = np.uint32(it.seed & 0xFFFFFFFF).view(np.int32)
        rows["steps"][b] = it.step
    num_b = layout.num_b
    bitmask, masked = _vocab_rows(items, num_b, "bitmask", 0xFFFFFFFF, np.uint32, -(-vocab_size // 32), neutral)
    logit_bias, biased = _vocab_rows(items, num_b, "logit_bias", 0.0, np.float32, vocab_size, neutral)
    scale, repeated = _vocab_rows(items, num_b, "repetition_scale", 1.0, np.float32, vocab_size, neutral)
    all_greedy = not (rows["temperature"] > GREEDY_TEMPERATURE).any()
    rows["flags"][:] = stage_flags(all_greedy=all_greedy, token_logprobs=logprobs, apply_mask=masked,
                                   apply_bias=biased, apply_repetition=repeated, want_top=top_logprobs > 0)
    plain = all_greedy and not (logprobs or masked or biased or repeated or top_logprobs > 0)
    rows["argmax"][:] = plain
    return Step(layout, packed, (bitmask, logit_bias, scale), plain, q_lens)


def _vocab_rows(items: list[ForwardItem], num_b: int, kind: str, fill: float | int, dtype: Any, width: int,
                neutral: Callable[[str, int], Any]) -> tuple[Any, bool]:
    """[num_b, width] of each item's ``kind`` array (``fill`` where it has none), or the neutral device array
    when no item has one; and whether any did."""
    if all(getattr(it, kind) is None for it in items):
        return neutral(kind, num_b), False
    out = np.full((num_b, width), fill, dtype)
    for b, it in enumerate(items):
        value = getattr(it, kind)
        if value is not None:
            out[b] = value
    return out, True


class ForwardInputs(NamedTuple):
    token_ids: jax.Array  # [T]
    write_slots: jax.Array  # [T]
    meta: AttentionMetadata
    sample_index: jax.Array  # [B]: each request's last new token
    target_ids: jax.Array  # [T]: the next prompt token of each (prompt logprobs)
    argmax: jax.Array  # scalar bool: the step's tokens are the greedy ones (no sampler follows)


def unpack_forward(ints: jax.Array, previous_tokens: jax.Array, layout: StepLayout) -> ForwardInputs:
    """Inside the jitted step: the forward's inputs."""
    t, b = layout.num_t, layout.num_b
    parts: dict[str, jax.Array] = {}
    offset = 0
    for name in TOKEN_ROWS:
        parts[name], offset = ints[offset: offset + t], offset + t
    for name in REQUEST_ROWS:
        parts[name], offset = ints[offset: offset + b], offset + b
    width = layout.table_width
    block_table = ints[offset: offset + b * width].reshape(b, width)
    meta = AttentionMetadata(parts["positions"], parts["q_start"], parts["q_len"], block_table, parts["kv_lens"],
                             layout.max_q, page_size=layout.page_size)
    previous_row = parts["previous_row"]
    token_ids = jnp.where(previous_row >= 0, previous_tokens[jnp.clip(previous_row, 0, b - 1)], parts["token_ids"])
    return ForwardInputs(token_ids, parts["write_slots"], meta, parts["sample_index"], parts["target_ids"],
                         ints[offset + b * width] != 0)


def unpack_sampling(sampling: jax.Array, bitmask: Any, logit_bias: Any, repetition_scale: Any,
                    top_logprobs: int) -> SamplingInputs:
    """Inside the jitted sampler: its ``SamplingInputs``."""
    b = (sampling.shape[0] - len(FLAG_NAMES)) // len(SAMPLING_ROWS)
    rows = {name: sampling[i * b: (i + 1) * b] for i, name in enumerate(SAMPLING_ROWS)}
    as_float = lambda name: jax.lax.bitcast_convert_type(rows[name], jnp.float32)  # noqa: E731
    return SamplingInputs(as_float("temperature"), as_float("top_p"), rows["top_k"], as_float("min_p"),
                          jax.lax.bitcast_convert_type(rows["seeds"], jnp.uint32), rows["steps"],
                          bitmask, logit_bias, repetition_scale, sampling[len(SAMPLING_ROWS) * b:] != 0,
                          top_logprobs=top_logprobs)
