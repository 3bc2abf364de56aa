"""OpenAI-compatible API, part 1: /v1/models, /v1/completions and what chat shares with completions.

Requests become engine requests with the same sampling semantics as /generate: the OpenAI fields that
are SamplingParams fields go through under their own names (openai_protocol.py derives them), `seed`
becomes `sampling_seed`, `max_tokens` / `min_tokens` become `max_new_tokens` / `min_new_tokens`, and
`response_format` becomes the engine's `json_schema`. `n` choices are the engine's parallel samples
(`expand_parallel_samples`: choice k of prompt i is request `{id}-{i * n + k}`, seeded `seed + k`),
submitted together so they are batched. Streamed logprobs arrive with each choice's final chunk.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request, Response

from jsgl.engine.request import FinishReason, GenerateOutput
from jsgl.engine.sampling_params import SamplingParams, expand_parallel_samples
from jsgl.server.common import (
    APIError,
    ServerState,
    check_batch,
    check_max_tokens,
    failed,
    raise_if_invalid,
    raise_if_invalid_first,
    server_state,
    token_pieces,
)
from jsgl.server.openai_protocol import SAMPLING_FIELD_NAMES, CompletionRequest, OpenAIBase
from jsgl.server.streaming import (
    SSE_DONE,
    ClientDisconnected,
    HandleGroup,
    sse,
    sse_response,
    stream_guard,
    submit,
)

router = APIRouter()
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]


# ------------------------------------------------------------------------------------------- shared parts
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def response_format_params(req: OpenAIBase) -> dict[str, Any]:
    """response_format -> the engine's json_schema (json_object: any JSON object)."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return {}
    if req.regex is not None or req.json_schema is not None or req.ebnf is not None:
        raise APIError("give response_format or regex/json_schema/ebnf, not both", param="response_format")
    if fmt.type == "json_object":
        return {"json_schema": {"type": "object"}}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError("response_format json_schema needs json_schema.schema", param="response_format")
    return {"json_schema": fmt.json_schema.schema_}


def sampling_params(req: OpenAIBase, max_tokens: int | None) -> dict[str, Any]:
    """Engine SamplingParams fields of an OpenAI request (unset fields keep the engine's defaults; n is
    expanded by run_choices)."""
    params: dict[str, Any] = {name: value for name in SAMPLING_FIELD_NAMES
                              if (value := getattr(req, name)) is not None}
    params["max_new_tokens"] = max_tokens
    if req.min_tokens is not None:
        params["min_new_tokens"] = req.min_tokens
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    for token, bias in (req.logit_bias or {}).items():  # the engine checks the ids against the vocabulary
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise APIError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}",
                           param="logit_bias")
    params.update(response_format_params(req))
    return params


def openai_finish_reason(out: GenerateOutput) -> str | None:
    if out.finish_reason is None:
        return None
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(out.finish_reason, "abort")


