"""A local retriever for the RAG and ReAct workloads: BM25 (rank_bm25) over BoolQ's 3,270 Wikipedia
passages, no network. Passages are cut to their first sentences so a prompt with three of them stays a
few hundred tokens on the default model."""

from __future__ import annotations

import functools
import re

from jsgl.experiments.datasets import boolq_rows

PASSAGE_CHARS = 400
_WORD = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def shorten(passage: str, limit: int = PASSAGE_CHARS) -> str:
    """The passage's leading sentences, at most `limit` characters (at least its first sentence cut there)."""
    if len(passage) <= limit:
        return passage
    cut = passage.rfind(". ", 0, limit)
    return passage[: cut + 1] if cut > 0 else passage[:limit]


class Retriever:
    def __init__(self, passages: list[str]) -> None:
        from rank_bm25 import BM25Okapi  # the bench extra: pip install rank-bm25

        self.passages = passages
        self._bm25 = BM25Okapi([tokenize(p) for p in passages])

    def search(self, query: str, k: int) -> list[str]:
        scores = self._bm25.get_scores(tokenize(query))
        best = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]
        return [self.passages[i] for i in best]


@functools.cache
def boolq_retriever() -> Retriever:
    """BM25 over BoolQ's distinct passages, each shortened (built once per process, ~1 s)."""
    passages = list(dict.fromkeys(shorten(r["passage"]) for r in boolq_rows()))
    return Retriever(passages)
