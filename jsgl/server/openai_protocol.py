"""Request bodies of OpenAI's `/v1` API as pydantic models.

Unknown fields are ignored (OpenAI clients send fields we do not model: `user`, `metadata`, ...); the
sampling fields are SGLang's OpenAI-compatible set (incl. its `extra_body` extensions).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from jsgl.server.protocol import _Lenient, _ValidUnicode


class StreamOptions(_Lenient):
    include_usage: bool = False


class OpenAIBase(_Lenient):
    """Fields shared by /v1/completions and /v1/chat/completions (incl. SGLang's extra sampling knobs)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM/SGLang style, passed through `extra_body` by the openai client).
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None


class CompletionRequest(_ValidUnicode, OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatMessage(_Lenient):
    role: str
    # A string, or OpenAI content parts ([{"type": "text", "text": ...}]); only text parts are served.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_ValidUnicode, OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    # Extension: continue the last (assistant) message instead of opening a new assistant turn. Lets a
    # client prefill the start of the reply; the DSL's OpenAI backend uses it to resume a partial turn.
    continue_final_message: bool = False
