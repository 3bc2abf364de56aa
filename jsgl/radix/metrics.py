"""The optimal cache hit rate of a workload (paper Theorem 3.1): 1 - distinct prefix tokens / prompt tokens.

With an unbounded cache and a perfect order, every prompt token that some earlier prompt already
contained at the same prefix is a hit, so only the tokens of the union trie must ever be computed.
"""

from __future__ import annotations

from collections.abc import Sequence


class DistinctPrefixCounter:
    """A plain token trie (dicts) that counts the distinct prefixes of all prompts added."""

    def __init__(self) -> None:
        self._root: dict[int, dict] = {}
        self.distinct_tokens = 0
        self.prompt_tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        node = self._root
        self.prompt_tokens += len(tokens)
        for token in tokens:
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                self.distinct_tokens += 1
            node = child

    @property
    def optimal_hit_rate(self) -> float:
        return 0.0 if not self.prompt_tokens else 1.0 - self.distinct_tokens / self.prompt_tokens
