"""Incremental detokenization with stop strings checked on text, never split across tokens."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters.

    Decoding a short window ``ids[prefix:]`` and subtracting the already-emitted part keeps each step
    O(window) and handles tokenizers whose decode of a token depends on its left neighbour.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: list[str],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # decoded so far, up to a stop string if one matched
        self.matched_stop: str | None = None
        self._prefix = 0  # window start (token index)
        self._read = 0  # tokens already turned into text
        self._emitted = 0  # characters already handed to the stream

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids: list[int]) -> bool:
        """Account for ``ids`` (the whole output so far); returns True if a stop string matched."""
        if self.matched_stop is not None:
            return True
        before = self._decode(ids[self._prefix: self._read])
        window = self._decode(ids[self._prefix:])
        if window.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
            return False
        new_text = window[len(before):]
        self._prefix, self._read = max(self._read - 4, 0), len(ids)
        return self._append(new_text)

    def append_forced(self, text: str, num_tokens: int) -> bool:
        """Text appended outside sampling (jump-forward); tokens from ``num_tokens`` on decode afresh."""
        self._prefix = self._read = num_tokens
        return self._append(text)

    def _append(self, new_text: str) -> bool:
        if self.matched_stop is not None:
            return True
        if not new_text:
            return False
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop_strings), default=0))
        self.text += new_text
        cut = None
        for stop in self.stop_strings:
            at = self.text.find(stop, search_from)
            if at >= 0 and (cut is None or at < cut[0]):
                cut = (at, stop)
        if cut is not None:
            self.text = self.text[: cut[0]]
            self.matched_stop = cut[1]
            return True
        return False

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string. Only prefixes
        ending in the text's last character can match, so candidates are that character's positions in
        the stop string (not every prefix length: with 32 stop strings of 256 characters that scan cost
        ~1 ms per token)."""
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
