"""On-device sampling inside the jitted step: masks, penalties, temperature, top-k/top-p/min-p, seeds."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jsgl.engine.sampling_params import GREEDY_TEMPERATURE


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
    # Which stages run: [all_greedy (no row samples: argmax only), token_logprobs (else zeros), apply_mask,
    # apply_bias, apply_repetition (apply the array given), want_top (else zeros of the top-logprobs' shape)].
    # One bool array, not six scalars: each argument of a jitted call costs its own host-to-device transfer
    # (~10 us). Whether a row is filtered (top-k/top-p/min-p) the step reads from its parameters.
    flags: jax.Array = dataclasses.field(default_factory=lambda: stage_flags())
    top_logprobs: int = dataclasses.field(metadata=dict(static=True), default=0)  # K: the output's width

    def _flag(self, name: str) -> jax.Array:
        return self.flags[FLAG_NAMES.index(name)]

    all_greedy = property(lambda self: self._flag("all_greedy"))
    token_logprobs = property(lambda self: self._flag("token_logprobs"))
    apply_mask = property(lambda self: self._flag("apply_mask"))
    apply_bias = property(lambda self: self._flag("apply_bias"))
    apply_repetition = property(lambda self: self._flag("apply_repetition"))
    want_top = property(lambda self: self._flag("want_top"))


FLAG_NAMES = ("all_greedy", "token_logprobs", "apply_mask", "apply_bias", "apply_repetition",
              "want_top")


def stage_flags(all_greedy: bool = True, token_logprobs: bool = True,
                apply_mask: bool = True, apply_bias: bool = True, apply_repetition: bool = True,
                want_top: bool = True) -> np.ndarray:
    """The ``SamplingInputs.flags`` array (defaults: greedy, logprobs on, any array given applied)."""
    return np.array([all_greedy, token_logprobs, apply_mask, apply_bias, apply_repetition, want_top])


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """[B, W] uint32 -> [B, V] bool; bit i of word i // 32 marks token i."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)[None, None, :]) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, -1)`` (the first maximum) as a max and a min: XLA CPU runs argmax's (value, index)
    reduction element by element, several times slower."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)  # a row with a NaN: nothing equals its NaN maximum


