"""The on-device sampler over real arrays: its argmax, the distribution it samples, and the filters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jsgl.engine.sampler import FLAG_NAMES, SamplingInputs, argmax, sample, stage_flags


def inputs(batch: int, vocab: int, **overrides) -> SamplingInputs:
    fields = dict(temperature=np.ones(batch, np.float32), top_p=np.ones(batch, np.float32),
                  top_k=np.full(batch, vocab, np.int32), min_p=np.zeros(batch, np.float32),
                  seeds=np.arange(batch, dtype=np.uint32), steps=np.zeros(batch, np.int32))
    flags = {"all_greedy": False} | {name: overrides.pop(name) for name in FLAG_NAMES if name in overrides}
    fields.update(overrides)
    return SamplingInputs(**fields, flags=stage_flags(**flags))


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
    s = inputs(512, 5, **overrides)
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


def test_gumbel_noise_is_per_row_gumbel_and_independent_across_steps_and_seeds():
    """The noise of a row is a function of its (seed, step) alone: the same in any batch and any width (a prefix
    of a wider draw), standard Gumbel (CDF exp(-exp(-x))), uncorrelated with the next step's and the next seed's."""
    from jsgl.engine.sampler import gumbel_noise, row_keys

    seeds = np.array([7, 7, 8, 0, 2**32 - 1], np.uint32)
    steps = np.array([0, 1, 0, 0, 5], np.int32)
    noise = np.asarray(jax.jit(gumbel_noise, static_argnums=1)(row_keys(seeds, steps), 49152), np.float64)
    alone = np.asarray(gumbel_noise(row_keys(seeds[2:3], steps[2:3]), 256))
    np.testing.assert_array_equal(alone[0], noise[2, :256].astype(np.float32))
    for row in noise:
        x = np.sort(row)  # Kolmogorov-Smirnov against the Gumbel CDF: 1.95 / sqrt(n) is p = 0.001
        cdf = np.exp(-np.exp(-x))
        n = len(x)
        assert max(np.abs(cdf - np.arange(1, n + 1) / n).max(), np.abs(cdf - np.arange(n) / n).max()) < 1.95 / n**0.5
    corr = np.corrcoef(noise)
    assert np.abs(corr[np.triu_indices(len(noise), 1)]).max() < 0.02, corr  # 4.4 sigma at n = 49152


# ------------------------------------------------------------- filters on shuffled logits vs numpy (chi-square)
# A permutation of 10 tokens with cycles longer than 2: scattering the filtered logits back with `order`
# instead of its inverse moves probability onto the wrong tokens (an involution would hide that).
SHUFFLED_PROBS = np.array([0.02, 0.21, 0.005, 0.12, 0.04, 0.3, 0.01, 0.07, 0.16, 0.065])
DRAWS = 20000  # rows of one batch: each its own seed, and `steps` varied too


def reference_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                           min_p: float) -> np.ndarray:
    """SGLang's semantics in float64 numpy: softmax(logits / T), then in descending order keep rank < top_k,
    the tokens whose preceding mass is < top_p, and p >= min_p * p_max (the top token always), renormalized."""
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    sp = p[order]
    before = np.concatenate([[0.0], np.cumsum(sp)[:-1]])
    # No threshold may sit within rounding of a probability: the float32 sampler must decide the same way.
    assert top_p == 1.0 or np.all(np.abs(before - top_p) > 1e-3)
    assert min_p == 0.0 or np.all(np.abs(sp - min_p * sp[0]) > 1e-4)
    keep = (np.arange(len(p)) < top_k) & (before < top_p) & (sp >= min_p * sp[0])
    keep[0] = True
    target = np.zeros_like(p)
    target[order[keep]] = sp[keep]
    return target / target.sum()


def chi_square_critical(df: int, alpha: float = 1e-7) -> float:
    try:
        from scipy.stats import chi2
    except ImportError:  # Wilson-Hilferty with z(1e-7) = 5.2, plus a margin for its error in the far tail
        return 1.25 * df * (1 - 2 / (9 * df) + 5.2 * np.sqrt(2 / (9 * df))) ** 3
    return float(chi2.isf(alpha, df))


def assert_follows(tokens: np.ndarray, target: np.ndarray) -> None:
    """Tokens outside the target's support never appear; the rest pass a chi-square test at p = 1e-7."""
    counts = np.bincount(tokens, minlength=len(target))
    support = target > 0
    assert counts[~support].sum() == 0, (counts, target)
    if support.sum() == 1:
        return
    expected = target[support] * len(tokens)
    assert expected.min() >= 20  # the chi-square approximation holds
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < chi_square_critical(int(support.sum()) - 1), (chi2, counts, target * len(tokens))


FILTER_CASES = {  # name: (temperature, top_k, top_p, min_p)
    "top_k": (1.0, 4, 1.0, 0.0),
    "top_p": (1.0, 10, 0.8, 0.0),
    "min_p": (1.0, 10, 1.0, 0.2),
    "top_k+temperature": (0.6, 5, 1.0, 0.0),
    "top_p+temperature": (1.7, 10, 0.75, 0.0),
    "min_p+temperature": (2.0, 10, 1.0, 0.3),
    "all+temperature": (1.4, 6, 0.9, 0.12),
}


