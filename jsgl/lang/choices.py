"""How `select` turns the per-token log-probabilities of each choice into a decision.

Each method gets, per choice, the list of `(logprob, token_id, token_text)` of the choice's tokens given
the prompt (`input_token_logprobs`), their mean (`normalized_prompt_logprobs`) and, when it asks for them,
the logprobs of the same tokens with no prompt at all (`unconditional_token_logprobs`, first one None).
A user may pass any callable with this keyword interface as `choices_method`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

from jsgl.engine.sampling_params import GREEDY_TEMPERATURE

TokenLogprob = tuple[float | None, int, str | None]


@dataclasses.dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


def _first_argmax(values: list[float]) -> int:
    if not values:
        raise ValueError("no choices to select from")
    # NaN (a choice with no tokens) must never win.
    clean = [(-math.inf if math.isnan(v) else v) for v in values]
    return max(range(len(clean)), key=clean.__getitem__)


def mean_logprob(token_logprobs: list[TokenLogprob]) -> float:
    """Mean of the known logprobs (a None, the first prompt token, has no context and is left out)."""
    vals = [t[0] for t in token_logprobs if t[0] is not None]
    return sum(vals) / len(vals) if vals else float("nan")


class ChoicesSamplingMethod:
    """Base class: set `requires_unconditional_logprobs` if `__call__` needs the no-prompt logprobs."""

    requires_unconditional_logprobs: bool = False

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[TokenLogprob]],
        output_token_logprobs: list[list[TokenLogprob]],
        unconditional_token_logprobs: list[list[TokenLogprob]] | None = None,
    ) -> ChoicesDecision:
        raise NotImplementedError

    def scores(self, **kwargs: Any) -> list[float]:
        """One number per choice, higher is better (also what temperature sampling uses)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


def _meta(kwargs: dict[str, Any], **extra: Any) -> dict[str, Any]:
    meta = {
        "normalized_prompt_logprobs": kwargs["normalized_prompt_logprobs"],
        "input_token_logprobs": kwargs["input_token_logprobs"],
        "output_token_logprobs": kwargs["output_token_logprobs"],
    }
    meta.update(extra)
    return meta


class TokenLengthNormalized(ChoicesSamplingMethod):
    """Pick the choice with the highest mean token logprob (total logprob would favour short choices)."""

    def scores(self, **kwargs: Any) -> list[float]:
        return list(kwargs["normalized_prompt_logprobs"])

    def __call__(self, **kwargs: Any) -> ChoicesDecision:
        best = _first_argmax(self.scores(**kwargs))
        return ChoicesDecision(kwargs["choices"][best], _meta(kwargs, scores=self.scores(**kwargs)))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token, keeping those with the best logprob at each position, as greedy
    decoding would. A choice that has run out of tokens is extended with its own mean logprob, so a
    choice that is a prefix of another still competes."""

    def _matrix(self, input_token_logprobs: list[list[TokenLogprob]]) -> list[list[float]]:
        width = max((len(toks) for toks in input_token_logprobs), default=0)
        rows = []
        for toks in input_token_logprobs:
            vals = [t[0] if t[0] is not None else 0.0 for t in toks]
            pad = sum(vals) / len(vals) if vals else -math.inf
            rows.append(vals + [pad] * (width - len(vals)))
        return rows

    def _survivors(self, matrix: list[list[float]]) -> list[int]:
        alive = list(range(len(matrix)))
        width = len(matrix[0]) if matrix else 0
        for j in range(width):
            top = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] == top]
            if len(alive) == 1:
                break
        return alive

    def scores(self, **kwargs: Any) -> list[float]:
        # Rank: survivors score 0, the rest by how long they survived (negative), for sampling/inspection.
        matrix = self._matrix(kwargs["input_token_logprobs"])
        out = [-math.inf] * len(matrix)
        for i in self._survivors(matrix):
            out[i] = 0.0
        return out

    def __call__(self, **kwargs: Any) -> ChoicesDecision:
        matrix = self._matrix(kwargs["input_token_logprobs"])
        best = self._survivors(matrix)[0]
        return ChoicesDecision(kwargs["choices"][best], _meta(kwargs, greedy_logprob_matrix=matrix))


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Pick the choice whose tokens gain the most from the prompt: mean of (logprob given the prompt -
    logprob with no prompt), which discounts choices that are likely whatever the question."""

    requires_unconditional_logprobs = True

    def scores(self, **kwargs: Any) -> list[float]:
        uncond = kwargs.get("unconditional_token_logprobs")
        if uncond is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs")
        out = []
        for cond_toks, unc_toks in zip(kwargs["input_token_logprobs"], uncond, strict=True):
            if len(cond_toks) != len(unc_toks):
                raise ValueError("conditional and unconditional logprobs differ in length")
            diffs = [(c[0] or 0.0) - (u[0] or 0.0) for c, u in zip(cond_toks, unc_toks, strict=True)]
            out.append(sum(diffs) / len(diffs) if diffs else float("nan"))
        return out

    def __call__(self, **kwargs: Any) -> ChoicesDecision:
        scores = self.scores(**kwargs)
        best = _first_argmax(scores)
        return ChoicesDecision(
            kwargs["choices"][best],
            _meta(kwargs, unconditional_token_logprobs=kwargs["unconditional_token_logprobs"],
                  normalized_unconditional_prompt_logprobs=scores),
        )


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def decide(choices: list[str], cond: list[list[TokenLogprob]], uncond: list[list[TokenLogprob]] | None,
           temperature: float, method: Any) -> ChoicesDecision:
    """Apply ``method`` to the scored choices; with ``temperature > 0`` and a method that exposes
    ``scores``, sample a choice from softmax(scores / temperature) instead of taking the argmax."""
    kwargs = {
        "choices": list(choices),
        "normalized_prompt_logprobs": [mean_logprob(t) for t in cond],
        "input_token_logprobs": cond,
        "output_token_logprobs": [[] for _ in choices],
        "unconditional_token_logprobs": uncond,
    }
    decision = method(**kwargs)
    if temperature <= GREEDY_TEMPERATURE or not hasattr(method, "scores"):
        return decision
    scores = method.scores(**kwargs)
    finite = [(-math.inf if math.isnan(x) else x) for x in scores]
    top = max(finite)
    weights = [math.exp((x - top) / temperature) if x > -math.inf else 0.0 for x in finite]
    pick = random.choices(range(len(choices)), weights=weights)[0]
    return ChoicesDecision(choices[pick], {**(decision.meta_info or {}), "sampled_from_scores": scores})


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Tokens two id lists share from the start (where a choice's own tokens begin after the prompt)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
