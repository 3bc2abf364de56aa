"""What the endpoint modules share: the server state, API errors, parameter checks, token texts."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request

from jsgl.engine.request import AbortReason, FinishReason, GenerateOutput
from jsgl.fsm.vocab import vocab_bytes
from jsgl.server.limits import ServerLimits, error_body  # noqa: F401  (error_body: re-exported)
from jsgl.server.streaming import RequestRegistry


class APIError(Exception):
    """An error answered as `{"error": {...}}` with the given HTTP status (OpenAI's error shape)."""

    def __init__(self, message: str, status: int = 400, type_: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type_, param


class UnloggedError(Exception):
    """An internal error of a request that asked for no logs (SGLang's `no_logs`): answered as any other (a 500
    with an error id), but logged by its id and the exception's type alone, and handled where no traceback of it
    reaches a log (an `Exception` handler's error would reach uvicorn's)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


@dataclasses.dataclass
class ServerState:
    engine: Any
    model_name: str
    api_key: str | None = None
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)
    registry: RequestRegistry = dataclasses.field(default_factory=RequestRegistry)
    started_at: float = dataclasses.field(default_factory=time.time)
    metrics: Any = None  # the engine's EngineMetrics behind /metrics (None: --disable-metrics)
    token_text: Callable[[int], str] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        tokenizer = self.engine.tokenizer

        # Logprob responses name the same few thousand tokens over and over; decoding each once is enough.
        @functools.lru_cache(maxsize=1 << 16)
        def token_text(token_id: int) -> str:
            return tokenizer.decode([token_id])

        self.token_text = token_text

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes a token adds to the output: a token that is part of a character has its own bytes, not
        the replacement character its text shows (OpenAI's chat logprobs `bytes`, which clients join)."""
        raw = vocab_bytes(self.engine.tokenizer).token_bytes  # built once per tokenizer (the engine warms it)
        piece = raw[token_id] if 0 <= token_id < len(raw) else b""
        return piece or self.token_text(token_id).encode("utf-8")  # special tokens: their text

    @property
    def max_context(self) -> int:
        return int(self.engine.max_context)


def server_state(request: Request) -> ServerState:
    return request.app.state.jsgl


def check_max_tokens(state: ServerState, max_tokens: int, name: str = "max_tokens") -> None:
    if max_tokens > state.max_context:
        raise APIError(f"{name} ({max_tokens}) exceeds the model's context length ({state.max_context} tokens)",
                       param=name)


def finish_reason_dict(out: GenerateOutput) -> dict[str, Any] | None:
    """SGLang's meta_info.finish_reason: {"type": "stop", "matched": str|token id|None} | {"type":
    "length", "length": n} | {"type": "abort", "message": ...}."""
    reason = out.finish_reason
    if reason is None:
        return None
    if reason == FinishReason.STOP:
        return {"type": "stop", "matched": out.matched_stop}
    if reason == FinishReason.LENGTH:
        return {"type": "length", "length": out.completion_tokens}
    # `reason` (jsgl's AbortReason) lets a client tell its own abort from a failure without reading text.
    return {"type": "abort", "message": out.error or "aborted",
            "reason": str(out.abort_reason or AbortReason.CLIENT)}


def failed(out: GenerateOutput) -> bool:
    """Aborted by something other than the caller (an engine failure or shutdown)."""
    return out.finish_reason == FinishReason.ABORT and out.abort_reason not in (None, AbortReason.CLIENT)


def raise_if_invalid(outs: list[GenerateOutput | None]) -> None:
    """A request whose own input failed while running (a constraint that did not build) is the client's
    mistake: answer 400 with its message, as if it had been caught at submission."""
    for out in outs:
        if out is not None and out.abort_reason == AbortReason.INVALID_REQUEST:
            raise APIError(out.error or "invalid request", status=400)


async def raise_if_invalid_first(group: Any) -> None:
    """Before a stream starts (and its 200 is sent): a request whose constraint failed to build is still
    answered 400. Waits for the group's first event, which the stream then yields as usual."""
    try:
        _, first = await group.peek()
        raise_if_invalid([first.output])
    except BaseException:
        group.abort_unfinished()
        raise


def check_batch(state: ServerState, count: int) -> None:
    limit = state.limits.max_batch_prompts
    if count > limit:
        raise APIError(f"{count} prompts (times n) in one request; this server allows at most {limit} "
                       "(--max-batch-prompts)", param="text")


def token_pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """Text of each token such that the pieces concatenate to the decoded text.

    Decoding a token alone is wrong for byte-level tokenizers when a character spans tokens; decoding a
    short window and diffing (as the engine's detokenizer does) gives the piece each token adds, with the
    bytes of an unfinished character attributed to the token that completes it.
    """
    pieces: list[str] = []
    done = 0  # tokens whose text has been attributed
    for i in range(len(ids)):
        start = max(0, done - 4)
        before = tokenizer.decode(ids[start:done])
        after = tokenizer.decode(ids[start:i + 1])
        if after.endswith("\ufffd") and i + 1 < len(ids):
            pieces.append("")  # wait for the rest of the character
            continue
        pieces.append(after[len(before):])
        done = i + 1
    return pieces
