"""Speculative decoding without a draft model: n-gram proposals, cut by the request's grammar, verified in one step.

A running request's next tokens are guessed from text it has already seen (``NgramProposer``): the continuation the
prefix cache holds for its exact tokens (an earlier answer to the same prompt), else the tokens that followed the
latest earlier occurrence of its last few tokens (prompt lookup: answers that copy the prompt). Under a grammar the
guess is walked through a copy of the request's constraint and cut where the grammar forbids it; each kept token
carries the mask of the state before it.

Verification (``EngineLoop``): the request's uncomputed tokens (one, or a jump-forward's forced run) and its draft
are one-token rows of a decode step, each attending to the request's slots up to its own position (every backend
writes a step's K/V before it attends). Each row samples as the request would at that output position: its own
step index (the seeded noise, so a seeded request gives the same tokens with or without speculation), penalties
over the output before it, its grammar mask. A draft token is accepted while it equals the token sampled before it
(greedy: the argmax; sampled: a point-mass draft's rejection rule is exactly "sample, keep if equal"), so the
output distribution is the model's. Rejected rows' slots go back to the allocator at once.

How many draft tokens a step verifies is ``choose_rows``'s: the most expected tokens per second of step, from each
request's acceptance record and what a step of so many rows costs here (``StepCosts``). A request whose draft was
wholly rejected, found none, or was not worth its rows backs off for a growing number of its tokens; none is
proposed for decode batches larger than ``max_batch``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import numpy as np

from jsgl.engine.sequence import Sequence
from jsgl.radix.cache_base import PrefixCacheBase

# Decode batches above this many requests get no drafts, per platform (docs/performance.md, speculative decoding).
DEFAULT_MAX_BATCH = {"cpu": 8, "gpu": 64, "tpu": 64}
MAX_BACKOFF_STEPS = 32  # a request whose drafts keep failing still tries every this many tokens
RECORD_DECAY = 0.7  # weight of a request's older drafts in its acceptance record, per verify step
# Decode step seconds by rows on one machine, relative (2 CPU cores, SmolLM2-135M, ~100-token contexts; 1 row = 7.6 ms,
# docs/performance.md): a draft row costs about a quarter of a step from 4 rows up. Accelerators have no profile
# yet (unmeasured): a step costs the same at any row count up to the batch limit, as a memory-bound decode would.
STEP_COST_PROFILE = {"cpu": {1: 1.0, 2: 1.27, 4: 1.61, 8: 2.72, 16: 4.36, 32: 9.0}}


@dataclasses.dataclass(frozen=True)
class SpeculativeSettings:
    num_draft_tokens: int = 4
    min_window: int = 1  # n-gram match lengths tried, longest first
    max_window: int = 4
    max_batch: int = 16  # decode batches above this many requests get no drafts


class DraftProposer(abc.ABC):
    """Where drafts come from (n-gram lookup here; a draft model would be another)."""

    @abc.abstractmethod
    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` guesses of the tokens that follow ``seq.token_ids``."""


class NgramProposer(DraftProposer):
    def __init__(self, prefix_cache: PrefixCacheBase, min_window: int, max_window: int):
        self.cache = prefix_cache
        self.min_window, self.max_window = min_window, max_window

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        tokens = seq.token_ids
        cached = self.cache.continuation(tokens, num_tokens)
        if cached:
            return cached
        return prompt_lookup(np.asarray(tokens, np.int32), num_tokens, self.min_window, self.max_window)