def sample_filtered(logits: np.ndarray, cases: list[tuple[float, int, float, float]], n: int,
                    sampler=sample) -> list[np.ndarray]:
    """n draws per case, all cases as rows of one batch (so per-row parameters are exercised too)."""
    rows = len(cases) * n
    col = lambda i: np.repeat(np.array([c[i] for c in cases]), n)
    s = inputs(rows, len(logits), temperature=col(0).astype(np.float32), top_k=col(1).astype(np.int32),
               top_p=col(2).astype(np.float32), min_p=col(3).astype(np.float32),
               seeds=np.arange(rows, dtype=np.uint32) * 7 + 3, steps=np.arange(rows, dtype=np.int32) % 97)
    tokens = np.asarray(jax.jit(sampler)(jnp.tile(jnp.asarray(logits), (rows, 1)), s)[0])
    return [tokens[i * n:(i + 1) * n] for i in range(len(cases))]


@pytest.fixture(scope="module")
def shuffled_logits():
    logits = np.log(SHUFFLED_PROBS).astype(np.float32) + 1.5  # an offset: logits are not log-probabilities
    order = np.argsort(-logits)
    assert not np.array_equal(order[order], np.arange(len(order)))  # not an involution
    return logits


@pytest.mark.slow  # 20,000 draws per case (~3 s): the full suite
def test_filters_on_shuffled_logits_follow_the_numpy_distribution(shuffled_logits):
    names = list(FILTER_CASES)
    draws = sample_filtered(shuffled_logits, [FILTER_CASES[k] for k in names], DRAWS)
    for name, tokens in zip(names, draws, strict=True):
        target = reference_distribution(shuffled_logits.astype(np.float64), *FILTER_CASES[name])
        assert 1 < (target > 0).sum() < len(target), name  # each case filters something and leaves a choice
        try:
            assert_follows(tokens, target)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


CANDIDATE_CASES = {  # name: (temperature, top_k, top_p, min_p) over a 1024-token vocabulary
    "top_k=3": (1.0, 3, 1.0, 0.0),
    "top_k=6": (1.0, 6, 1.0, 0.0),
    "top_p+temperature": (1.7, 1024, 0.75, 0.0),
    "min_p+temperature": (2.0, 1024, 1.0, 0.01),  # keeps all ten
    "all+temperature": (1.4, 6, 0.9, 0.12),
    "no filter": (1.0, 1024, 1.0, 0.0),  # in a batch with filtered rows: the full-vocabulary draw
}


@pytest.mark.parametrize("widths", [None, (4, 8)], ids=["default widths", "forced fallbacks"])
def test_candidate_sets_and_their_fallbacks_follow_the_numpy_distribution(shuffled_logits, widths, monkeypatch):
    """The ten tokens scattered over 1024 (the rest near -inf). With the default widths every filtered row is
    sampled from its top-256 candidates, in one batch beside an unfiltered row; with widths (4, 8) each case,
    alone in its batch, goes to the first set holding all its kept tokens: 4, 8, or the whole vocabulary."""
    from jsgl.engine import sampler as sampler_module

    vocab = 1024
    logits = np.full(vocab, -1e4, np.float32)
    positions = np.random.default_rng(4).choice(vocab, len(shuffled_logits), replace=False)
    logits[positions] = shuffled_logits
    targets = {name: reference_distribution(logits.astype(np.float64), *case)
               for name, case in CANDIDATE_CASES.items()}
    n = 5000
    if widths is None:
        batches = {tuple(CANDIDATE_CASES): list(CANDIDATE_CASES.values())}
    else:
        monkeypatch.setattr(sampler_module, "CANDIDATE_WIDTHS", widths)
        batches = {(name,): [case] for name, case in CANDIDATE_CASES.items() if name != "no filter"}
        sets_used = {sum(int((targets[name] > 0).sum()) >= w for w in widths) for (name,) in batches}
        assert sets_used == {0, 1, 2}  # each fallback is exercised
    for names, cases in batches.items():
        # A fresh function: jit caches a trace per function, and the widths are read when tracing.
        draws = sample_filtered(logits, cases, n, sampler=lambda x, s: sample(x, s))
        for name, tokens in zip(names, draws, strict=True):
            try:
                assert_follows(tokens, targets[name])
            except AssertionError as exc:
                raise AssertionError(f"{name}, widths {widths}: {exc}") from None


# ------------------------------------------------------------- masks, bias, repetition penalty, logprobs


def test_unpack_bitmask_matches_numpy_unpackbits():
    from jsgl.engine.sampler import unpack_bitmask

    words = np.random.default_rng(3).integers(0, 2**32, size=(3, 4), dtype=np.uint64).astype(np.uint32)
    words[1] = [0xFFFFFFFF, 0, 0x80000001, 1]
    expected = np.unpackbits(words.astype("<u4").view(np.uint8), axis=-1, bitorder="little")[:, :100]
    got = np.asarray(jax.jit(unpack_bitmask, static_argnums=1)(jnp.asarray(words), 100))
    assert got.dtype == np.bool_ and got.shape == (3, 100)
    np.testing.assert_array_equal(got, expected.astype(bool))


