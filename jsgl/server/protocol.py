"""Request bodies of SGLang's native API as pydantic models (the OpenAI ones: openai_protocol.py).

Field names follow SGLang's `/generate` (GenerateReqInput, sampling params) so its clients work unchanged.
Unknown fields are rejected (a typo in a sampling parameter should fail loudly); fields SGLang defines but
jsgl cannot honour get a 400 that names them and says why.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, create_model, model_validator

from jsgl.engine.sampling_params import ALIASES, REQUEST_LEVEL_FIELDS, SamplingParams
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
def _derive_sampling_model() -> type[BaseModel]:
    """`sampling_params` of /generate, derived from the engine's SamplingParams (minus the logprob fields,
    which /generate takes at the top level). Every field may be null (= its default, as in SGLang); the
    engine checks values, so the in-process API and the server refuse the same things."""
    hints = typing.get_type_hints(SamplingParams)
    fields: dict[str, Any] = {
        f.name: (Optional[hints[f.name]], None)  # noqa: UP045  (a runtime-built annotation)
        for f in dataclasses.fields(SamplingParams) if f.name not in REQUEST_LEVEL_FIELDS
    }
    fields.update({alias: (Optional[hints[name]], None) for alias, name in ALIASES.items()})  # noqa: UP045
    return create_model("GenerateSamplingParams", __base__=_Strict, **fields)


GenerateSamplingParams = _derive_sampling_model()

# GenerateReqInput fields SGLang defines that jsgl cannot honour: accepted at their "off" value (clients
# send some as null), otherwise a 400 saying why, never an "unknown field" error.
UNSUPPORTED_REQUEST_FIELDS: dict[str, str] = {
    **dict.fromkeys(("image_data", "video_data", "audio_data", "input_embeds", "modalities", "mm_hashes",
                     "mm_content_hashes", "use_audio_in_video", "video_config", "positional_embed_overrides"),
                    "jsgl serves text-only models"),
    **dict.fromkeys(("lora_path", "lora_id"), "no LoRA adapters are loaded"),
    "custom_logit_processor": "jsgl does not load custom logit processors",
    **dict.fromkeys(("session_id", "session_params"), "sessions are not implemented; send the whole text"),
    "token_ids_logprob": "logprobs of chosen token ids are not implemented; use top_logprobs_num",
    **dict.fromkeys(("return_hidden_states", "return_routed_experts", "return_indexer_topk",
                     "return_sampling_mask", "return_flat_raw_top_logprobs",
                     "return_flat_raw_output_top_logprobs", "sampling_logprobs_mode"),
                    "jsgl does not return this"),
    **dict.fromkeys(("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
                     "decode_tp_size", "disagg_prefill_dp_rank"), "prefill/decode disaggregation is not implemented"),
    **dict.fromkeys(("data_parallel_rank", "routed_dp_rank"), "jsgl serves one data-parallel rank"),
    "watermark": "jsgl does not implement watermarking",
    # sglang-router forwards these (off) on every /generate.
    "return_bytes": "jsgl generates text, not images (SGLang returns an image's bytes)",
    "return_entropy": "jsgl does not return the output distribution's entropy",
    "extra_key": "jsgl keeps one prefix cache for all requests (no extra_key namespaces)",
    "background": "background requests are not implemented",
    "require_reasoning": "reasoning control is not implemented",
}
# Fields accepted and ignored, as they change nothing about the result (logging and routing hints).
IGNORED_REQUEST_FIELDS = ("log_metrics", "routing_key", "conversation_id", "http_worker_ipc",
                          "return_prompt_token_ids", "routed_experts_start_len", "custom_labels")


# Request fields of jsgl's own, named in /get_model_info so that a client sends them only to a server taking them.
JSGL_EXTENSIONS = ("plain_spans",)
# `plain_spans` of one prompt: sorted, disjoint [start, end] character ranges (jsgl.engine.spanned_prompt).
PlainSpans = list[tuple[int, int]]


def _is_off(value: Any) -> bool:
    return value in (None, False, 0, "", [], {}) or (isinstance(value, list) and all(_is_off(v) for v in value))


class GenerateRequest(_ValidUnicode, _Strict):
    @model_validator(mode="before")
    @classmethod
    def _sglang_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, why in UNSUPPORTED_REQUEST_FIELDS.items():
            if name in data and not _is_off(data[name]):
                raise ValueError(f"`{name}` is not supported: {why}")
        dropped = UNSUPPORTED_REQUEST_FIELDS.keys() | set(IGNORED_REQUEST_FIELDS)
        return {k: v for k, v in data.items() if k not in dropped}

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSamplingParams | list[GenerateSamplingParams] | None = None
    rid: str | list[str] | None = None
    priority: int | list[int] | None = None  # SGLang's; also taken inside sampling_params (this one wins)
    return_logprob: bool | list[bool] | None = False
    logprob_start_len: int | list[int] | None = -1
    top_logprobs_num: int | list[int] | None = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    # sglang-router sends both on every request. `model` is informational (a server serves one model; null from a
    # router that has none); `no_logs` (SGLang's "disallow logging for this request", e.g. zero data retention):
    # jsgl logs no prompt or output anyway, and for such a request not even an internal error's text (app.py).
    model: str | None = None
    no_logs: bool = False
    # True: a special token's string in `text` is ordinary text (transformers' split_special_tokens), as chat
    # messages are; off by default, since /generate takes raw prompts that may hold a template's markers.
    split_special_tokens: bool | list[bool] = False
    # jsgl's extension (advertised in /get_model_info's `jsgl_extensions`): `[start, end]` character ranges of
    # `text` that are plain text (a DSL program's role contents), one list per prompt in a batch; the text
    # around them keeps its markers as control tokens. RuntimeEndpoint sends it, SGLang's servers have none.
    plain_spans: PlainSpans | list[PlainSpans] | None = None


class TokenizeRequest(_ValidUnicode, _Strict):
    prompt: str | list[str]
    add_special_tokens: bool = False  # False: exactly how /generate tokenizes a text prompt
    split_special_tokens: bool = False  # as /generate's: special tokens' strings tokenized as ordinary text
    plain_spans: PlainSpans | list[PlainSpans] | None = None  # as /generate's


class AbortRequest(_ValidUnicode, _Strict):
    rid: str | None = None
    abort_all: bool = False


class ConcateAndAppendRequest(_ValidUnicode, _Strict):
    src_rids: list[str]
    dst_rid: str
