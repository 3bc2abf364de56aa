"""Requests and their parameters: what a caller asks for and what it gets back."""

from __future__ import annotations

import dataclasses
import enum
import secrets
from typing import Any, Protocol

import numpy as np

from jsgl.engine.sampling_params import SamplingParams  # noqa: F401  (re-exported)
from jsgl.errors import InvalidRequestError  # noqa: F401  (re-exported: callers import it from here)


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
    token_ids: list[int]  # the whole output so far
    finished: bool
    output: GenerateOutput | None = None  # set on the final chunk
    # Tokens new in this chunk are token_ids[first_new_token:]; with return_logprob, their logprobs (and
    # top-k pairs when asked), so a stream carries each token's logprob once, in the chunk that shows it.
    first_new_token: int = 0
    output_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None


class TokenConstraint(Protocol):
    """Per-request constrained-decoding state (implemented by jsgl.fsm), driven by the engine."""

    def allowed_token_bitmask(self) -> np.ndarray:
        """Packed uint32 bitmask, length ceil(vocab/32), of the tokens allowed next."""
        ...

    def advance(self, token_id: int) -> None: ...

    def is_terminated(self) -> bool:
        """True once no further token can follow (the engine then finishes the request)."""
        ...

    def copy(self) -> TokenConstraint:
        """An independent state at the same point (speculative decoding walks its drafts through one)."""
        ...


def new_request_id() -> str:
    """Unguessable (128 random bits): a request id is what /abort_request needs, so ids must not be
    enumerable, and a client-chosen id cannot predict the server's next one."""
    return f"req-{secrets.token_hex(16)}"
