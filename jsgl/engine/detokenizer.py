"""Incremental detokenization with stop strings and stop regexes checked on text, never split across tokens."""

from __future__ import annotations

import time

import regex
from transformers import PreTrainedTokenizerBase

from jsgl.errors import InvalidRequestError

# A stop_regex is searched from this many characters before the new text (fewer if the pattern's matches
# are shorter): bounds the per-token cost of a pattern like `a.*b` on a long output.
STOP_REGEX_WINDOW = 4096
# A request's stop_regexes may take this long together per new piece of text; `(a|a)*b`-style backtracking (30
# 'a's take seconds), or many slow patterns, would otherwise stall the engine thread for every request. The request
# fails instead (400-class).
STOP_REGEX_TIMEOUT_S = 0.01
# Tokens already turned into text that are decoded again before new ones: a token's text can depend on its left
# neighbour (SentencePiece's leading space is dropped from the first token of a decode).
LEFT_CONTEXT_TOKENS = 4


def _max_match_len(pattern: regex.Pattern) -> int:
    """Longest text the pattern can match, or STOP_REGEX_WINDOW if unbounded (SGLang bounds it alike)."""
    import re._parser as sre_parse

    try:
        _, high = sre_parse.parse(pattern.pattern).getwidth()
    except Exception:  # a `regex`-only construct: no bound known
        return STOP_REGEX_WINDOW
    return min(int(high), STOP_REGEX_WINDOW)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters.

    Decoding a short window ``ids[prefix:]`` and subtracting the already-emitted part keeps each step
    O(window) and handles tokenizers whose decode of a token depends on its left neighbour.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: list[str],
                 skip_special_tokens: bool = True, *, stop_regexes: list[str] | None = None,
                 spaces_between_special_tokens: bool = True, no_stop_trim: bool = False):
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.stop_regexes = [regex.compile(p) for p in stop_regexes or []]
        self._regex_window = max((_max_match_len(p) for p in self.stop_regexes), default=0)
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.no_stop_trim = no_stop_trim  # keep the matched stop string in the text
        self.check_stops = True  # False while min_new_tokens is not reached
        self.text = ""  # decoded so far, up to a stop string if one matched
        self.matched_stop: str | None = None
        self._prefix = 0  # window start (token index)
        self._read = 0  # tokens already turned into text
        self._emitted = 0  # characters already handed to the stream

    def _decode(self, ids: list[int]) -> str:
        if self.spaces_between_special_tokens:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        # Only slow (Python) tokenizers read this flag; fast ones never put spaces there.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=False)

    def add(self, ids: list[int]) -> bool:
        """Account for ``ids`` (the whole output so far); returns True if a stop string matched."""
        if self.matched_stop is not None:
            return True
        before = self._decode(ids[self._prefix: self._read])
        window = self._decode(ids[self._prefix:])
        if window.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            return False
        new_text = window[len(before):]
        self._prefix, self._read = max(self._read - LEFT_CONTEXT_TOKENS, 0), len(ids)
        return self._append(new_text)

    def append_forced(self, text: str, num_tokens: int) -> bool:
        """Text appended outside sampling (jump-forward): the output's first ``num_tokens`` tokens, whose text
        is taken as given; tokens from ``num_tokens`` on decode after them (as left context)."""
        self._prefix, self._read = max(num_tokens - LEFT_CONTEXT_TOKENS, 0), num_tokens
        return self._append(text)

    def _append(self, new_text: str) -> bool:
        if self.matched_stop is not None:
            return True
        if not new_text:
            return False
        old_len = len(self.text)
        self.text += new_text
        if not self.check_stops:
            return False
        search_from = max(0, old_len - max((len(s) for s in self.stop_strings), default=0))
        cut = None  # (start, end, what matched)
        for stop in self.stop_strings:
            at = self.text.find(stop, search_from)
            if at >= 0 and (cut is None or at < cut[0]):
                cut = (at, at + len(stop), stop)
        if self.stop_regexes:
            cut = self._search_regexes(old_len, cut)
        if cut is not None:
            self.text = self.text[: cut[1] if self.no_stop_trim else cut[0]]
            self.matched_stop = cut[2]
            return True
        return False

    def _search_regexes(self, old_len: int, cut: tuple[int, int, str] | None) -> tuple[int, int, str] | None:
        """The earliest stop_regex match ending in the new text (earlier text was searched before)."""
        start = max(0, old_len - self._regex_window)
        deadline = time.perf_counter() + STOP_REGEX_TIMEOUT_S  # one budget for all of them: a step's cost is bounded
        for pattern in self.stop_regexes:
            try:
                m = pattern.search(self.text, start, timeout=max(deadline - time.perf_counter(), 1e-6))
            except TimeoutError:
                raise InvalidRequestError(f"the stop_regex patterns took over {STOP_REGEX_TIMEOUT_S * 1000:g} ms "
                                          f"together to search the output (at {pattern.pattern!r}): give fewer "
                                          "or simpler ones") from None
            if m is not None and (cut is None or m.start() < cut[0]):
                cut = (m.start(), m.end(), pattern.pattern)
        return cut

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string. Only prefixes
        ending in the text's last character can match, so candidates are that character's positions in
        the stop string (not every prefix length, which is slow with many long stop strings)."""
        last, held = self.text[-1], 0
        for stop in self.stop_strings:
            k = stop.rfind(last, 0, min(len(stop) - 1, len(self.text)))
            while k + 1 > held:
                if self.text.endswith(stop[: k + 1]):
                    held = k + 1
                    break
                k = stop.rfind(last, 0, k)
        return held

    def stream_delta(self, final: bool) -> str:
        """New text safe to show: holds back a tail that could still become a stop string."""
        end = len(self.text)
        if not final and end:
            end -= self._held_back()
        end = max(end, self._emitted)
        delta = self.text[self._emitted: end]
        self._emitted = end
        return delta
