"""Request bodies of the HTTP API as pydantic models.

Field names follow SGLang's `/generate` (GenerateReqInput, sampling params) and OpenAI's `/v1` APIs so
existing clients work unchanged. Unknown fields are rejected on our own endpoints (a typo in a sampling
parameter should fail loudly) but ignored on the OpenAI ones, whose clients send fields we do not model
(`user`, `metadata`, ...).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jsgl.server.limits import find_invalid_unicode


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _ValidUnicode:
    """Top-level request bodies: reject lone surrogates anywhere (a 400 naming the field, not a 500 from
    the tokenizer or the response encoder)."""

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        where = find_invalid_unicode(data)
        if where:
            raise ValueError(where)
        return data


# ---------------------------------------------------------------------------------------------- /generate
class GenerateSamplingParams(_Strict):
    """`sampling_params` of /generate: the engine's SamplingParams minus the logprob fields (top level)."""

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    jump_forward: bool | None = None


class GenerateRequest(_ValidUnicode, _Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSamplingParams | list[GenerateSamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


class TokenizeRequest(_ValidUnicode, _Strict):
    prompt: str | list[str]
    add_special_tokens: bool = False  # False: exactly how /generate tokenizes a text prompt


class AbortRequest(_ValidUnicode, _Strict):
    rid: str | None = None
    abort_all: bool = False


# ------------------------------------------------------------------------------------------------ OpenAI
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
