"""The sampling parameters: one definition for the engine, the HTTP API and the DSL.

Fields, defaults and meanings follow SGLang's `SamplingParams` (sglang 0.5, srt/sampling/sampling_params.py),
so a `sampling_params` dict written for SGLang means the same here. The server's pydantic model
(`server/protocol.py`) and the DSL's `GenParams` (`lang/ir.py`) are derived from this dataclass: a new
parameter is added here once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import regex

from jsgl.errors import InvalidRequestError

# A temperature at or below this samples greedily (the argmax), as in SGLang.
GREEDY_TEMPERATURE = 1e-5

# /generate takes these at the top level of the request, not inside `sampling_params`.
REQUEST_LEVEL_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num")
# Old jsgl spellings still accepted (the OpenAI API says `seed`; SGLang says `sampling_seed`).
ALIASES = {"seed": "sampling_seed"}
MAX_STOP_REGEX_BYTES = 256  # SGLang's limits on stop_regex: each pattern is searched on every token
MAX_STOP_REGEX_COUNT = 32
MAX_N = 64  # parallel samples of one prompt (each is a request of its own)


@dataclasses.dataclass
class SamplingParams:
    # Length. max_new_tokens None: until the context (or the KV pool) is full.
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0  # EOS, stop tokens, stop strings and stop regexes are ignored before this
    # Stopping. The matched stop is cut from the text unless no_stop_trim.
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # searched in the output text after every token
    ignore_eos: bool = False
    no_stop_trim: bool = False
    # Sampling.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0  # minus penalty x count, for each token already generated
    presence_penalty: float = 0.0  # minus penalty, for each token already generated
    repetition_penalty: float = 1.0  # logit / p (or x p if negative) for tokens already generated
    logit_bias: dict[str, float] | None = None  # token id (as a string, as in OpenAI's API) -> added logit
    sampling_seed: int | None = None  # None: the engine draws one
    n: int = 1  # parallel samples of the prompt (expanded into n requests; see expand_parallel_samples)
    # Constrained decoding: at most one of these.
    regex: str | None = None
    json_schema: str | dict | None = None
    ebnf: str | None = None  # SGLang's EBNF grammar (GBNF dialect); needs a grammar backend that reads it
    structural_tag: str | None = None
    jump_forward: bool | None = None  # jsgl: None takes the engine's default
    # Output text.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream_interval: int | None = None  # stream a chunk every this many tokens (None: every token)
    # Scheduling (SGLang's request-level `priority`): higher first; a waiting request may preempt running ones of
    # a lower priority. All 0 (the default): no request goes before another.
    priority: int = 0
    # Accepted as SGLang does: read only by custom logit processors, which jsgl does not load.
    custom_params: dict[str, Any] | None = None
    # SGLang fields jsgl cannot honour: accepted at their defaults, a 400 naming them otherwise.
    beam_width: int | None = None
    watermark: Any = None
    # Log-probabilities. logprob_start_len >= 0 asks for prompt logprobs from that prompt position on.
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0

    @classmethod
    def from_any(cls, value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """From a dict as SGLang's API takes it: a None value means "the default", as in SGLang, except
        for max_new_tokens, where None means "no limit but the context"."""
        if value is None:
            return cls()
        if isinstance(value, SamplingParams):
            return dataclasses.replace(value)
        if isinstance(value, dict):
            value = {ALIASES.get(k, k): v for k, v in value.items()
                     if v is not None or k == "max_new_tokens"}
            unknown = set(value) - FIELD_NAMES
            if unknown:
                raise InvalidRequestError(f"unknown sampling parameters: {sorted(unknown)}")
            return cls(**value)
        raise InvalidRequestError(f"sampling params must be a dict or SamplingParams, not {type(value).__name__}")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def stop_regexes(self) -> list[str]:
        if self.stop_regex is None:
            return []
        return [self.stop_regex] if isinstance(self.stop_regex, str) else [s for s in self.stop_regex if s]

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE or self.top_k == 1

    def token_bias(self) -> dict[int, float]:
        """logit_bias with integer token ids (validate() has checked the keys)."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field (type checks included: the in-process API
        has no pydantic in front of it)."""
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequestError(msg)

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        check(self.max_new_tokens is None or (is_int(self.max_new_tokens) and self.max_new_tokens >= 0),
              f"max_new_tokens must be a non-negative integer or null, got {self.max_new_tokens!r}")
        check(is_int(self.min_new_tokens) and self.min_new_tokens >= 0,
              f"min_new_tokens must be a non-negative integer, got {self.min_new_tokens!r}")
        check(self.max_new_tokens is None or self.min_new_tokens <= self.max_new_tokens,
              f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            value = getattr(self, name)
            # NaN fails every comparison below, and an infinite temperature turns the logits into NaN.
            check(isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
                  f"{name} must be a finite number, got {value!r}")
        check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
              f"top_k must be -1 or >= 1, got {self.top_k}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]")
        check(0 < self.repetition_penalty <= 2, "repetition_penalty must be in (0, 2] (1 = no penalty)")
        check_n(self.n)
        check(self.sampling_seed is None or (is_int(self.sampling_seed) and -2**63 <= self.sampling_seed < 2**63),
              f"sampling_seed must be a 64-bit integer, got {self.sampling_seed!r}")
        check(self.stream_interval is None or (is_int(self.stream_interval) and self.stream_interval >= 1),
              "stream_interval must be a positive integer")
        check(is_int(self.priority) and -2**31 <= self.priority < 2**31,
              f"priority must be a 32-bit integer, got {self.priority!r}")
        check(is_int(self.top_logprobs_num) and self.top_logprobs_num >= 0, "top_logprobs_num must be >= 0")
        check(is_int(self.logprob_start_len), "logprob_start_len must be an integer")
        grammars = [g for g in ("regex", "json_schema", "ebnf", "structural_tag") if getattr(self, g) is not None]
        check(len(grammars) <= 1, f"give at most one of regex, json_schema, ebnf and structural_tag (got {grammars})")
        stop = self.stop
        check(stop is None or isinstance(stop, str)
              or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)),
              "stop must be a string or a list of strings")
        check(self.stop_token_ids is None or all(is_int(t) for t in self.stop_token_ids),
              "stop_token_ids must be a list of integers")
        self._validate_stop_regex()
        self._validate_logit_bias(vocab_size)
        check(self.custom_params is None or isinstance(self.custom_params, dict), "custom_params must be an object")
        # Fields SGLang defines that jsgl cannot honour: say which and why, never "unknown field".
        check(self.beam_width in (None, 1), "beam_width: beam search is not implemented in jsgl (use n for "
                                            "parallel samples)")
        check(self.watermark is None, "watermark: jsgl does not implement watermarking")

    def _validate_stop_regex(self) -> None:
        stop_regex = self.stop_regex
        if stop_regex is None:
            return
        if not (isinstance(stop_regex, str) or (isinstance(stop_regex, list)
                                                and all(isinstance(s, str) for s in stop_regex))):
            raise InvalidRequestError("stop_regex must be a string or a list of strings")
        patterns = self.stop_regexes
        if len(patterns) > MAX_STOP_REGEX_COUNT:
            raise InvalidRequestError(f"stop_regex: at most {MAX_STOP_REGEX_COUNT} patterns, got {len(patterns)}")
        for pattern in patterns:
            size = len(pattern.encode("utf-8", "replace"))
            if size > MAX_STOP_REGEX_BYTES:
                raise InvalidRequestError(f"stop_regex: a pattern is {size} bytes, over the "
                                          f"{MAX_STOP_REGEX_BYTES}-byte limit")
            try:
                regex.compile(pattern)  # the `regex` module: it matches with a timeout (stop_regex.py)
            except (regex.error, RecursionError, OverflowError) as exc:
                raise InvalidRequestError(f"stop_regex {pattern!r} is not a valid regex: {exc}") from None

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequestError("logit_bias must be an object mapping token ids to numbers")
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise InvalidRequestError(f"logit_bias: key {key!r} is not a token id") from None
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise InvalidRequestError(f"logit_bias: token id {token} is outside [0, {vocab_size})")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise InvalidRequestError(f"logit_bias: the bias of token {token} must be a finite number, "
                                          f"got {value!r}")


FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def check_n(n: Any) -> None:
    if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N):
        raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}")


def expand_parallel_samples(prompts: list[Any], params: list[SamplingParams]) -> tuple[list[Any], list[SamplingParams]]:
    """n > 1 becomes n requests of the same prompt, consecutive, as SGLang orders them. A given
    sampling_seed is offset per sample (the same seed would make every sample identical). Only ``n`` is checked
    here: each sample's params are validated once, when the engine admits it."""
    out_prompts: list[Any] = []
    out_params: list[SamplingParams] = []
    for prompt, p in zip(prompts, params, strict=True):
        check_n(p.n)
        for j in range(p.n):
            seed = p.sampling_seed
            if seed is not None and j:
                seed = (seed + j + 2**63) % 2**64 - 2**63  # stays a valid 64-bit seed
            out_prompts.append(prompt)
            out_params.append(dataclasses.replace(p, n=1, sampling_seed=seed))
    return out_prompts, out_params