def prompt_lookup(tokens: np.ndarray, num_tokens: int, min_window: int, max_window: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the last n tokens (n from ``max_window`` down to
    ``min_window``), at most ``num_tokens`` of them."""
    for n in range(min(max_window, len(tokens) - 1), min_window - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start: start + num_tokens].tolist()
    return []


@dataclasses.dataclass
class Draft:
    """One request's proposal for a step: the tokens, and under a grammar the mask before each token and after the
    last (``masks[i]``: where the request stands after ``tokens[:i]``)."""

    tokens: list[int]
    masks: list[np.ndarray] | None = None


@dataclasses.dataclass
class SpeculativeStats:
    verify_steps: int = 0  # decode steps that carried drafts
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    drafted_requests: int = 0  # request-steps with a draft (acceptance length = accepted / this + 1)

    def as_dict(self) -> dict[str, float]:
        per_request = self.accepted / self.drafted_requests + 1 if self.drafted_requests else 0.0
        return {**dataclasses.asdict(self), "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "acceptance_length": per_request}


def make_speculator(config: Any, prefix_cache: PrefixCacheBase, token_limit: int, platform: str) -> Speculator | None:
    """The speculator an ``EngineConfig`` asks for, or None (``speculative_algorithm`` none)."""
    if config.speculative_algorithm == "none":
        return None
    settings = SpeculativeSettings(config.speculative_num_draft_tokens, config.speculative_ngram_min_match_window_size,
                                   config.speculative_ngram_max_match_window_size,
                                   config.speculative_max_batch or DEFAULT_MAX_BATCH.get(platform, 16))
    return Speculator(NgramProposer(prefix_cache, settings.min_window, settings.max_window), settings, token_limit,
                      STEP_COST_PROFILE.get(platform))


class Speculator:
    """Decides each request's draft for a step and learns from what was accepted."""

    def __init__(self, proposer: DraftProposer, settings: SpeculativeSettings, token_limit: int,
                 platform_costs: dict[int, float] | None = None):
        self.proposer = proposer
        self.settings = settings
        self.token_limit = token_limit
        self.stats = SpeculativeStats()
        # rid -> (output length from which it drafts again, current backoff): paused by its own progress, so steps
        # that do not ask (overlapped ones) count too.
        self._backoff: dict[str, tuple[int, int]] = {}
        # rid -> (accepted, trials) of its draft tokens, decayed: a draft token is accepted with probability
        # (accepted + 1) / (trials + 2), the next after it with that squared, ...
        self._record: dict[str, tuple[float, float]] = {}
        self.costs = StepCosts(platform_costs)

    def may_draft(self, seq: Sequence) -> bool:
        """Whether ``seq`` would look for a draft now (not backed off). A verified token's logprobs are its row's."""
        return len(seq.output_ids) >= self._backoff.get(seq.rid, (0, 0))[0]

    def draft(self, seq: Sequence) -> Draft | None:
        """``seq``'s draft for this step, or None (no guess, backed off, or no room). A request
        whose text offers no guess backs off as one whose draft was rejected."""
        if not self.may_draft(seq):
            return None
        # Room: one sampled token follows the draft, within the request's budget and the pool's token limit.
        room = min(self.settings.num_draft_tokens, seq.max_new_tokens - len(seq.output_ids) - 1,
                   self.token_limit - seq.num_tokens - 1)
        if room <= 0:
            return None
        tokens = self.proposer.propose(seq, room)
        if not tokens:
            self._back_off(seq)
            return None
        if seq.constraint is None:
            return Draft(tokens)
        return grammar_cut(seq, tokens)

    def acceptance(self, seq: Sequence) -> float:
        """The chance that ``seq``'s next draft token is accepted (each further one: this times the one before)."""
        accepted, trials = self._record.get(seq.rid, (0.0, 0.0))
        return (accepted + 1.0) / (trials + 2.0)

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """``accepted`` of ``proposed`` draft tokens were kept (the model agreed with them): the request's record,
        and a wholly rejected draft doubles its pause."""
        s = self.stats
        s.proposed += proposed
        s.accepted += accepted
        s.drafted_requests += 1
        past_accepted, past_trials = self._record.get(seq.rid, (0.0, 0.0))
        trials = accepted + (accepted < proposed)  # tokens after the first rejected one were never tried
        self._record[seq.rid] = (RECORD_DECAY * past_accepted + accepted, RECORD_DECAY * past_trials + trials)
        if accepted == 0:
            self._back_off(seq)
        else:
            self._backoff.pop(seq.rid, None)

    def passed_over(self, seq: Sequence) -> None:
        """``seq``'s draft was not worth its rows in this step (choose_rows): it pauses as after a miss."""
        self._back_off(seq)

    def _back_off(self, seq: Sequence) -> None:
        """No draft for the next 1, 2, 4, ... tokens of ``seq`` (up to MAX_BACKOFF_STEPS) after each miss in a row."""
        backoff = min(max(1, 2 * self._backoff.get(seq.rid, (0, 0))[1]), MAX_BACKOFF_STEPS)
        self._backoff[seq.rid] = (len(seq.output_ids) + backoff, backoff)

    def forget(self, seq: Sequence) -> None:
        self._backoff.pop(seq.rid, None)
        self._record.pop(seq.rid, None)


class StepCosts:
    """What a decode step of R rows (a power of two) costs, relative to others: the engine's own timings (a decayed
    mean per row count, once seen a few times), else the platform's measured profile scaled to what was seen."""

    def __init__(self, profile: dict[int, float] | None):
        self.profile = dict(profile or {})
        self._seen: dict[int, tuple[float, int]] = {}  # rows -> (mean seconds, observations)

    def observe(self, rows: int, seconds: float) -> None:
        mean, count = self._seen.get(rows, (seconds, 0))
        self._seen[rows] = (mean + (seconds - mean) / min(count + 1, 16), count + 1)

    def cost(self, rows: int) -> float:
        seen = {r: mean for r, (mean, count) in self._seen.items() if count >= 3}
        if rows in seen:
            return seen[rows]
        if not seen:
            return self._prior(rows)
        anchor = min(seen, key=lambda r: abs(r.bit_length() - rows.bit_length()))
        estimate = self._prior(rows) * seen[anchor] / self._prior(anchor)
        # Never below what fewer rows were seen to cost, nor above what more rows were.
        estimate = max([estimate, *(mean for r, mean in seen.items() if r < rows)])
        return min([estimate, *(mean for r, mean in seen.items() if r > rows)])

    def _prior(self, rows: int) -> float:
        """The profile's cost, linear between its row counts (flat where it has none: a memory-bound step)."""
        if not self.profile:
            return 1.0
        points = sorted(self.profile.items())
        if rows <= points[0][0]:
            return points[0][1]
        for (r0, c0), (r1, c1) in zip(points, points[1:]):
            if rows <= r1:
                return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
        (r0, c0), (r1, c1) = points[-2], points[-1]
        return c1 + (c1 - c0) * (rows - r1) / (r1 - r0)


def choose_rows(base_rows: int, num_requests: int, lengths: list[int], acceptance: list[float], costs: StepCosts,
                max_rows: int) -> list[int]:
    """How many tokens of each draft a step verifies: the row count (a power of two, at most ``max_rows``; padding
    rows cost what draft rows do) with the most expected tokens per second of step. A draft's j-th token adds
    ``acceptance ** j`` expected tokens; the most likely ones fill the rows first (a prefix of each draft)."""
    gains = sorted(((a ** j, i) for i, (n, a) in enumerate(zip(lengths, acceptance)) for j in range(1, n + 1)),
                   reverse=True)
    smallest = 1 << max(0, (base_rows - 1).bit_length())
    best_value, best_extra = num_requests / costs.cost(smallest), 0
    rows = smallest
    while True:
        extra = min(rows - base_rows, len(gains))
        value = (num_requests + sum(g for g, _ in gains[:extra])) / costs.cost(rows)
        if value > best_value:
            best_value, best_extra = value, extra
        if rows >= max_rows or extra == len(gains):
            break
        rows *= 2
    keep = [0] * len(lengths)
    for _, i in gains[:best_extra]:
        keep[i] += 1
    return keep


def grammar_cut(seq: Sequence, tokens: list[int]) -> Draft | None:
    """``tokens`` walked through a copy of ``seq``'s constraint: kept up to the first the grammar forbids (or a stop
    token: the request would end there), with the mask before each kept token and after the last."""
    state: Any = seq.constraint.copy()
    masks = [state.allowed_token_bitmask()]
    kept: list[int] = []
    for token in tokens:
        mask = masks[-1]
        if token in seq.stop_ids or token >= len(mask) * 32 or not (int(mask[token >> 5]) >> (token & 31)) & 1:
            break
        state.advance(token)
        kept.append(token)
        masks.append(state.allowed_token_bitmask())
    return Draft(kept, masks) if kept else None
