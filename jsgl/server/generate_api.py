"""SGLang's native API: POST /generate (single or batch, streaming, logprobs) and POST /tokenize.

    {"text": "...", "sampling_params": {"max_new_tokens": 16, "temperature": 0}, "return_logprob": true}
    -> {"text": "...", "output_ids": [...], "meta_info": {"id", "finish_reason": {"type", ...},
        "prompt_tokens", "completion_tokens", "cached_tokens", "input_token_logprobs": [[lp, id, text], ...],
        "output_token_logprobs": [...], "input_top_logprobs": [...], "output_top_logprobs": [...]}}

A list in `text`/`input_ids` makes a batch and the response a list. `stream: true` answers with SSE
events carrying the cumulative `text` (and `index` in a batch); the final event of each request carries
the full meta_info, then `data: [DONE]`. A `text` prompt is tokenized as it is, a template's markers
(`<|im_start|>`) as control tokens; `split_special_tokens: true` (per prompt, or a list) makes every special
token's string in it ordinary text instead, as a chat message's content is. jsgl's `plain_spans` (a list of
[start, end] character ranges per prompt, also taken by /tokenize) makes only those ranges plain text: what
RuntimeEndpoint sends for a DSL program's role contents, so it tokenizes as the in-process Runtime does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jsgl.engine.request import GenerateOutput, StreamChunk
from jsgl.engine.sampling_params import SamplingParams, expand_parallel_samples
from jsgl.engine.spanned_prompt import SpannedPrompt, tokenize_prompt
from jsgl.errors import InvalidRequestError, OverloadedError
from jsgl.server.common import (
    APIError,
    ServerState,
    UnloggedError,
    check_batch,
    check_max_tokens,
    finish_reason_dict,
    raise_if_invalid,
    raise_if_invalid_first,
    server_state,
)
from jsgl.server.protocol import GenerateRequest, GenerateSamplingParams, TokenizeRequest
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


def _prompts(req: GenerateRequest) -> tuple[list[Any], bool]:
    """The prompts and whether the request was a single one (the response is then not a list)."""
    if (req.text is None) == (req.input_ids is None):
        raise APIError("give exactly one of `text` and `input_ids`", param="text")
    if req.text is not None:
        if isinstance(req.text, str):
            return [req.text], True
        prompts, single = list(req.text), False
    else:
        ids = req.input_ids or []
        if ids and isinstance(ids[0], int):
            return [ids], True
        prompts, single = list(ids), False
    if not prompts:
        raise APIError("the batch is empty", param="text" if req.text is not None else "input_ids")
    return prompts, single


def _split_special_tokens(req: GenerateRequest, prompts: list[Any]) -> list[Any]:
    """Text prompts as the engine takes them: wholly plain text where `split_special_tokens` is set, else with
    their `plain_spans` (jsgl's extension) as plain text."""
    split = _per_item(req.split_special_tokens, len(prompts), "split_special_tokens")
    if req.input_ids is not None:
        if any(split) or req.plain_spans is not None:
            raise APIError("split_special_tokens and plain_spans apply to `text` prompts; `input_ids` are used as "
                           "given", param="plain_spans" if req.plain_spans is not None else "split_special_tokens")
        return prompts
    spans = plain_spans_per_prompt(req.plain_spans, prompts, isinstance(req.text, str))
    return [SpannedPrompt.all_plain(p) if s else _spanned(p, sp)
            for p, s, sp in zip(prompts, split, spans, strict=True)]


def plain_spans_per_prompt(value: list[Any] | None, prompts: list[str], single: bool) -> list[list[Any]]:
    """`plain_spans` as one list of ranges per prompt: a single prompt's is a list of [start, end] pairs, a
    batch's a list of those, one per prompt."""
    if value is None:
        return [[] for _ in prompts]
    nested = bool(value) and not isinstance(value[0], tuple)  # the validated pairs are tuples, a batch's lists
    if single == nested or (not single and len(value) != len(prompts)):
        want = "a list of [start, end] pairs" if single else f"one list of pairs per prompt ({len(prompts)})"
        raise APIError(f"`plain_spans` must be {want}", param="plain_spans")
    return [value] if single else list(value)


def _spanned(text: str, spans: list[Any]) -> str | SpannedPrompt:
    if not spans:
        return text  # no plain text: exactly the raw prompt (and its tokenization)
    try:
        return SpannedPrompt(text, tuple((int(a), int(b)) for a, b in spans))
    except ValueError as exc:  # unsorted, overlapping or outside the text: the client's mistake
        raise APIError(str(exc), param="plain_spans") from exc


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise APIError(f"`{name}` has {len(value)} entries for a batch of {n}", param=name)
        return value
    return [value] * n


def _engine_params(state: ServerState, req: GenerateRequest, n: int) -> list[SamplingParams]:
    sampling = _per_item(req.sampling_params or GenerateSamplingParams(), n, "sampling_params")
    logprob = _per_item(req.return_logprob, n, "return_logprob")
    start = _per_item(req.logprob_start_len, n, "logprob_start_len")
    top = _per_item(req.top_logprobs_num, n, "top_logprobs_num")
    priority = _per_item(req.priority, n, "priority")
    out = []
    for sp, lp, st, tp, pr in zip(sampling, logprob, start, top, priority, strict=True):
        # Unset and null fields take the engine's defaults (SamplingParams.from_any drops the nulls).
        params = sp.model_dump(exclude_unset=True)
        if pr is not None:
            params["priority"] = pr
        check_max_tokens(state, params.get("max_new_tokens") or 0, "max_new_tokens")
        lp = bool(lp)
        params.update(return_logprob=lp, logprob_start_len=(-1 if st is None else st) if lp else -1,
                      top_logprobs_num=(tp or 0) if lp else 0)
        out.append(SamplingParams.from_any(params))
    return out


def _parallel_samples(prompts: list[Any], params: list[SamplingParams], rids: list[str] | None,
                      ) -> tuple[list[Any], list[SamplingParams], list[str] | None]:
    """n > 1: n requests per prompt (sample j's rid is `{rid}-{j}`)."""
    counts = [p.n for p in params]
    prompts, params = expand_parallel_samples(prompts, params)
    if rids is not None:
        rids = [f"{rid}-{j}" for rid, n in zip(rids, counts, strict=True) for j in range(n)]
    return prompts, params, rids


def _triples(state: ServerState, pairs: Any, with_text: bool) -> list[list[Any]]:
    """[logprob, token_id, text or None] triples, SGLang's logprob format."""
    return [[lp, int(t), state.token_text(int(t)) if with_text else None] for lp, t in pairs]


def _top(state: ServerState, rows: list | None, with_text: bool) -> list[Any]:
    return [None if row is None else _triples(state, row, with_text) for row in rows or []]


def generate_body(state: ServerState, out: GenerateOutput, return_logprob: bool, with_text: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": out.request_id,
        "finish_reason": finish_reason_dict(out),
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
    }
    if return_logprob:
        meta["input_token_logprobs"] = _triples(state, zip(out.input_logprobs or [], out.input_token_ids or []),
                                                with_text)
        meta["output_token_logprobs"] = _triples(state, zip(out.output_logprobs or [], out.token_ids), with_text)
        if out.input_top_logprobs is not None or out.output_top_logprobs is not None:
            meta["input_top_logprobs"] = _top(state, out.input_top_logprobs, with_text)
            meta["output_top_logprobs"] = _top(state, out.output_top_logprobs, with_text)
    return {"text": out.text, "output_ids": list(out.token_ids), "meta_info": meta}


# Errors with handlers of their own (answered 4xx/503, logged without the request): what no_logs lets through.
_HANDLED = (APIError, InvalidRequestError, OverloadedError, StarletteHTTPException)


@router.post("/generate")
async def generate(req: GenerateRequest, request: Request) -> Any:
    if not req.no_logs:
        return await _generate(req, request)
    try:
        return await _generate(req, request)
    except _HANDLED:
        raise
    except Exception as exc:  # SGLang's no_logs: an internal error logged by its type alone (UnloggedError)
        raise UnloggedError(type(exc).__name__) from None


async def _generate(req: GenerateRequest, request: Request) -> Any:
    state = server_state(request)
    prompts, single = _prompts(req)
    check_batch(state, len(prompts))
    prompts = _split_special_tokens(req, prompts)
    params = _engine_params(state, req, len(prompts))
    rids = None if req.rid is None else _per_item(req.rid, len(prompts), "rid")
    if rids is not None and not isinstance(req.rid, list) and len(prompts) > 1:
        raise APIError("a batch needs one `rid` per prompt", param="rid")
    samples = [p.n for p in params]
    if any(p.n != 1 for p in params):
        prompts, params, rids = _parallel_samples(prompts, params, rids)
        single = False  # SGLang answers n > 1 with a list, the samples of each prompt consecutive
    handles = await submit(state.engine, state.registry, prompts, params, rids,
                           max_live=state.limits.max_concurrent_requests, samples=samples)
    group = HandleGroup(handles, state.registry)
    with_text = req.return_text_in_logprobs
    if req.stream:
        await raise_if_invalid_first(group)
        return sse_response(stream_guard(group, lambda: _stream(state, group, params, single, with_text)))
    try:
        outs = await group.outputs(request)
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the requests were aborted and their KV freed
    raise_if_invalid(outs)

    def render() -> bytes:  # logprob bodies can be megabytes: built and encoded off the event loop
        bodies = [generate_body(state, out, p.return_logprob, with_text) for out, p in zip(outs, params)]
        return json.dumps(bodies[0] if single else bodies, ensure_ascii=False).encode()

    return Response(await asyncio.to_thread(render), media_type="application/json")


async def _stream(state: ServerState, group: HandleGroup, params: list[SamplingParams], single: bool,
                  with_text: bool) -> AsyncIterator[str]:
    texts = [""] * len(group.handles)
    async for i, chunk in group.events():
        if chunk.finished:
            event = generate_body(state, chunk.output, params[i].return_logprob, with_text)
        else:
            texts[i] += chunk.text_delta
            # Cumulative text, as SGLang streams it; meta_info says how far along the request is.
            event = {"text": texts[i], "meta_info": {"id": chunk.request_id, "finish_reason": None,
                                                     "completion_tokens": len(chunk.token_ids)}}
        if params[i].return_logprob:
            _chunk_logprobs(state, event["meta_info"], chunk, with_text)
        if not single:
            event["index"] = i
        yield sse(event)
    yield SSE_DONE


def _chunk_logprobs(state: ServerState, meta: dict[str, Any], chunk: StreamChunk, with_text: bool) -> None:
    """A stream's output logprobs come per chunk (the chunk's new tokens), with the running count, as
    SGLang's text_async_iter(return_meta_data=True) yields them; prompt logprobs come with the last chunk."""
    new_ids = chunk.token_ids[chunk.first_new_token:]
    meta["output_token_logprobs"] = _triples(state, zip(chunk.output_logprobs or [], new_ids), with_text)
    meta["output_token_logprobs_length"] = len(chunk.token_ids)
    if chunk.output_top_logprobs is not None:
        meta["output_top_logprobs"] = _top(state, chunk.output_top_logprobs, with_text)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    tok = state.engine.tokenizer

    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    check_batch(state, len(prompts))

    if (req.split_special_tokens or req.plain_spans is not None) and req.add_special_tokens:
        raise APIError("give add_special_tokens or split_special_tokens/plain_spans, not both",
                       param="split_special_tokens" if req.split_special_tokens else "plain_spans")
    spanned = [_spanned(p, sp) for p, sp in zip(prompts, plain_spans_per_prompt(
        req.plain_spans, prompts, isinstance(req.prompt, str)), strict=True)]

    def encode() -> list[list[int]]:  # off the event loop: 20 x 1 MB once stalled /health for 8 s
        if req.split_special_tokens:
            return [tokenize_prompt(tok, SpannedPrompt.all_plain(p)) for p in prompts]
        if req.plain_spans is not None:  # exactly how /generate tokenizes the same text and spans
            return [tokenize_prompt(tok, p) for p in spanned]
        return [list(tok(p, add_special_tokens=req.add_special_tokens).input_ids) for p in prompts]

    batch = await asyncio.to_thread(encode)
    if isinstance(req.prompt, str):
        return {"tokens": batch[0], "count": len(batch[0]), "max_model_len": state.max_context}
    return {"tokens": batch, "count": [len(b) for b in batch], "max_model_len": state.max_context}