def _mix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's finalizer: a bijection on uint32 in which every input bit flips each output bit with
    probability ~1/2."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """[B, 2] uint32 words keying a row's noise: its request's seed and how many tokens it has sampled."""
    a = _mix32(_mix32(seeds.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + jnp.uint32(0x632BE5AB))
               ^ steps.astype(jnp.uint32) * jnp.uint32(0x85157AF5))
    return jnp.stack([a, _mix32(a + jnp.uint32(0x6A09E667))], axis=-1)


def gumbel_noise(keys: jax.Array, width: int) -> jax.Array:
    """[B, width] standard Gumbel noise, element i a hash of (the row's keys, i): counter-based like
    jax.random's threefry, so a row's noise depends on its seed and step alone, never on the batch, the
    bucket or the width (a prefix of a wider draw is the narrower draw). Not threefry: its 20 unrolled rounds
    were most of a step's compile time and several times slower to run than two finalizer rounds. The second
    key word enters after the first round, so rows whose first words differ by a
    small offset do not share shifted noise."""
    index = jax.lax.broadcasted_iota(jnp.uint32, (keys.shape[0], width), 1)
    bits = _mix32(_mix32(index + keys[:, :1]) ^ keys[:, 1:])
    uniform = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # 24 bits, in (0, 1)
    return -jnp.log(-jnp.log(uniform))


# Widths of the candidate sets tried before the whole (sorted) vocabulary. A filtered row is sampled exactly
# from its top-W candidates when the filter drops the last of them: top-k, top-p and min-p each keep a prefix
# of the sorted order, so nothing past the candidates survives either. lax.top_k's cost grows with its width.
CANDIDATE_WIDTHS = (256, 4096)


def _keep_sorted(sorted_logits: jax.Array, log_normalizer: jax.Array, s: SamplingInputs) -> jax.Array:
    """Which of the (descending) logits the filters keep: rank < top_k, preceding mass < top_p, p >= min_p *
    p_max, the most likely token always. ``sorted_logits`` may be a prefix of the order (the candidates):
    probabilities use the whole row's normalizer."""
    probs = jnp.exp(sorted_logits - log_normalizer[:, None])
    rank = jnp.arange(sorted_logits.shape[-1])[None, :]
    keep = rank < s.top_k[:, None]
    keep &= jnp.cumsum(probs, axis=-1) - probs < s.top_p[:, None]
    keep &= probs >= s.min_p[:, None] * probs[:, :1]
    keep &= sorted_logits > -jnp.inf  # masked tokens: a row with fewer allowed tokens than candidates is complete
    return keep.at[:, 0].set(True)


def _sample_filtered(scaled: jax.Array, keys: jax.Array, s: SamplingInputs, filtered: jax.Array) -> jax.Array:
    """Sample the ``filtered`` rows by Gumbel-max over the candidates their filters keep (exact, and free of the
    rounding a cumulative-sum draw would carry across step shapes), from the narrowest candidate set that holds
    all of them: the widths in turn, the whole vocabulary last."""
    log_normalizer = jax.nn.logsumexp(scaled, axis=-1)
    vocab = scaled.shape[-1]
    widths = [w for w in CANDIDATE_WIDTHS if w < vocab] + [vocab]

    def attempt(level: int, x: jax.Array) -> jax.Array:
        values, ids = jax.lax.top_k(x, widths[level])
        keep = _keep_sorted(values, log_normalizer, s)

        def from_candidates(_: jax.Array) -> jax.Array:
            choice = argmax(jnp.where(keep, values + gumbel_noise(keys, values.shape[-1]), -jnp.inf))
            return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]

        if level == len(widths) - 1:
            return from_candidates(x)
        complete = jnp.all(~filtered | ~keep[:, -1])
        return jax.lax.cond(complete, from_candidates, functools.partial(attempt, level + 1), x)

    return attempt(0, scaled)


def sample(logits: jax.Array, s: SamplingInputs) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Sample one token per row.

    Returns (tokens [B], logprob of each token under the model's raw distribution [B] (zeros unless
    ``s.token_logprobs``), and the top-k (logprobs, ids) [B, K] of that distribution).

    Each stage sits under its own flag (a branch costs little on XLA CPU). A plain greedy batch (no mask,
    penalty or logprobs) never gets here: the forward takes its argmax (``model_runner._step``).
    """
    logits = logits.astype(jnp.float32)
    raw = logits  # the model's distribution, before bias and masks
    batch = logits.shape[0]
    adjusting = s.apply_repetition | s.apply_bias | s.apply_mask
    # Logprobs without writing out [B, V] of them; skipped when nobody asked.
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
        scaled = x / jnp.maximum(s.temperature, GREEDY_TEMPERATURE)[:, None]
        keys = row_keys(s.seeds, s.steps)
        sampling = s.temperature > GREEDY_TEMPERATURE
        filtered = sampling & ((s.top_k < x.shape[-1]) | (s.top_p < 1.0) | (s.min_p > 0.0))

        def unfiltered(y: jax.Array) -> jax.Array:  # Gumbel-max, as jax.random.categorical, with the faster argmax
            return argmax(y + gumbel_noise(keys, y.shape[-1]))

        def zeros(y: jax.Array) -> jax.Array:
            return jnp.zeros(y.shape[0], jnp.int32)

        # Each kind of row pays only when present: the full-vocabulary noise is costly.
        plain = jax.lax.cond(jnp.any(sampling & ~filtered), unfiltered, zeros, scaled)
        chosen = jax.lax.cond(jnp.any(filtered), lambda y: _sample_filtered(y, keys, s, filtered), zeros, scaled)
        return jnp.where(sampling, jnp.where(filtered, chosen, plain), greedy_tokens)

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
