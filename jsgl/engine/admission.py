"""Admission checks: everything a request is validated against before it may cost the engine anything.

Runs on the caller's thread (`Engine.submit`). Limits come from EngineConfig, so the in-process API and the
server refuse the same things: non-finite sampling values, too many logprobs or stop strings, prompts that
cannot fit, text that is not valid Unicode.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from jsgl.engine.config import EngineConfig
from jsgl.engine.request import SamplingParams
from jsgl.engine.spanned_prompt import SpannedPrompt, prompt_text, tokenize_prompt
from jsgl.errors import InvalidRequestError


def check_text(text: str, what: str) -> None:
    """Reject strings that are not valid Unicode (JSON allows lone surrogates; UTF-8 does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"the {what} is not valid Unicode (a lone surrogate at character "
                                  f"{exc.start})") from None


class Admission:
    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int, max_context: int,
                 kv_capacity: int) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.vocab_size, self.max_context, self.kv_capacity = vocab_size, max_context, kv_capacity
        # A text longer than this cannot fit the context whatever it says (no token is longer than the
        # vocabulary's longest), so checking it before tokenizing rejects nothing that would fit.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = max_context * max(longest, 1)

    def sampling_params(self, value: SamplingParams | dict | None) -> SamplingParams:
        """Validated params of one request (one sample: n > 1 is expanded by the caller)."""
        params = SamplingParams.from_any(value)
        params.validate(self.vocab_size)
        if params.n > 1:
            raise InvalidRequestError("n > 1 asks for several samples: expand it into n requests "
                                      "(Engine.generate and the server do; Engine.submit takes one)")
        cfg = self.config
        if params.top_logprobs_num > cfg.max_top_logprobs:
            raise InvalidRequestError(f"top_logprobs_num is {params.top_logprobs_num}; this server allows at "
                                      f"most {cfg.max_top_logprobs} (--max-top-logprobs)")
        stops = params.stop_strings
        if len(stops) > cfg.max_stop_sequences:
            raise InvalidRequestError(f"{len(stops)} stop strings; this server allows at most "
                                      f"{cfg.max_stop_sequences} (--max-stop-sequences)")
        if any(len(stop) > cfg.max_stop_chars for stop in stops):
            raise InvalidRequestError(f"a stop string is longer than {cfg.max_stop_chars} characters "
                                      "(--max-stop-chars)")
        for stop in stops:
            check_text(stop, "stop string")
        return params

    def prompt_ids(self, prompt: str | SpannedPrompt | Seq[int], params: SamplingParams) -> list[int]:
        ids = self._tokenize(prompt)
        if len(ids) >= self.max_context:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; the context length is {self.max_context}")
        if len(ids) + 1 > self.kv_capacity:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; the KV pool holds {self.kv_capacity}")
        if params.logprob_start_len >= len(ids):
            raise InvalidRequestError(f"logprob_start_len {params.logprob_start_len} >= prompt length")
        return ids

    def check_samples_fit(self, prompt_ids: Seq[list[int]], params: Seq[SamplingParams],
                          samples: Seq[int] | None) -> None:
        """Refuse the n samples of a prompt (``samples[i]`` consecutive requests) that together can never fit the KV
        pool: admitted together, they would retract and recompute each other over and over, holding the engine."""
        if samples is None:
            return
        if sum(samples) != len(prompt_ids):
            raise ValueError(f"samples counts {sum(samples)} requests of {len(prompt_ids)}")
        start = 0
        for n in samples:
            if n > 1:
                self._check_group_fits(len(prompt_ids[start]), params[start].max_new_tokens, n)
            start += n

    def _check_group_fits(self, prompt_len: int, max_new_tokens: int | None, n: int) -> None:
        if max_new_tokens is None:  # no limit asked for (chat's default): the samples end at EOS, or the pool's size
            return
        limit = min(self.max_context, self.kv_capacity)  # a request stops growing there
        new = min(max_new_tokens, limit - prompt_len)
        # The radix cache holds the shared prompt once; without it each sample computes its own copy.
        prompts = 1 if self.config.prefix_cache == "radix" else n
        need = prompts * prompt_len + n * new
        if need > self.kv_capacity:
            raise InvalidRequestError(f"n = {n} samples of a {prompt_len}-token prompt with max_new_tokens "
                                      f"{max_new_tokens} need up to "
                                      f"{need} KV slots; the KV pool holds {self.kv_capacity}")

    def _tokenize(self, prompt: str | SpannedPrompt | Seq[int]) -> list[int]:
        if isinstance(prompt, (str, SpannedPrompt)):
            text = prompt_text(prompt)
            if not text:
                raise InvalidRequestError("prompt is empty")
            if len(text) > self.max_prompt_chars:  # checked before tokenizing, which is slow on huge texts
                raise InvalidRequestError(f"prompt has {len(text)} characters; the context length is "
                                          f"{self.max_context} tokens")
            check_text(text, "prompt")
            return tokenize_prompt(self.tokenizer, prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})")
        return ids