def usage(outs: list[GenerateOutput], n: int) -> dict[str, Any]:
    """A prompt is counted once however many choices it has (as OpenAI bills it)."""
    prompt = sum(o.prompt_tokens for o in outs[::n])
    completion = sum(o.completion_tokens for o in outs)
    cached = sum(o.cached_tokens for o in outs[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def raise_if_failed(outs: list[GenerateOutput]) -> None:
    raise_if_invalid(outs)
    for out in outs:
        if failed(out):
            raise APIError(f"generation failed: {out.error}", status=500, type_="server_error")


async def run_choices(state: ServerState, prompts: list[Any], params: dict[str, Any], n: int,
                      rid_base: str) -> HandleGroup:
    """Submit n choices per prompt; choice k (OpenAI's order: the choices of a prompt together) is
    request `{rid_base}-{k}`."""
    check_batch(state, len(prompts) * n)
    one = SamplingParams.from_any({**params, "n": n})
    all_prompts, all_params = expand_parallel_samples(prompts, [one] * len(prompts))
    rids = [f"{rid_base}-{k}" for k in range(len(all_prompts))]
    handles = await submit(state.engine, state.registry, all_prompts, all_params, rids,
                           max_live=state.limits.max_concurrent_requests, samples=[n] * len(prompts))
    return HandleGroup(handles, state.registry)


ChunkMaker = Callable[[int, str, "str | None", Any], list[dict[str, Any]]]
# A choice's own fields for one engine chunk: one event's (a dict) or several events' (a list; chat's tool
# calls). "finish_reason" among them overrides the engine's (chat: "tool_calls").
FieldsOf = Callable[[int, str, "str | None"], "dict[str, Any] | list[dict[str, Any]]"]
LogprobsOf = Callable[[GenerateOutput], Any]


async def stream_choices(group: HandleGroup, make_chunk: ChunkMaker, logprobs_of: LogprobsOf,
                         usage_chunk: Callable[[list[GenerateOutput]], dict[str, Any]] | None) -> AsyncIterator[str]:
    """The SSE body shared by both endpoints: events per text delta; the final chunk of a choice
    carries its finish_reason (and logprobs); then an optional usage event and [DONE]."""
    outs: list[GenerateOutput | None] = [None] * len(group.handles)
    async for i, chunk in group.events():
        if chunk.finished:
            outs[i] = out = chunk.output
            if failed(out):
                yield sse({"error": {"message": f"generation failed: {out.error}", "type": "server_error",
                                     "code": 500}})
                continue
            for event in make_chunk(i, chunk.text_delta, openai_finish_reason(out), logprobs_of(out)):
                yield sse(event)
        elif chunk.text_delta:
            for event in make_chunk(i, chunk.text_delta, None, None):
                yield sse(event)
    if usage_chunk is not None and all(o is not None for o in outs):
        yield sse(usage_chunk(outs))
    yield SSE_DONE


async def respond_with_choices(
    request: Request, req: OpenAIBase, group: HandleGroup, *, cid: str, model: str, objects: tuple[str, str],
    chunk_fields: FieldsOf,
    choice_fields: Callable[[int, GenerateOutput], dict[str, Any]], logprobs_of: LogprobsOf,
) -> Any:
    """The response both endpoints build around their choices: an SSE stream of chunks (``objects[0]``)
    or one body (``objects[1]``). ``chunk_fields`` / ``choice_fields`` give a choice's own fields
    (completions: ``text``; chat: ``delta`` / ``message``)."""
    created = int(time.time())

    def envelope(obj: str) -> dict[str, Any]:
        return {"id": cid, "object": obj, "created": created, "model": model}

    if req.stream:
        def make_chunk(i: int, text: str, finish: str | None, logprobs: Any) -> list[dict[str, Any]]:
            fields = chunk_fields(i, text, finish)
            events = fields if isinstance(fields, list) else [fields]
            chunks = []
            for k, event in enumerate(events):  # the finish reason and logprobs go with the last
                last = k == len(events) - 1
                event = dict(event)
                reason = event.pop("finish_reason", finish)
                choice = {"index": i, **event, "logprobs": logprobs if last else None,
                          "finish_reason": reason if last else None}
                chunks.append({**envelope(objects[0]), "choices": [choice]})
            return chunks

        usage_chunk = None
        if req.stream_options is not None and req.stream_options.include_usage:
            usage_chunk = lambda outs: {**envelope(objects[0]), "choices": [], "usage": usage(outs, req.n)}  # noqa: E731
        await raise_if_invalid_first(group)
        return sse_response(stream_guard(group, lambda: stream_choices(group, make_chunk, logprobs_of, usage_chunk)))
    try:
        outs = await group.outputs(request)
    except ClientDisconnected:
        return Response(status_code=499)
    raise_if_failed(outs)

    def render() -> dict[str, Any]:  # logprobs can be large: built off the event loop
        choices = []
        for i, out in enumerate(outs):
            fields = choice_fields(i, out)
            reason = fields.pop("finish_reason", openai_finish_reason(out))
            choices.append({"index": i, **fields, "logprobs": logprobs_of(out), "finish_reason": reason})
        return {**envelope(objects[1]), "choices": choices, "usage": usage(outs, req.n)}

    return await asyncio.to_thread(render)


# --------------------------------------------------------------------------------------------- endpoints
@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started_at),
                                        "owned_by": "jsgl", "root": state.model_name,
                                        "max_model_len": state.max_context}]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    """OpenAI's retrieve-model: the served model's object, 404 (OpenAI's error shape) for another id."""
    listed = (await models(request))["data"]
    for obj in listed:
        if obj["id"] == model_id:
            return obj
    raise APIError(f"The model `{model_id}` does not exist", status=404, param="model")


def _completion_prompts(req: CompletionRequest) -> list[Any]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def completion_logprobs(state: ServerState, out: GenerateOutput, echo: bool, top: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs object; with echo, the prompt's tokens come first (the very first one
    has no logprob). text_offset indexes the choice's text (echoed prompt included)."""
    ids, lps, tops = list(out.token_ids), list(out.output_logprobs or []), list(out.output_top_logprobs or [])
    if echo:
        ids = list(out.input_token_ids or []) + ids
        lps = list(out.input_logprobs or []) + lps
        tops = list(out.input_top_logprobs or [None] * len(out.input_token_ids or [])) + tops
    pieces = token_pieces(state.engine.tokenizer, ids)
    offsets, pos = [], 0
    for piece in pieces:
        offsets.append(pos)
        pos += len(piece)
    top_dicts = None
    if top:
        top_dicts = [None if row is None else {state.token_text(t): lp for lp, t in row} for row in tops]
    return {"tokens": pieces, "token_logprobs": lps, "top_logprobs": top_dicts, "text_offset": offsets}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Any:
    state = server_state(request)
    if req.suffix:
        raise APIError("suffix is not supported by this server", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of must equal n (or be left out)", param="best_of")
    prompts = _completion_prompts(req)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for completions
    check_max_tokens(state, max_tokens)
    params = sampling_params(req, max_tokens)
    if req.logprobs is not None:
        params.update(return_logprob=True, top_logprobs_num=req.logprobs, logprob_start_len=0 if req.echo else -1)
    cid = new_id("cmpl")
    group = await run_choices(state, prompts, params, req.n, cid)
    tok = state.engine.tokenizer
    echo_text = [p if isinstance(p, str) else tok.decode(p) for p in prompts] if req.echo else None

    def logprobs_of(out: GenerateOutput) -> dict[str, Any] | None:
        return None if req.logprobs is None else completion_logprobs(state, out, req.echo, req.logprobs)

    def head(i: int) -> str:
        return echo_text[i // req.n] if echo_text else ""

    started: set[int] = set()

    def chunk_fields(i: int, text: str, finish: str | None) -> dict[str, Any]:
        if i not in started:  # the echoed prompt goes out with the choice's first chunk
            started.add(i)
            text = head(i) + text
        return {"text": text}

    return await respond_with_choices(
        request, req, group, cid=cid, model=state.model_name, objects=("text_completion", "text_completion"),
        chunk_fields=chunk_fields, choice_fields=lambda i, out: {"text": head(i) + out.text},
        logprobs_of=logprobs_of)