def test_penalty_bias_mask_and_logprobs_by_their_effect():
    """Each row's greedy choice is worked out by hand; logprobs are of the model's raw distribution."""
    vocab = 40
    raw = np.tile(3.0 - 0.1 * np.arange(vocab, dtype=np.float32), (6, 1))  # token 0 best, then 1, 2, ...
    raw[1] -= 10.0  # all negative
    raw[5] -= 2.5  # token 0 at 0.5: between 0 and 1
    scale = np.ones((6, vocab), np.float32)
    scale[0, 0] = 4.0  # positive logit divided: 3.0 -> 0.75 < 2.9, so token 1
    scale[1, 0] = 1.1  # negative logit multiplied: -7.0 -> -7.7 < -7.1, so token 1
    scale[5, 0] = 4.0  # 0.5 -> 0.125 < 0.4: token 1
    bias = np.zeros((6, vocab), np.float32)
    bias[2, 7] = 1.0  # 2.3 + 1.0 > 3.0: token 7
    allowed = np.ones((6, vocab), bool)
    allowed[3] = np.isin(np.arange(vocab), [5, 35])  # token 5
    allowed[4] = np.isin(np.arange(vocab), [33, 35])  # token 33: the second word of the mask
    bits = np.zeros((6, 64), np.uint8)
    bits[:, :vocab] = allowed
    bitmask = np.packbits(bits, axis=-1, bitorder="little").view("<u4").astype(np.uint32)
    expected = [1, 1, 7, 5, 33, 1]
    log_softmax = raw.astype(np.float64) - np.log(np.exp(raw.astype(np.float64)).sum(-1, keepdims=True))
    for greedy in (True, False):  # all-greedy batch, and the sampling path with temperature 0
        s = inputs(6, vocab, all_greedy=greedy, temperature=np.zeros(6, np.float32), bitmask=bitmask,
                   logit_bias=bias, repetition_scale=scale, top_logprobs=3)
        tokens, token_lp, top_vals, top_ids = jax.jit(sample)(jnp.asarray(raw), s)
        assert np.asarray(tokens).tolist() == expected
        np.testing.assert_allclose(np.asarray(token_lp), log_softmax[np.arange(6), expected], atol=1e-5)
        assert np.asarray(top_ids).tolist() == [[0, 1, 2]] * 6
        np.testing.assert_allclose(np.asarray(top_vals), log_softmax[:, :3], atol=1e-5)
    s = inputs(6, vocab, all_greedy=True, token_logprobs=False)
    tokens, token_lp, top_vals, top_ids = jax.jit(sample)(jnp.asarray(raw), s)
    assert np.asarray(tokens).tolist() == [0] * 6
    assert token_lp.shape == (6,) and not np.asarray(token_lp).any()
    assert top_vals.shape == (6, 0) and top_ids.shape == (6, 0) and top_ids.dtype == jnp.int32


def test_top_k_one_and_min_p_one_with_tied_maxima():
    """top_k=1 leaves only the best token; min_p=1 keeps every token tied with the best (p >= 1 * p_max)."""
    logits = np.array([1.0, 3.0, 3.0, 0.0, 2.9], np.float32)
    n = 400
    s = inputs(2 * n, 5, top_k=np.repeat(np.array([1, 5], np.int32), n),
               min_p=np.repeat(np.array([0.0, 1.0], np.float32), n))
    tokens = np.asarray(jax.jit(sample)(jnp.tile(jnp.asarray(logits), (2 * n, 1)), s)[0])
    assert set(tokens[:n].tolist()) in ({1}, {2})  # whichever of the tie sorts first, alone
    counts = np.bincount(tokens[n:], minlength=5)
    assert counts[[0, 3, 4]].sum() == 0 and min(counts[1], counts[2]) > 150  # both tied tokens, ~1/2 each


def test_bfloat16_logits_are_sampled_in_float32():
    """Logprobs come from float32 arithmetic even when the model hands bfloat16 logits."""
    raw = (np.arange(64, dtype=np.float32) % 7) * 0.5  # exact in bfloat16
    tokens, token_lp, top_vals, _ = jax.jit(sample)(jnp.asarray(raw[None], jnp.bfloat16),
                                                    inputs(1, 64, all_greedy=True, top_logprobs=2))
    log_softmax = raw.astype(np.float64) - np.log(np.exp(raw.astype(np.float64)).sum())
    assert int(tokens[0]) == 6 and token_lp.dtype == jnp.float32
    np.testing.assert_allclose(float(token_lp[0]), log_softmax[6], atol=1e-5)
    np.testing.assert_allclose(np.asarray(top_vals[0]), log_softmax[[6, 13]], atol=1e-5)


def test_argmax_of_a_row_with_nan_stays_a_valid_token():
    x = np.zeros((2, 300), np.float32)
    x[0, 5] = np.nan
    x[1, 7] = 1.0
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    assert 0 <= got[0] < 300 and got[1] == 7  # a NaN row (a broken model) must not index past the vocabulary
