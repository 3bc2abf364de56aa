"""On-device sampling inside the jitted step: masks, penalties, temperature, top-k/top-p/min-p, seeds."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    """Per-row sampling parameters, padded to the batch bucket.

    Which stages run is decided at run time (scalar flags, each stage under ``lax.cond``), not by the traced
    shape: one compiled step serves greedy and sampled batches, with or without filters, masks, penalties and
    logprobs, so a new mix of requests never compiles a new step. A stage whose flag is off costs a branch.
    Only ``top_logprobs`` (the width of the top-k output) stays static.
    """

    temperature: jax.Array  # [B] float32; 0 means greedy
    top_p: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32; vocab size means "all"
    min_p: jax.Array  # [B] float32
    seeds: jax.Array  # [B] uint32: a request's seed
    steps: jax.Array  # [B] int32: tokens it has sampled so far, folded into its key
    bitmask: jax.Array | None = None  # [B, ceil(V/32)] uint32 allowed tokens (constrained decoding)
    logit_bias: jax.Array | None = None  # [B, V] float32 additive (penalties, logit_bias, min_new_tokens)
    repetition_scale: jax.Array | None = None  # [B, V] float32 repetition penalty (1: untouched)
    # Which stages run: [all_greedy (no row samples: argmax only), need_sort (a sampled row has top-k/top-p/
    # min-p), token_logprobs (else zeros), apply_mask, apply_bias, apply_repetition (apply the array given),
    # want_top (else zeros of the top-logprobs' shape)]. One bool array, not seven scalars: each argument of
    # a jitted call costs its own host-to-device transfer (~10 us).
    flags: jax.Array = dataclasses.field(default_factory=lambda: stage_flags())
    top_logprobs: int = dataclasses.field(metadata=dict(static=True), default=0)  # K: the output's width

    def _flag(self, name: str) -> jax.Array:
        return self.flags[FLAG_NAMES.index(name)]

    all_greedy = property(lambda self: self._flag("all_greedy"))
    need_sort = property(lambda self: self._flag("need_sort"))
    token_logprobs = property(lambda self: self._flag("token_logprobs"))
    apply_mask = property(lambda self: self._flag("apply_mask"))
    apply_bias = property(lambda self: self._flag("apply_bias"))
    apply_repetition = property(lambda self: self._flag("apply_repetition"))
    want_top = property(lambda self: self._flag("want_top"))


FLAG_NAMES = ("all_greedy", "need_sort", "token_logprobs", "apply_mask", "apply_bias", "apply_repetition",
              "want_top")


def stage_flags(all_greedy: bool = True, need_sort: bool = False, token_logprobs: bool = True,
                apply_mask: bool = True, apply_bias: bool = True, apply_repetition: bool = True,
                want_top: bool = True) -> np.ndarray:
    """The ``SamplingInputs.flags`` array (defaults: greedy, logprobs on, any array given applied)."""
    return np.array([all_greedy, need_sort, token_logprobs, apply_mask, apply_bias, apply_repetition, want_top])


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """[B, W] uint32 -> [B, V] bool; bit i of word i // 32 marks token i."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)[None, None, :]) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, -1)`` (the first maximum) as a max and a min: XLA CPU runs argmax's (value, index)
    reduction element by element, ~5x slower over a 49k vocabulary (0.22 vs 0.04 ms a row here)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)  # a row with a NaN: nothing equals its NaN maximum


def _filter_sorted(logits: jax.Array, s: SamplingInputs) -> jax.Array:
    """Apply top-k, top-p and min-p in sorted order; returns logits with filtered entries at -inf."""
    vocab = logits.shape[-1]
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = rank < s.top_k[:, None]
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < s.top_p[:, None]
    keep &= probs >= s.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    filtered_sorted = jnp.where(keep, sorted_logits, -jnp.inf)
    # Scatter back to vocabulary order.
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(filtered_sorted, inverse, axis=-1)


