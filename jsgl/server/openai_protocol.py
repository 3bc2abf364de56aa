"""Request bodies of OpenAI's `/v1` API as pydantic models.

Every field OpenAI's /v1/completions and /v1/chat/completions define is modelled, honoured, ignored
(when it cannot change the result: `user`, `metadata`, cache hints) or answered 400 naming it and why
(`audio`, `prediction`, ...; accepted at its default/null, which clients send). SGLang's extensions
(`extra_body` in the openai client) are the engine's `SamplingParams` fields of the same name, derived
from the dataclass, plus the renamed `min_tokens` and chat's `continue_final_message`,
`chat_template_kwargs`, `separate_reasoning`. Other unknown fields are ignored, as OpenAI clients send
fields nobody models.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field, create_model, model_validator

from jsgl.engine.sampling_params import MAX_N, REQUEST_LEVEL_FIELDS, SamplingParams
from jsgl.server.protocol import UNSUPPORTED_REQUEST_FIELDS, _is_off, _Lenient, _ValidUnicode

# SamplingParams fields that OpenAI's API spells differently (max_tokens, min_tokens, seed, logprobs) or
# that the OpenAI models declare themselves (n, with OpenAI's bounds).
_RENAMED = {"max_new_tokens", "min_new_tokens", "sampling_seed", "n", *REQUEST_LEVEL_FIELDS}


def _derive_sampling_fields() -> type[BaseModel]:
    """The OpenAI request fields that are SamplingParams fields under the same name: OpenAI's own
    (temperature, top_p, stop, penalties, logit_bias) and SGLang's extensions (top_k, min_p, regex,
    ebnf, stop_regex, ...). None means the engine's default, so a new SamplingParams field is accepted
    here without being written out again."""
    hints = typing.get_type_hints(SamplingParams)
    fields: dict[str, Any] = {f.name: (Optional[hints[f.name]], None)  # noqa: UP045  (built at runtime)
                              for f in dataclasses.fields(SamplingParams) if f.name not in _RENAMED}
    return create_model("OpenAISamplingFields", __base__=_Lenient, **fields)


OpenAISamplingFields = _derive_sampling_fields()
SAMPLING_FIELD_NAMES: tuple[str, ...] = tuple(OpenAISamplingFields.model_fields)


# ------------------------------------------------------------------------------ fields jsgl cannot honour
def _off(value: Any) -> bool:
    return _is_off(value)


def _null(value: Any) -> bool:
    return value is None  # an empty object still asks for the feature (web_search_options: {} = defaults)


def _one_of(*ok: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in ok


# OpenAI fields jsgl cannot honour: (is this value harmless?, why not). Checked before the model is built,
# so a client hears which field and why instead of having it silently dropped.
UNSUPPORTED_OPENAI_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "audio": (_null, "jsgl serves text-only models (no audio output)"),
    "modalities": (lambda v: v is None or (isinstance(v, list) and all(m == "text" for m in v)),
                   "jsgl serves text-only models: only [\"text\"] is possible"),
    "prediction": (_null, "predicted outputs (speculative decoding from a given text) are not implemented"),
    "web_search_options": (_null, "jsgl has no web search"),
    "functions": (_off, "the deprecated `functions` API is not implemented; send `tools`"),
    "function_call": (_off, "the deprecated `function_call` API is not implemented; send `tool_choice`"),
    "store": (_off, "stored completions are not implemented"),
    "moderation": (_null, "jsgl does not run moderation"),
    "reasoning_effort": (_one_of("none"), "the served model does not reason"),
    "verbosity": (_one_of("medium"), "the served model has no verbosity control"),
    "service_tier": (_one_of("auto", "default"), "jsgl has one service tier"),
    # SGLang's own extensions that jsgl lacks (LoRA, sessions, hidden states, ...): as /generate says.
    **{name: (_off, why) for name, why in UNSUPPORTED_REQUEST_FIELDS.items() if name != "modalities"},
}
# Accepted and ignored, since they cannot change the output: identifiers for abuse tracking
# (`user`, `safety_identifier`), tags for stored completions (`metadata`), and prompt-cache hints (jsgl
# caches every prefix in its radix tree whatever they say).


def reject_unsupported(data: Any) -> Any:
    if isinstance(data, dict):
        for name, (harmless, why) in UNSUPPORTED_OPENAI_FIELDS.items():
            if name in data and not harmless(data[name]):
                raise ValueError(f"`{name}` is not supported: {why}")
    return data


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class OpenAIBase(OpenAISamplingFields):  # type: ignore[misc,valid-type]
    """Fields shared by /v1/completions and /v1/chat/completions; the sampling fields come from
    OpenAISamplingFields."""

    @model_validator(mode="before")
    @classmethod
    def _check_unsupported(cls, data: Any) -> Any:
        return reject_unsupported(data)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None  # -> sampling_seed
    min_tokens: int | None = Field(None, ge=0)  # SGLang's extension -> min_new_tokens
    response_format: ResponseFormat | None = None  # json_object / json_schema -> the engine's json_schema
    user: str | None = None


class CompletionRequest(_ValidUnicode, OpenAIBase):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# ---------------------------------------------------------------------------------------------- chat
class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; a dict is taken as well


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # None: no parameters (OpenAI's meaning)
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatMessage(_Lenient):
    role: str  # system, developer, user, assistant, tool (others go to the template as given)
    # A string, or OpenAI content parts ([{"type": "text", "text": ...}]); only text parts are served.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_ValidUnicode, OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI
    # Extensions (SGLang). continue_final_message: continue the last (assistant) message instead of
    # opening a new assistant turn (lets a client prefill the reply; the DSL's OpenAI backend uses it).
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    # Reasoning output is split out only for models with a reasoning parser; jsgl serves none, so
    # these are accepted (SGLang clients send them) and change nothing.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
