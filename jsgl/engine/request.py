"""Requests and their parameters: what a caller asks for and what it gets back."""

from __future__ import annotations

import dataclasses
import enum
import math
import secrets
from typing import Any, Protocol

import numpy as np

from jsgl.errors import InvalidRequestError  # noqa: F401  (re-exported: callers import it from here)


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Constrained decoding (jsgl.fsm): at most one of these.
    regex: str | None = None
    json_schema: str | dict | None = None
    ebnf: str | None = None  # SGLang's EBNF grammar (GBNF dialect); needs a grammar backend that reads it
    structural_tag: str | None = None
    jump_forward: bool | None = None  # None: the engine's default
    # Log-probabilities. logprob_start_len >= 0 asks for prompt logprobs from that prompt position on.
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0

    @classmethod
    def from_any(cls, value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        if value is None:
            return cls()
        if isinstance(value, SamplingParams):
            return dataclasses.replace(value)
        if isinstance(value, dict):
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = set(value) - names
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
    def greedy(self) -> bool:
        return self.temperature <= 1e-5 or self.top_k == 1

    def validate(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequestError(msg)

        check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
              f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            # NaN fails every comparison below, and an infinite temperature turns the logits into NaN.
            check(isinstance(value, int | float) and math.isfinite(value),
                  f"{name} must be a finite number, got {value!r}")
        check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 or >= 1, got {self.top_k}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]")
        check(isinstance(self.top_logprobs_num, int) and self.top_logprobs_num >= 0, "top_logprobs_num must be >= 0")
        check(not (self.regex is not None and self.json_schema is not None),
              "give at most one of regex and json_schema")
        stop = self.stop
        check(stop is None or isinstance(stop, str) or all(isinstance(s, str) for s in stop),
              "stop must be a string or a list of strings")


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop string or stop token, or the grammar ended
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # cancelled by the caller or failed: `GenerateOutput.abort_reason` says which


class AbortReason(enum.StrEnum):
    """Why a request ended with FinishReason.ABORT: callers branch on this, never on error text."""

    CLIENT = "client"  # the caller aborted it (RequestHandle.abort, /abort_request, a disconnect)
    SHUTDOWN = "shutdown"  # the engine shut down
    INVALID_REQUEST = "invalid_request"  # its own input proved bad while running (a constraint failed to build)
    STEP_FAILED = "step_failed"  # the model step failed for this request (an engine fault: HTTP 500)


@dataclasses.dataclass
class GenerateOutput:
    """The result of one request (also the final chunk of a stream)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    jump_forward_tokens: int = 0  # of completion_tokens, appended by jump-forward (no forward pass each)
    # Per output token: logprob of the sampled token and, if asked, the top-k (logprob, token_id) pairs.
    output_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    # Per prompt token from logprob_start_len on: logprob of that token given what precedes it
    # (None for position 0, which has no context).
    input_logprobs: list[float | None] | None = None
    input_token_ids: list[int] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    error: str | None = None
    abort_reason: AbortReason | None = None  # set exactly when finish_reason is ABORT

    @property
    def meta_info(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "finish_reason": None if self.finish_reason is None else self.finish_reason.value,
            "matched_stop": self.matched_stop,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "jump_forward_tokens": self.jump_forward_tokens,
        }


@dataclasses.dataclass
class StreamChunk:
    """Incremental output: the new text since the previous chunk (held back while it may be a stop)."""

    request_id: str
    text_delta: str
    token_ids: list[int]
    finished: bool
    output: GenerateOutput | None = None  # set on the final chunk


class TokenConstraint(Protocol):
    """Per-request constrained-decoding state (implemented by jsgl.fsm), driven by the engine."""

    def allowed_token_bitmask(self) -> np.ndarray:
        """Packed uint32 bitmask, length ceil(vocab/32), of the tokens allowed next."""
        ...

    def advance(self, token_id: int) -> None: ...

    def is_terminated(self) -> bool:
        """True once no further token can follow (the engine then finishes the request)."""
        ...


def new_request_id() -> str:
    """Unguessable (128 random bits): a request id is what /abort_request needs, so ids must not be
    enumerable, and a client-chosen id cannot predict the server's next one."""
    return f"req-{secrets.token_hex(16)}"
