"""The optimal cache hit rate of a workload (paper Theorem 3.1): 1 - distinct prefix tokens / prompt tokens.

With an unbounded cache and a perfect order, every prompt token that some earlier sequence already
contained at the same prefix is a hit, so only the prompt tokens of the union trie must ever be computed.
A finished request's output counts as contained too (the cache keeps prompt + output): a program's next
call extends the text its last call generated, and that continuation is a hit, not a distinct prefix.
"""

from __future__ import annotations

from collections.abc import Sequence


class DistinctPrefixCounter:
    """A plain token trie (dicts) that counts the distinct prefixes of all prompts added."""

    def __init__(self) -> None:
        self._root: dict[int, dict] = {}
        self.distinct_tokens = 0
        self.prompt_tokens = 0
        self.nodes = 0  # distinct prompt tokens plus the output tokens added (what the trie's memory holds)

    def add(self, tokens: Sequence[int]) -> None:
        node = self._root
        self.prompt_tokens += len(tokens)
        for token in tokens:
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                self.distinct_tokens += 1
                self.nodes += 1
            node = child

    def add_generated(self, tokens: Sequence[int]) -> None:
        """A finished request's prompt + output: later prompts may reuse it, but none of it was a prompt
        token of its own to count."""
        node = self._root
        for token in tokens:
            child = node.get(token)
            if child is None:
                child = node[token] = {}
                self.nodes += 1
            node = child

    @property
    def optimal_hit_rate(self) -> float:
        return 0.0 if not self.prompt_tokens else 1.0 - self.distinct_tokens / self.prompt_tokens
