"""The on-device sampler over real arrays: its argmax, the distribution it samples, and the filters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsgl.engine.sampler import SamplingInputs, argmax, sample


def inputs(batch: int, vocab: int, **overrides) -> SamplingInputs:
    fields = dict(temperature=np.ones(batch, np.float32), top_p=np.ones(batch, np.float32),
                  top_k=np.full(batch, vocab, np.int32), min_p=np.zeros(batch, np.float32),
                  seeds=np.arange(batch, dtype=np.uint32), steps=np.zeros(batch, np.int32), all_greedy=False)
    fields.update(overrides)
    return SamplingInputs(**fields)


def test_argmax_is_the_first_maximum():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 49152)).astype(np.float32)
    x[1, [7, 900, 4000]] = 50.0  # ties: the first wins
    x[2] = -np.inf  # a fully masked row
    x[3, :100] = np.round(x[3, :100])  # many small ties
    x[4, -1] = 99.0  # the maximum in the last slot
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(x))), np.argmax(x, axis=-1))


def test_samples_follow_the_softmax():
    """Temperature 1 over 5 tokens: frequencies over 4000 seeds match softmax(logits) (chi-square)."""
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], np.float32))
    n = 4000
    s = inputs(n, 5, seeds=np.arange(n, dtype=np.uint32))
    tokens, logprobs, _, _ = jax.jit(sample)(jnp.tile(jnp.asarray(logits), (n, 1)), s)
    counts = np.bincount(np.asarray(tokens), minlength=5)
    expected = np.exp(logits) * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 18.5  # p = 0.001 at 4 degrees of freedom
    np.testing.assert_allclose(np.asarray(logprobs), logits[np.asarray(tokens)], atol=1e-5)


@pytest.mark.parametrize("overrides, allowed", [
    (dict(top_k=np.full(512, 2, np.int32)), {0, 1}),
    (dict(top_p=np.full(512, 0.6, np.float32)), {0, 1}),  # 0.4 + 0.3 covers 0.6
    (dict(min_p=np.full(512, 0.5, np.float32)), {0, 1}),  # p >= 0.5 * 0.4
])
def test_filters_keep_only_the_allowed_tokens(overrides, allowed):
    logits = jnp.log(jnp.asarray([0.4, 0.3, 0.15, 0.1, 0.05], jnp.float32))
    s = inputs(512, 5, need_sort=True, **overrides)
    tokens, _, _, _ = jax.jit(sample)(jnp.tile(logits, (512, 1)), s)
    assert set(np.asarray(tokens).tolist()) == allowed


def test_greedy_rows_and_same_seed_same_token():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 1000)).astype(np.float32))
    s = inputs(4, 1000, temperature=np.array([0, 1, 0, 1], np.float32), seeds=np.array([5, 9, 5, 9], np.uint32))
    tokens = np.asarray(jax.jit(sample)(jnp.concatenate([logits[:2], logits[:2]]), s)[0])
    assert tokens[0] == tokens[2] == int(jnp.argmax(logits[0]))
    assert tokens[1] == tokens[3]


def test_skipping_logprobs_keeps_the_tokens():
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((8, 3000)).astype(np.float32))
    s = inputs(8, 3000, temperature=np.array([0, 1] * 4, np.float32))
    with_lp, without = jax.jit(sample)(logits, s), jax.jit(sample)(logits, inputs(8, 3000, token_logprobs=False,
                                                                              temperature=s.temperature))
    np.testing.assert_array_equal(np.asarray(with_lp[0]), np.asarray(without[0]))
    expected = jax.nn.log_softmax(logits)[jnp.arange(8), with_lp[0]]
    np.testing.assert_allclose(np.asarray(with_lp[1]), np.asarray(expected), atol=1e-5)
