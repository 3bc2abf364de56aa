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

Per request, a draft that was wholly rejected backs speculation off for a growing number of steps; and none is
proposed for decode batches larger than ``max_batch`` (where a verify row costs more than it saves).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import numpy as np

from jsgl.engine.sequence import Sequence
from jsgl.radix.cache_base import PrefixCacheBase

ALGORITHMS = ("none", "ngram")
# Decode batches above this many requests get no drafts, per platform (docs/performance.md, speculative decoding).
DEFAULT_MAX_BATCH = {"cpu": 16, "gpu": 16, "tpu": 16}
MAX_BACKOFF_STEPS = 32  # a request whose drafts keep failing still tries every this many steps


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
    return Speculator(NgramProposer(prefix_cache, settings.min_window, settings.max_window), settings, token_limit)


class Speculator:
    """Decides each request's draft for a step and learns from what was accepted."""

    def __init__(self, proposer: DraftProposer, settings: SpeculativeSettings, token_limit: int):
        self.proposer = proposer
        self.settings = settings
        self.token_limit = token_limit
        self.stats = SpeculativeStats()
        self._backoff: dict[str, tuple[int, int]] = {}  # rid -> (steps left without drafts, current backoff)

    def draft(self, seq: Sequence) -> Draft | None:
        """``seq``'s draft for this step, or None (no guess, backed off, asks for logprobs, or no room)."""
        if seq.params.return_logprob:  # a verified token's logprob would need every row's: not supported yet
            return None
        skip, backoff = self._backoff.get(seq.rid, (0, 0))
        if skip > 0:
            self._backoff[seq.rid] = (skip - 1, backoff)
            return None
        # Room: one sampled token follows the draft, within the request's budget and the pool's token limit.
        room = min(self.settings.num_draft_tokens, seq.max_new_tokens - len(seq.output_ids) - 1,
                   self.token_limit - seq.num_tokens - 1)
        if room <= 0:
            return None
        tokens = self.proposer.propose(seq, room)
        if not tokens:
            return None
        if seq.constraint is None:
            return Draft(tokens)
        return grammar_cut(seq, tokens)

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """``accepted`` of ``proposed`` draft tokens were kept: a wholly rejected draft doubles the pause."""
        s = self.stats
        s.proposed += proposed
        s.accepted += accepted
        s.drafted_requests += 1
        if accepted == 0:
            _, backoff = self._backoff.get(seq.rid, (0, 0))
            backoff = min(max(1, 2 * backoff), MAX_BACKOFF_STEPS)
            self._backoff[seq.rid] = (backoff, backoff)
        else:
            self._backoff.pop(seq.rid, None)

    def forget(self, seq: Sequence) -> None:
        self._backoff.pop(seq.rid, None)


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