def sample(logits: jax.Array, s: SamplingInputs) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Sample one token per row.

    Returns (tokens [B], logprob of each token under the model's raw distribution [B] (zeros unless
    ``s.token_logprobs``), and the top-k (logprobs, ids) [B, K] of that distribution).

    A batch that is all greedy, with no mask, penalty or logprobs (plain decoding) takes one branch: the
    argmax. Each stage of the other branch sits under its own flag (a branch costs ~0.04 ms on XLA CPU, so
    the plain path stays at one).
    """
    logits = logits.astype(jnp.float32)
    batch, k = logits.shape[0], s.top_logprobs
    adjusting = s.apply_repetition | s.apply_bias | s.apply_mask
    plain = s.all_greedy & ~adjusting & ~s.token_logprobs & ~(s.want_top if k else False)

    def plain_path(raw: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        return (argmax(raw), jnp.zeros(batch, jnp.float32), jnp.zeros((batch, k), jnp.float32),
                jnp.zeros((batch, k), jnp.int32))

    return jax.lax.cond(plain, plain_path, functools.partial(_full_sample, s=s), logits)


def _full_sample(logits: jax.Array, s: SamplingInputs) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    raw = logits  # the model's distribution, before bias and masks
    batch = logits.shape[0]
    adjusting = s.apply_repetition | s.apply_bias | s.apply_mask
    # Logprobs without writing out [B, V] of them; skipped when nobody asked (0.1-0.3 ms of a decode step).
    want_normalizer = s.token_logprobs | (s.want_top if s.top_logprobs else False)
    log_normalizer = jax.lax.cond(want_normalizer, lambda r: jax.nn.logsumexp(r, axis=-1),
                                  lambda r: jnp.zeros(batch, jnp.float32), raw)

    def adjusted(x: jax.Array) -> jax.Array:  # penalties, biases and masks: one branch, skipped when none applies
        if s.repetition_scale is not None:
            x = jnp.where(s.apply_repetition, jnp.where(x < 0, x * s.repetition_scale, x / s.repetition_scale), x)
        if s.logit_bias is not None:
            x = jnp.where(s.apply_bias, x + s.logit_bias, x)
        if s.bitmask is not None:
            x = jnp.where(s.apply_mask & ~unpack_bitmask(s.bitmask, x.shape[-1]), -jnp.inf, x)
        return x

    if s.repetition_scale is not None or s.logit_bias is not None or s.bitmask is not None:
        logits = jax.lax.cond(adjusting, adjusted, lambda x: x, logits)
    greedy_tokens = argmax(logits)

    def sampled(x: jax.Array) -> jax.Array:
        scaled = x / jnp.maximum(s.temperature, 1e-5)[:, None]
        scaled = jax.lax.cond(s.need_sort, lambda y: _filter_sorted(y, s), lambda y: y, scaled)
        keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.PRNGKey(seed), step))(s.seeds, s.steps)
        # Gumbel-max, as jax.random.categorical does, with the faster argmax.
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, scaled.shape[-1:], scaled.dtype))(keys)
        return jnp.where(s.temperature <= 1e-5, greedy_tokens, argmax(scaled + gumbel))

    tokens = jax.lax.cond(s.all_greedy, lambda x: greedy_tokens, sampled, logits)
    token_logprobs = jnp.where(s.token_logprobs,
                               jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0] - log_normalizer, 0.0)
    k = s.top_logprobs
    if k:
        def top(r: jax.Array) -> tuple[jax.Array, jax.Array]:
            vals, ids = jax.lax.top_k(r, k)
            return vals - log_normalizer[:, None], ids

        top_vals, top_ids = jax.lax.cond(s.want_top, top, lambda r: (jnp.zeros((batch, k), jnp.float32),
                                                                     jnp.zeros((batch, k), jnp.int32)), raw)
    else:
        top_vals = jnp.zeros((batch, 0), jnp.float32)
        top_ids = jnp.zeros((batch, 0), jnp.int32)
    return tokens, token_logprobs, top_vals, top_ids
